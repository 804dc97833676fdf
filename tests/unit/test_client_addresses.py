"""The client library and the CLI given several coordinator addresses, against scripted
servers on 127.0.0.1: which requests go again on the next address, and which do not."""

from __future__ import annotations

import io
import socket
import threading
from contextlib import ExitStack, closing

import pytest

from jobmesh.cli import main, parse
from jobmesh.client.api import CoordinatorClient
from jobmesh.client.commands import Console, run_client_command
from jobmesh.errors import CoordinatorUnavailable
from jobmesh.exitcodes import EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE
from tests.support.processes import closed_address
from tests.support.scripted_server import CLOSE, ScriptedServer

SNAP = {"jobId": "j-1", "taskType": "SLEEP", "state": "QUEUED", "attempts": 0, "maxAttempts": 3,
        "workerId": None, "result": None, "error": None, "createdAtMillis": 1, "updatedAtMillis": 1,
        "priority": "NORMAL"}


def closed_port() -> int:
    return int(closed_address().rpartition(":")[2])


@pytest.fixture
def servers():
    """``servers(*steps, port=0, dies=False)``: a ScriptedServer, closed at teardown."""
    with ExitStack() as stack:
        yield lambda *steps, port=0, dies=False: stack.enter_context(closing(ScriptedServer(steps, port, dies)))


def test_a_refused_address_moves_on_to_the_next(servers):
    live = servers({"type": "JOB_STATUS", "job": SNAP})
    with CoordinatorClient("127.0.0.1:%d,127.0.0.1:%d" % (closed_port(), live.port)) as client:
        assert client.status("j-1") == SNAP
        assert client.port == live.port


def test_a_list_of_addresses_is_taken_too(servers):
    live = servers({"type": "JOB_STATUS", "job": SNAP})
    with CoordinatorClient(["127.0.0.1:%d" % closed_port(), "127.0.0.1:%d" % live.port]) as client:
        assert client.status("j-1") == SNAP


def test_every_address_refused_names_each_in_one_line():
    dead = [closed_port(), closed_port()]
    with CoordinatorClient(["127.0.0.1:%d" % p for p in dead]) as client:
        with pytest.raises(CoordinatorUnavailable) as info:
            client.workers()
    assert str(info.value) == "cannot connect to 127.0.0.1:%d: Connection refused; 127.0.0.1:%d: Connection refused" % (
        dead[0], dead[1])


def test_a_keyed_submit_lost_before_its_reply_goes_once_to_the_next_address(servers):
    # Given a coordinator that reads the submit and dies before replying, and a second one
    first, second = servers(CLOSE), servers({"type": "JOB_SUBMITTED", "jobId": "j-7"})
    with CoordinatorClient("127.0.0.1:%d,127.0.0.1:%d" % (first.port, second.port)) as client:
        # When a keyed submit is made
        job_id = client.submit("SLEEP", {"durationMillis": 1}, idempotency_key="k-1")
    # Then the same request went to the second, which answered it
    assert job_id == "j-7"
    assert first.requests == second.requests and second.requests[0]["idempotencyKey"] == "k-1"


def test_a_keyed_submit_waits_for_a_standby_to_take_over(servers):
    # Given a leader that reads the submit and dies, and a standby not yet listening
    first, standby = servers(CLOSE, dies=True), closed_port()
    took_over = []
    timer = threading.Timer(0.3, lambda: took_over.append(servers({"type": "JOB_SUBMITTED", "jobId": "j-7"},
                                                                  port=standby)))
    timer.start()
    try:
        with CoordinatorClient("127.0.0.1:%d,127.0.0.1:%d" % (first.port, standby), failover_timeout=30) as client:
            # When a keyed submit is made
            job_id = client.submit("SLEEP", {"durationMillis": 1}, idempotency_key="k-1")
    finally:
        timer.join()
    # Then it went round the list until the standby answered, and was sent there once
    assert job_id == "j-7" and took_over[0].requests == first.requests


def test_a_resend_gives_up_after_the_failover_timeout(servers):
    first = servers(CLOSE, dies=True)
    with CoordinatorClient("127.0.0.1:%d,%s" % (first.port, closed_address()), failover_timeout=0.2) as client:
        with pytest.raises(CoordinatorUnavailable, match="cannot connect to"):
            client.status("j-1")


def test_a_submit_without_a_key_is_not_sent_again(servers):
    first, second = servers(CLOSE), servers({"type": "JOB_SUBMITTED", "jobId": "j-7"})
    with CoordinatorClient("127.0.0.1:%d,127.0.0.1:%d" % (first.port, second.port)) as client:
        with pytest.raises(CoordinatorUnavailable):
            client.submit("SLEEP", {"durationMillis": 1})
        assert len(first.requests) == 1 and second.requests == []
        # ... and the next request starts with the next address
        assert client.submit("SLEEP", {"durationMillis": 1}) == "j-7"
    assert first.connections == 1


def test_a_cancel_lost_before_its_reply_is_not_sent_again(servers):
    first, second = servers(CLOSE), servers({"type": "JOB_CANCEL", "cancelled": True, "job": SNAP})
    with CoordinatorClient("127.0.0.1:%d,127.0.0.1:%d" % (first.port, second.port)) as client:
        with pytest.raises(CoordinatorUnavailable):
            client.cancel("j-1")
    assert second.requests == []


