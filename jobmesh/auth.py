"""Tokens with roles: the auth file, who a token is, and what each role may ask.

The auth file (``--auth-file``) is TOML, one table per token; the token itself is never
stored, only the SHA-256 of its text::

    [[token]]
    name = "ci"                 # 1-128 letters, digits and _ . : -; unique in the file
    role = "client"             # worker | reader | client | admin
    sha256 = "9f86d08...0f00a08"  # hex SHA-256 of the token's UTF-8 text
    taskTypes = ["GREET", "etl.*"]  # optional: the task types it may submit (client,
                                    # admin) or declare (worker); "PREFIX.*" is a prefix

The API, used by every port that authenticates:

* ``AuthFile.load(path)`` parses and checks the file; ``AuthFileError`` (a
  ``ConfigError``) with a one-line message naming the file and the entry otherwise.
* ``auth_file.authenticate(token) -> Identity | None``: the token's SHA-256 compared
  with ``hmac.compare_digest`` against every stored hash (all of them, whatever matches).
* ``Identity(name, role, task_types)``: ``may(kind)`` says whether the role may make a
  request of that kind (a message type such as ``"SUBMIT_JOB"``, or ``"METRICS"``);
  ``may_use_type(task_type)`` applies the entry's ``taskTypes``.
* ``auth_file.still_valid(identity)``: after a reload, whether the identity's entry is
  unchanged (a removed or changed token's connections are closed).
* ``new_token``, ``remove_token``, ``list_tokens``: what ``jobmesh token`` does to a file.
* ``read_token(flag_path, environ)``: the token a client or worker presents, from
  ``--token-file``, ``JOBMESH_TOKEN`` or ``JOBMESH_TOKEN_FILE`` (never a command-line value).

Roles (docs/SECURITY.md): ``worker`` uses the worker port only, and only a worker token
registers a worker; ``reader`` reads (``ROLE_REQUESTS["reader"]`` and the metrics port);
``client`` also submits and cancels; ``admin`` may do everything else (retry, purge,
schedule changes) except register a worker. A request kind missing from the table is
``admin``'s alone.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import tempfile
import tomllib
from dataclasses import dataclass
from typing import Any, Mapping

from jobmesh.errors import ConfigError

log = logging.getLogger(__name__)

TOKEN_BYTES = 32  # secrets.token_urlsafe(32): 43 characters, 256 bits
MAX_TOKEN_CHARS = 4096  # a longer presented token is refused unhashed
TOKEN_ENV = "JOBMESH_TOKEN"
TOKEN_FILE_ENV = "JOBMESH_TOKEN_FILE"

WORKER, READER, CLIENT, ADMIN = "worker", "reader", "client", "admin"
ROLES = (WORKER, READER, CLIENT, ADMIN)
_RANK = {READER: 1, CLIENT: 2, ADMIN: 3}  # reader < client < admin; worker stands apart

# Each request kind in exactly one row: the least role that may make it (a role may do
# what the rows of lower roles list too; worker's row is its own). A kind in no row is
# admin's. "METRICS" is the metrics port's every path but /healthz and /readyz.
ROLE_REQUESTS: dict[str, frozenset[str]] = {
    WORKER: frozenset({"WORKER_REGISTER", "HEARTBEAT", "TASK_RESULT", "TASK_PROGRESS"}),
    READER: frozenset({"GET_JOB_STATUS", "LIST_JOBS", "LIST_WORKERS", "GET_JOB_EVENTS", "WAIT_JOB", "GET_STATS",
                       "GET_JOB_PAYLOAD", "SCHEDULE_GET", "SCHEDULE_LIST", "SCHEDULE_PREVIEW", "LIMIT_GET",
                       "LIMIT_LIST", "METRICS", "WORKFLOW_STATUS", "WAIT_WORKFLOW"}),
    CLIENT: frozenset({"SUBMIT_JOB", "CANCEL_JOB", "SUBMIT_WORKFLOW", "WORKFLOW_CANCEL"}),
    ADMIN: frozenset({"RETRY_JOB", "PURGE_JOBS", "SCHEDULE_PUT", "SCHEDULE_PAUSE", "SCHEDULE_RESUME",
                      "SCHEDULE_DELETE", "SCHEDULE_TRIGGER", "LIMIT_PUT", "LIMIT_DELETE", "TYPE_PAUSE",
                      "TYPE_RESUME"}),
}
_LEAST_ROLE = {kind: role for role, kinds in ROLE_REQUESTS.items() for kind in kinds}

NAME_RULE = "1-128 characters of letters, digits and _ . : -"
_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,128}\Z")
_PATTERN = re.compile(r"[A-Za-z0-9_.:\-]{1,128}(\.\*)?\Z")
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_HEADER = re.compile(r"\s*\[\[\s*token\s*\]\]\s*(#.*)?\Z")
_KEYS = frozenset({"name", "role", "sha256", "taskTypes"})


def roles_for(kind: str) -> list[str]:
    """The roles that may make a request of ``kind``, least first (``["client", "admin"]``)."""
    least = _LEAST_ROLE.get(kind, ADMIN)
    if least == WORKER:
        return [WORKER]
    return [role for role in (READER, CLIENT, ADMIN) if _RANK[role] >= _RANK[least]]


class AuthFileError(ConfigError):
    """The auth file cannot be read or is not valid; the message is one line naming it."""


def token_digest(token: str) -> str:
    """The hex SHA-256 of a token's UTF-8 text, as the auth file stores it."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def type_allowed(patterns: tuple[str, ...] | None, task_type: str) -> bool:
    """Whether ``task_type`` matches one of ``patterns`` (``NAME`` exactly, ``PREFIX.*``
    any name that starts with ``PREFIX.``); None allows every type."""
    if patterns is None:
        return True
    for pattern in patterns:
        if pattern.endswith(".*"):
            if task_type.startswith(pattern[:-1]) and len(task_type) > len(pattern) - 1:
                return True
        elif task_type == pattern:
            return True
    return False


