"""CoordinatorClient's error mapping, against a tiny scripted server on 127.0.0.1 (stdlib threads).

The ``serve`` fixture (tests/unit/conftest.py) plays ``tests.support.scripted_server.ScriptedServer`` steps.
"""

from __future__ import annotations

import socket

import pytest

from jobmesh.client.api import DROPS_AT_ONCE, WAIT_CHUNK_MILLIS, CoordinatorClient, Failover, WaitTimeout, submit_backoff
from jobmesh.client.wire import ClosedUnanswered, NotConnected
from jobmesh.errors import CoordinatorUnavailable, RequestFailed, SubmitRejected
from tests.support.scripted_server import CLOSE, Delayed, HANG

SNAP = {"jobId": "j-1", "taskType": "SLEEP", "state": "QUEUED", "attempts": 0, "maxAttempts": 3,
        "workerId": None, "result": None, "error": None, "createdAtMillis": 1, "updatedAtMillis": 1,
        "priority": "NORMAL"}


def test_submit_returns_job_id_and_sends_every_field(serve):
    server, client = serve({"type": "JOB_SUBMITTED", "jobId": "j-9"})
    assert client.submit("SLEEP", {"durationMillis": 1}, max_attempts=2, priority="HIGH",
                         idempotency_key="k1") == "j-9"
    assert server.requests == [{"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 1},
                                "maxAttempts": 2, "idempotencyKey": "k1", "priority": "HIGH",
                                "runAtMillis": None, "delayMillis": None}]


def test_many_requests_share_one_connection(serve):
    server, client = serve({"type": "JOB_STATUS", "job": SNAP}, {"type": "WORKER_LIST", "workers": []},
                           {"type": "JOB_LIST", "jobs": [SNAP], "nextCursor": "c2"})
    assert client.status("j-1") == SNAP
    assert client.workers() == []
    assert client.list_jobs(limit=1, state="QUEUED") == ([SNAP], "c2")
    assert server.connections == 1
    assert server.requests[2] == {"type": "LIST_JOBS", "limit": 1, "state": "QUEUED", "cursor": None,
                                  "taskType": None}


def test_error_reply_is_request_failed_and_keeps_the_connection(serve):
    server, client = serve({"type": "ERROR", "message": "unknown job j-x"}, {"type": "JOB_STATUS", "job": SNAP})
    with pytest.raises(RequestFailed) as info:
        client.status("j-x")
    assert info.value.message == "unknown job j-x"
    assert client.status("j-1") == SNAP
    assert server.connections == 1


def test_submit_rejected_carries_its_fields(serve):
    _, client = serve({"type": "SUBMIT_REJECTED", "reason": "at capacity", "activeCount": 5, "limit": 5,
                       "retryable": True})
    with pytest.raises(SubmitRejected) as info:
        client.submit("SLEEP", {"durationMillis": 1})
    exc = info.value
    assert (exc.reason, exc.active_count, exc.limit, exc.retryable) == ("at capacity", 5, 5, True)


def test_submit_retries_only_retryable_rejections(serve):
    rejected = {"type": "SUBMIT_REJECTED", "reason": "full", "activeCount": 1, "limit": 1, "retryable": True}
    server, client = serve(rejected, rejected, {"type": "JOB_SUBMITTED", "jobId": "j-3"})
    assert client.submit("SLEEP", {"durationMillis": 1}, submit_retries=5) == "j-3"
    assert len(server.requests) == 3


def test_submit_retries_give_up_after_n(serve):
    rejected = {"type": "SUBMIT_REJECTED", "reason": "full", "activeCount": 1, "limit": 1, "retryable": True}
    server, client = serve(rejected, rejected, rejected)
    with pytest.raises(SubmitRejected):
        client.submit("SLEEP", {"durationMillis": 1}, submit_retries=2)
    assert len(server.requests) == 3


def test_non_retryable_rejection_is_not_retried(serve):
    server, client = serve({"type": "SUBMIT_REJECTED", "reason": "no", "activeCount": 1, "limit": 1,
                            "retryable": False}, {"type": "JOB_SUBMITTED", "jobId": "never"})
    with pytest.raises(SubmitRejected):
        client.submit("SLEEP", {"durationMillis": 1}, submit_retries=3)
    assert len(server.requests) == 1


def test_error_reply_to_submit_is_never_retried(serve):
    server, client = serve({"type": "ERROR", "message": "bad payload"}, {"type": "JOB_SUBMITTED", "jobId": "x"})
    with pytest.raises(RequestFailed):
        client.submit("SLEEP", {"durationMillis": -1}, submit_retries=3)
    assert len(server.requests) == 1