def test_a_read_lost_before_its_reply_goes_to_the_next_address(servers):
    first, second = servers(CLOSE), servers({"type": "JOB_STATUS", "job": SNAP})
    with CoordinatorClient("127.0.0.1:%d,127.0.0.1:%d" % (first.port, second.port)) as client:
        assert client.status("j-1") == SNAP


def cli(servers_ports, *argv):
    command, args = parse(list(argv) + ["--coordinator=%s" % ",".join("127.0.0.1:%d" % p for p in servers_ports)])
    out, err = io.StringIO(), io.StringIO()
    return run_client_command(command, args, Console(out, err)), out.getvalue(), err.getvalue()


def test_the_cli_gives_each_submit_a_key_of_its_own(servers):
    live = servers({"type": "JOB_SUBMITTED", "jobId": "j-1"}, {"type": "JOB_SUBMITTED", "jobId": "j-2"})
    assert cli([live.port], "submit", "SLEEP")[:2] == (EXIT_OK, "submitted job j-1\n")
    assert cli([live.port], "submit", "SLEEP")[:2] == (EXIT_OK, "submitted job j-2\n")
    keys = [r["idempotencyKey"] for r in live.requests]
    assert [r["type"] for r in live.requests] == ["SUBMIT_JOB"] * 2  # nothing else is asked
    assert all(k.startswith("cli-") and len(k) == 36 for k in keys) and keys[0] != keys[1]


def test_the_cli_submit_lost_before_its_reply_is_sent_again_and_prints_the_job(servers):
    # The second coordinator already holds the job the key made: it answers with that job.
    first, second = servers(CLOSE), servers({"type": "JOB_SUBMITTED", "jobId": "j-1"})
    code, out, err = cli([first.port, second.port], "submit", "SLEEP", '{"durationMillis": 5}')
    assert (code, out, err) == (EXIT_OK, "submitted job j-1\n", "")
    assert first.requests == second.requests


def test_the_cli_with_every_address_dead_says_so_in_one_line_and_exits_3():
    # Two listeners open at once, so the two ports differ (one closed before the next is
    # bound can be handed out again, and a list naming one address twice names it once)
    with socket.create_server(("127.0.0.1", 0)) as one, socket.create_server(("127.0.0.1", 0)) as two:
        dead = [one.getsockname()[1], two.getsockname()[1]]
    code, out, err = cli(dead, "list")
    assert code == EXIT_UNREACHABLE and out == ""
    assert err == ("jobmesh list: coordinator unreachable: cannot connect to 127.0.0.1:%d: Connection refused; "
                   "127.0.0.1:%d: Connection refused\n" % tuple(dead))


def test_a_bad_address_is_a_usage_error_naming_the_flag(capsys):
    assert main(["list", "--coordinator=127.0.0.1:1,,127.0.0.1:2"]) == EXIT_USAGE
    assert capsys.readouterr().err == ("jobmesh list: --coordinator: '127.0.0.1:1,,127.0.0.1:2' has an empty entry; "
                                       "give HOST:PORT[,HOST:PORT...] (an IPv6 host in brackets: [::1]:7070)\n")


def test_the_library_takes_jobmesh_coordinator_when_given_no_address(servers, monkeypatch):
    live = servers({"type": "JOB_STATUS", "job": SNAP})
    monkeypatch.setenv("JOBMESH_COORDINATOR", "127.0.0.1:%d,127.0.0.1:%d" % (closed_port(), live.port))
    with CoordinatorClient() as client:
        assert client.status("j-1") == SNAP
    with CoordinatorClient("127.0.0.1:%d" % closed_port()) as client:  # an address given wins
        with pytest.raises(CoordinatorUnavailable):
            client.status("j-1")


def test_a_wait_whose_coordinator_stays_away_past_the_window_raises_the_public_error(servers):
    # Given one address, where the coordinator reads the wait and dies for good
    gone = servers(CLOSE, dies=True)
    with CoordinatorClient("127.0.0.1:%d" % gone.port, failover_timeout=0.3) as client:
        # When the wait is sent again until the window ends
        with pytest.raises(CoordinatorUnavailable) as info:
            client.wait("j-1")
    # Then the error is the documented class itself, in one line naming the address
    assert type(info.value) is CoordinatorUnavailable
    assert str(info.value) == "cannot connect to 127.0.0.1:%d: Connection refused" % gone.port


def test_a_coordinator_that_drops_every_request_at_once_is_given_up_quickly(servers):
    # (as a TLS port drops a plaintext client: sending again cannot help)
    dropping = servers(CLOSE, CLOSE, CLOSE, CLOSE, {"type": "JOB_STATUS", "job": SNAP})
    with CoordinatorClient("127.0.0.1:%d" % dropping.port) as client:
        with pytest.raises(CoordinatorUnavailable) as info:
            client.status("j-1")
    assert type(info.value) is CoordinatorUnavailable
    assert str(info.value) == "127.0.0.1:%d closed the connection without replying" % dropping.port
    assert len(dropping.requests) == 3


def test_the_cli_wait_given_up_is_one_line_and_exit_3(servers):
    dropping = servers(CLOSE, CLOSE, CLOSE)
    code, out, err = cli([dropping.port], "wait", "j-1")
    assert (code, out) == (EXIT_UNREACHABLE, "")
    assert err == ("jobmesh wait: coordinator unreachable: 127.0.0.1:%d closed the connection without replying\n"
                   % dropping.port)
