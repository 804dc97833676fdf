"""The core's visibility features (CONTRACT.md "Seeing inside"): job timelines written in
the batch's commit, waiting reasons, retryAtMillis, RETRY_JOB, purging and retention,
and the plain counters the metrics port reads."""

from __future__ import annotations

import pytest

from jobmesh.coordinator.core.table import EVENTS_KEPT
from jobmesh.protocol import messages as m
from jobmesh.store.columns import load_events
from jobmesh.store.sqlite import SQLiteStore
from tests.unit.test_core import BASE, HB, TIMEOUT, Harness

DAY = 86_400_000


@pytest.fixture
def h() -> Harness:
    return Harness()


def events(h: Harness, job_id: str) -> list[dict]:
    reply = h.core.requests.get_job_events(0, job_id)
    assert isinstance(reply, m.JobEvents), reply
    return reply.events


def names(h: Harness, job_id: str) -> list[str]:
    return [e["event"] for e in events(h, job_id)]


# ==== timelines =================================================================================


def test_a_job_that_fails_once_then_completes(h):
    h.register(0, "w1")
    job_id = h.submit_ok(10)
    h.report(20, job_id, success=False, error="boom")
    h.sweep(20 + BASE)
    h.report(200, job_id)
    got = events(h, job_id)
    assert [e["event"] for e in got] == ["SUBMITTED", "ASSIGNED", "ATTEMPT_FAILED", "RETRY_WAIT", "QUEUED",
                                         "ASSIGNED", "COMPLETED"]
    assert got[0] == {"atMillis": 10, "event": "SUBMITTED"}
    assert got[1] == {"atMillis": 10, "event": "ASSIGNED", "attempt": 1, "attemptId": job_id + ".1", "workerId": "w1"}
    assert got[2]["detail"] == "boom" and got[2]["attempt"] == 1 and got[2]["workerId"] == "w1"
    assert got[3]["retryAtMillis"] == 20 + BASE and "attempt" not in got[3]
    assert got[5]["attempt"] == 2 and got[6]["attempt"] == 2 and got[6]["workerId"] == "w1"


def test_lease_expiry_worker_loss_cancel_and_final_failure_are_on_the_timeline():
    h = Harness(default_max_attempts=2)
    h.register(0, "w1")
    job_id = h.submit_ok(1)
    h.sweep(1 + TIMEOUT + 1)  # the deadline passes
    h.sweep(1 + TIMEOUT + 1 + BASE)  # due again: assigned
    h.disconnect(1 + TIMEOUT + 2 + BASE, "w1")  # the worker is lost on the last attempt
    assert names(h, job_id) == ["SUBMITTED", "ASSIGNED", "LEASE_EXPIRED", "RETRY_WAIT", "QUEUED", "ASSIGNED",
                                "WORKER_LOST", "FAILED"]
    assert "lost" in events(h, job_id)[-1]["detail"]
    other = h.submit_ok(5, delay=1000)
    h.cancel(6, other)
    assert names(h, other) == ["SUBMITTED", "CANCELLED"]


def test_a_stale_result_is_noted_on_the_timeline(h):
    h.register(0, "w1")
    job_id = h.submit_ok(1)
    first = h.assign_of(job_id)
    h.report(2, job_id, success=False, error="x")
    h.sweep(2 + BASE)
    h.report(3, job_id, attempt=first)  # the old lease reports late
    stale = events(h, job_id)[-1]
    assert stale["event"] == "STALE_RESULT" and stale["attemptId"] == first.attempt_id and stale["attempt"] == 1
    assert h.core.counters.stale_results == 1


def stored_events(store: SQLiteStore, job_id: str) -> list[str]:
    return [e[1] for e in load_events(store.get(job_id).events)]


