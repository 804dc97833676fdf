"""A misbehaving peer costs only its own connection (PROTOCOL.md "Error handling"; MalformedProtocolIT).

Framing and protocol violations (bad length, bad UTF-8/JSON, non-object JSON, missing or
unknown type, wrong field types, EOF inside a frame, a first worker message that is not
WORKER_REGISTER, a bad capacity, a workerId that is not the session's) get a best-effort
ERROR and that connection closes. Meanwhile an already-open client connection and a
registered worker keep working, and the coordinator keeps serving.

Well-formed requests that cannot be served (unknown jobId, invalid payload, bad priority
name, idempotency conflict) get ERROR and the connection stays open (CONTRACT.md).

Since a bad peer must cost only its own connection, the cases share coordinators: one
(``module_coordinator``) where workers take part, each test's bystanders declaring a task
type of their own, and one (``clients_only``) that no worker ever joins. Each case then
proves that the coordinator the cases before it misbehaved at still serves. The tests that
fill a coordinator with work, or measure its latency, start their own.
"""

from __future__ import annotations

import fcntl
import itertools
import socket
import struct
import termios
import threading
import time

import pytest

from jobmesh.protocol.framing import HEADER, MAX_FRAME, encode_frame
from tests.helpers import (RawConn, RegistrationRefused, ScriptedWorker, assert_prompt, baseline,
                           read_until_closed, timed, wait_until)

_serial = itertools.count(1)


def unique(prefix: str) -> str:
    """A name no other test of this module uses (task types, worker ids, keys)."""
    return "%s-%d" % (prefix, next(_serial))


@pytest.fixture(scope="module")
def clients_only(shared_coordinator):
    """The coordinator shared by the module's tests in which no worker ever registers."""
    return shared_coordinator


def job_ids(client) -> list[str]:
    """Every job's id, newest first (the shared coordinators hold far fewer than 1000)."""
    reply = client.list_jobs(limit=1000)
    assert reply["nextCursor"] is None, "more jobs than one page"
    return [j["jobId"] for j in reply["jobs"]]


def worker_ids(client) -> list[str]:
    return [w["workerId"] for w in client.workers()]


