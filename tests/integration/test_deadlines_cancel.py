"""Execution deadlines and cancellation: the lease/deadline PR's DeadlineAndCancellationIT.

With --task-timeout-millis=300 a RUNNING attempt past its coordinator-clock deadline has
its lease revoked, a best-effort TASK_CANCEL {jobId, attemptId} goes to its worker, and the
job is retried or failed. CANCEL_JOB moves QUEUED/RETRY_WAIT/RUNNING jobs to CANCELLED;
late results from revoked attempts are stale-rejected.

The tests share two coordinators (one with the short deadline, one with the default):
each test's jobs are of a task type of its own, declared by its own workers, and its
workers have ids of their own. Tests that need other retry settings start their own.
"""

from __future__ import annotations

import itertools
import re
import time

import pytest

from tests.support.waiting import assert_stays, wait_until

TIMEOUT_MS = 300
TIMEOUT_WORDS = re.compile(r"time|deadline", re.IGNORECASE)


_serial = itertools.count(1)


def own_type() -> str:
    """A task type no other test of this module uses."""
    return "DEADLINES-%d" % next(_serial)


def active_jobs(client, worker_id: str) -> int:
    (item,) = [w for w in client.workers() if w["workerId"] == worker_id]
    return item["activeJobs"]


@pytest.fixture(scope="module")
def coord(module_coordinators):
    """The coordinator with the short deadline, shared by the module."""
    return module_coordinators(task_timeout_millis=TIMEOUT_MS)


def test_deadline_expiry_on_a_heartbeating_worker_cancels_and_reassigns(coord, peers):
    # Given a healthy, heartbeating worker holding attempt 1 and never answering it
    client = peers.client(coord)
    task_type = own_type()
    worker = peers.worker(coord, "w-stuck", capacity=1, task_types=[task_type])
    job_id = client.submit_ok(task_type, {"durationMillis": 60_000}, max_attempts=3)
    first = worker.await_assign()
    t_assign = time.monotonic()

    # When the execution deadline passes
    cancel = worker.await_cancel(timeout=5)
    elapsed = time.monotonic() - t_assign

    # Then TASK_CANCEL names exactly that attempt, and came no earlier than the deadline
    assert cancel["type"] == "TASK_CANCEL"
    assert (cancel["jobId"], cancel["attemptId"]) == (first["jobId"], first["attemptId"])
    assert elapsed >= TIMEOUT_MS / 1000 - 0.03, elapsed
    assert worker.heartbeats_sent > 0 and not worker.closed.is_set()

    # And the job is reassigned with a new lease (the freed slot makes this worker eligible)
    second = worker.await_assign(timeout=5)
    assert second["jobId"] == job_id
    assert second["attemptNumber"] == 2
    assert second["attemptId"] != first["attemptId"]

    # And it completes on attempt 2
    worker.complete(second, {"sleptMillis": 1})
    done = client.wait_state(job_id, ("COMPLETED", "FAILED", "CANCELLED"))
    assert done["state"] == "COMPLETED"
    assert done["attempts"] == 2
    assert done["result"] == {"sleptMillis": 1}
    assert done["error"] and TIMEOUT_WORDS.search(done["error"]), done["error"]


def test_late_success_from_a_timed_out_attempt_is_stale(coord, peers):
    # Given attempt 1 timed out and attempt 2 is RUNNING
    client = peers.client(coord)
    task_type = own_type()
    worker = peers.worker(coord, "w-late", capacity=1, task_types=[task_type])
    job_id = client.submit_ok(task_type, {"durationMillis": 60_000}, max_attempts=3)
    first = worker.await_assign()
    worker.await_cancel(timeout=5)
    second = worker.await_assign(timeout=5)
    assert second["attemptNumber"] == 2
    running = client.wait_state(job_id, "RUNNING")

    # When the timed-out attempt reports success late
    worker.complete(first, {"sleptMillis": 111})

    # Then the result is stale-rejected: the job is still RUNNING attempt 2, no result
    def unchanged():
        snap = client.status(job_id)
        return (snap["state"], snap["attempts"], snap["result"], snap["workerId"]) == (
            "RUNNING", 2, None, "w-late")

    assert_stays(unchanged, 0.2, message="job unaffected by the stale result")
    assert running["attempts"] == 2

    # And the live attempt's result is the one that counts
    worker.complete(second, {"sleptMillis": 222})
    done = client.wait_state(job_id, ("COMPLETED", "FAILED"))
    assert (done["state"], done["result"], done["attempts"]) == ("COMPLETED", {"sleptMillis": 222}, 2)


