"""Hostile and broken peers (FAILURE_MODEL.md, "Hostile and broken peers").

Huge and odd field values on both ports get an ERROR that names the reason and fits a
frame; payloads and results nested deeper than 64 levels are refused or fail the attempt;
a client or worker pointed at the wrong port is told which port to use.
"""

from __future__ import annotations

import urllib.request
from types import SimpleNamespace

import pytest

from jobmesh.client import CoordinatorClient
from jobmesh.errors import RequestFailed
from jobmesh.protocol.framing import HEADER
from jobmesh.protocol.payloads import MAX_NESTING
from tests.support.cli import run_cli
from tests.support.connections import RawConn, read_until_closed

HUGE = {
    "del": "\x7f" * 300_000,
    "control": "\x01\x1b" * 75_000,  # escaped on the wire: 900 KB
    "emoji": "\U0001f600" * 200_000,  # 4-byte UTF-8: 800 KB
}
MAX_MESSAGE = 4200  # MAX_ERROR_CHARS and its "… (N characters)"


def nested(depth: int):
    value: object = 1
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.fixture(scope="module")
def coord(module_coordinator):
    return module_coordinator


def assert_error(frame: dict | None, reason: str) -> None:
    assert frame is not None and frame.get("type") == "ERROR", frame
    message = frame["message"]
    assert reason in message, message
    assert len(message) <= MAX_MESSAGE, len(message)


def last_frame_before_close(conn: RawConn) -> dict | None:
    frames, closed = read_until_closed(conn, timeout=5)
    assert closed, frames
    return frames[-1] if frames else None


# (case, request built from the huge value, the reason the ERROR must carry, the connection closes)
CLIENT_CASES = [
    ("type", lambda v: {"type": v}, "unknown or unexpected message type", True),
    ("status-job-id", lambda v: {"type": "GET_JOB_STATUS", "jobId": v}, "unknown job", False),
    ("events-job-id", lambda v: {"type": "GET_JOB_EVENTS", "jobId": v}, "unknown job", False),
    ("cancel-job-id", lambda v: {"type": "CANCEL_JOB", "jobId": v}, "unknown job", False),
    ("payload-job-id", lambda v: {"type": "GET_JOB_PAYLOAD", "jobId": v}, "unknown job", False),
    ("list-state", lambda v: {"type": "LIST_JOBS", "state": v}, "unknown state", False),
    ("list-cursor", lambda v: {"type": "LIST_JOBS", "cursor": v}, "invalid cursor", False),
    ("submit-task-type", lambda v: {"type": "SUBMIT_JOB", "taskType": v, "payload": {}}, "unknown task type",
     False),
    ("submit-priority", lambda v: {"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 1},
                                   "priority": v}, "priority must be one of", False),
    ("submit-payload-field", lambda v: {"type": "SUBMIT_JOB", "taskType": "SLEEP",
                                        "payload": {"durationMillis": v}}, "must be an integer", False),
]


@pytest.mark.parametrize("value", list(HUGE.values()), ids=list(HUGE))
@pytest.mark.parametrize("case,build,reason,closes", CLIENT_CASES, ids=[c[0] for c in CLIENT_CASES])
def test_client_port_errors_quote_huge_values_briefly(coord, case, build, reason, closes, value):
    conn = RawConn(coord.client_addr)
    try:
        conn.send(build(value))
        if closes:
            assert_error(last_frame_before_close(conn), reason)
        else:
            assert_error(conn.recv(), reason)
            assert conn.request({"type": "LIST_WORKERS"})["type"] == "WORKER_LIST"  # still open
    finally:
        conn.close()


@pytest.mark.parametrize("value", list(HUGE.values()), ids=list(HUGE))
def test_an_idempotency_conflict_quotes_the_key_briefly(coord, value):
    key = value[:1024]  # the longest key allowed
    conn = RawConn(coord.client_addr)
    try:
        first = conn.request({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 1},
                              "idempotencyKey": key})
        assert first["type"] == "JOB_SUBMITTED", first
        assert_error(conn.request({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 2},
                                   "idempotencyKey": key}), "is already bound to job %s" % first["jobId"])
    finally:
        conn.close()


