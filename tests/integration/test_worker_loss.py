"""Worker loss (ARCHITECTURE.md failure detector): a dropped connection or a silent worker.

A closed worker socket retries its RUNNING jobs at once; a worker that stops heartbeating
while keeping its socket open is declared dead after --heartbeat-timeout-millis (600 ms in
tests), removed from LIST_WORKERS, its session closed and its jobs retried. Results from
the dead session's attempts are stale and dropped.

The tests share one coordinator: each test's jobs are of a task type of its own that only
its own workers declare, and each looks only at its own workers in LIST_WORKERS.
"""

from __future__ import annotations

import itertools
import time

import pytest

from tests.support.processes import FAST_FLAGS
from tests.support.waiting import assert_stays, wait_until

HEARTBEAT_TIMEOUT = FAST_FLAGS["heartbeat-timeout-millis"] / 1000.0
_serial = itertools.count(1)


@pytest.fixture
def task_type():
    """A task type no other test of this module uses."""
    return "LOSS-%d" % next(_serial)


@pytest.fixture
def coordinator(shared_coordinator):
    """The coordinator the module's tests share."""
    return shared_coordinator


def worker_ids(client, *mine: str) -> list[str]:
    """Which of the workers ``mine`` are listed, sorted."""
    return sorted(w["workerId"] for w in client.workers() if w["workerId"] in mine)


def test_closed_worker_socket_retries_its_jobs_elsewhere(coordinator, peers, task_type):
    # Given worker A running two jobs, and then an idle worker B
    client = peers.client(coordinator)
    a = peers.worker(coordinator, "w-a", capacity=2, task_types=[task_type])
    j1 = client.submit_ok(task_type, {"durationMillis": 1}, max_attempts=3)
    j2 = client.submit_ok(task_type, {"durationMillis": 2}, max_attempts=3)
    first = {x["jobId"]: x for x in (a.await_assign(), a.await_assign())}
    assert set(first) == {j1, j2}
    b = peers.worker(coordinator, "w-b", capacity=2, task_types=[task_type])

    # When A's connection drops
    a.close()

    # Then A leaves the worker list and both jobs are re-run on B with new leases
    wait_until(lambda: worker_ids(client, "w-a", "w-b") == ["w-b"], timeout=3, message="w-a removed")
    again = {x["jobId"]: x for x in (b.await_assign(), b.await_assign())}
    assert set(again) == {j1, j2}
    for job_id, assign in again.items():
        assert assign["attemptNumber"] == 2
        assert assign["attemptId"] != first[job_id]["attemptId"]
        b.complete(assign, {"sleptMillis": 0})
    for job_id in (j1, j2):
        done = client.wait_state(job_id, ("COMPLETED", "FAILED"))
        assert (done["state"], done["attempts"]) == ("COMPLETED", 2)
        assert done["error"], "the lost attempt leaves an error for history"


def test_worker_loss_on_the_final_attempt_fails_the_job(coordinator, peers, task_type):
    client = peers.client(coordinator)
    a = peers.worker(coordinator, "w-last", capacity=1, task_types=[task_type])
    job_id = client.submit_ok(task_type, {"durationMillis": 1}, max_attempts=1)
    a.await_assign()
    a.close()
    done = client.wait_state(job_id, ("FAILED", "COMPLETED"), timeout=3)
    assert (done["state"], done["attempts"], done["workerId"]) == ("FAILED", 1, None)
    assert done["error"]


def test_a_silent_worker_is_declared_dead_and_its_jobs_retried(coordinator, peers, task_type):
    # Given worker A running a job, and a healthy worker B
    client = peers.client(coordinator)
    a = peers.worker(coordinator, "w-hung", capacity=1, task_types=[task_type])
    job_id = client.submit_ok(task_type, {"durationMillis": 1}, max_attempts=3)
    first = a.await_assign()
    b = peers.worker(coordinator, "w-healthy", capacity=1, task_types=[task_type])
    assert worker_ids(client, "w-healthy", "w-hung") == ["w-healthy", "w-hung"]

    # When A stops heartbeating but keeps its socket open
    a.pause_heartbeats()
    t0 = time.monotonic()

    # Then after the heartbeat timeout A is removed, its session closed, and the job re-run on B
    second = b.await_assign(timeout=5)
    elapsed = time.monotonic() - t0
    assert second["jobId"] == job_id
    assert second["attemptNumber"] == 2 and second["attemptId"] != first["attemptId"]
    # (the last beat was at most one 100 ms interval before the pause)
    assert elapsed >= HEARTBEAT_TIMEOUT - 0.15, elapsed
    assert worker_ids(client, "w-healthy", "w-hung") == ["w-healthy"]
    assert a.wait_closed(timeout=3), "the coordinator should close a dead worker's session"

    # And the healthy worker was never suspected
    assert not b.closed.is_set()
    b.complete(second, {"sleptMillis": 1})
    assert client.wait_state(job_id, "COMPLETED")["attempts"] == 2


