"""Submit → assign → result → status, against a real coordinator (PROTOCOL.md, CONTRACT.md).

A scripted worker plays the worker side by hand, so every frame the coordinator sends
is observed exactly. Checks that need no fresh coordinator share one per store: their
workers declare a task type of their own and run only their test's jobs.
"""

from __future__ import annotations

import hashlib
import itertools
import time

import pytest

from tests.pg_support import on_both_stores
from tests.support.waiting import assert_stays, wait_until

SNAPSHOT_FIELDS = {"jobId", "taskType", "state", "attempts", "maxAttempts", "workerId", "result", "error",
                   "createdAtMillis", "updatedAtMillis", "priority", "runAtMillis",
                   "retryAtMillis", "retryOf", "waitingReason", "protocol", "name",
                   "submittedBy", "concurrencyKey", "uniqueKey", "progress", "workflowId", "ref"}
WORKER_ITEM_FIELDS = {"workerId", "capacity", "activeJobs", "lastHeartbeatMillis"}


_serial = itertools.count(1)


def own_type() -> str:
    """A task type no other test of this module uses."""
    return "ROUNDTRIP-%d" % next(_serial)


def now_ms() -> int:
    return int(time.time() * 1000)


def assert_snapshot_shape(snap: dict) -> None:
    assert set(snap) == SNAPSHOT_FIELDS, snap
    assert isinstance(snap["jobId"], str) and snap["jobId"]
    assert snap["state"] in {"QUEUED", "RUNNING", "RETRY_WAIT", "COMPLETED", "FAILED", "CANCELLED"}
    for key in ("attempts", "maxAttempts", "createdAtMillis", "updatedAtMillis"):
        assert isinstance(snap[key], int) and not isinstance(snap[key], bool), (key, snap)
    assert snap["priority"] in {"HIGH", "NORMAL", "LOW"}
    # workerId only while RUNNING
    if snap["state"] == "RUNNING":
        assert isinstance(snap["workerId"], str) and snap["workerId"], snap
    else:
        assert snap["workerId"] is None, snap
    assert snap["updatedAtMillis"] >= snap["createdAtMillis"]


@on_both_stores
def test_submit_assign_complete(coordinator, peers):
    # Given a coordinator and no worker yet
    client = peers.client(coordinator)
    before = now_ms()

    # When a job is submitted
    reply = client.submit("SHA256", {"text": "hello"}, max_attempts=2)
    after = now_ms()

    # Then it is acknowledged with a string jobId and sits QUEUED with a complete snapshot
    assert reply["type"] == "JOB_SUBMITTED" and isinstance(reply["jobId"], str) and reply["jobId"]
    job_id = reply["jobId"]
    queued = client.status(job_id)
    assert_snapshot_shape(queued)
    assert queued == {
        "jobId": job_id, "taskType": "SHA256", "state": "QUEUED", "attempts": 0, "maxAttempts": 2,
        "workerId": None, "result": None, "error": None, "createdAtMillis": queued["createdAtMillis"],
        "updatedAtMillis": queued["updatedAtMillis"], "priority": "NORMAL", "runAtMillis": None,
        "retryAtMillis": None, "retryOf": None, "waitingReason": "NO_WORKER", "protocol": "json", "name": None,
        "submittedBy": None, "concurrencyKey": None, "uniqueKey": None, "progress": None,
        "workflowId": None, "ref": None,
    }
    # createdAtMillis is Unix epoch milliseconds, stamped during the request
    assert before - 5 <= queued["createdAtMillis"] <= after + 5

    # When a worker registers
    worker = peers.worker(coordinator, "w-rt", capacity=1)

    # Then it receives TASK_ASSIGN with the lease and the payload as submitted
    assign = worker.await_assign()
    assert assign["type"] == "TASK_ASSIGN"
    assert assign["jobId"] == job_id
    assert isinstance(assign["attemptId"], str) and assign["attemptId"]
    assert assign["attemptNumber"] == 1
    assert assign["taskType"] == "SHA256"
    assert assign["payload"] == {"text": "hello"}

    running = client.wait_state(job_id, "RUNNING")
    assert_snapshot_shape(running)
    assert running["workerId"] == "w-rt"
    assert running["attempts"] == 1
    assert running["updatedAtMillis"] >= queued["updatedAtMillis"]

    # When the worker reports success
    digest = hashlib.sha256(b"hello").hexdigest()
    done_before = now_ms()
    worker.complete(assign, {"sha256": digest})

    # Then the job is COMPLETED with the result, no worker, attempts 1
    done = client.wait_state(job_id, ("COMPLETED", "FAILED", "CANCELLED"))
    assert_snapshot_shape(done)
    assert done == {
        "jobId": job_id, "taskType": "SHA256", "state": "COMPLETED", "attempts": 1, "maxAttempts": 2,
        "workerId": None, "result": {"sha256": digest}, "error": None,
        "createdAtMillis": queued["createdAtMillis"], "updatedAtMillis": done["updatedAtMillis"],
        "priority": "NORMAL", "runAtMillis": None, "retryAtMillis": None, "retryOf": None,
        "waitingReason": None, "protocol": "json", "name": None, "submittedBy": None, "concurrencyKey": None, "uniqueKey": None,
        "progress": None, "workflowId": None, "ref": None,
    }
    assert done_before - 5 <= done["updatedAtMillis"] <= now_ms() + 5
    assert worker.bad_frames == [] and worker.errors == []