def test_a_lone_surrogate_escape_is_a_violation_with_a_reason(coord):
    body = b'{"type": "GET_JOB_STATUS", "jobId": "' + b"\\ud800" * 150_000 + b'"}'
    for addr in (coord.client_addr, coord.worker_addr):
        conn = RawConn(addr)
        try:
            conn.send_raw(HEADER.pack(len(body)) + body)
            assert_error(last_frame_before_close(conn), "lone UTF-16 surrogate")
        finally:
            conn.close()


WORKER_CASES = [
    ("type", lambda v: {"type": v}, "unknown or unexpected message type"),
    ("register-worker-id", lambda v: {"type": "WORKER_REGISTER", "workerId": v, "capacity": 1},
     "workerId must be 1..256 characters"),
    ("register-task-types", lambda v: {"type": "WORKER_REGISTER", "workerId": "w-h", "capacity": 1,
                                       "taskTypes": [v]}, "taskTypes holds"),
]


@pytest.mark.parametrize("value", list(HUGE.values()), ids=list(HUGE))
@pytest.mark.parametrize("case,build,reason", WORKER_CASES, ids=[c[0] for c in WORKER_CASES])
def test_worker_port_errors_quote_huge_values_briefly(coord, case, build, reason, value):
    conn = RawConn(coord.worker_addr)
    try:
        conn.send(build(value))
        assert_error(last_frame_before_close(conn), reason)
    finally:
        conn.close()


@pytest.mark.parametrize("value", list(HUGE.values()), ids=list(HUGE))
def test_a_registered_worker_with_a_huge_foreign_id_gets_the_reason(coord, value):
    conn = RawConn(coord.worker_addr)
    try:
        assert conn.request({"type": "WORKER_REGISTER", "workerId": "w-huge", "capacity": 1})["type"] == \
            "WORKER_REGISTERED"
        conn.send({"type": "HEARTBEAT", "workerId": value})
        assert_error(last_frame_before_close(conn), "does not match this session's 'w-huge'")
    finally:
        conn.close()


# ---- nesting ----------------------------------------------------------------------------------


def test_a_payload_nested_deeper_than_the_bound_creates_no_job(coordinator, peers):
    client = peers.client(coordinator)
    # When a payload nests 65 levels (the payload object itself is level 1)
    deep = {"durationMillis": 1, "x": nested(MAX_NESTING)}
    reply = client.submit("SLEEP", deep)
    # Then it is refused with the reason, and nothing is created
    assert_error(reply, "payload nested deeper than %d levels" % MAX_NESTING)
    assert client.list_jobs()["jobs"] == []
    # And 64 levels are fine, on the same connection
    job_id = client.submit_ok("SLEEP", {"durationMillis": 1, "x": nested(MAX_NESTING - 1)})
    assert [j["jobId"] for j in client.list_jobs()["jobs"]] == [job_id]


def test_a_result_nested_1000_levels_fails_the_attempt(coordinator_factory, peers, tmp_path):
    coordinator = coordinator_factory()
    client = peers.client(coordinator)
    worker = peers.worker(coordinator, "w-deep", capacity=1)
    job_id = client.submit_ok("SLEEP", {"durationMillis": 1}, max_attempts=1)
    # When the worker reports a result nested 1000 levels deep
    worker.complete(worker.await_assign(), nested(1000))
    # Then the attempt fails with the reason, and the result is not stored
    job = client.wait_state(job_id, "FAILED")
    assert job["error"] == "result nested deeper than %d levels" % MAX_NESTING
    assert job["result"] is None
    # And the coordinator keeps serving: lists, the worker gets more work
    assert [j["jobId"] for j in client.list_jobs()["jobs"]] == [job_id]
    next_id = client.submit_ok("SLEEP", {"durationMillis": 1})
    worker.complete(worker.await_assign(), {"sleptMillis": 1})
    assert client.wait_state(next_id, "COMPLETED")
    # And a restart on the same database is fine
    client.close()
    worker.close()
    assert coordinator.terminate() == 0
    coordinator.start()
    again = peers.client(coordinator)
    assert again.status(job_id)["error"] == "result nested deeper than %d levels" % MAX_NESTING
    assert len(again.list_jobs()["jobs"]) == 2


# ---- the wrong port -----------------------------------------------------------------------------


def test_the_cli_on_the_worker_port_is_told_the_right_port(coord):
    done = run_cli("list", coordinator=coord.worker_target)
    assert done.returncode == 1, done
    assert done.stderr.strip() == ("jobmesh list: the coordinator refused: this is the worker port; LIST_JOBS "
                                   "belongs on the client port (7071 by default)")


