"""The malformed-peer cases (PROTOCOL.md "Error handling"), shared by the unit tier, which
runs every one against an in-process coordinator, and the integration tier, which runs a
few against a coordinator process.

A framing or protocol violation (``FRAMING_CASES`` on either port, ``WORKER_CASES``,
``CLIENT_CASES``): a best-effort ERROR, that connection closes, and an already-open client
connection and a registered worker (``bystanders``) keep working
(``assert_still_serving``). A well-formed request that cannot be served (``UNSERVABLE``):
ERROR, no job, and the connection stays open. Each case is ``(id, step, expect_error)``
(``step(conn)`` misbehaves on a ``RawConn``) or, for ``UNSERVABLE``, ``(id, request)``.
"""

from __future__ import annotations

import itertools
import socket

from jobmesh.protocol.framing import HEADER, MAX_FRAME
from tests.support.connections import RawConn, read_until_closed
from tests.support.waiting import wait_until

_serial = itertools.count(1)


def unique(prefix: str) -> str:
    """A name no other test of this run uses (task types, worker ids, keys)."""
    return "%s-%d" % (prefix, next(_serial))


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


def make_bystanders(coordinator, peers):
    """An open client connection and a registered worker, made before the bad peer arrives;
    the worker alone runs a task type of its own (``worker.task_type``)."""
    client = peers.client(coordinator)
    task_type = unique("BYSTANDER")
    worker = peers.worker(coordinator, "w-" + task_type.lower(), capacity=2, task_types=[task_type])
    worker.task_type = task_type
    assert worker.worker_id in worker_ids(client)
    return client, worker


def assert_still_serving(coordinator, peers, client, worker):
    # The coordinator is still running
    assert coordinator.running()
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


def worker_port_violation(coordinator, peers, bystanders, step, expect_error):
    """A bad peer on the worker port misbehaves (``step``): it gets a best-effort ERROR, its
    connection closes, any session it registered is gone, and the bystanders are unaffected."""
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


def client_port_violation(coordinator, peers, bystanders, step, expect_error):
    """A bad peer on the client port misbehaves (``step``): it gets a best-effort ERROR, its
    connection closes, it created no job, and the bystanders are unaffected."""
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


def unservable_request(coordinator, peers, request):
    """A well-formed request that cannot be served: ERROR with a message, no job, and the
    same connection keeps serving."""
    client = peers.client(coordinator)
    before = job_ids(client)
    # When a well-formed request cannot be served
    reply = client.request(request)
    # Then the reply is ERROR with a message
    assert reply["type"] == "ERROR", reply
    assert isinstance(reply["message"], str) and reply["message"]
    # And no job was created
    assert job_ids(client) == before
    # And the same connection keeps serving
    job_id = client.submit_ok("SLEEP", {"durationMillis": 1})
    assert client.status(job_id)["state"] == "QUEUED"
    assert job_ids(client) == [job_id] + before


def case(cases, case_id):
    """The case named ``case_id`` of a table, without its id."""
    for item in cases:
        if item[0] == case_id:
            return item[1:]
    raise KeyError(case_id)