@pytest.mark.parametrize("given", [None, 0, -1, -100])
def test_max_attempts_le_zero_uses_the_server_default(shared_coordinator, peers, given):
    # Given the default --default-max-attempts (3)
    client = peers.client(shared_coordinator)
    # When a submit says maxAttempts <= 0 (or omits it)
    job_id = client.submit_ok("SLEEP", {"durationMillis": 1}, max_attempts=given)
    # Then the job gets the server default
    assert client.status(job_id)["maxAttempts"] == 3


def test_max_attempts_default_follows_the_flag(coordinator_factory, peers):
    coord = coordinator_factory(default_max_attempts=5)
    client = peers.client(coord)
    assert client.status(client.submit_ok("SLEEP", {"durationMillis": 1}, max_attempts=0))["maxAttempts"] == 5
    assert client.status(client.submit_ok("SLEEP", {"durationMillis": 1}, max_attempts=7))["maxAttempts"] == 7


def test_list_workers(coordinator, peers):
    # Given two registered workers, one of them running a job
    client = peers.client(coordinator)
    assert client.workers() == []
    before = now_ms()
    a = peers.worker(coordinator, "w-a", capacity=2)
    job_id = client.submit_ok("SLEEP", {"durationMillis": 1})
    assign = a.await_assign()
    assert assign["jobId"] == job_id
    b = peers.worker(coordinator, "w-b", capacity=3)

    # When workers are listed
    items = client.workers()

    # Then each live worker is one item with the contract's fields
    by_id = {w["workerId"]: w for w in items}
    assert set(by_id) == {"w-a", "w-b"}
    for item in items:
        assert WORKER_ITEM_FIELDS <= set(item), item
        assert before - 5 <= item["lastHeartbeatMillis"] <= now_ms() + 5
    assert (by_id["w-a"]["capacity"], by_id["w-a"]["activeJobs"]) == (2, 1)
    assert (by_id["w-b"]["capacity"], by_id["w-b"]["activeJobs"]) == (3, 0)

    # And heartbeats move lastHeartbeatMillis forward
    first = by_id["w-b"]["lastHeartbeatMillis"]
    b.heartbeat()
    wait_until(lambda: {w["workerId"]: w for w in client.workers()}["w-b"]["lastHeartbeatMillis"] > first,
               timeout=3, message="lastHeartbeatMillis to advance")

    # And a completed job frees the slot
    a.complete(assign, {"sleptMillis": 1})
    wait_until(lambda: {w["workerId"]: w for w in client.workers()}["w-a"]["activeJobs"] == 0, timeout=3,
               message="activeJobs back to 0")


def test_many_requests_on_one_connection(shared_coordinator, peers):
    # Given one client connection
    client = peers.client(shared_coordinator)
    # When it sends many requests one after another
    ids = [client.submit_ok("WORD_COUNT", {"text": "a b c %d" % i}) for i in range(40)]
    # Then each gets exactly one reply, in order, on the same connection
    assert len(set(ids)) == 40
    for job_id in ids:
        assert client.status(job_id)["jobId"] == job_id
    assert isinstance(client.workers(), list)  # a WORKER_LIST
    assert client.list_jobs()["type"] == "JOB_LIST"


def test_pipelined_requests_get_replies_in_order(shared_coordinator, peers):
    # Given several requests written back-to-back before reading any reply
    client = peers.client(shared_coordinator)
    job_id = client.submit_ok("SLEEP", {"durationMillis": 1})
    frames = [{"type": "GET_JOB_STATUS", "jobId": job_id}, {"type": "LIST_WORKERS"},
              {"type": "GET_JOB_STATUS", "jobId": "no-such-job"}, {"type": "LIST_JOBS"}]
    for f in frames:
        client.conn.send(f)
    # Then the replies come one per request, in request order
    replies = [client.conn.recv() for _ in frames]
    assert [r["type"] for r in replies] == ["JOB_STATUS", "WORKER_LIST", "ERROR", "JOB_LIST"]
    assert replies[0]["job"]["jobId"] == job_id