def frame_of(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


def eof_after(data: bytes):
    def step(conn: RawConn):
        conn.send_raw(data)
        conn.sock.shutdown(socket.SHUT_WR)
    return step


def raw(data: bytes):
    return lambda conn: conn.send_raw(data)


def msg(obj: dict):
    return lambda conn: conn.send(obj)


def registered_then(obj_or_bytes, worker_id: str = "w-bad"):
    """Register properly first (expect WORKER_REGISTERED), then misbehave."""
    def step(conn: RawConn):
        conn.send({"type": "WORKER_REGISTER", "workerId": worker_id, "capacity": 1})
        reply = conn.recv()
        assert reply is not None and reply["type"] == "WORKER_REGISTERED", reply
        if isinstance(obj_or_bytes, bytes):
            conn.send_raw(obj_or_bytes)
        else:
            conn.send(obj_or_bytes)
    return step


def served_then(obj_or_bytes):
    """Make one valid client request first (expect its reply), then misbehave."""
    def step(conn: RawConn):
        reply = conn.request({"type": "LIST_WORKERS"})
        assert reply["type"] == "WORKER_LIST", reply
        if isinstance(obj_or_bytes, bytes):
            conn.send_raw(obj_or_bytes)
        else:
            conn.send(obj_or_bytes)
    return step


# (case id, step, expect an ERROR frame before the close)
FRAMING_CASES = [
    ("length-0", raw(HEADER.pack(0)), True),
    ("length-over-1MiB", raw(HEADER.pack(MAX_FRAME + 1)), True),
    ("length-4GiB", raw(HEADER.pack(0xFFFFFFFF)), True),
    ("bad-utf8", raw(frame_of(b'{"type": "\xff\xfe"}')), True),
    ("non-json", raw(frame_of(b"this is not json")), True),
    ("truncated-json", raw(frame_of(b'{"type": "LIST_WORKERS"')), True),
    ("json-array", raw(frame_of(b'[{"type": "LIST_WORKERS"}]')), True),
    ("json-string", raw(frame_of(b'"LIST_WORKERS"')), True),
    ("json-number", raw(frame_of(b"42")), True),
    ("missing-type", msg({"workerId": "w-x", "capacity": 1}), True),
    ("unknown-type", msg({"type": "NOPE"}), True),
    ("type-not-a-string", msg({"type": 7}), True),
    ("eof-mid-frame", eof_after(HEADER.pack(100) + b'{"type": "LI'), False),
    ("eof-mid-header", eof_after(b"\x00\x00"), False),
]

WORKER_CASES = [
    ("first-message-heartbeat", msg({"type": "HEARTBEAT", "workerId": "w-x"}), True),
    ("first-message-task-result", msg({"type": "TASK_RESULT", "workerId": "w-x", "jobId": "j", "attemptId": "a",
                                       "success": True, "result": {}, "error": None}), True),
    ("client-message-on-worker-port", msg({"type": "SUBMIT_JOB", "taskType": "SLEEP",
                                           "payload": {"durationMillis": 1}}), True),
    ("coordinator-message-from-worker", msg({"type": "TASK_ASSIGN", "jobId": "j", "attemptId": "a",
                                             "attemptNumber": 1, "taskType": "SLEEP", "payload": {}}), True),
    ("capacity-string", msg({"type": "WORKER_REGISTER", "workerId": "w-x", "capacity": "4"}), True),
    ("capacity-float", msg({"type": "WORKER_REGISTER", "workerId": "w-x", "capacity": 4.5}), True),
    ("capacity-bool", msg({"type": "WORKER_REGISTER", "workerId": "w-x", "capacity": True}), True),
    ("capacity-missing", msg({"type": "WORKER_REGISTER", "workerId": "w-x"}), True),
    ("worker-id-number", msg({"type": "WORKER_REGISTER", "workerId": 5, "capacity": 1}), True),
    ("capacity-0", msg({"type": "WORKER_REGISTER", "workerId": "w-x", "capacity": 0}), True),
    ("capacity-1025", msg({"type": "WORKER_REGISTER", "workerId": "w-x", "capacity": 1025}), True),
    ("capacity-negative", msg({"type": "WORKER_REGISTER", "workerId": "w-x", "capacity": -1}), True),
    ("task-types-string", msg({"type": "WORKER_REGISTER", "workerId": "w-x", "capacity": 1,
                               "taskTypes": "SLEEP"}), True),
    ("task-types-number-item", msg({"type": "WORKER_REGISTER", "workerId": "w-x", "capacity": 1,
                                    "taskTypes": ["SLEEP", 7]}), True),
    ("task-types-bad-name", msg({"type": "WORKER_REGISTER", "workerId": "w-x", "capacity": 1,
                                 "taskTypes": ["has space"]}), True),
    ("task-types-empty-name", msg({"type": "WORKER_REGISTER", "workerId": "w-x", "capacity": 1,
                                   "taskTypes": [""]}), True),
    ("task-types-name-129", msg({"type": "WORKER_REGISTER", "workerId": "w-x", "capacity": 1,
                                 "taskTypes": ["x" * 129]}), True),
    ("task-types-too-many", msg({"type": "WORKER_REGISTER", "workerId": "w-x", "capacity": 1,
                                 "taskTypes": ["T%d" % i for i in range(1025)]}), True),
    ("heartbeat-other-worker-id", registered_then({"type": "HEARTBEAT", "workerId": "w-someone-else"}), True),
    ("result-other-worker-id", registered_then({"type": "TASK_RESULT", "workerId": "w-someone-else", "jobId": "j",
                                                "attemptId": "a", "success": True, "result": {},
                                                "error": None}), True),
    ("registered-then-wrong-field-type", registered_then({"type": "TASK_RESULT", "workerId": "w-bad", "jobId": "j",
                                                          "attemptId": "a", "success": "yes"}), True),
    ("registered-then-unknown-type", registered_then({"type": "NOPE"}), True),
    ("registered-then-non-json", registered_then(frame_of(b"{{{")), True),
    ("registered-then-length-0", registered_then(HEADER.pack(0)), True),
]

CLIENT_CASES = [
    ("worker-message-on-client-port", msg({"type": "HEARTBEAT", "workerId": "w-x"}), True),
    ("register-on-client-port", msg({"type": "WORKER_REGISTER", "workerId": "w-x", "capacity": 1}), True),
    ("reply-type-as-request", msg({"type": "JOB_SUBMITTED", "jobId": "j"}), True),
    ("payload-job-id-number", msg({"type": "GET_JOB_PAYLOAD", "jobId": 12}), True),
    ("submit-payload-array", msg({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": []}), True),
    ("submit-payload-missing", msg({"type": "SUBMIT_JOB", "taskType": "SLEEP"}), True),
    ("submit-task-type-number", msg({"type": "SUBMIT_JOB", "taskType": 3, "payload": {}}), True),
    ("submit-max-attempts-string", msg({"type": "SUBMIT_JOB", "taskType": "SLEEP",
                                        "payload": {"durationMillis": 1}, "maxAttempts": "3"}), True),
    ("submit-priority-number", msg({"type": "SUBMIT_JOB", "taskType": "SLEEP",
                                    "payload": {"durationMillis": 1}, "priority": 2}), True),
    ("submit-idempotency-key-object", msg({"type": "SUBMIT_JOB", "taskType": "SLEEP",
                                           "payload": {"durationMillis": 1}, "idempotencyKey": {"k": 1}}), True),
    ("status-job-id-number", msg({"type": "GET_JOB_STATUS", "jobId": 12}), True),
    ("status-job-id-missing", msg({"type": "GET_JOB_STATUS"}), True),
    ("cancel-job-id-null", msg({"type": "CANCEL_JOB", "jobId": None}), True),
    ("list-limit-string", msg({"type": "LIST_JOBS", "limit": "10"}), True),
    ("list-task-type-number", msg({"type": "LIST_JOBS", "taskType": 5}), True),
    ("submit-run-at-string", msg({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 1},
                                  "runAtMillis": "2026-12-24T18:00:00Z"}), True),
    ("submit-delay-float", msg({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 1},
                                "delayMillis": 1.5}), True),
    ("served-then-non-json", served_then(frame_of(b"nope")), True),
    ("served-then-unknown-type", served_then({"type": "NOPE"}), True),
]


@pytest.fixture
def bystanders(module_coordinator, peers):
    """An open client connection and a registered worker, made before the bad peer arrives;
    the worker alone runs a task type of its own (``worker.task_type``)."""
    client = peers.client(module_coordinator)
    task_type = unique("BYSTANDER")
    worker = peers.worker(module_coordinator, "w-" + task_type.lower(), capacity=2, task_types=[task_type])
    worker.task_type = task_type
    assert worker.worker_id in worker_ids(client)
    return client, worker


def assert_still_serving(coordinator, peers, client, worker):
    # The coordinator process is still running
    assert coordinator.proc.poll() is None, coordinator.stderr()
    # The already-open client connection still answers
    assert worker.worker_id in worker_ids(client)
    # The registered worker is still alive and receives and completes work
    job_id = client.submit_ok(worker.task_type, {"text": "still serving"})
    assign = worker.await_assign()
    assert assign["jobId"] == job_id
    worker.complete(assign, {"words": 2})
    assert client.wait_state(job_id, ("COMPLETED", "FAILED"))["state"] == "COMPLETED"
    assert not worker.closed.is_set()
    # And new connections are accepted
    fresh = peers.client(coordinator)
    assert fresh.status(job_id)["result"] == {"words": 2}


def check_violation(conn: RawConn, expect_error: bool, allowed_before=()):
    frames, closed = read_until_closed(conn, timeout=5)
    assert closed, "the coordinator kept the connection open after a protocol violation (frames %r)" % frames
    types = [f.get("type") for f in frames]
    assert all(t in set(allowed_before) | {"ERROR"} for t in types), frames
    if expect_error:
        assert types and types[-1] == "ERROR", "no best-effort ERROR before the close: %r" % frames
        assert isinstance(frames[-1].get("message"), str) and frames[-1]["message"], frames[-1]


@pytest.mark.parametrize("case,step,expect_error", FRAMING_CASES + WORKER_CASES,
                         ids=[c[0] for c in FRAMING_CASES + WORKER_CASES])
def test_worker_port_violation_closes_only_that_connection(module_coordinator, peers, bystanders, case, step,
                                                           expect_error):
    coordinator = module_coordinator
    client, worker = bystanders
    # Given a bad peer on the worker port
    bad = peers.raw(coordinator.worker_addr)
    # When it misbehaves
    step(bad)
    # Then it gets a best-effort ERROR and its connection is closed
    check_violation(bad, expect_error)
    # And any session it had registered is gone
    wait_until(lambda: not {"w-bad", "w-x"} & set(worker_ids(client)), timeout=3,
               message="the bad worker's session to be removed")
    # And everybody else is unaffected
    assert_still_serving(coordinator, peers, client, worker)


@pytest.mark.parametrize("case,step,expect_error", FRAMING_CASES + CLIENT_CASES,
                         ids=[c[0] for c in FRAMING_CASES + CLIENT_CASES])
def test_client_port_violation_closes_only_that_connection(module_coordinator, peers, bystanders, case, step,
                                                           expect_error):
    coordinator = module_coordinator
    client, worker = bystanders
    before = job_ids(client)
    # Given a bad peer on the client port
    bad = peers.raw(coordinator.client_addr)
    # When it misbehaves
    step(bad)
    # Then it gets a best-effort ERROR and its connection is closed
    check_violation(bad, expect_error)
    # And no job was created by it
    assert job_ids(client) == before
    # And everybody else is unaffected
    assert_still_serving(coordinator, peers, client, worker)


# ---- well-formed but unservable: ERROR, connection stays open ---------------------------------

UNSERVABLE = [
    ("status-unknown-job", {"type": "GET_JOB_STATUS", "jobId": "no-such-job"}),
    ("cancel-unknown-job", {"type": "CANCEL_JOB", "jobId": "no-such-job"}),
    ("unknown-task-type", {"type": "SUBMIT_JOB", "taskType": "EXEC", "payload": {"cmd": "rm -rf /"}}),
    ("lowercase-task-type", {"type": "SUBMIT_JOB", "taskType": "sleep", "payload": {"durationMillis": 1}}),
    ("sleep-over-bound", {"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 600_001}}),
    ("sleep-negative", {"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": -1}}),
    ("prime-under-bound", {"type": "SUBMIT_JOB", "taskType": "PRIME_COUNT", "payload": {"limit": 1}}),
    ("prime-over-bound", {"type": "SUBMIT_JOB", "taskType": "PRIME_COUNT", "payload": {"limit": 50_000_001}}),
    ("fail-over-bound", {"type": "SUBMIT_JOB", "taskType": "FAIL", "payload": {"failUntilAttempt": 1001}}),
    ("text-too-long", {"type": "SUBMIT_JOB", "taskType": "WORD_COUNT", "payload": {"text": "x" * 200_001}}),
    ("payload-field-missing", {"type": "SUBMIT_JOB", "taskType": "SHA256", "payload": {}}),
    ("payload-field-wrong-type", {"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": "5"}}),
    ("payload-field-bool", {"type": "SUBMIT_JOB", "taskType": "FAIL", "payload": {"failUntilAttempt": True}}),
    ("priority-unknown-name", {"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 1},
                               "priority": "URGENT"}),
    ("priority-lowercase", {"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 1},
                            "priority": "high"}),
    ("run-at-and-delay", {"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 1},
                          "runAtMillis": 1, "delayMillis": 1}),
    ("delay-negative", {"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 1},
                        "delayMillis": -5}),
    ("run-at-negative", {"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 1},
                         "runAtMillis": -5}),
]


@pytest.mark.parametrize("case,request_", UNSERVABLE, ids=[c[0] for c in UNSERVABLE])
def test_unservable_request_gets_error_and_the_connection_stays_open(clients_only, peers, case, request_):
    client = peers.client(clients_only)
    before = job_ids(client)
    # When a well-formed request cannot be served
    reply = client.request(request_)
    # Then the reply is ERROR with a message
    assert reply["type"] == "ERROR", reply
    assert isinstance(reply["message"], str) and reply["message"]
    # And no job was created
    assert job_ids(client) == before
    # And the same connection keeps serving
    job_id = client.submit_ok("SLEEP", {"durationMillis": 1})
    assert client.status(job_id)["state"] == "QUEUED"
    assert job_ids(client) == [job_id] + before


def test_text_at_the_bound_is_accepted(clients_only, peers):
    client = peers.client(clients_only)
    job_id = client.submit_ok("WORD_COUNT", {"text": "x" * 200_000})
    assert client.status(job_id)["taskType"] == "WORD_COUNT"


def test_idempotency_conflict_keeps_the_connection_open(clients_only, peers):
    client = peers.client(clients_only)
    key = unique("k-conflict")
    job_id = client.submit_ok("SLEEP", {"durationMillis": 1}, idempotencyKey=key)
    reply = client.submit("SLEEP", {"durationMillis": 2}, idempotencyKey=key)
    assert reply["type"] == "ERROR" and reply["message"]
    assert client.status(job_id)["state"] == "QUEUED"


# ---- registration ---------------------------------------------------------------------------------

def test_duplicate_register_of_a_live_id_is_refused(module_coordinator, peers):
    coordinator = module_coordinator
    # Given a live worker session "w-dup" (the one worker for its task type)
    client = peers.client(coordinator)
    task_type = unique("DUP")
    first = peers.worker(coordinator, "w-dup", capacity=1, task_types=[task_type])
    # When a second connection registers the same id
    second = peers.raw(coordinator.worker_addr)
    second.send({"type": "WORKER_REGISTER", "workerId": "w-dup", "capacity": 5})
    # Then it is refused with ERROR and closed
    frames, closed = read_until_closed(second, timeout=5)
    assert [f["type"] for f in frames] == ["ERROR"], frames
    assert closed
    # And the first session is untouched: listed once with its own capacity, still gets work
    items = [w for w in client.workers() if w["workerId"] == "w-dup"]
    assert len(items) == 1 and items[0]["capacity"] == 1
    job_id = client.submit_ok(task_type, {"durationMillis": 1})
    assign = first.await_assign()
    assert assign["jobId"] == job_id
    first.complete(assign, {"sleptMillis": 1})
    assert client.wait_state(job_id, "COMPLETED")["attempts"] == 1


def test_an_id_can_register_again_after_its_session_ended(module_coordinator, peers):
    coordinator = module_coordinator
    client = peers.client(coordinator)
    first = peers.worker(coordinator, "w-again", capacity=1)
    first.close()
    wait_until(lambda: "w-again" not in worker_ids(client), timeout=3, message="session removed after close")
    again = peers.worker(coordinator, "w-again", capacity=2)
    assert [(w["workerId"], w["capacity"]) for w in client.workers() if w["workerId"] == "w-again"] == [("w-again", 2)]
    assert not again.closed.is_set()


def test_scripted_worker_raises_on_refusal(module_coordinator, peers):
    w = ScriptedWorker(module_coordinator.worker_addr, worker_id="w-zero", capacity=0)
    try:
        with pytest.raises(RegistrationRefused) as info:
            w.register()
        assert info.value.reply["type"] == "ERROR"
    finally:
        w.close()


@pytest.mark.parametrize("capacity", [1, 1024])
def test_capacity_bounds_are_inclusive(module_coordinator, peers, capacity):
    client = peers.client(module_coordinator)
    worker_id = unique("w-cap")
    peers.worker(module_coordinator, worker_id, capacity=capacity)
    assert [(w["workerId"], w["capacity"]) for w in client.workers() if w["workerId"] == worker_id] == [
        (worker_id, capacity)]


# ---- forward compatibility and framing on a healthy connection ------------------------------------

def test_unknown_fields_are_ignored_on_both_ports(module_coordinator, peers):
    coordinator = module_coordinator
    # Given a worker (the one worker for its task type) whose every message carries extra fields
    client = peers.client(coordinator)
    task_type = unique("FWD")
    w = peers.raw(coordinator.worker_addr)
    w.send({"type": "WORKER_REGISTER", "workerId": "w-fwd", "capacity": 1, "taskTypes": [task_type], "v": 1,
            "labels": {"zone": "a"}})
    assert w.recv()["type"] == "WORKER_REGISTERED"
    w.send({"type": "HEARTBEAT", "workerId": "w-fwd", "load": [0.1, 0.2]})
    # When a client submits with extra fields too
    reply = client.request({"type": "SUBMIT_JOB", "taskType": task_type, "payload": {"durationMillis": 1},
                            "maxAttempts": 1, "v": 1, "trace": {"id": "t"}})
    assert reply["type"] == "JOB_SUBMITTED"
    job_id = reply["jobId"]
    # Then everything works as if they were absent
    assign = w.recv()
    assert assign["type"] == "TASK_ASSIGN" and assign["jobId"] == job_id
    w.send({"type": "TASK_RESULT", "workerId": "w-fwd", "jobId": job_id, "attemptId": assign["attemptId"],
            "success": True, "result": {"sleptMillis": 1}, "error": None, "durationMillis": 3})
    done = client.wait_state(job_id, "COMPLETED")
    assert done["result"] == {"sleptMillis": 1}
    status = client.request({"type": "GET_JOB_STATUS", "jobId": job_id, "verbose": True})
    assert status["type"] == "JOB_STATUS" and status["job"]["jobId"] == job_id
    assert client.request({"type": "LIST_WORKERS", "extra": 1})["type"] == "WORKER_LIST"
    assert client.request({"type": "LIST_JOBS", "sort": "asc"})["type"] == "JOB_LIST"


def test_a_frame_split_into_single_bytes_is_assembled(clients_only, peers):
    conn = peers.raw(clients_only.client_addr)
    data = encode_frame({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 1}})
    for i in range(len(data)):
        conn.send_raw(data[i:i + 1])
        if i % 7 == 0:
            time.sleep(0.001)
    reply = conn.recv()
    assert reply["type"] == "JOB_SUBMITTED"


def test_several_frames_in_one_write_each_get_a_reply(clients_only, peers):
    conn = peers.raw(clients_only.client_addr)
    conn.send_raw(b"".join(encode_frame({"type": "LIST_WORKERS"}) for _ in range(5)))
    assert [conn.recv()["type"] for _ in range(5)] == ["WORKER_LIST"] * 5


def test_clean_close_between_frames_is_harmless(clients_only, peers):
    coordinator = clients_only
    client = peers.client(coordinator)
    for _ in range(5):
        c = RawConn(coordinator.client_addr)
        assert c.request({"type": "LIST_WORKERS"})["type"] == "WORKER_LIST"
        c.close()
        w = RawConn(coordinator.worker_addr)
        w.close()
    assert client.workers() == []


def test_a_submission_too_big_to_assign_does_not_wedge_a_worker(coordinator, peers):
    # Given a live worker with room for two tasks
    client = peers.client(coordinator)
    worker = peers.worker(coordinator, "w-victim", capacity=2)
    # When a client submits a valid SLEEP whose payload carries an (ignored) extra field so large that
    # the SUBMIT_JOB frame fits in 1 MiB but a TASK_ASSIGN carrying the payload would not
    pad = "p" * (MAX_FRAME - 150)
    reply = client.submit("SLEEP", {"durationMillis": 1, "pad": pad})
    # Then the coordinator either refuses it (ERROR, connection open) or accepts it...
    assert reply["type"] in ("JOB_SUBMITTED", "ERROR"), reply
    # ...but no reply and no frame to the worker may exceed the frame limit, and the worker's session
    # must keep working: a normal job submitted next is assigned to it and completes
    job_id = client.submit_ok("SLEEP", {"durationMillis": 2})
    deadline = time.monotonic() + 3
    got = None
    while time.monotonic() < deadline and got is None:
        a = worker.poll_assign(0.1)
        if a is not None and a["jobId"] == job_id:
            got = a
    assert got is not None, "the worker received no further work after the oversized job (session wedged)"
    worker.complete(got, {"sleptMillis": 2})
    assert client.wait_state(job_id, "COMPLETED")["attempts"] == 1
    assert worker.bad_frames == []
    assert not worker.closed.is_set()


@pytest.mark.parametrize("token", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_in_a_payload_creates_no_job(clients_only, peers, token):
    # NaN/Infinity are not JSON. Whether the coordinator treats the frame as non-JSON (ERROR and close)
    # or as an invalid payload (ERROR, connection open), it must answer ERROR and create nothing.
    coordinator = clients_only
    client = peers.client(coordinator)
    before = job_ids(client)
    bad = peers.raw(coordinator.client_addr)
    bad.send_raw(frame_of(b'{"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 1, "x": '
                          + token + b"}}"))
    reply = bad.recv()
    assert reply is not None and reply["type"] == "ERROR", reply
    assert job_ids(client) == before
    assert client.workers() == []


# ---- slow and stalled peers cost only themselves --------------------------------------------------

def test_a_stalled_partial_frame_blocks_nobody(coordinator, peers):
    # Given a client's submit latency measured first (jobs delayed out of the way)
    client = peers.client(coordinator)
    base = baseline(lambda: client.submit_ok("SLEEP", {"durationMillis": 1}, delayMillis=10 ** 9))
    # and peers that sent half a header / half a frame on each port and then went quiet
    stalled = [peers.raw(coordinator.client_addr), peers.raw(coordinator.worker_addr),
               peers.raw(coordinator.client_addr)]
    stalled[0].send_raw(b"\x00\x00")
    stalled[1].send_raw(HEADER.pack(50) + b'{"type": "WORKER_')
    stalled[2].send_raw(HEADER.pack(50))
    # Then everyone else is served promptly
    worker = peers.worker(coordinator, "w-prompt", capacity=1)
    job_id, elapsed = timed(lambda: client.submit_ok("SLEEP", {"durationMillis": 1}))
    assert_prompt(elapsed, base, "a submit beside stalled peers")
    worker.complete(worker.await_assign(timeout=2), {"sleptMillis": 1})
    assert client.wait_state(job_id, "COMPLETED", timeout=2)


def test_a_client_that_never_reads_its_replies_blocks_nobody(coordinator, peers):
    # Given 300 jobs, so that every full LIST_JOBS reply is large
    client = peers.client(coordinator)
    for start in range(0, 300, 100):
        for i in range(100):
            client.conn.send({"type": "SUBMIT_JOB", "taskType": "WORD_COUNT", "payload": {"text": "w %d" % i}})
        for _ in range(100):
            assert client.conn.recv()["type"] == "JOB_SUBMITTED"
    # and another client's latencies measured before anything hostile happens
    other = peers.client(coordinator)
    base_list = baseline(other.workers)
    base_submit = baseline(lambda: other.submit_ok("SLEEP", {"durationMillis": 1}, delayMillis=10 ** 9))
    # When a client pipelines many large requests and never reads a reply (its buffers fill up)
    hog = peers.raw(coordinator.client_addr)
    hog.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    request = encode_frame({"type": "LIST_JOBS", "limit": 1000})
    hog.sock.settimeout(2)
    sent = 0
    try:
        for _ in range(400):
            hog.send_raw(request)
            sent += 1
    except (socket.timeout, TimeoutError, OSError):
        pass  # its own send buffer filled up too: the coordinator stopped reading from it
    # Then other clients and workers are still served promptly
    worker = peers.worker(coordinator, "w-unblocked", capacity=1)
    _, elapsed = timed(other.workers)
    assert_prompt(elapsed, base_list, "LIST_WORKERS beside a client that never reads")
    job_id, elapsed = timed(lambda: other.submit_ok("SLEEP", {"durationMillis": 1}))
    assert_prompt(elapsed, base_submit, "a submit beside a client that never reads")
    assign = worker.await_assign(timeout=5)
    worker.complete(assign, {"sleptMillis": 1})
    assert other.wait_state(assign["jobId"], "COMPLETED", timeout=3)


def unread(sock: socket.socket) -> int:
    """Bytes that arrived on ``sock`` and are not read yet (FIONREAD)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def test_a_slow_reader_gets_every_large_reply_in_order_once_it_reads(coordinator, peers):
    # Given 300 jobs, so that each full LIST_JOBS reply is tens of kilobytes
    client = peers.client(coordinator)
    for i in range(300):
        client.conn.send({"type": "SUBMIT_JOB", "taskType": "WORD_COUNT", "payload": {"text": "w %d" % i}})
    ids = [client.conn.recv()["jobId"] for _ in range(300)]
    # When a client pipelines more large requests than its socket buffers hold, reading
    # nothing until all are sent (a thread sends, since the coordinator stops reading
    # from it while its replies wait)
    # (about 11 MB of replies in all, more than both sockets' buffers hold).
    slow = peers.raw(coordinator.client_addr)
    n = 120
    requests = [encode_frame({"type": "LIST_JOBS", "limit": 1000})] * (n - 1)
    requests.append(encode_frame({"type": "GET_JOB_STATUS", "jobId": ids[7]}))
    sender = threading.Thread(target=lambda: slow.send_raw(b"".join(requests)), daemon=True)
    sender.start()
    # (the coordinator has replies waiting for it: its receive buffer holds unread bytes)
    wait_until(lambda: unread(slow.sock) >= 16384, message="replies waiting to be read")
    # Then, once it reads, every reply arrives whole and in request order
    replies = [slow.recv() for _ in range(n)]
    sender.join(5)
    assert not sender.is_alive()
    assert [r["type"] for r in replies] == ["JOB_LIST"] * (n - 1) + ["JOB_STATUS"]
    for r in replies[:-1]:
        assert [j["jobId"] for j in r["jobs"]] == ids[::-1]
    assert replies[-1]["job"]["jobId"] == ids[7]
    # And the connection keeps working
    assert slow.request({"type": "LIST_WORKERS"})["type"] == "WORKER_LIST"


def test_clients_that_reset_with_replies_pending_cost_only_themselves(coordinator, peers):
    # Given clients that pipeline submits and reset their connection (RST) at once,
    # before any reply can be written
    tokens = []
    for c in range(20):
        conn = RawConn(coordinator.client_addr)
        frames = []
        for i in range(30):
            token = "reset %d %d" % (c, i)
            tokens.append(token)
            frames.append(encode_frame({"type": "SUBMIT_JOB", "taskType": "WORD_COUNT",
                                        "payload": {"text": token}, "idempotencyKey": token}))
        conn.send_raw(b"".join(frames))
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
    # Then the coordinator keeps serving others, and every submit it read exists exactly
    # once: resubmitting each key finds the same job or creates it now
    client = peers.client(coordinator)
    assert client.request({"type": "LIST_WORKERS"})["type"] == "WORKER_LIST"
    ids = set()
    for token in tokens:
        ids.add(client.submit_ok("WORD_COUNT", {"text": token}, idempotencyKey=token))
    assert len(ids) == len(tokens)
    listed = client.request({"type": "LIST_JOBS", "limit": 1000})
    assert len({j["jobId"] for j in listed["jobs"]}) == len(tokens)


def test_a_worker_that_never_reads_blocks_nobody(coordinator, peers):
    # Given a client's latencies measured first (its baseline jobs delayed out of the way)
    other = peers.client(coordinator)
    base_list = baseline(lambda: other.list_jobs(limit=10))
    base_submit = baseline(lambda: other.submit_ok("SLEEP", {"durationMillis": 1}, delayMillis=10 ** 9))
    # and a registered worker with a large capacity that heartbeats but never reads its socket
    hog = peers.raw(coordinator.worker_addr)
    hog.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    hog.send({"type": "WORKER_REGISTER", "workerId": "w-deaf", "capacity": 1024})
    assert hog.recv()["type"] == "WORKER_REGISTERED"
    import threading
    stop = threading.Event()

    def beat():
        while not stop.wait(0.1):
            try:
                hog.send({"type": "HEARTBEAT", "workerId": "w-deaf"})
            except OSError:
                return

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        # When many large assignments are pushed at it (about 40 MB of TASK_ASSIGN frames)
        client = peers.client(coordinator)
        text = "z" * 200_000
        for start in range(0, 200, 50):
            for i in range(50):
                client.conn.send({"type": "SUBMIT_JOB", "taskType": "SHA256", "payload": {"text": text}})
            for _ in range(50):
                assert client.conn.recv()["type"] == "JOB_SUBMITTED"
        # Then clients are still answered promptly
        for _ in range(5):
            _, elapsed = timed(lambda: other.list_jobs(limit=10))
            assert_prompt(elapsed, base_list, "LIST_JOBS beside a worker that never reads")
        _, elapsed = timed(lambda: other.submit_ok("SLEEP", {"durationMillis": 1}))
        assert_prompt(elapsed, base_submit, "a submit beside a worker that never reads")
        # And the deaf worker, holding more unsent output than the bound, was closed: its
        # attempts are lost with it and wait for another worker, none of them gone
        wait_until(lambda: not any(w["workerId"] == "w-deaf" for w in other.workers()), timeout=10,
                   message="the deaf worker closed")
        jobs = other.list_jobs(limit=1000)["jobs"]
        assert len(jobs) == 211 and all(j["state"] in ("QUEUED", "RETRY_WAIT", "FAILED") for j in jobs
                                        if j["taskType"] == "SHA256")
    finally:
        stop.set()
        beater.join(2)


def test_a_client_that_half_closes_still_gets_every_reply(clients_only, peers):
    coordinator = clients_only
    # Given a client that pipelines more requests than the per-connection limit, then
    # closes its sending side without reading anything yet
    conn = peers.raw(coordinator.client_addr)
    n = 150
    conn.send_raw(b"".join(
        encode_frame({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": i}})
        for i in range(n)))
    conn.sock.shutdown(socket.SHUT_WR)
    # Then every request is answered, in order, before the coordinator closes
    replies = [conn.recv() for _ in range(n)]
    assert [r["type"] for r in replies] == ["JOB_SUBMITTED"] * n
    assert len({r["jobId"] for r in replies}) == n
    assert conn.recv() is None  # then a clean close
    client = peers.client(coordinator)
    assert all(client.status(r["jobId"])["state"] == "QUEUED" for r in replies)


def test_a_violation_after_pipelined_requests_is_answered_after_them(clients_only, peers):
    # Given valid requests followed by a malformed frame, all in one write
    conn = peers.raw(clients_only.client_addr)
    good = [encode_frame({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 1}})
            for _ in range(3)]
    conn.send_raw(b"".join(good) + frame_of(b"{not json"))
    # Then the valid ones are answered first, then the ERROR, then the connection closes
    replies = [conn.recv() for _ in range(4)]
    assert [r["type"] for r in replies] == ["JOB_SUBMITTED"] * 3 + ["ERROR"]
    assert "JSON" in replies[3]["message"]
    assert conn.recv() is None  # then a clean close