def test_events_are_committed_with_their_batch_and_read_back(tmp_path):
    store = SQLiteStore(str(tmp_path / "jm.db"))
    h = Harness(store=store)
    job_id = h.submit_ok(1)
    assert stored_events(store, job_id) == ["SUBMITTED"]
    # An event of the batch being applied is shown before its commit too
    h.core.requests.cancel_job(2, job_id)
    assert names(h, job_id) == ["SUBMITTED", "CANCELLED"]
    h.commit()
    assert stored_events(store, job_id) == ["SUBMITTED", "CANCELLED"]
    assert isinstance(h.core.requests.get_job_events(0, "nope"), m.Error)
    # A finished job that left memory is read back with its timeline
    h.core.table.finished.clear()
    assert names(h, job_id) == ["SUBMITTED", "CANCELLED"]
    store.close()


def test_a_restart_records_recovered(tmp_path):
    store = SQLiteStore(str(tmp_path / "jm.db"))
    h = Harness(store=store)
    h.register(0, "w1")
    job_id = h.submit_ok(1)
    store.close()
    h2 = Harness(store=SQLiteStore(str(tmp_path / "jm.db")))
    h2.core.recover(50)
    h2.commit()
    got = events(h2, job_id)
    assert [e["event"] for e in got] == ["SUBMITTED", "ASSIGNED", "RECOVERED"]
    assert got[-1]["attemptId"] == job_id + ".1" and "requeued" in got[-1]["detail"]


def test_only_the_newest_events_are_kept(tmp_path):
    store = SQLiteStore(str(tmp_path / "jm.db"))
    h = Harness(store=store, default_max_attempts=1000, retry_base_millis=1, retry_cap_millis=1)
    h.register(0, "w1")
    job_id = h.submit_ok(1)
    now = 1
    while h.core.table.jobs[job_id].attempts < 40:  # four events an attempt
        now += 2
        h.report(now, job_id, success=False, error="again")
        h.sweep(now + 1)
    stored = load_events(store.get(job_id).events)
    assert len(stored) == EVENTS_KEPT
    assert stored[-1][1] == "ASSIGNED" and stored[-1][2] == 40
    assert [e["event"] for e in events(h, job_id)][-4:] == ["ATTEMPT_FAILED", "RETRY_WAIT", "QUEUED", "ASSIGNED"]
    assert "SUBMITTED" not in names(h, job_id)  # the oldest went first
    store.close()


# ==== waiting reasons ============================================================================


def test_waiting_reasons(h):
    queued = h.submit_ok(1)
    assert h.status(queued)["waitingReason"] == "NO_WORKER"
    h.register(2, "greeter", capacity=1, task_types=["GREET"])
    assert h.status(queued)["waitingReason"] == "NO_WORKER_FOR_TYPE"
    greet = h.submit_ok(3, task_type="GREET", payload={})
    assert h.status(greet)["waitingReason"] is None  # RUNNING
    blocked = h.submit_ok(4, task_type="GREET", payload={})
    assert h.status(blocked)["waitingReason"] == "WORKERS_BUSY"
    later = h.submit_ok(5, delay=1000)
    assert h.status(later)["waitingReason"] == "SCHEDULED"
    h.report(6, greet, success=False, error="x")
    snap = h.status(greet)
    assert (snap["state"], snap["waitingReason"], snap["retryAtMillis"]) == ("RETRY_WAIT", "RETRY_BACKOFF", 6 + BASE)
    assert h.state(blocked) == "RUNNING"  # the failed attempt freed the slot
    # A worker for the type has room, but the job was not picked yet (before the batch's pass)
    h.register(7, "sleeper", capacity=2)  # takes `queued` at once; one slot stays free
    fresh = h.core.requests.submit_job(8, m.SubmitJob("SLEEP", {"durationMillis": 1}))
    assert h.core.requests.get_job_status(8, fresh.job_id).job["waitingReason"] == "BEHIND_OTHER_JOBS"
    h.step(8)
    assert h.state(fresh.job_id) == "RUNNING"


def test_finished_jobs_have_no_waiting_reason(h):
    job_id = h.submit_ok(1)
    h.cancel(2, job_id)
    snap = h.status(job_id)
    assert snap["waitingReason"] is None and snap["retryAtMillis"] is None