@on_both_stores
def test_failed_result_is_retried_with_a_new_attempt_and_the_error_is_kept(shared_on_store, peers):
    # Given a worker and a job with a budget of 3
    client = peers.client(shared_on_store)
    task_type = own_type()
    worker = peers.worker(shared_on_store, "w-retry-" + task_type, capacity=1, task_types=[task_type])
    job_id = client.submit_ok(task_type, {"durationMillis": 1}, max_attempts=3)
    first = worker.await_assign()

    # When attempt 1 fails
    worker.fail(first, "boom on attempt 1")

    # Then the job is retried with a new lease and attemptNumber 2
    second = worker.await_assign()
    assert second["jobId"] == job_id
    assert second["attemptNumber"] == 2
    assert second["attemptId"] != first["attemptId"]
    running = client.wait_state(job_id, "RUNNING")
    assert running["attempts"] == 2
    assert running["error"] == "boom on attempt 1"

    # When attempt 2 succeeds
    worker.complete(second, {"sleptMillis": 1})

    # Then the job is COMPLETED and the earlier error is kept for history
    done = client.wait_state(job_id, ("COMPLETED", "FAILED"))
    assert done["state"] == "COMPLETED"
    assert done["attempts"] == 2
    assert done["result"] == {"sleptMillis": 1}
    assert done["error"] == "boom on attempt 1"
    assert done["workerId"] is None


@on_both_stores
def test_failures_exhausting_the_budget_end_failed(coordinator, peers):
    # Given a FAIL job that fails on every attempt, with a budget of 2
    client = peers.client(coordinator)
    worker = peers.worker(coordinator, "w-fail", capacity=1)
    job_id = client.submit_ok("FAIL", {"failUntilAttempt": 5}, max_attempts=2)
    a1 = worker.await_assign()
    assert (a1["taskType"], a1["payload"], a1["attemptNumber"]) == ("FAIL", {"failUntilAttempt": 5}, 1)

    # When both attempts fail
    worker.fail(a1, "attempt 1 failed")
    a2 = worker.await_assign()
    assert a2["attemptNumber"] == 2 and a2["attemptId"] != a1["attemptId"]
    worker.fail(a2, "attempt 2 failed")

    # Then the job is FAILED with the last error, and no third attempt is made
    done = client.wait_state(job_id, ("FAILED", "COMPLETED"))
    assert done["state"] == "FAILED"
    assert done["attempts"] == 2
    assert done["error"] == "attempt 2 failed"
    assert done["result"] is None
    assert done["workerId"] is None
    assert worker.poll_assign(0.3) is None


@on_both_stores
def test_backoff_is_visible_as_retry_wait(coordinator_factory, peers):
    # Given retry backoff base 300 ms, cap 700 ms: delays 300, 600, then 700 (capped 1200)
    coord = coordinator_factory(retry_base_millis=300, retry_cap_millis=700)
    client = peers.client(coord)
    worker = peers.worker(coord, "w-backoff", capacity=1)
    job_id = client.submit_ok("SLEEP", {"durationMillis": 1}, max_attempts=4)
    assign = worker.await_assign()
    delays = []
    for expected_ms in (300, 600, 700):
        # When the attempt fails
        t0 = time.monotonic()
        worker.fail(assign, "fail %d" % assign["attemptNumber"])
        # Then the job waits in RETRY_WAIT, with no worker and the error recorded
        waiting = client.wait_state(job_id, "RETRY_WAIT", timeout=2)
        assert waiting["workerId"] is None
        assert waiting["error"] == "fail %d" % assign["attemptNumber"]
        assert waiting["attempts"] == assign["attemptNumber"]
        # And the retry is due exactly the backoff delay after the failure
        assert waiting["retryAtMillis"] - waiting["updatedAtMillis"] == expected_ms, waiting
        # And the next attempt comes no earlier
        nxt = worker.await_assign(timeout=10)
        delay_ms = (time.monotonic() - t0) * 1000
        delays.append(delay_ms)
        assert nxt["attemptNumber"] == assign["attemptNumber"] + 1
        assert delay_ms >= expected_ms - 30, (expected_ms, delays)
        assign = nxt
    worker.complete(assign, {"sleptMillis": 1})
    done = client.wait_state(job_id, "COMPLETED")
    assert done["attempts"] == 4 and done["error"] == "fail 3"