def test_connect_refused_is_unavailable():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()
    with CoordinatorClient("127.0.0.1", port) as client:
        with pytest.raises(CoordinatorUnavailable) as info:
            client.status("j-1")
    assert "cannot connect" in str(info.value)


def test_connection_closed_mid_submit_is_unavailable_and_not_retried(serve):
    server, client = serve(CLOSE, {"type": "JOB_SUBMITTED", "jobId": "j-2"})
    with pytest.raises(CoordinatorUnavailable):
        client.submit("SLEEP", {"durationMillis": 1}, submit_retries=3)
    assert len(server.requests) == 1
    # the socket was discarded: the next call reconnects
    assert client.submit("SLEEP", {"durationMillis": 1}) == "j-2"
    assert server.connections == 2


def test_reply_timeout_is_unavailable(serve):
    _, client = serve(HANG, timeout=0.2)
    with pytest.raises(CoordinatorUnavailable) as info:
        client.cancel("j-1")
    assert "no reply" in str(info.value)


def test_garbage_reply_is_unavailable(serve):
    _, client = serve(b"\x00\x00\x00\x03abc")
    with pytest.raises(CoordinatorUnavailable):
        client.workers()


def test_wrong_reply_type_is_unavailable(serve):
    _, client = serve({"type": "WORKER_LIST", "workers": []})
    with pytest.raises(CoordinatorUnavailable) as info:
        client.status("j-1")
    assert "unexpected WORKER_LIST" in str(info.value)


def test_read_is_resent_once_when_a_reused_connection_is_dead(serve):
    # The first connection serves one request and then dies while idle; a status call
    # notices on the reused socket and goes again on a fresh connection.
    server, client = serve({"type": "JOB_STATUS", "job": SNAP}, CLOSE, {"type": "JOB_STATUS", "job": SNAP})
    assert client.status("j-1") == SNAP
    assert client.status("j-1") == SNAP
    assert server.connections == 2


def test_cancel_returns_flag_and_snapshot(serve):
    _, client = serve({"type": "JOB_CANCEL", "cancelled": True, "job": dict(SNAP, state="CANCELLED")})
    cancelled, job = client.cancel("j-1")
    assert cancelled is True and job["state"] == "CANCELLED"


def test_wait_is_one_wait_job_request_not_polling(serve):
    # The coordinator answers WAIT_JOB when the job ends: one request, one reply.
    done = dict(SNAP, state="COMPLETED", result={"sleptMillis": 1})
    server, client = serve({"type": "JOB_STATUS", "job": done}, {"type": "JOB_STATUS", "job": done})
    assert client.wait("j-1", timeout=5) == done
    [request] = server.requests
    assert request["type"] == "WAIT_JOB" and request["jobId"] == "j-1"
    assert 4900 <= request["timeoutMillis"] <= 5000


def test_wait_without_a_limit_asks_again_every_chunk(serve):
    running = dict(SNAP, state="RUNNING", workerId="w")
    done = dict(SNAP, state="FAILED", error="boom")
    server, client = serve({"type": "JOB_STATUS", "job": running}, {"type": "JOB_STATUS", "job": running},
                           {"type": "JOB_STATUS", "job": done})
    assert client.wait("j-1") == done
    assert [r["timeoutMillis"] for r in server.requests] == [WAIT_CHUNK_MILLIS] * 3
    assert server.connections == 1


def test_a_long_wait_is_cut_into_chunks(serve):
    # A wait longer than a chunk asks for a chunk and, not done yet, asks again.
    running = dict(SNAP, state="RUNNING", workerId="w")
    server, client = serve({"type": "JOB_STATUS", "job": running}, {"type": "ERROR", "message": "unknown job"})
    with pytest.raises(RequestFailed):
        client.wait("j-1", timeout=150)
    assert [r["timeoutMillis"] for r in server.requests] == [WAIT_CHUNK_MILLIS] * 2


def test_wait_timeout_carries_the_snapshot(serve):
    running = dict(SNAP, state="RUNNING", workerId="w")
    server, client = serve({"type": "JOB_STATUS", "job": running})
    with pytest.raises(WaitTimeout) as info:
        client.wait("j-1", timeout=0.05)
    assert isinstance(info.value, TimeoutError)
    assert info.value.job == running
    assert len(server.requests) == 1 and server.requests[0]["timeoutMillis"] <= 50