def test_deadline_expiry_on_the_final_attempt_fails_the_job(coord, peers):
    # Given a job with a single attempt, stuck on a live worker
    client = peers.client(coord)
    task_type = own_type()
    worker = peers.worker(coord, "w-final", capacity=1, task_types=[task_type])
    job_id = client.submit_ok(task_type, {"durationMillis": 60_000}, max_attempts=1)
    first = worker.await_assign()

    # When its deadline passes
    cancel = worker.await_cancel(timeout=5)
    assert (cancel["jobId"], cancel["attemptId"]) == (job_id, first["attemptId"])

    # Then the job is FAILED with a timeout error
    done = client.wait_state(job_id, ("FAILED", "COMPLETED", "CANCELLED"))
    assert done["state"] == "FAILED"
    assert done["attempts"] == 1
    assert done["workerId"] is None
    assert done["result"] is None
    assert done["error"] and TIMEOUT_WORDS.search(done["error"]), done["error"]

    # And the worker's slot was freed: it receives the next job, and the old one is not retried
    nxt = client.submit_ok(task_type, {"durationMillis": 1}, max_attempts=1)
    assign = worker.await_assign(timeout=5)
    assert assign["jobId"] == nxt
    # A late success for the failed attempt cannot revive it
    worker.complete(first, {"sleptMillis": 1})
    assert_stays(lambda: client.status(job_id)["state"] == "FAILED", 0.2, message="job stays FAILED")


def test_cancel_a_queued_job(coord, peers):
    # Given a QUEUED job and no workers for its type (the one that declared it has left)
    client = peers.client(coord)
    task_type = own_type()
    peers.worker(coord, "w-declares", capacity=1, task_types=[task_type]).close()
    wait_until(lambda: "w-declares" not in [w["workerId"] for w in client.workers()], timeout=3,
               message="the declaring worker gone")
    job_id = client.submit_ok(task_type, {"durationMillis": 1})
    assert client.status(job_id)["state"] == "QUEUED"

    # When it is cancelled
    reply = client.cancel(job_id)

    # Then the reply says this call cancelled it, with the CANCELLED snapshot
    assert reply["type"] == "JOB_CANCEL"
    assert reply["cancelled"] is True
    assert reply["job"]["jobId"] == job_id
    assert reply["job"]["state"] == "CANCELLED"
    assert reply["job"]["workerId"] is None
    assert reply["job"]["attempts"] == 0
    assert client.status(job_id)["state"] == "CANCELLED"

    # And it is never scheduled once a worker joins, while later work is
    worker = peers.worker(coord, "w-joins", capacity=2, task_types=[task_type])
    later = client.submit_ok(task_type, {"durationMillis": 1})
    assign = worker.await_assign()
    assert assign["jobId"] == later
    assert worker.poll_assign(0.3) is None
    assert [a["jobId"] for a in worker.assigns] == [later]
    assert client.status(job_id)["state"] == "CANCELLED"


