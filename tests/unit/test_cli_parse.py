"""Every command's docopt usage accepts the flags CONTRACT.md names (parsing only, no subprocess)."""

from __future__ import annotations

import pytest
from docopt import DocoptExit

from jobmesh.cli import UsageError

from jobmesh.cli import CLIENT_COMMANDS, DOCS, parse

COORDINATOR_FLAGS = {
    "--bind": ("127.0.0.1", "0.0.0.0"),
    "--worker-port": ("7070", "0"),
    "--client-port": ("7071", "0"),
    "--periodic-port": (None, "5000"),
    "--db": ("jobmesh.db", "/tmp/j.db"),
    "--heartbeat-timeout-millis": ("6000", "600"),
    "--task-timeout-millis": ("600000", "300"),
    "--max-active-jobs": ("100000", "3"),
    "--aging-step-millis": ("60000", "200"),
    "--retry-base-millis": ("1000", "20"),
    "--retry-cap-millis": ("30000", "200"),
    "--default-max-attempts": ("3", "5"),
    "--sweep-interval-millis": ("500", "20"),
    "--retain-finished-millis": ("604800000", "0"),
    "--log-format": ("text", "json"),
}


def test_commands_are_the_contracts():
    client = {"submit", "status", "list", "workers", "cancel", "wait", "events", "retry", "purge", "top",
              "schedule", "limit", "pause", "resume", "workflow"}
    assert set(DOCS) == {"up", "coordinator", "worker", "token"} | client
    assert set(CLIENT_COMMANDS) == client


@pytest.mark.parametrize("command", ["coordinator", "up"])
def test_coordinator_option_defaults(command):
    cmd, args = parse([command])
    assert cmd == command
    for flag, (default, _given) in COORDINATOR_FLAGS.items():
        assert args[flag] == default, flag


@pytest.mark.parametrize("command", ["coordinator", "up"])
def test_coordinator_options_given(command):
    argv = [command] + ["%s=%s" % (flag, given) for flag, (_d, given) in COORDINATOR_FLAGS.items()]
    _cmd, args = parse(argv)
    for flag, (_default, given) in COORDINATOR_FLAGS.items():
        assert args[flag] == given, flag


def test_coordinator_options_with_space_separated_values():
    _cmd, args = parse(["coordinator", "--worker-port", "0", "--client-port", "0", "--db", "x.db"])
    assert (args["--worker-port"], args["--client-port"], args["--db"]) == ("0", "0", "x.db")


def test_up_workers():
    assert parse(["up"])[1]["--workers"] == "2"
    assert parse(["up", "--workers=5"])[1]["--workers"] == "5"
    assert parse(["up", "--workers=1", "--db=u.db", "--worker-port=0"])[1]["--db"] == "u.db"


def test_worker_options():
    _cmd, args = parse(["worker"])
    assert args["--coordinator"] == "127.0.0.1:7070"
    assert args["--id"] is None
    assert args["--capacity"] == "4"
    assert args["--heartbeat-interval-millis"] == "2000"
    _cmd, args = parse(["worker", "--coordinator=h:1", "--id=w-1", "--capacity=8",
                        "--heartbeat-interval-millis=100"])
    assert (args["--coordinator"], args["--id"], args["--capacity"], args["--heartbeat-interval-millis"]) == (
        "h:1", "w-1", "8", "100")


def test_submit():
    _cmd, args = parse(["submit", "SLEEP"])
    assert args["TASK_TYPE"] == "SLEEP"
    assert args["PAYLOAD_JSON"] is None
    assert args["--wait"] is False and args["--json"] is False
    assert args["--idempotency-key"] is None
    assert args["--coordinator"] == "127.0.0.1:7071"
    _cmd, args = parse(["submit", "SHA256", '{"text": "hi"}', "--max-attempts=5", "--priority=HIGH",
                        "--idempotency-key=k-1", "--submit-retries=3", "--wait", "--json",
                        "--coordinator=c:9"])
    assert args["TASK_TYPE"] == "SHA256"
    assert args["PAYLOAD_JSON"] == '{"text": "hi"}'
    assert (args["--max-attempts"], args["--priority"], args["--idempotency-key"], args["--submit-retries"]) == (
        "5", "HIGH", "k-1", "3")
    assert args["--wait"] is True and args["--json"] is True
    assert args["--coordinator"] == "c:9"


def test_submit_schedule_flags():
    _cmd, args = parse(["submit", "SLEEP"])
    assert args["--delay-millis"] is None and args["--run-at"] is None
    _cmd, args = parse(["submit", "SLEEP", "--delay-millis=5000"])
    assert args["--delay-millis"] == "5000"
    _cmd, args = parse(["submit", "GREET", '{"name": "Ada"}', "--run-at=2026-12-24T18:00:00Z", "--wait"])
    assert (args["TASK_TYPE"], args["--run-at"], args["--wait"]) == ("GREET", "2026-12-24T18:00:00Z", True)


def test_list_type_and_state():
    _cmd, args = parse(["list"])
    assert args["--type"] is None and args["--state"] is None
    _cmd, args = parse(["list", "--type=GREET", "--state=SCHEDULED"])
    assert (args["--type"], args["--state"]) == ("GREET", "SCHEDULED")