def test_a_jobs_payload_is_served_on_the_client_port_not_on_the_worker_port(coord):
    payload = {"text": "héllo ✓ \U0001f600 \x01"}
    client = RawConn(coord.client_addr)
    worker = RawConn(coord.worker_addr)
    try:
        # Given a job submitted on the client port
        job_id = client.request({"type": "SUBMIT_JOB", "taskType": "SHA256", "payload": payload})["jobId"]
        # Then GET_JOB_PAYLOAD answers the payload as it was submitted
        assert client.request({"type": "GET_JOB_PAYLOAD", "jobId": job_id}) == {
            "type": "JOB_PAYLOAD", "jobId": job_id, "payload": payload}
        # an unknown job is an ERROR that leaves the connection open
        assert client.request({"type": "GET_JOB_PAYLOAD", "jobId": "no-such-job"}) == {
            "type": "ERROR", "message": "unknown job 'no-such-job'"}
        assert client.request({"type": "GET_JOB_STATUS", "jobId": job_id})["type"] == "JOB_STATUS"
        # and the library hands out the same
        with CoordinatorClient(coord.client_target) as library:
            assert library.payload(job_id) == payload
            with pytest.raises(RequestFailed, match="unknown job"):
                library.payload("no-such-job")
        # The worker port refuses it, naming the right port, and closes
        worker.send({"type": "GET_JOB_PAYLOAD", "jobId": job_id})
        assert last_frame_before_close(worker) == {
            "type": "ERROR", "message": "this is the worker port; GET_JOB_PAYLOAD belongs on the client port "
                                        "(7071 by default)"}
    finally:
        client.close()
        worker.close()


def test_a_worker_on_the_client_port_logs_the_right_port_and_exits_1(coord, worker_procs):  # noqa: F811
    worker = worker_procs.start(SimpleNamespace(worker_target=coord.client_target), "w-lost")
    assert worker.proc.wait(10) == 1  # retrying cannot help: it stops at once
    assert "this is the client port; WORKER_REGISTER belongs on the worker port (7070 by default)" in worker.log()
    assert "Traceback" not in worker.log()


def test_a_worker_with_a_token_at_a_coordinator_without_tokens_says_so_and_exits_1(coord, worker_procs,  # noqa: F811
                                                                                   tmp_path):
    token_file = tmp_path / "worker.token"
    token_file.write_text("a-token-this-coordinator-does-not-ask-for\n")
    worker = worker_procs.start(coord, "w-token", extra=["--token-file=%s" % token_file])
    assert worker.proc.wait(30) == 1  # retrying cannot help: the coordinator takes no tokens at all
    assert "this coordinator takes no tokens" in worker.log()
    assert "a-token-this-coordinator-does-not-ask-for" not in worker.log()
    assert "Traceback" not in worker.log()


METRICS_PORT_REFUSAL = ("this is the metrics port (HTTP); a client belongs on the client port (7071 by default), "
                        "a worker on the worker port (7070 by default)")


def test_a_client_on_the_metrics_port_is_told_the_right_port(coordinator_factory):
    coord = coordinator_factory(metrics_port=0)
    # a reply timeout far beyond the port's own read timeout: the answer is the refusal, not a close
    with CoordinatorClient(*coord.metrics_addr, timeout=60) as client:
        with pytest.raises(RequestFailed) as info:
            client.stats()
    assert str(info.value) == METRICS_PORT_REFUSAL
    done = run_cli("list", coordinator="%s:%d" % coord.metrics_addr)
    assert done.returncode == 1, done
    assert done.stderr.strip() == "jobmesh list: the coordinator refused: " + METRICS_PORT_REFUSAL
    # and the port still serves HTTP
    with urllib.request.urlopen(coord.metrics_url + "/healthz", timeout=10) as reply:
        assert reply.status == 200


def test_a_worker_on_the_metrics_port_logs_the_right_port_and_exits_1(coordinator_factory, worker_procs):
    coord = coordinator_factory(metrics_port=0)
    worker = worker_procs.start(SimpleNamespace(worker_target="%s:%d" % coord.metrics_addr), "w-lost")
    assert worker.proc.wait(30) == 1  # retrying cannot help: it stops at once
    assert METRICS_PORT_REFUSAL in worker.log()
    assert "Traceback" not in worker.log()