def type_refusal(name: str | None, patterns: tuple[str, ...] | None, task_type: str) -> str | None:
    """The ``forbidden`` ERROR text for token ``name`` (its ``taskTypes``: ``patterns``)
    making a job of ``task_type`` it may not submit, or None if it may."""
    if type_allowed(patterns, task_type):
        return None
    assert patterns is not None
    return "forbidden: token %s may not submit task type %s (its taskTypes: %s)" % (
        repr(name), repr(task_type), ", ".join(patterns) or "none")


@dataclass(frozen=True)
class Identity:
    """Who an accepted token is: its entry's name, role and task-type patterns (None: any)."""

    name: str
    role: str
    task_types: tuple[str, ...] | None = None
    digest: str = ""  # the entry's stored hash, so a reload can tell whether it changed

    def may(self, kind: str) -> bool:
        """Whether this role may make a request of ``kind`` (a message type, or ``METRICS``)."""
        return self.at_least(_LEAST_ROLE.get(kind, ADMIN))

    def may_use_type(self, task_type: str) -> bool:
        """Whether the entry's ``taskTypes`` let it submit (or, a worker, declare) ``task_type``."""
        return type_allowed(self.task_types, task_type)

    def at_least(self, role: str) -> bool:
        """Whether this is ``role`` or above it (reader < client < admin; a worker is only a worker)."""
        if self.role == WORKER or role == WORKER:
            return self.role == role
        return _RANK[self.role] >= _RANK[role]


class AuthFile:
    """The tokens of one auth file, checked; ``load`` reads one, ``authenticate`` looks a token up."""

    def __init__(self, path: str, entries: tuple[Identity, ...]) -> None:
        self.path = path
        self.entries = entries
        self._by_name = {entry.name: entry for entry in entries}

    def __len__(self) -> int:
        return len(self.entries)

    @classmethod
    def load(cls, path: str, missing_ok: bool = False) -> AuthFile:
        """Read and check ``path``; ``AuthFileError`` naming the file and entry on any fault.
        With ``missing_ok``, a file that does not exist is an empty one."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            if missing_ok:
                return cls(path, ())
            raise AuthFileError("auth file %s: no such file" % path) from None
        except OSError as exc:
            raise AuthFileError("auth file %s: cannot read it: %s" % (path, exc.strerror or exc)) from None
        return cls(path, parse(data, path))

    def authenticate(self, token: Any) -> Identity | None:
        """The identity whose hash is the token's, or None. Every stored hash is compared
        (``hmac.compare_digest``), so the time taken does not say which entries came close."""
        if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_CHARS:
            return None
        digest = token_digest(token).encode("ascii")
        found = None
        for entry in self.entries:
            if hmac.compare_digest(entry.digest.encode("ascii"), digest):
                found = entry
        return found

    def still_valid(self, identity: Identity) -> bool:
        """Whether this file still holds ``identity``'s entry exactly (same name, hash, role, types)."""
        return self._by_name.get(identity.name) == identity

    def names(self) -> list[str]:
        return [entry.name for entry in self.entries]