def test_submit_options_before_positionals():
    _cmd, args = parse(["submit", "--priority=LOW", "SLEEP", '{"durationMillis": 1}'])
    assert (args["TASK_TYPE"], args["PAYLOAD_JSON"], args["--priority"]) == ("SLEEP", '{"durationMillis": 1}', "LOW")


@pytest.mark.parametrize("command", ["status", "cancel", "wait"])
def test_job_id_commands(command):
    _cmd, args = parse([command, "job-42"])
    assert args["JOB_ID"] == "job-42"
    assert args["--json"] is False
    assert args["--coordinator"] == "127.0.0.1:7071"
    _cmd, args = parse([command, "job-42", "--json", "--coordinator=h:2"])
    assert args["--json"] is True and args["--coordinator"] == "h:2"


def test_wait_timeout():
    assert parse(["wait", "j", "--timeout-millis=250"])[1]["--timeout-millis"] == "250"


@pytest.mark.parametrize("command", ["list", "workers"])
def test_listing_commands(command):
    _cmd, args = parse([command, "--json", "--coordinator=h:3"])
    assert args["--json"] is True and args["--coordinator"] == "h:3"


@pytest.mark.parametrize("command", sorted(CLIENT_COMMANDS))
def test_every_client_command_takes_coordinator(command):
    argv = [command] + {"submit": ["SLEEP"], "status": ["j"], "cancel": ["j"], "wait": ["j"], "events": ["j"],
                         "retry": ["j"], "purge": ["--older-than=7d"], "schedule": ["list"], "limit": ["list"],
                         "pause": ["T"], "resume": ["T"], "workflow": ["status", "w"]}.get(command, [])
    _cmd, args = parse(argv + ["--coordinator=example:1234"])
    assert args["--coordinator"] == "example:1234"


@pytest.mark.parametrize("argv", [
    ["frobnicate"],
    ["coordinator", "--no-such-flag=1"],
    ["status"],                # JOB_ID required
    ["cancel"],
    ["wait"],
    ["submit"],                # TASK_TYPE required
    ["events"],                # JOB_ID required
    ["retry"],
    ["purge"],                 # --older-than required
    ["top", "--json"],         # top has no --json
    ["status", "a", "b"],
    ["worker", "extra"],
])
def test_usage_errors(argv):
    with pytest.raises((DocoptExit, UsageError)) as info:
        parse(argv)
    assert "Usage:" in str(info.value)
    assert "unmatched (duplicate?)" not in str(info.value)


@pytest.mark.parametrize("command", sorted(DOCS))
def test_help_exits(command):
    with pytest.raises(SystemExit):
        parse([command, "--help"])


@pytest.mark.parametrize("argv,message", [
    (["lst"], "unknown command 'lst' (did you mean 'list'?)"),
    (["frobnicate"], "unknown command 'frobnicate'\n"),
    (["list", "--bogus"], "jobmesh list: unknown option --bogus\n"),
    (["list", "--jsn"], "jobmesh list: unknown option --jsn (did you mean '--json'?)"),
    (["submit", "SLEEP", "--prority=HIGH"], "unknown option --prority (did you mean '--priority'?)"),
])
def test_a_bad_command_or_flag_is_named_with_the_closest_one(argv, message):
    with pytest.raises(UsageError) as info:
        parse(argv)
    assert message in str(info.value)
    assert "Commands:" not in str(info.value)  # not the whole help


def test_a_unique_prefix_of_an_option_is_not_called_unknown():
    command, args = parse(["submit", "SLEEP", "--prio=HIGH"])
    assert args["--priority"] == "HIGH"


def test_limit_set_and_its_flags():
    cmd, args = parse(["limit", "set", "EXPORT", "--max-running=5", "--max-running-per-key=2", "--rate=10",
                       "--burst=20", "--rate-per-key=0.5", "--json"])
    assert cmd == "limit" and args["set"] and args["TASK_TYPE"] == "EXPORT" and args["--json"]
    assert (args["--max-running"], args["--max-running-per-key"], args["--rate"], args["--burst"],
            args["--rate-per-key"]) == ("5", "2", "10", "20", "0.5")


@pytest.mark.parametrize("argv,sub", [(["limit", "list"], "list"), (["limit", "show", "EXPORT"], "show"),
                                      (["limit", "rm", "EXPORT"], "rm")])
def test_limit_subcommands(argv, sub):
    cmd, args = parse(argv)
    assert cmd == "limit" and args[sub]


@pytest.mark.parametrize("command", ["pause", "resume"])
def test_pause_and_resume_take_a_task_type(command):
    cmd, args = parse([command, "MAILER", "--json"])
    assert (cmd, args["TASK_TYPE"], args["--json"]) == (command, "MAILER", True)
    with pytest.raises(UsageError):
        parse([command])


def test_submit_keys():
    _cmd, args = parse(["submit", "EXPORT", "--concurrency-key=acme", "--unique-key=report:1"])
    assert (args["--concurrency-key"], args["--unique-key"]) == ("acme", "report:1")


@pytest.mark.parametrize("argv", [["limit"], ["limit", "set"], ["limit", "show"], ["limit", "list", "X"],
                                  ["limit", "set", "X", "--max-runnin-per=1"]])
def test_limit_usage_errors(argv):
    with pytest.raises(UsageError):
        parse(argv)
