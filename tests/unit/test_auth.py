"""The auth file, token lookup, the role table and taskTypes patterns (jobmesh/auth.py)."""

from __future__ import annotations

import hashlib
import os
import stat

import pytest

from jobmesh import auth
from jobmesh.auth import ADMIN, CLIENT, READER, ROLE_REQUESTS, ROLES, WORKER, AuthFile, AuthFileError, Identity
from jobmesh.errors import ConfigError
from jobmesh.protocol import messages as m

SCHEDULE_KINDS = {"SCHEDULE_PUT", "SCHEDULE_GET", "SCHEDULE_LIST", "SCHEDULE_PAUSE", "SCHEDULE_RESUME",
                  "SCHEDULE_DELETE", "SCHEDULE_TRIGGER", "SCHEDULE_PREVIEW"}


def write(tmp_path, text: str) -> str:
    path = tmp_path / "auth.toml"
    path.write_text(text)
    return str(path)


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def test_every_request_kind_is_in_exactly_one_role_row():
    kinds = set(m.CLIENT_PORT_REQUESTS | m.WORKER_PORT_REQUESTS) | SCHEDULE_KINDS | {"METRICS"}
    for kind in kinds:
        rows = [role for role, row in ROLE_REQUESTS.items() if kind in row]
        assert len(rows) == 1, (kind, rows)
    assert set().union(*ROLE_REQUESTS.values()) == kinds