def parse(data: bytes, path: str) -> tuple[Identity, ...]:
    """The entries of an auth file's bytes; ``AuthFileError`` (one line, naming ``path``)."""
    where = "auth file %s" % path
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise AuthFileError("%s: not UTF-8 text" % where) from None
    except tomllib.TOMLDecodeError as exc:
        raise AuthFileError("%s: not valid TOML: %s" % (where, " ".join(str(exc).split()))) from None
    unknown = sorted(set(doc) - {"token"})
    if unknown:
        raise AuthFileError("%s: unknown key %r (the file holds [[token]] tables only)" % (where, unknown[0]))
    tables = doc.get("token", [])
    if not isinstance(tables, list):
        raise AuthFileError("%s: 'token' must be an array of tables, written [[token]]" % where)
    entries: list[Identity] = []
    names: set[str] = set()
    digests: set[str] = set()
    for number, table in enumerate(tables, 1):
        entry = _entry(table, "%s: [[token]] number %d" % (where, number))
        if entry.name in names:
            raise AuthFileError("%s: two tokens are named %r" % (where, entry.name))
        if entry.digest in digests:
            raise AuthFileError("%s: token %r has the same sha256 as another token" % (where, entry.name))
        names.add(entry.name)
        digests.add(entry.digest)
        entries.append(entry)
    return tuple(entries)


def _entry(table: Any, where: str) -> Identity:
    if not isinstance(table, dict):
        raise AuthFileError("%s is not a table" % where)
    unknown = sorted(set(table) - _KEYS)
    if unknown:
        raise AuthFileError("%s: unknown key %r (keys: name, role, sha256, taskTypes)" % (where, unknown[0]))
    for key in ("name", "role", "sha256"):
        if not isinstance(table.get(key), str):
            raise AuthFileError("%s: %r must be a string" % (where, key))
    name, role, digest = table["name"], table["role"], table["sha256"]
    if not _NAME.match(name):
        raise AuthFileError("%s: name %r must be %s" % (where, name[:200], NAME_RULE))
    where = "%s (%s)" % (where, name)
    if role not in ROLES:
        raise AuthFileError("%s: role must be one of %s, got %r" % (where, ", ".join(ROLES), role[:200]))
    if not _HEX64.match(digest.lower()):
        raise AuthFileError("%s: sha256 must be 64 hexadecimal digits" % where)
    return Identity(name, role, parse_task_types(table.get("taskTypes"), where), digest.lower())


