"""The command line never shows a traceback: unknown options, oversized requests, a closed
stdout (``jobmesh list | head``) and unexpected exceptions each end in one line and an exit code."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jobmesh import cli
from jobmesh.client.api import CoordinatorClient
from jobmesh.errors import ClientError, InvalidRequest, RequestTooLarge
from jobmesh.exitcodes import EXIT_BROKEN_PIPE, EXIT_FAILED, EXIT_USAGE
from tests.support.processes import child_env
from tests.support.scripted_server import ScriptedServer

SNAP = {"jobId": "j-1", "taskType": "SLEEP", "state": "COMPLETED", "attempts": 1, "maxAttempts": 3,
        "workerId": None, "result": {"pad": "x" * 5000}, "error": None, "createdAtMillis": 1,
        "updatedAtMillis": 1, "priority": "NORMAL", "runAtMillis": None}


def lines(text: str) -> list[str]:
    return text.splitlines()


@pytest.mark.parametrize("argv", [["-v"], ["--bogus", "list"], ["-x", "submit", "SLEEP"]])
def test_an_unknown_top_level_option_is_one_usage_line(capsys, argv):
    assert cli.main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert lines(err) == ["jobmesh: unknown option %s; run 'jobmesh --help' for the commands and options" % argv[0]]


def test_an_unexpected_exception_is_one_line_and_exit_1(capsys, monkeypatch):
    from jobmesh.client import commands

    def boom(*_args):
        raise RuntimeError("something broke\nacross lines")

    monkeypatch.setattr(commands, "run_client_command", boom)
    monkeypatch.delenv("JOBMESH_DEBUG", raising=False)
    assert cli.main(["list", "--coordinator=127.0.0.1:1"]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert lines(err) == ["jobmesh list: internal error: RuntimeError: something broke across lines"]


def test_jobmesh_debug_adds_the_traceback(capsys, monkeypatch):
    from jobmesh.client import commands

    monkeypatch.setattr(commands, "run_client_command", lambda *a: 1 / 0)
    monkeypatch.setenv("JOBMESH_DEBUG", "1")
    assert cli.main(["status", "j", "--coordinator=127.0.0.1:1"]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().endswith("jobmesh status: internal error: ZeroDivisionError: "
                                                        "division by zero")


def test_the_library_raises_a_client_error_for_an_oversized_request():
    with CoordinatorClient("127.0.0.1", 1) as client:  # never connects: nothing is sent
        with pytest.raises(RequestTooLarge) as info:
            client.submit("WORD_COUNT", {"text": "x" * 1_100_000})
    assert isinstance(info.value, ClientError) and "exceeds the 1048576-byte limit" in str(info.value)
    with CoordinatorClient("127.0.0.1", 1) as client:
        with pytest.raises(InvalidRequest, match="not valid Unicode"):
            client.submit("WORD_COUNT", {"text": "\ud800"})


def test_the_cli_refuses_an_oversized_payload_in_one_line(capsys):
    server = ScriptedServer([])
    try:
        code = cli.main(["submit", "WORD_COUNT", '{"text": "%s"}' % ("x" * 1_100_000),
                         "--coordinator=127.0.0.1:%d" % server.port])
    finally:
        server.close()
    assert code == EXIT_USAGE
    err = capsys.readouterr().err
    assert len(lines(err)) == 1 and err.startswith("jobmesh submit: SUBMIT_JOB is too large to send: ")
    assert server.requests == []


def test_a_closed_stdout_ends_the_command_quietly():
    # Given a coordinator whose JOB_LIST is far larger than a pipe holds
    server = ScriptedServer([{"type": "JOB_LIST", "jobs": [dict(SNAP, jobId="j-%d" % i) for i in range(100)],
                              "nextCursor": None}])
    try:
        # When `jobmesh list --json | head -c 10` stops reading after a few bytes
        # (buffered stdout, as in a terminal session: with PYTHONUNBUFFERED=1 Python drops
        # the rest of a partial write to a closed pipe silently, and exits 0)
        env = {k: v for k, v in child_env().items()
               if k not in ("PYTHONUNBUFFERED", "GEVENT_MONITOR_THREAD_ENABLE")}
        proc = subprocess.Popen([sys.executable, "-m", "jobmesh", "list", "--json",
                                 "--coordinator=127.0.0.1:%d" % server.port],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                env=env)
        assert proc.stdout.read(10)
        proc.stdout.close()
        err = proc.stderr.read().decode()
        code = proc.wait(20)
    finally:
        server.close()
    # Then it exits 141 (as a tool killed by SIGPIPE would) without a word
    assert code == EXIT_BROKEN_PIPE
    assert err == ""
