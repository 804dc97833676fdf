"""Durations run on core time (monotonic), instants on the wall clock (CONTRACT/issue:
"Monotonic time"): a wall-clock step moves createdAtMillis, runAtMillis, retry times and
event times, and nothing else. The clock is injected: core time is the ``now`` each call
gets, the wall clock is what ``observe_wall`` reports."""

from __future__ import annotations

from jobmesh.coordinator.core import events as ev
from tests.unit.test_core import BASE, HB, Harness

HOUR = 3_600_000


def step_wall(h: Harness, now: int, by: int) -> None:
    h.core.observe_wall(now, now + h.core.table.drift + by)


def test_a_forward_step_declares_no_healthy_worker_dead():
    h = Harness()
    h.register(0, "w1")
    job_id = h.submit_ok(10)
    step_wall(h, 20, +HOUR)
    h.sweep(20 + HB // 2)  # core time moved half a heartbeat timeout; the wall an hour
    assert h.state(job_id) == "RUNNING" and h.core.json.workers.get("w1") is not None
    later = h.submit_ok(30)
    assert h.status(later)["createdAtMillis"] == 30 + HOUR  # instants follow the wall


def test_a_backward_step_postpones_no_retry_and_keeps_dead_workers_dead():
    h = Harness()
    h.register(0, "w1")
    job_id = h.submit_ok(1)
    h.report(2, job_id, success=False, error="x")
    retry_at = h.status(job_id)["retryAtMillis"]
    assert retry_at == 2 + BASE
    step_wall(h, 3, -HOUR)
    h.sweep(2 + BASE)  # the backoff elapsed in core time: due, whatever the wall says
    assert h.state(job_id) == "RUNNING"
    h.sweep(2 + BASE + HB + 1, beat=False)  # a silent worker is still found silent
    assert h.core.json.workers.get("w1") is None


def test_scheduled_jobs_follow_the_wall_clock():
    h = Harness()
    h.register(0, "w1")
    job_id = h.submit_ok(0, run_at=10 * 60_000)  # ten minutes from now, on the wall
    step_wall(h, 1, +HOUR)  # the wall jumps past the run-at time
    h.sweep(2)
    assert h.state(job_id) == "RUNNING"
    back = h.submit_ok(3, run_at=3 + HOUR + 60_000)  # a minute from the (new) wall time
    step_wall(h, 4, -HOUR)  # back an hour: now it is due in an hour and a minute
    h.sweep(5 + 60_000)
    assert h.state(back) == "SCHEDULED"
    h.sweep(5 + HOUR + 60_000)
    assert h.state(back) == "RUNNING"


def test_small_drifts_are_followed_without_re_timing():
    h = Harness()
    job_id = h.submit_ok(0, delay=1000)
    h.core.observe_wall(10, 10 + 300)  # a slew, not a step
    assert h.core.table.drift == 300
    h.sweep(1000)
    assert h.state(job_id) == "QUEUED"  # its core-time wake-up was kept


def test_event_times_are_wall_clock_instants():
    h = Harness()
    step_wall(h, 0, +HOUR)
    job_id = h.submit_ok(5)
    assert h.core.requests.get_job_events(5, job_id).events[0]["atMillis"] == 5 + HOUR


def test_the_sweep_reads_each_worker_s_last_arrival_and_the_wall_clock_as_it_is_applied():
    # The runtime's sweep marker carries these readers: a worker whose frames arrived
    # (still waiting in the mailbox) is alive; a silent one is not; the wall clock's
    # offset is taken before the sweep's steps.
    h = Harness()
    h.register(0, "w1")
    h.register(0, "w2")
    now = 2 * HB + 10
    read: list[str] = []

    def arrival(conn) -> int:
        read.append(conn.name)
        return now - 5 if conn is h.conns["w1"] else 0

    h.apply(now, ev.Sweep(arrival, lambda: now + HOUR))
    h.step(now)
    assert sorted(read) == ["w1", "w2"]
    assert h.core.json.workers.get("w1") is not None and h.core.json.workers.get("w2") is None
    assert h.status(h.submit_ok(now))["createdAtMillis"] == now + HOUR