def test_cancel_a_running_job_revokes_the_lease_and_frees_capacity(shared_coordinator, peers):
    # Given a capacity-1 worker running job A (with the long default deadline, so only the cancel acts)
    coord = shared_coordinator
    coord_client = peers.client(coord)
    task_type = own_type()
    worker = peers.worker(coord, "w-run", capacity=1, task_types=[task_type])
    a = coord_client.submit_ok(task_type, {"durationMillis": 60_000}, max_attempts=3)
    assign_a = worker.await_assign()
    coord_client.wait_state(a, "RUNNING")

    # When A is cancelled
    reply = coord_client.cancel(a)

    # Then this call cancelled it
    assert reply["type"] == "JOB_CANCEL" and reply["cancelled"] is True
    assert reply["job"]["state"] == "CANCELLED"
    assert reply["job"]["workerId"] is None
    assert reply["job"]["attempts"] == 1

    # And the worker receives TASK_CANCEL for exactly that attempt
    cancel = worker.await_cancel(timeout=2)
    assert (cancel["jobId"], cancel["attemptId"]) == (a, assign_a["attemptId"])

    # And its slot is free: the next job goes to it although it never answered A
    b = coord_client.submit_ok(task_type, {"durationMillis": 1})
    assign_b = worker.await_assign(timeout=2)
    assert assign_b["jobId"] == b
    assert active_jobs(coord_client, "w-run") == 1

    # And A is not retried
    worker.complete(assign_b, {"sleptMillis": 1})
    coord_client.wait_state(b, "COMPLETED")
    assert worker.poll_assign(0.2) is None
    assert coord_client.status(a)["state"] == "CANCELLED"


def test_a_worker_ignoring_the_cancel_cannot_resurrect_the_job(shared_coordinator, peers):
    # Given a RUNNING job A on a capacity-1 worker, cancelled by a client
    client = peers.client(shared_coordinator)
    task_type = own_type()
    worker = peers.worker(shared_coordinator, "w-ignore", capacity=1, task_types=[task_type])
    a = client.submit_ok(task_type, {"durationMillis": 60_000})
    assign_a = worker.await_assign()
    client.wait_state(a, "RUNNING")
    assert client.cancel(a)["cancelled"] is True
    worker.await_cancel(timeout=2)
    # and the freed slot now holds job B
    b = client.submit_ok(task_type, {"durationMillis": 60_000})
    assign_b = worker.await_assign(timeout=2)
    assert assign_b["jobId"] == b

    # When the worker ignores the cancel and reports success for A
    worker.complete(assign_a, {"sleptMillis": 60_000})

    # Then A stays CANCELLED with no result
    def still_cancelled():
        snap = client.status(a)
        return snap["state"] == "CANCELLED" and snap["result"] is None

    assert_stays(still_cancelled, 0.2, message="A stays CANCELLED")
    # And the stale result freed no capacity: B still holds the only slot, so C waits
    c = client.submit_ok(task_type, {"durationMillis": 1})
    assert worker.poll_assign(0.3) is None
    assert client.status(c)["state"] == "QUEUED"
    assert active_jobs(client, "w-ignore") == 1
    worker.complete(assign_b, {"sleptMillis": 1})
    assert worker.await_assign(timeout=2)["jobId"] == c


def test_cancel_a_retry_wait_job(coordinator_factory, peers):
    # Given a job waiting 500 ms for its retry
    coord = coordinator_factory(retry_base_millis=500, retry_cap_millis=500)
    client = peers.client(coord)
    worker = peers.worker(coord, "w-rw", capacity=1)
    job_id = client.submit_ok("SLEEP", {"durationMillis": 1}, max_attempts=3)
    worker.fail(worker.await_assign(), "first failure")
    client.wait_state(job_id, "RETRY_WAIT")

    # When it is cancelled
    reply = client.cancel(job_id)

    # Then it is CANCELLED, keeps its history, and is never retried
    assert reply["cancelled"] is True
    assert reply["job"]["state"] == "CANCELLED"
    assert reply["job"]["attempts"] == 1
    assert reply["job"]["error"] == "first failure"
    assert worker.poll_assign(0.8) is None
    assert client.status(job_id)["state"] == "CANCELLED"


