"""Priority scheduling and aging (PROTOCOL.md "priority"; ARCHITECTURE.md Scheduler).

QUEUED jobs are assigned highest effective priority first: base level (HIGH=2, NORMAL=1,
LOW=0) raised by one per whole --aging-step-millis waited since submission, capped at
HIGH; ties go by a persistent, strictly increasing submission sequence (FIFO).

The checks at the default aging step share one coordinator: each test's jobs are of a
task type of its own, which only its own workers run, so the order they see is the
order among that test's jobs. The other aging steps start their own.
"""

from __future__ import annotations

import itertools
import time

import pytest

from tests.support.waiting import wait_until

_serial = itertools.count(1)


def declared_type(peers, coordinator, client) -> str:
    """A task type no other test of this module uses, made known to ``coordinator`` by a
    worker that declared it and left (its jobs then wait for the test's own worker)."""
    task_type = "PRIORITY-%d" % next(_serial)
    worker_id = "w-declares-" + task_type
    peers.worker(coordinator, worker_id, capacity=1, task_types=[task_type]).close()
    wait_until(lambda: worker_id not in [w["workerId"] for w in client.workers()], timeout=3,
               message="the declaring worker gone")
    return task_type


def drain_order(worker, n: int) -> list[str]:
    """Complete assignments one at a time (capacity 1) and return the job order."""
    order = []
    for _ in range(n):
        a = worker.await_assign()
        order.append(a["jobId"])
        worker.complete(a, {"ok": True})
    assert worker.poll_assign(0.1) is None
    return order


def test_highest_priority_first_fifo_within_a_level(shared_coordinator, peers):
    # Given no worker and a mix of priorities submitted in this order
    coordinator = shared_coordinator
    client = peers.client(coordinator)
    task_type = declared_type(peers, coordinator, client)
    spec = [("L1", "LOW"), ("N1", "NORMAL"), ("H1", "HIGH"), ("N2", None), ("L2", "LOW"), ("H2", "HIGH"),
            ("N3", "NORMAL"), ("H3", "HIGH"), ("N4", "__omit__")]
    ids = {}
    for name, prio in spec:
        extra = {} if prio == "__omit__" else {"priority": prio}
        ids[name] = client.submit_ok(task_type, {"text": name}, **extra)
    # and snapshots carry the base priority (null/omitted = NORMAL)
    assert [client.status(ids[n])["priority"] for n, _ in spec] == [
        "LOW", "NORMAL", "HIGH", "NORMAL", "LOW", "HIGH", "NORMAL", "HIGH", "NORMAL"]

    # When a capacity-1 worker attaches
    worker = peers.worker(coordinator, "w-prio", capacity=1, task_types=[task_type])

    # Then HIGH jobs go first, then NORMAL, then LOW, each level in submission order
    names = {v: k for k, v in ids.items()}
    order = [names[j] for j in drain_order(worker, len(spec))]
    assert order == ["H1", "H2", "H3", "N1", "N2", "N3", "N4", "L1", "L2"]


def test_fifo_for_many_jobs_submitted_in_the_same_millisecond(shared_coordinator, peers):
    # Given a burst of same-priority jobs, pipelined so many share a millisecond
    coordinator = shared_coordinator
    client = peers.client(coordinator)
    task_type = declared_type(peers, coordinator, client)
    n = 30
    for i in range(n):
        client.conn.send({"type": "SUBMIT_JOB", "taskType": task_type, "payload": {"durationMillis": i}})
    ids = [client.conn.recv()["jobId"] for _ in range(n)]
    # When a worker drains them one at a time
    worker = peers.worker(coordinator, "w-fifo", capacity=1, task_types=[task_type])
    # Then the order is exactly the submission order
    assert drain_order(worker, n) == ids