def test_a_late_result_from_a_dead_worker_is_dropped(coordinator, peers, task_type):
    # Given a job whose first worker went silent and was declared dead; attempt 2 runs on B
    client = peers.client(coordinator)
    a = peers.worker(coordinator, "w-zombie", capacity=1, task_types=[task_type])
    job_id = client.submit_ok(task_type, {"durationMillis": 1}, max_attempts=3)
    first = a.await_assign()
    b = peers.worker(coordinator, "w-live", capacity=1, task_types=[task_type])
    a.pause_heartbeats()
    second = b.await_assign(timeout=5)
    a.wait_closed(timeout=3)
    a.close()

    # When the dead worker comes back under its old id and reports the revoked attempt
    back = peers.worker(coordinator, "w-zombie", capacity=1, task_types=[task_type])
    back.complete(first, {"sleptMillis": 12345})

    # Then the result is dropped: the job is still RUNNING attempt 2 on B
    def unchanged():
        s = client.status(job_id)
        return (s["state"], s["attempts"], s["workerId"], s["result"]) == ("RUNNING", 2, "w-live", None)

    assert_stays(unchanged, 0.25, message="job unaffected by the late result")
    # And the returning worker is a normal live worker again, and receives no phantom work
    assert worker_ids(client, "w-live", "w-zombie") == ["w-live", "w-zombie"]
    assert back.poll_assign(0.1) is None
    b.complete(second, {"sleptMillis": 1})
    done = client.wait_state(job_id, "COMPLETED")
    assert done["result"] == {"sleptMillis": 1}


def test_heartbeats_keep_a_worker_alive(coordinator, peers, task_type):
    # Given a worker that heartbeats every 100 ms while holding a job
    client = peers.client(coordinator)
    w = peers.worker(coordinator, "w-steady", capacity=1, task_types=[task_type])
    job_id = client.submit_ok(task_type, {"durationMillis": 1})
    assign = w.await_assign()
    # Then it is never declared dead across several heartbeat timeouts
    assert_stays(lambda: worker_ids(client, "w-steady") == ["w-steady"] and client.state(job_id) == "RUNNING",
                 3 * HEARTBEAT_TIMEOUT, interval=0.05, message="worker alive and job RUNNING")
    assert not w.closed.is_set()
    w.complete(assign, {"sleptMillis": 1})
    client.wait_state(job_id, "COMPLETED")


def test_a_worker_that_never_heartbeats_is_removed(coordinator, peers, task_type):
    # Given a worker that registers and then says nothing
    client = peers.client(coordinator)
    w = peers.worker(coordinator, "w-mute", capacity=1, task_types=[task_type])
    w.pause_heartbeats()
    assert worker_ids(client, "w-mute") == ["w-mute"]
    # Then it is removed after the heartbeat timeout, and its connection closed
    wait_until(lambda: worker_ids(client, "w-mute") == [], timeout=3, message="mute worker removed")
    assert w.wait_closed(timeout=3)


def test_a_lost_job_comes_back_to_the_same_worker_after_reconnect(coordinator, peers, task_type):
    # Given the only worker drops with a job in flight
    client = peers.client(coordinator)
    w = peers.worker(coordinator, "w-flaky", capacity=1, task_types=[task_type])
    job_id = client.submit_ok(task_type, {"durationMillis": 1}, max_attempts=3)
    first = w.await_assign()
    w.close()
    client.wait_state(job_id, ("RETRY_WAIT", "QUEUED"), timeout=3)
    # When it reconnects under the same id
    w2 = peers.worker(coordinator, "w-flaky", capacity=1, task_types=[task_type])
    # Then the job is retried on it with a new lease
    second = w2.await_assign()
    assert second["jobId"] == job_id and second["attemptId"] != first["attemptId"]
    assert second["attemptNumber"] == 2
    w2.complete(second, {"sleptMillis": 1})
    assert client.wait_state(job_id, "COMPLETED")["attempts"] == 2