# ==== retry, purge, retention ======================================================================


def test_retry_makes_a_new_job_that_names_the_old_one(h):
    h.register(0, "w1")
    old = h.submit_ok(1, payload={"durationMillis": 3}, priority="HIGH", max_attempts=1)
    h.report(2, old, success=False, error="x")
    assert h.state(old) == "FAILED"
    reply = h.core.requests.retry_job(3, old)
    assert isinstance(reply, m.JobSubmitted)
    h.step(3)
    new = h.status(reply.job_id)
    assert (new["retryOf"], new["priority"], new["maxAttempts"], new["taskType"]) == (old, "HIGH", 1, "SLEEP")
    assert h.assign_of(reply.job_id).payload == {"durationMillis": 3}
    assert h.state(old) == "FAILED"  # a finished job never leaves its terminal state
    assert events(h, reply.job_id)[0]["detail"] == "retry of %s" % old


def test_retry_of_an_active_or_unknown_job_is_an_error(h):
    job_id = h.submit_ok(1)
    assert "only a finished job" in h.core.requests.retry_job(2, job_id).message
    assert isinstance(h.core.requests.retry_job(2, "nope"), m.Error)


def test_purge_deletes_old_finished_jobs_their_events_and_frees_their_keys(tmp_path):
    store = SQLiteStore(str(tmp_path / "jm.db"))
    h = Harness(store=store)
    old = h.submit_ok(1, key="k-old")
    h.cancel(2, old)
    recent = h.submit_ok(DAY, key="k-recent")
    h.cancel(DAY + 1, recent)
    active = h.submit_ok(DAY + 2)
    reply = h.core.requests.purge_jobs(DAY + 10, m.PurgeJobs(older_than_millis=DAY // 2))
    h.commit()
    assert (reply.purged, reply.more) == (1, False)
    assert isinstance(h.core.requests.get_job_status(0, old), m.Error)
    assert h.state(recent) == "CANCELLED" and h.state(active) == "QUEUED"
    # The purged job's key is free again; the retained one's is still bound
    again = h.submit(DAY + 11, key="k-old")
    assert isinstance(again, m.JobSubmitted) and again.job_id != old
    assert h.submit(DAY + 11, key="k-recent").job_id == recent
    store.close()


def test_purge_reports_more_when_its_limit_was_reached(h):
    for i in range(5):
        h.cancel(2, h.submit_ok(1))
    reply = h.core.requests.purge_jobs(100, m.PurgeJobs(older_than_millis=0, limit=3))
    h.commit()
    assert (reply.purged, reply.more) == (3, True)
    reply = h.core.requests.purge_jobs(100, m.PurgeJobs(older_than_millis=0, limit=3))
    h.commit()
    assert (reply.purged, reply.more) == (2, False)
    assert isinstance(h.core.requests.purge_jobs(100, m.PurgeJobs(older_than_millis=-1)), m.Error)


def test_retention_purges_in_small_batches_each_sweep_and_batch():
    h = Harness(retain_finished_millis=1000)
    h.register(0, "w1", capacity=4)
    done = []
    for i in range(10):
        job_id = h.submit_ok(i)
        h.report(i, job_id)
        done.append(job_id)
    h.sweep(500)
    assert h.store.count() == 10  # nothing old enough yet
    h.sweep(1_005)  # jobs finished at 0..4 are older than 1000 ms
    assert h.store.count() == 5
    h.sweep(5_000)
    assert h.store.count() == 0 and h.core.counters.purged == 10
    assert not h.core.table.finished


def test_a_time_to_live_purges_its_job_whatever_retention_says():
    # Given retention of one second, and jobs finished at 0: one kept a minute, one 0 ms, one without
    h = Harness(retain_finished_millis=1000)
    h.register(0, "w1", capacity=4)
    jobs = {}
    for name, ttl in (("minute", 60_000), ("none", 0), ("plain", None)):
        reply = h.request(0, m.SubmitJob("SLEEP", {"durationMillis": 1}, result_ttl_millis=ttl))
        h.step(0)
        jobs[name] = reply.job_id
        h.report(0, reply.job_id)
    # When a sweep comes at once, the 0 ms one is purged (retention would keep it a second)
    h.sweep(1)
    assert h.store.get(jobs["none"]) is None and h.store.count() == 2
    # Then at 1 s retention takes the plain one, but not the one that asked for a minute
    h.sweep(1_001)
    assert h.store.count() == 1 and h.store.get(jobs["minute"]) is not None
    h.sweep(59_999)
    assert h.store.get(jobs["minute"]) is not None
    # which its own time to live purges once the minute is over; each job counted once
    h.sweep(60_000)
    assert h.store.count() == 0 and h.core.counters.purged == 3


def test_retention_zero_keeps_everything():
    h = Harness(retain_finished_millis=0)
    h.cancel(1, h.submit_ok(0))
    h.sweep(10 * DAY)
    assert h.store.count() == 1


# ==== counters ======================================================================================


def test_metrics_count_what_happened(h):
    h.register(0, "w1", capacity=1)
    done = h.submit_ok(1)
    queued = h.submit_ok(1, priority="HIGH")
    h.report(2, done)  # queued now runs
    h.report(3, queued, success=False, error="x")
    h.submit_ok(4, delay=100)
    figures = h.core.metrics()
    assert figures.counters.submitted == 3
    assert figures.finished_by_state == {"COMPLETED": 1, "FAILED": 0, "CANCELLED": 0}
    assert figures.counters.retries == 1
    assert figures.jobs == {("RETRY_WAIT", "SLEEP", "HIGH", "json"): 1, ("SCHEDULED", "SLEEP", "NORMAL", "json"): 1}
    assert (figures.workers, figures.capacity, figures.busy_slots) == (1, 1, 0)
    stats = h.core.get_stats(5)  # GET_STATS: the same figures for `jobmesh top`
    assert stats.jobs == {"QUEUED": 0, "SCHEDULED": 1, "RUNNING": 0, "RETRY_WAIT": 1, "WAITING": 0}
    assert (stats.submitted, stats.finished["COMPLETED"], stats.retries, stats.workers) == (3, 1, 1, 1)
    assert m.decode(stats.to_wire(), m.TO_CLIENT) == stats
    h.disconnect(5, "w1")
    h.sweep(3 + BASE)
    assert h.core.metrics().counters.workers_lost == 1
    assert h.core.metrics().queued_by_priority == {"HIGH": 1, "NORMAL": 0, "LOW": 0}


def test_the_state_counts_always_match_the_jobs():
    import random
    rng = random.Random(3)
    h = Harness(max_active_jobs=10_000)
    h.register(0, "w1", capacity=3)
    now = 0
    for _ in range(300):
        now += rng.choice([1, 5, BASE])
        op = rng.random()
        if op < 0.4:
            h.submit_ok(now, delay=rng.choice([None, 0, 50]), priority=rng.choice(["LOW", "NORMAL", "HIGH"]))
        elif op < 0.6 and h.core.table.running(h.core.json.workers.get("w1")):
            job_id = rng.choice(sorted(h.core.table.running(h.core.json.workers.get("w1"))))
            h.report(now, job_id, success=rng.random() < 0.6, error="e")
        elif op < 0.7 and h.core.table.jobs:
            h.cancel(now, rng.choice(sorted(h.core.table.jobs)))
        else:
            h.sweep(now)
        expected: dict = {}
        for job in h.core.table.jobs.values():
            key = (job.state.value, job.task_type, job.priority.value, job.periodic is not None)
            expected[key] = expected.get(key, 0) + 1
        assert dict(h.core.table.counts) == expected
    assert HB  # the harness's heartbeat timeout is what keeps w1 alive through the sweeps