def test_an_aged_low_job_ties_at_high_and_wins_by_sequence(coordinator_factory, peers):
    # Given --aging-step-millis=200 and no worker
    coord = coordinator_factory(aging_step_millis=200)
    client = peers.client(coord)
    # When a LOW job is submitted, then right after it a HIGH and a NORMAL one
    low = client.submit_ok("WORD_COUNT", {"text": "low"}, priority="LOW")
    t_low = time.monotonic()
    high = client.submit_ok("WORD_COUNT", {"text": "high"}, priority="HIGH")
    normal = client.submit_ok("WORD_COUNT", {"text": "normal"}, priority="NORMAL")
    # and all of them wait at least two whole aging steps (LOW 0 -> 2, NORMAL 1 -> capped 2)
    time.sleep(max(0.0, 0.5 - (time.monotonic() - t_low)))
    # and a fresh NORMAL job arrives just before the worker
    fresh = client.submit_ok("WORD_COUNT", {"text": "fresh"}, priority="NORMAL")
    worker = peers.worker(coord, "w-aging", capacity=1)

    # Then every aged job is at HIGH (capped, never above), so submission order decides among them,
    # and the fresh NORMAL job comes last
    assert drain_order(worker, 4) == [low, high, normal, fresh]
    # And the snapshot still shows the base priority, not the aged one
    assert client.status(low)["priority"] == "LOW"


def test_without_aging_low_waits_behind_normal(coordinator_factory, peers):
    # Given a long aging step, a LOW job submitted before a NORMAL one
    coord = coordinator_factory(aging_step_millis=60_000)
    client = peers.client(coord)
    low = client.submit_ok("WORD_COUNT", {"text": "low"}, priority="LOW")
    normal = client.submit_ok("WORD_COUNT", {"text": "normal"})
    worker = peers.worker(coord, "w-noage", capacity=1)
    # Then NORMAL runs first
    assert drain_order(worker, 2) == [normal, low]


def test_one_aging_step_lifts_low_to_normal(coordinator_factory, peers):
    # Given --aging-step-millis=400: a LOW job that waited one step ties with NORMAL ones
    coord = coordinator_factory(aging_step_millis=400)
    client = peers.client(coord)
    low = client.submit_ok("WORD_COUNT", {"text": "low"}, priority="LOW")
    t_low = time.monotonic()
    time.sleep(max(0.0, 0.45 - (time.monotonic() - t_low)))
    normal = client.submit_ok("WORD_COUNT", {"text": "normal"})
    high = client.submit_ok("WORD_COUNT", {"text": "high"}, priority="HIGH")
    worker = peers.worker(coord, "w-onestep", capacity=1)
    # Then: HIGH first; LOW (aged to NORMAL, older sequence) before the new NORMAL
    first = worker.await_assign()
    assert first["jobId"] == high
    worker.complete(first, {"ok": True})
    assert drain_order(worker, 2) == [low, normal]


def test_a_retry_keeps_its_priority(shared_coordinator, peers):
    # Given a HIGH job that fails once
    client = peers.client(shared_coordinator)
    task_type = "PRIORITY-%d" % next(_serial)
    worker = peers.worker(shared_coordinator, "w-keep", capacity=1, task_types=[task_type])
    job_id = client.submit_ok(task_type, {"failUntilAttempt": 2}, priority="HIGH", max_attempts=2)
    worker.fail(worker.await_assign(), "once")
    # Then it keeps HIGH through RETRY_WAIT and the retry
    second = worker.await_assign()
    assert second["jobId"] == job_id and second["attemptNumber"] == 2
    assert client.status(job_id)["priority"] == "HIGH"
    worker.complete(second, {"attempt": 2})
    assert client.wait_state(job_id, "COMPLETED")["priority"] == "HIGH"


@pytest.mark.parametrize("bad", ["URGENT", "high", "Low", "", "2", " HIGH"])
def test_invalid_priority_is_an_error(shared_coordinator, peers, bad):
    client = peers.client(shared_coordinator)
    before = [j["jobId"] for j in client.list_jobs(limit=1000)["jobs"]]
    reply = client.submit("SLEEP", {"durationMillis": 1}, priority=bad)
    assert reply["type"] == "ERROR", reply
    assert reply["message"]
    assert [j["jobId"] for j in client.list_jobs(limit=1000)["jobs"]] == before
    # the connection stays open
    assert client.status(client.submit_ok("SLEEP", {"durationMillis": 1}, priority="LOW"))["priority"] == "LOW"