# (kind, roles that may make it): the contract's "Roles", written out.
EXPECTED = {
    "WORKER_REGISTER": {WORKER}, "HEARTBEAT": {WORKER}, "TASK_RESULT": {WORKER},
    "GET_JOB_STATUS": {READER, CLIENT, ADMIN}, "LIST_JOBS": {READER, CLIENT, ADMIN},
    "LIST_WORKERS": {READER, CLIENT, ADMIN}, "GET_JOB_EVENTS": {READER, CLIENT, ADMIN},
    "WAIT_JOB": {READER, CLIENT, ADMIN}, "GET_STATS": {READER, CLIENT, ADMIN},
    "GET_JOB_PAYLOAD": {READER, CLIENT, ADMIN},
    "SCHEDULE_GET": {READER, CLIENT, ADMIN}, "SCHEDULE_LIST": {READER, CLIENT, ADMIN},
    "SCHEDULE_PREVIEW": {READER, CLIENT, ADMIN}, "METRICS": {READER, CLIENT, ADMIN},
    "SUBMIT_JOB": {CLIENT, ADMIN}, "CANCEL_JOB": {CLIENT, ADMIN},
    "RETRY_JOB": {ADMIN}, "PURGE_JOBS": {ADMIN}, "SCHEDULE_PUT": {ADMIN}, "SCHEDULE_PAUSE": {ADMIN},
    "SCHEDULE_RESUME": {ADMIN}, "SCHEDULE_DELETE": {ADMIN}, "SCHEDULE_TRIGGER": {ADMIN},
    "LIMIT_GET": {READER, CLIENT, ADMIN}, "LIMIT_LIST": {READER, CLIENT, ADMIN}, "LIMIT_PUT": {ADMIN},
    "LIMIT_DELETE": {ADMIN}, "TYPE_PAUSE": {ADMIN}, "TYPE_RESUME": {ADMIN},
    "SOMETHING_NEW": {ADMIN},  # a kind missing from the table is admin's alone
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_may_follows_the_contract(kind):
    allowed = {role for role in ROLES if Identity("x", role).may(kind)}
    assert allowed == EXPECTED[kind]


def test_at_least():
    assert Identity("a", ADMIN).at_least(CLIENT) and Identity("a", CLIENT).at_least(READER)
    assert not Identity("r", READER).at_least(CLIENT)
    assert not Identity("a", ADMIN).at_least(WORKER) and not Identity("w", WORKER).at_least(READER)


@pytest.mark.parametrize("patterns,task_type,ok", [
    (None, "ANYTHING", True),
    (("GREET",), "GREET", True),
    (("GREET",), "GREETING", False),
    (("etl.*",), "etl.load", True),
    (("etl.*",), "etl.a.b", True),
    (("etl.*",), "etl.", False),
    (("etl.*",), "etl", False),
    (("etl.*",), "etlx.load", False),
    (("etl.*", "SLEEP"), "SLEEP", True),
    ((), "SLEEP", False),
])
def test_task_type_patterns(patterns, task_type, ok):
    assert auth.type_allowed(patterns, task_type) is ok
    assert Identity("x", CLIENT, patterns).may_use_type(task_type) is ok


def test_authenticate_by_hash(tmp_path):
    path = write(tmp_path, '# team tokens\n[[token]]\nname = "ci"\nrole = "client"\nsha256 = "%s"\n'
                           'taskTypes = ["etl.*"]\n\n[[token]]\nname = "w1"\nrole = "worker"\nsha256 = "%s"\n'
                 % (digest("secret-ci"), digest("secret-w").upper()))
    f = AuthFile.load(path)
    ci = f.authenticate("secret-ci")
    assert ci is not None and (ci.name, ci.role, ci.task_types) == ("ci", CLIENT, ("etl.*",))
    w1 = f.authenticate("secret-w")  # an upper-case stored hash is read as the same hash
    assert w1 is not None and (w1.name, w1.role, w1.task_types) == ("w1", WORKER, None)
    for wrong in ("secret", "secret-ci ", "", None, 42, digest("secret-ci"), "x" * 5000):
        assert f.authenticate(wrong) is None
    assert f.still_valid(ci) and f.still_valid(w1)


@pytest.mark.parametrize("text,says", [
    ("[[token]]\nname = 'a'\nrole = 'root'\nsha256 = '%s'\n" % ("0" * 64), "role must be one of"),
    ("[[token]]\nname = 'a'\nrole = 'admin'\nsha256 = 'abc'\n", "sha256 must be 64 hexadecimal digits"),
    ("[[token]]\nname = 'a b'\nrole = 'admin'\nsha256 = '%s'\n" % ("0" * 64), "name 'a b' must be"),
    ("[[token]]\nname = 'a'\nrole = 'admin'\n", "'sha256' must be a string"),
    ("[[token]]\nname = 'a'\nrole = 'admin'\nsha256 = '%s'\ntoken = 'x'\n" % ("0" * 64), "unknown key 'token'"),
    ("[[token]]\nname = 'a'\nrole = 'client'\nsha256 = '%s'\ntaskTypes = 'X'\n" % ("0" * 64),
     "taskTypes must be an array"),
    ("[[token]]\nname = 'a'\nrole = 'client'\nsha256 = '%s'\ntaskTypes = ['a b']\n" % ("0" * 64),
     "taskTypes holds 'a b'"),
    ("[[token]]\nname = 'a'\nrole = 'client'\nsha256 = '%s'\n[[token]]\nname = 'a'\nrole = 'admin'\n"
     "sha256 = '%s'\n" % ("0" * 64, "1" * 64), "two tokens are named 'a'"),
    ("[[token]]\nname = 'a'\nrole = 'client'\nsha256 = '%s'\n[[token]]\nname = 'b'\nrole = 'admin'\n"
     "sha256 = '%s'\n" % ("0" * 64, "0" * 64), "same sha256"),
    ("[[token]\n", "not valid TOML"),
    ("users = 1\n", "unknown key 'users'"),
    ("token = 1\n", "array of tables"),
])
def test_bad_files_are_one_line_errors_naming_the_file(tmp_path, text, says):
    path = write(tmp_path, text)
    with pytest.raises(AuthFileError) as err:
        AuthFile.load(path)
    message = str(err.value)
    assert says in message and path in message and "\n" not in message
    assert isinstance(err.value, ConfigError)


def test_missing_file(tmp_path):
    with pytest.raises(AuthFileError, match="no such file"):
        AuthFile.load(str(tmp_path / "nope.toml"))
    assert len(AuthFile.load(str(tmp_path / "nope.toml"), missing_ok=True)) == 0


def test_new_list_rm(tmp_path):
    path = str(tmp_path / "auth.toml")
    first = auth.new_token(path, "ci", CLIENT, ("GREET", "etl.*"))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    second = auth.new_token(path, "w1", WORKER)
    assert first != second and len(first) >= 43
    text = open(path).read()
    assert first not in text and digest(first) in text  # only the hash is stored
    f = AuthFile.load(path)
    assert f.authenticate(first).name == "ci" and f.authenticate(second).name == "w1"
    assert [(e.name, e.role, e.task_types) for e in auth.list_tokens(path)] == [
        ("ci", CLIENT, ("GREET", "etl.*")), ("w1", WORKER, None)]
    with pytest.raises(AuthFileError, match="exists already"):
        auth.new_token(path, "ci", ADMIN)
    with pytest.raises(AuthFileError, match="role must be one of"):
        auth.new_token(path, "x", "root")
    with pytest.raises(AuthFileError, match="must be"):
        auth.new_token(path, "bad name", CLIENT)
    auth.remove_token(path, "ci")
    f = AuthFile.load(path)
    assert f.names() == ["w1"] and f.authenticate(first) is None and f.authenticate(second).name == "w1"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with pytest.raises(AuthFileError, match="no token named 'ci'"):
        auth.remove_token(path, "ci")


def test_rm_keeps_the_other_entries_and_comments(tmp_path):
    path = write(tmp_path, "# jobmesh tokens\n[[token]]  # the first\nname = 'a'\nrole = 'admin'\nsha256 = '%s'\n"
                           "\n[[token]]\n# CI's\nname = 'b'\nrole = 'client'\nsha256 = '%s'\n"
                           "[[token]]\nname = 'c'\nrole = 'reader'\nsha256 = '%s'\n" % ("0" * 64, "1" * 64, "2" * 64))
    auth.remove_token(path, "b")
    text = open(path).read()
    assert AuthFile.load(path).names() == ["a", "c"]
    assert "# jobmesh tokens" in text and "# the first" in text and "# CI's" not in text


def test_read_token(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text("  from-file  \n")
    other = tmp_path / "other"
    other.write_text("from-env-file\n")
    env = {"JOBMESH_TOKEN": "from-env", "JOBMESH_TOKEN_FILE": str(other)}
    assert auth.read_token(str(token_file), env) == "from-file"
    assert auth.read_token(None, env) == "from-env"
    assert auth.read_token(None, {"JOBMESH_TOKEN_FILE": str(other)}) == "from-env-file"
    assert auth.read_token(None, {}) is None
    with pytest.raises(ConfigError, match="cannot read the token file"):
        auth.read_token(str(tmp_path / "missing"), {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="holds no token"):
        auth.read_token(None, {"JOBMESH_TOKEN_FILE": str(tmp_path / "empty")})