@pytest.mark.parametrize("final", ["COMPLETED", "FAILED", "CANCELLED"])
def test_cancelling_a_terminal_job_reports_the_real_state(shared_coordinator, peers, final):
    # Given a job that already ended
    client = peers.client(shared_coordinator)
    task_type = own_type()
    worker = peers.worker(shared_coordinator, "w-term-" + final.lower(), capacity=1, task_types=[task_type])
    job_id = client.submit_ok(task_type, {"durationMillis": 1}, max_attempts=1)
    assign = worker.await_assign()
    if final == "COMPLETED":
        worker.complete(assign, {"sleptMillis": 1})
    elif final == "FAILED":
        worker.fail(assign, "it broke")
    else:
        assert client.cancel(job_id)["cancelled"] is True
    before = client.wait_state(job_id, final)

    # When it is cancelled (again)
    reply = client.cancel(job_id)

    # Then cancelled=false and the snapshot shows the real, unchanged state
    assert reply["type"] == "JOB_CANCEL"
    assert reply["cancelled"] is False
    assert reply["job"]["state"] == final
    assert reply["job"] == before
    assert client.status(job_id) == before


def test_cancelling_an_unknown_job_is_an_error(shared_coordinator, peers):
    client = peers.client(shared_coordinator)
    reply = client.cancel("no-such-job")
    assert reply["type"] == "ERROR" and reply["message"]
    # the connection stays open
    assert isinstance(client.workers(), list)


def test_cancel_for_one_attempt_does_not_touch_the_next(coord, peers):
    # Given attempt 1 timed out (cancelled) and attempt 2 RUNNING on the same worker
    client = peers.client(coord)
    task_type = own_type()
    worker = peers.worker(coord, "w-next", capacity=1, task_types=[task_type])
    job_id = client.submit_ok(task_type, {"durationMillis": 60_000}, max_attempts=2)
    first = worker.await_assign()
    c1 = worker.await_cancel(timeout=5)
    second = worker.await_assign(timeout=5)
    # Then the only cancel so far named attempt 1, never attempt 2
    assert c1["attemptId"] == first["attemptId"]
    assert all(c["attemptId"] != second["attemptId"] for c in worker.cancels)
    worker.complete(second, {"sleptMillis": 2})
    assert client.wait_state(job_id, ("COMPLETED", "FAILED"))["state"] == "COMPLETED"
    wait_until(lambda: active_jobs(client, "w-next") == 0, timeout=2, message="slot freed")


def test_worker_loss_after_a_timeout_does_not_count_twice(coordinator_factory, peers):
    # Given a 300 ms deadline and a long retry backoff: attempt 1 times out and the job waits to retry
    coord = coordinator_factory(task_timeout_millis=TIMEOUT_MS, retry_base_millis=5000, retry_cap_millis=5000)
    client = peers.client(coord)
    worker = peers.worker(coord, "w-twice", capacity=1)
    job_id = client.submit_ok("SLEEP", {"durationMillis": 60_000}, max_attempts=2)
    worker.await_assign()
    worker.await_cancel(timeout=5)
    waiting = client.wait_state(job_id, "RETRY_WAIT")
    assert waiting["attempts"] == 1

    # When the worker that held the revoked attempt disconnects
    worker.close()
    # Then the job is not charged again: still RETRY_WAIT with one attempt, not FAILED
    assert_stays(lambda: client.status(job_id) == waiting, 0.3, message="RETRY_WAIT unchanged")


def test_worker_loss_after_a_cancel_leaves_the_job_cancelled(shared_coordinator, peers):
    client = peers.client(shared_coordinator)
    task_type = own_type()
    worker = peers.worker(shared_coordinator, "w-gone", capacity=1, task_types=[task_type])
    job_id = client.submit_ok(task_type, {"durationMillis": 60_000}, max_attempts=3)
    worker.await_assign()
    cancelled = client.cancel(job_id)["job"]
    worker.await_cancel()
    worker.close()
    spare = peers.worker(shared_coordinator, "w-spare", capacity=1, task_types=[task_type])
    assert_stays(lambda: client.status(job_id) == cancelled, 0.3, message="job stays CANCELLED")
    assert spare.poll_assign(0.05) is None