def test_result_with_a_wrong_lease_is_dropped(shared_coordinator, peers):
    # Given a RUNNING job
    client = peers.client(shared_coordinator)
    task_type = own_type()
    worker = peers.worker(shared_coordinator, "w-lease-" + task_type, capacity=1, task_types=[task_type])
    job_id = client.submit_ok(task_type, {"durationMillis": 1})
    assign = worker.await_assign()

    # When the worker reports a result for a different attemptId, and for an unknown job
    worker.result(assign, True, result={"sleptMillis": 99}, attemptId="not-the-lease")
    worker.result(assign, True, result={"sleptMillis": 98}, jobId="no-such-job")

    # Then they are dropped: the job stays RUNNING and the session stays usable
    assert_stays(lambda: client.status(job_id)["state"] == "RUNNING", 0.3, message="job RUNNING")
    assert not worker.closed.is_set()
    worker.complete(assign, {"sleptMillis": 1})
    done = client.wait_state(job_id, "COMPLETED")
    assert done["result"] == {"sleptMillis": 1}
    assert done["attempts"] == 1


@on_both_stores
def test_unicode_payload_reaches_the_worker_unchanged(coordinator, peers):
    # Given text with accents, symbols, non-BMP characters, quotes, slashes and newlines
    text = 'é✓😀 "quoted" back\\slash / 日本語\n\ttab'
    client = peers.client(coordinator)
    worker = peers.worker(coordinator, "w-utf8", capacity=1)
    job_id = client.submit_ok("SHA256", {"text": text})
    # Then the worker receives exactly the submitted text, and the result comes back exactly too
    assign = worker.await_assign()
    assert assign["payload"] == {"text": text}
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    worker.complete(assign, {"sha256": digest, "echo": text})
    assert client.wait_state(job_id, "COMPLETED")["result"] == {"sha256": digest, "echo": text}


def test_largest_text_payload_is_assigned_whole(coordinator, peers):
    # 200 000 four-byte characters: an 800 KB frame, within the 1 MiB limit
    text = "😀" * 200_000
    client = peers.client(coordinator)
    worker = peers.worker(coordinator, "w-big", capacity=1)
    job_id = client.submit_ok("WORD_COUNT", {"text": text})
    assign = worker.await_assign()
    assert assign["jobId"] == job_id and assign["payload"]["text"] == text
    worker.complete(assign, {"words": 1})
    assert client.wait_state(job_id, "COMPLETED")["result"] == {"words": 1}


@on_both_stores
def test_a_huge_result_never_produces_an_oversized_reply(shared_on_store, peers):
    # Given a worker that reports a result as large as a TASK_RESULT frame can carry
    from jobmesh.protocol.framing import MAX_FRAME
    client = peers.client(shared_on_store)
    task_type = own_type()
    worker = peers.worker(shared_on_store, "w-huge-" + task_type, capacity=1, task_types=[task_type])
    job_id = client.submit_ok(task_type, {"durationMillis": 1}, max_attempts=1)
    assign = worker.await_assign()
    blob = "x" * (MAX_FRAME - 400)
    worker.result(assign, True, result={"blob": blob}, error=None)
    # Then the job ends, and status and listing replies are valid frames (no reply exceeds 1 MiB)
    done = client.wait_state(job_id, ("COMPLETED", "FAILED"))
    assert client.list_jobs()["type"] == "JOB_LIST"
    # And the connection and the worker keep working
    nxt = client.submit_ok(task_type, {"durationMillis": 1})
    a2 = worker.await_assign()
    assert a2["jobId"] == nxt
    worker.complete(a2, {"sleptMillis": 1})
    assert client.wait_state(nxt, "COMPLETED")
    assert done["state"] in ("COMPLETED", "FAILED")


@on_both_stores
def test_a_duplicate_result_is_applied_once(shared_on_store, peers):
    # Given a capacity-1 worker that completed job A
    client = peers.client(shared_on_store)
    task_type = own_type()
    worker = peers.worker(shared_on_store, "w-dupres-" + task_type, capacity=1, task_types=[task_type])
    a = client.submit_ok(task_type, {"durationMillis": 1})
    assign_a = worker.await_assign()
    worker.complete(assign_a, {"sleptMillis": 1})
    done = client.wait_state(a, "COMPLETED")
    # and is now running job B, with job C queued behind it
    b = client.submit_ok(task_type, {"durationMillis": 2})
    assign_b = worker.await_assign()
    assert assign_b["jobId"] == b
    c = client.submit_ok(task_type, {"durationMillis": 3})

    # When A's result is sent again (a failure report, even)
    worker.complete(assign_a, {"sleptMillis": 999})
    worker.fail(assign_a, "late duplicate")

    # Then A is unchanged and no capacity was freed: C waits until B finishes
    assert_stays(lambda: client.status(a) == done, 0.2, message="A unchanged")
    assert worker.poll_assign(0.2) is None
    assert client.status(c)["state"] == "QUEUED"
    worker.complete(assign_b, {"sleptMillis": 2})
    assert worker.await_assign()["jobId"] == c