def parse_task_types(value: Any, where: str) -> tuple[str, ...] | None:
    """``taskTypes`` as a tuple of patterns (None when absent); ``AuthFileError`` naming ``where``."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise AuthFileError("%s: taskTypes must be an array of strings" % where)
    for pattern in value:
        if not isinstance(pattern, str) or not _PATTERN.match(pattern) or pattern == ".*":
            raise AuthFileError("%s: taskTypes holds %r; each is a task type (%s) or PREFIX.*"
                                % (where, pattern if not isinstance(pattern, str) else pattern[:200], NAME_RULE))
    return tuple(value)


# ---- what `jobmesh token` does to a file ----------------------------------------------------


def _toml_string(text: str) -> str:
    """A TOML basic string (names and patterns are plain ASCII by their rules)."""
    return '"%s"' % text.replace("\\", "\\\\").replace('"', '\\"')


def entry_text(name: str, role: str, digest: str, task_types: tuple[str, ...] | None = None) -> str:
    """One ``[[token]]`` table as the file holds it."""
    lines = ["[[token]]", "name = %s" % _toml_string(name), "role = %s" % _toml_string(role),
             "sha256 = %s" % _toml_string(digest)]
    if task_types is not None:
        lines.append("taskTypes = [%s]" % ", ".join(_toml_string(p) for p in task_types))
    return "\n".join(lines) + "\n"


def new_token(path: str, name: str, role: str, task_types: tuple[str, ...] | None = None) -> str:
    """Make a random token for a new entry ``name`` appended to ``path`` (created mode
    0600) and return it: the only time its text exists. ``AuthFileError`` for a bad or
    duplicate name, a bad role or patterns, or an unreadable file."""
    where = "auth file %s" % path
    if not _NAME.match(name):
        raise AuthFileError("token name %r must be %s" % (name[:200], NAME_RULE))
    if role not in ROLES:
        raise AuthFileError("role must be one of %s, got %r" % (", ".join(ROLES), role[:200]))
    if task_types is not None:
        parse_task_types(list(task_types), "--task-types")
    current = AuthFile.load(path, missing_ok=True)
    if name in current.names():
        raise AuthFileError("%s: a token named %r exists already (remove it first: jobmesh token rm %s)"
                            % (where, name, name))
    token = secrets.token_urlsafe(TOKEN_BYTES)
    text = entry_text(name, role, token_digest(token), task_types)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    except OSError as exc:
        raise AuthFileError("%s: cannot write it: %s" % (where, exc.strerror or exc)) from None
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        if f.tell() > 0:
            f.write("\n")
        f.write(text)
    return token


def remove_token(path: str, name: str) -> None:
    """Remove entry ``name`` from ``path`` (rewritten whole, mode 0600; other entries and
    their comments kept). ``AuthFileError`` if there is no such entry."""
    current = AuthFile.load(path)
    if name not in current.names():
        raise AuthFileError("auth file %s: no token named %r" % (path, name))
    with open(path, encoding="utf-8") as f:
        text = f.read()
    kept = [block for block in _blocks(text) if _block_name(block, path) != name]
    replace_file(path, "".join(kept))


def _blocks(text: str) -> list[str]:
    """The file cut before each ``[[token]]`` header: the preamble, then one block per entry."""
    blocks: list[str] = []
    current: list[str] = []
    for line in text.splitlines(keepends=True):
        if _HEADER.match(line.strip()) and current:
            blocks.append("".join(current))
            current = []
        current.append(line)
    blocks.append("".join(current))
    return blocks


def _block_name(block: str, path: str) -> str | None:
    if not any(_HEADER.match(line.strip()) for line in block.splitlines()):
        return None  # the preamble (comments)
    entries = parse(block.encode("utf-8"), path)
    return entries[0].name if entries else None


def replace_file(path: str, text: str) -> None:
    """Write ``text`` as ``path``'s new content, mode 0600, all at once (a temporary file
    in the same directory, then renamed over it)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(prefix=".jobmesh-auth-", dir=directory)  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise


def list_tokens(path: str) -> list[Identity]:
    """The entries of ``path`` in file order (``AuthFileError`` if it cannot be read)."""
    return list(AuthFile.load(path).entries)


# ---- the token a client or worker presents ---------------------------------------------------


def token_file_of(token_file: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The file ``read_token`` takes the token from (None: none, or ``JOBMESH_TOKEN``)."""
    env = os.environ if environ is None else environ
    if token_file:
        return token_file
    if env.get(TOKEN_ENV, "").strip():
        return None
    return env.get(TOKEN_FILE_ENV, "").strip() or None


def warn_if_exposed(path: str | None, what: str) -> None:
    """Log a warning when the secret file at ``path`` (a token, the auth file, a private
    key) may be read by users other than its owner; a file that cannot be looked at is
    left to whoever reads it."""
    if path is None:
        return
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if mode & 0o044:
        log.warning("%s %s is readable by other users (mode %04o): make it mode 0600 (chmod 600 %s)",
                    what, path, mode & 0o7777, path)


def read_token(token_file: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The token to present: ``--token-file`` (the flag's value), else ``JOBMESH_TOKEN``,
    else ``JOBMESH_TOKEN_FILE``; None when none is given. A file holds the token on its
    first line (surrounding whitespace is dropped). ``ConfigError`` for a file that cannot
    be read or holds no token."""
    env = os.environ if environ is None else environ
    if token_file:
        return _token_from_file(token_file, "--token-file")
    token = env.get(TOKEN_ENV, "").strip()
    if token:
        return token
    path = env.get(TOKEN_FILE_ENV, "").strip()
    if path:
        return _token_from_file(path, TOKEN_FILE_ENV)
    return None


def _token_from_file(path: str, source: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_TOKEN_CHARS + 2)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("%s: cannot read the token file %s: %s"
                          % (source, path, getattr(exc, "strerror", None) or exc)) from None
    lines = text.strip().splitlines()
    token = lines[0].strip() if lines else ""
    if not token or len(token) > MAX_TOKEN_CHARS:
        raise ConfigError("%s: the token file %s holds no token" % (source, path))
    return token