def test_wait_zero_asks_once_for_the_snapshot(serve):
    server, client = serve({"type": "JOB_STATUS", "job": SNAP})
    with pytest.raises(WaitTimeout):
        client.wait("j-1", timeout=0)
    assert server.requests == [{"type": "WAIT_JOB", "jobId": "j-1", "timeoutMillis": 0}]


def test_the_reply_timeout_covers_the_wait(serve):
    # The client's reply timeout is 0.2 s, the coordinator holds the WAIT_JOB for 0.5 s.
    done = dict(SNAP, state="COMPLETED", result={})
    server, client = serve(Delayed(0.5, {"type": "JOB_STATUS", "job": done}), {"type": "JOB_STATUS", "job": SNAP},
                           timeout=0.2)
    assert client.wait("j-1", timeout=2) == done
    # ... and the socket's own timeout is back for the next request.
    assert client.status("j-1") == SNAP
    assert server.connections == 1


def test_wait_for_an_unknown_job_is_request_failed(serve):
    _, client = serve({"type": "ERROR", "message": "unknown job 'j-x'"})
    with pytest.raises(RequestFailed):
        client.wait("j-x", timeout=1)


def test_iter_jobs_follows_cursors(serve):
    a, b, c = (dict(SNAP, jobId=i) for i in "abc")
    server, client = serve({"type": "JOB_LIST", "jobs": [a, b], "nextCursor": "n1"},
                           {"type": "JOB_LIST", "jobs": [c], "nextCursor": None})
    assert [j["jobId"] for j in client.iter_jobs(page_size=2)] == ["a", "b", "c"]
    assert server.requests[1]["cursor"] == "n1"


def test_submit_backoff_is_capped_and_jittered():
    for retry in range(1, 20):
        delay = submit_backoff(retry)
        ceiling = min(2.0, 0.05 * 2 ** (retry - 1))
        assert ceiling / 2 <= delay <= ceiling


def test_drops_at_once_end_a_request_only_in_a_row_by_one_address_taking_connections():
    # A coordinator killed again soon after each restart drops a pending request "at once"
    # each time, but between the drops no address takes the connection: it went away, it
    # did not refuse the request, and the request (a wait) rides on.
    def closed(address: str | None = None) -> ClosedUnanswered:
        return ClosedUnanswered("closed the connection without replying", True, address)

    restarting = Failover(closed(), 30.0, lambda: 0.0)
    for _ in range(2 * DROPS_AT_ONCE):
        assert restarting.pause(NotConnected("cannot connect"), ride=True) >= 0
        assert restarting.pause(closed(), ride=True) >= 0
    # ... as are leaders killed one after the other, each soon after it took over: the
    # drops come from one address, then another
    taking_over = Failover(closed("a"), 30.0, lambda: 0.0)
    for _ in range(DROPS_AT_ONCE):
        for address in ("b", "a"):
            assert taking_over.pause(closed(address), ride=True) >= 0
    # while one that takes every connection and drops the request at once is given up
    refusing = Failover(closed(), 30.0, lambda: 0.0)
    for _ in range(DROPS_AT_ONCE - 2):
        refusing.pause(closed(), ride=True)
    with pytest.raises(ClosedUnanswered):
        refusing.pause(closed(), ride=True)


def test_a_close_right_after_an_error_sends_the_next_request_again_on_a_fresh_connection(serve):
    # Given a coordinator that refused a request and closes the connection at the next one
    server, client = serve({"type": "ERROR", "message": "SUBMIT_JOB field 'payload' must be an object"}, CLOSE,
                           {"type": "JOB_SUBMITTED", "jobId": "j-2"})
    with pytest.raises(RequestFailed):
        client.submit("SLEEP", {"durationMillis": 1})
    # Then the next write goes again, on a fresh connection (the closed one read nothing more)
    assert client.submit("SLEEP", {"durationMillis": 1}) == "j-2"
    assert server.connections == 2


def test_a_write_closed_unanswered_without_a_refusal_before_it_is_not_sent_again(serve):
    server, client = serve({"type": "JOB_SUBMITTED", "jobId": "j-1"}, CLOSE, {"type": "JOB_SUBMITTED", "jobId": "j-2"})
    assert client.submit("SLEEP", {"durationMillis": 1}) == "j-1"
    with pytest.raises(CoordinatorUnavailable, match="closed the connection without replying"):
        client.submit("SLEEP", {"durationMillis": 1})  # its outcome is unknown: never resent
    assert len(server.requests) == 2
