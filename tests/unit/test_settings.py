"""Settings from flags, JOBMESH_* variables and a TOML --config file (jobmesh/config.py
``layered``, jobmesh/cli.py ``settings``): the precedence, errors that name where a bad
value came from, and --print-config. Driven through ``cli.main`` as the process runs it."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from jobmesh.addresses import Address
from jobmesh.cli import COORDINATOR_DOC, main, parse, settings
from jobmesh.config import coordinator_config, env_name, worker_config
from jobmesh.up import HIDDEN_FROM_CHILDREN, child_environment


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("JOBMESH_"):
            monkeypatch.delenv(name)


def printed(capsys, *argv: str) -> dict[str, tuple[str, str]]:
    """``jobmesh ... --print-config`` as {key: (value, source)}; unset keys are left out."""
    assert main([*argv, "--print-config"]) == 0
    out = capsys.readouterr().out
    rows = {}
    for line in out.splitlines():
        m = re.match(r"(?P<key>[a-z0-9-]+) = (?P<value>.*?)\s+# (?P<source>.+)$", line)
        if m:
            rows[m["key"]] = (m["value"], m["source"])
    return rows


def failed(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def write(tmp_path, text: str, name: str = "jobmesh.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_flag_beats_environment_beats_file_beats_default(tmp_path, monkeypatch, capsys):
    conf = write(tmp_path, 'heartbeat-timeout-millis = 100\nretry-base-millis = 200\nretry-cap-millis = 300\n'
                           'db = "from-file.db"\n')
    monkeypatch.setenv("JOBMESH_HEARTBEAT_TIMEOUT_MILLIS", "111")
    monkeypatch.setenv("JOBMESH_RETRY_BASE_MILLIS", "222")
    rows = printed(capsys, "coordinator", "--config=%s" % conf, "--heartbeat-timeout-millis=1")
    assert rows["heartbeat-timeout-millis"] == ("1", "command line")
    assert rows["retry-base-millis"] == ("222", "environment JOBMESH_RETRY_BASE_MILLIS")
    assert rows["retry-cap-millis"] == ("300", "config file " + conf)
    assert rows["db"] == ('"from-file.db"', "config file " + conf)
    assert rows["sweep-interval-millis"] == ("500", "default")


def test_a_default_never_beats_the_environment(monkeypatch):
    # docopt fills in [default: ...]; a flag left at its default is not a flag given.
    monkeypatch.setenv("JOBMESH_WORKER_PORT", "0")
    monkeypatch.setenv("JOBMESH_DB_SYNCHRONOUS", "normal")
    argv = ["coordinator"]
    args, sources = settings("coordinator", argv, parse(argv)[1], __import__("os").environ)
    cfg = coordinator_config(args)
    assert (cfg.worker_port, cfg.db_synchronous) == (0, "NORMAL")
    assert str(sources["--worker-port"]) == "environment JOBMESH_WORKER_PORT"
    # ... but a flag given on the command line, even with the default's value, beats it.
    argv = ["coordinator", "--worker-port=7070"]
    args, sources = settings("coordinator", argv, parse(argv)[1], __import__("os").environ)
    assert coordinator_config(args).worker_port == 7070


def test_an_abbreviated_flag_or_a_separate_value_is_a_flag_given(monkeypatch):
    monkeypatch.setenv("JOBMESH_HEARTBEAT_TIMEOUT_MILLIS", "111")
    monkeypatch.setenv("JOBMESH_DB", "env.db")
    argv = ["coordinator", "--heartbeat-timeout=222", "--db", "flag.db"]
    args, sources = settings("coordinator", argv, parse(argv)[1], __import__("os").environ)
    cfg = coordinator_config(args)
    assert (cfg.heartbeat_timeout_millis, cfg.db) == (222, "flag.db")
    assert str(sources["--db"]) == "command line"


def test_config_flag_beats_jobmesh_config(tmp_path, monkeypatch, capsys):
    named = write(tmp_path, "max-active-jobs = 5\n", "named.toml")
    monkeypatch.setenv("JOBMESH_CONFIG", write(tmp_path, "max-active-jobs = 7\n", "env.toml"))
    assert printed(capsys, "coordinator")["max-active-jobs"][0] == "7"
    assert printed(capsys, "coordinator", "--config=%s" % named)["max-active-jobs"] == ("5", "config file " + named)


def test_an_unknown_key_in_the_file_names_the_file(tmp_path, capsys):
    conf = write(tmp_path, "heartbeat-timeout-milis = 300\n")
    err = failed(capsys, "coordinator", "--config=%s" % conf)
    assert conf in err and "heartbeat-timeout-milis" in err and "heartbeat-timeout-millis" in err


@pytest.mark.parametrize("text, what", [
    ('worker-port = "abc"\n', "--worker-port"),
    ("worker-port = 1.5\n", "worker-port"),
    ("retry-base-millis = -1\n", "--retry-base-millis"),
    ("db-synchronous = true\n", "db-synchronous"),
    ("worker-port = [\n", "TOML"),
    ("config = 'other.toml'\n", "config"),
])
def test_a_bad_value_in_the_file_names_the_file(tmp_path, capsys, text, what):
    conf = write(tmp_path, text)
    err = failed(capsys, "coordinator", "--config=%s" % conf)
    assert conf in err and what in err


@pytest.mark.parametrize("argv, flag", [
    (["--tls-key=k.pem"], "--tls-cert"),
    (["--tls-client-ca=ca.pem"], "--tls-client-ca"),
    (["--tls-cert=missing.pem", "--tls-key=missing-key.pem", "--worker-port=0", "--client-port=0"], "--tls-cert"),
])
def test_tls_flags_that_cannot_work_are_usage_errors(tmp_path, capsys, argv, flag):
    # The certificate files are read before the database is touched.
    err = failed(capsys, "coordinator", "--db=%s" % (tmp_path / "x.db"), *["--%s" % a[2:] for a in argv])
    assert flag in err
    assert not (tmp_path / "x.db").exists()


def test_a_missing_file_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("JOBMESH_CONFIG", str(tmp_path / "nowhere.toml"))
    assert str(tmp_path / "nowhere.toml") in failed(capsys, "coordinator")


@pytest.mark.parametrize("var, value", [
    ("JOBMESH_WORKER_PORT", "abc"), ("JOBMESH_HEARTBEAT_TIMEOUT_MILLIS", "0"), ("JOBMESH_LOG_LEVEL", "LOUD"),
])
def test_a_bad_variable_is_named(capsys, monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    err = failed(capsys, "coordinator")
    assert var in err


def test_a_bad_switch_in_the_environment_is_named(capsys, monkeypatch):
    monkeypatch.setenv("JOBMESH_TLS", "maybe")
    assert "JOBMESH_TLS" in failed(capsys, "worker")


def test_variables_that_name_no_flag_are_ignored(capsys, monkeypatch):
    monkeypatch.setenv("JOBMESH_NO_SUCH_FLAG", "whatever")
    monkeypatch.setenv("JOBMESH_TOKEN", "a-secret-token")
    monkeypatch.setenv("JOBMESH_DEBUG", "0")
    rows = printed(capsys, "coordinator")
    assert all(source == "default" for _value, source in rows.values())


def test_print_config_covers_every_flag_of_the_usage_text(capsys):
    # Generic: every flag the usage text declares is a setting, with no list kept anywhere
    # (set ones as "key = value", unset ones as "# key is not set").
    assert main(["coordinator", "--print-config"]) == 0
    shown = set(re.findall(r"^#? ?([a-z][a-z0-9-]*)(?: = | is not set)", capsys.readouterr().out, re.M))
    declared = {flag[2:] for flag in re.findall(r"^\s+(--[a-z][a-z0-9-]*)", COORDINATOR_DOC, re.M)}
    assert declared - {"help", "config", "print-config"} <= shown


def test_print_config_of_up_says_what_an_unset_lease_grace_becomes(capsys):
    assert main(["up", "--print-config", "--heartbeat-timeout-millis=4000"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "lease-grace-millis" in line]
    assert len(lines) == 1 and lines[0].startswith("# lease-grace-millis is not set")
    assert lines[0].endswith("up gives its coordinator the heartbeat timeout, 4000 ms")
    assert main(["up", "--print-config", "--lease-grace-millis=5"]) == 0
    assert "heartbeat timeout" not in capsys.readouterr().out


def test_print_config_never_shows_keys(tmp_path, capsys):
    key = str(tmp_path / "very-private-key.pem")
    cert = str(tmp_path / "server.pem")
    assert main(["coordinator", "--print-config", "--tls-cert=%s" % cert, "--tls-key=%s" % key]) == 0
    out = capsys.readouterr().out
    assert "very-private-key" not in out
    assert "tls-key = (set, not shown)" in out
    assert 'tls-cert = "%s"' % cert in out


@pytest.mark.parametrize("command", ["coordinator", "up"])
def test_print_config_never_shows_a_database_password(monkeypatch, capsys, command):
    url = "postgresql://jobs:very-secret@db.example:5432/jobs?password=also-secret"
    assert main([command, "--print-config", "--db=%s" % url]) == 0
    out = capsys.readouterr().out
    assert "secret" not in out
    assert re.search(r'^# db = "postgresql://jobs:\*\*\*@db.example:5432/jobs\?password=\*\*\*"', out, re.M)
    monkeypatch.setenv("JOBMESH_DB", url)
    assert main([command, "--print-config"]) == 0
    assert "secret" not in capsys.readouterr().out
    assert printed(capsys, command, "--db=postgresql://jobs@db.example/jobs")["db"] == (
        '"postgresql://jobs@db.example/jobs"', "command line")


def test_print_config_output_is_a_config_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JOBMESH_SWEEP_INTERVAL_MILLIS", "25")
    assert main(["coordinator", "--print-config", "--bind=127.0.0.2", "--db=my db.sqlite"]) == 0
    conf = write(tmp_path, capsys.readouterr().out)
    monkeypatch.delenv("JOBMESH_SWEEP_INTERVAL_MILLIS")
    rows = printed(capsys, "coordinator", "--config=%s" % conf)
    assert rows["sweep-interval-millis"] == ("25", "config file " + conf)
    assert rows["bind"] == ('"127.0.0.2"', "config file " + conf)
    assert rows["db"] == ('"my db.sqlite"', "config file " + conf)


def test_worker_and_up_settings(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JOBMESH_COORDINATOR", "10.0.0.5:7070")
    monkeypatch.setenv("JOBMESH_TLS_CA", "/etc/jobmesh/ca.pem")
    conf = write(tmp_path, 'capacity = 8\ntasks = ["mytasks", "more.tasks"]\n')
    argv = ["worker", "--config=%s" % conf]
    args, _ = settings("worker", argv, parse(argv)[1], __import__("os").environ)
    cfg = worker_config(args)
    assert (cfg.coordinators, cfg.capacity) == ((Address("10.0.0.5", 7070),), 8)
    assert cfg.task_modules == ("mytasks", "more.tasks")
    assert cfg.tls is not None and cfg.tls.ca == "/etc/jobmesh/ca.pem"
    monkeypatch.setenv("JOBMESH_WORKERS", "3")
    assert printed(capsys, "up")["workers"] == ("3", "environment JOBMESH_WORKERS")


def test_client_commands_take_the_coordinator_from_the_environment_below_the_flag(monkeypatch):
    monkeypatch.setenv("JOBMESH_COORDINATOR", "10.0.0.5:7071,10.0.0.6:7071")
    monkeypatch.setenv("JOBMESH_CONNECT_TIMEOUT_MILLIS", "300")
    for command in ("list", "top", "submit"):
        argv = [command] + (["SLEEP"] if command == "submit" else [])
        args, sources = settings(command, argv, parse(argv)[1], __import__("os").environ)
        assert args["--coordinator"] == "10.0.0.5:7071,10.0.0.6:7071" and args["--connect-timeout-millis"] == "300"
        assert str(sources["--coordinator"]) == "environment JOBMESH_COORDINATOR"
    argv = ["list", "--coordinator=10.0.0.7:7071"]
    assert settings("list", argv, parse(argv)[1], __import__("os").environ)[0]["--coordinator"] == "10.0.0.7:7071"


def test_up_keeps_its_own_settings_from_its_children(monkeypatch):
    for name in HIDDEN_FROM_CHILDREN:
        monkeypatch.setenv(name, "x")
    monkeypatch.setenv("JOBMESH_TOKEN_FILE", "kept")
    env = child_environment()
    assert not set(HIDDEN_FROM_CHILDREN) & set(env)
    assert env["JOBMESH_TOKEN_FILE"] == "kept"


def test_env_names():
    assert env_name("--heartbeat-timeout-millis") == "JOBMESH_HEARTBEAT_TIMEOUT_MILLIS"
    assert env_name("--tls-ca") == "JOBMESH_TLS_CA"


def test_print_config_as_a_process(tmp_path):
    # The real entry point: no coordinator starts, the output says where each value came from.
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": sys.path[0] if sys.path[0] else ".",
           "JOBMESH_CLIENT_PORT": "17071"}
    import os

    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    out = subprocess.run([sys.executable, "-m", "jobmesh", "coordinator", "--print-config",
                          "--db=%s" % (tmp_path / "x.db")], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^client-port = 17071\s+# environment JOBMESH_CLIENT_PORT$", out.stdout, re.M)
    assert not (tmp_path / "x.db").exists()


def test_ssl_is_patched_before_anything_imports_it():
    # The process entry patches first: the ssl module jobmesh uses is gevent's, and gevent
    # does not warn that ssl was imported before patching.
    code = ("import warnings; warnings.simplefilter('error')\n"
            "import jobmesh.__main__, ssl, gevent.ssl, gevent.monkey\n"
            "import jobmesh.cli, jobmesh.coordinator.shell.runtime, jobmesh.worker.agent, jobmesh.client.api\n"
            "assert gevent.monkey.is_module_patched('ssl')\n"
            "assert ssl.SSLContext is gevent.ssl.SSLContext\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_no_line_of_prose_declares_an_option():
    # docopt reads any line of a usage text that starts with "--" as an option: prose
    # wrapped so that "--keep-running-millis:" began a line declared a flag of that name
    # (--print-config listed it, and the prefix --keep-running= was ambiguous).
    import docopt

    from jobmesh.cli import DOCS

    for command, doc in DOCS.items():
        bad = [o.longer for o in docopt.parse_options(doc)
               if o.longer and not re.fullmatch(r"--[a-z0-9][a-z0-9-]*", o.longer)]
        assert not bad, "jobmesh %s: prose read as options %s" % (command, bad)
    assert parse(["worker", "--keep-running=5"])[1]["--keep-running-millis"] == "5"


def test_every_flag_of_every_command_parses():
    # A line of a usage text that starts with a flag is read by docopt as that flag's
    # definition; a second definition makes the flag unusable ("not a unique prefix").
    from jobmesh.cli import DOCS, _options_of

    for command, doc in DOCS.items():
        for flag in _options_of(doc):
            if flag in ("--help", "--version"):
                continue
            try:
                parse([command, flag + "=1"])
            except Exception as exc:  # noqa: BLE001 - a usage error is fine, a broken usage text is not
                assert "unique prefix" not in str(exc) and type(exc).__name__ != "DocoptLanguageError", (
                    "jobmesh %s %s: %s" % (command, flag, exc))
            try:
                parse([command, flag])
            except Exception as exc:  # noqa: BLE001
                assert "unique prefix" not in str(exc) and type(exc).__name__ != "DocoptLanguageError", (
                    "jobmesh %s %s: %s" % (command, flag, exc))


TEN_YEARS = 315_360_000_000
CLOSED = "127.0.0.1:1"  # no coordinator listens there
TOO_LONG = "99999999999999999999"


@pytest.mark.parametrize("command, flag", [
    ("coordinator", "--task-timeout-millis"), ("coordinator", "--lease-grace-millis"),
    ("coordinator", "--retry-cap-millis"), ("up", "--heartbeat-timeout-millis"), ("worker", "--keep-running-millis"),
])
@pytest.mark.parametrize("source", ["flag", "environment", "file"])
def test_a_millisecond_setting_above_ten_years_is_an_error_naming_its_source(tmp_path, monkeypatch, capsys,
                                                                            command, flag, source):
    argv = [command, "--print-config"]
    if source == "flag":
        argv.append("%s=%s" % (flag, TOO_LONG))
        where = flag
    elif source == "environment":
        where = env_name(flag)
        monkeypatch.setenv(where, TOO_LONG)
    else:
        where = write(tmp_path, "%s = %s\n" % (flag[2:], TOO_LONG))
        argv.append("--config=%s" % where)
    err = failed(capsys, *argv)
    assert flag in err and where in err and str(TEN_YEARS) in err, err
    # Ten years itself is a setting like any other.
    assert printed(capsys, command, "%s=%d" % (flag, TEN_YEARS))[flag[2:]] == (str(TEN_YEARS), "command line")


def test_every_millisecond_flag_of_every_command_is_bounded_at_ten_years(capsys):
    # Generic: found in the usage texts, so a flag added later is bounded too.
    import docopt

    from jobmesh.cli import DOCS

    samples = {"submit": ["SLEEP"], "purge": ["--older-than=1d"], "schedule": ["preview", "--cron=@daily"],
               "limit": ["list"], "pause": ["SLEEP"], "resume": ["SLEEP"], "workflow": ["wait", "W"]}
    checked = set()
    for command, doc in DOCS.items():
        for flag in sorted({o.longer for o in docopt.parse_options(doc) if (o.longer or "").endswith("-millis")}):
            argv = [command] + samples.get(command, ["J"] if "JOB_ID" in doc.split("Usage:")[1] else [])
            if flag == "--every-millis":
                argv = ["schedule", "preview"]
            # Nothing starts or connects, whatever happens to the check.
            argv.append("--print-config" if command in ("coordinator", "up", "worker") else "--coordinator=" + CLOSED)
            argv.append("%s=%s" % (flag, TOO_LONG))
            err = failed(capsys, *argv)
            assert flag in err and str(TEN_YEARS) in err, (command, err)
            checked.add(flag)
    assert {"--timeout-millis", "--drain-millis", "--every-millis", "--connect-timeout-millis"} <= checked
