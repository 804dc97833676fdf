"""The core with declared task types and scheduled jobs (CONTRACT.md "Your own task types",
"Scheduled jobs"): routing by type, no head-of-line blocking, least-loaded choice among
capable workers, known types across restarts, due-time promotion, aging from the due time,
recovery of SCHEDULED jobs. Plain numbers for time; ``Harness`` checks store == memory
after every batch."""

from __future__ import annotations

import pytest

from jobmesh.coordinator.core.face import CoordinatorCore, CoreConfig
from jobmesh.protocol import messages as m
from jobmesh.protocol.jobs import JobState
from jobmesh.protocol.payloads import TASK_TYPES
from jobmesh.store.job import MAX_RUN_AT_MILLIS
from jobmesh.store.sqlite import SQLiteStore
from tests.unit.test_core import STEP, Harness

GREET = {"name": "Ada"}


@pytest.fixture
def h() -> Harness:
    return Harness()


def assigned_types(h: Harness, worker_id: str) -> list[str]:
    return [a.task_type for a in h.assigns(h.conns[worker_id])]


# ==== declared task types =====================================================================


def test_an_undeclared_type_is_refused_and_creates_no_job(h):
    reply = h.submit(0, task_type="GREET", payload=GREET)
    assert isinstance(reply, m.Error) and "unknown task type 'GREET'" in reply.message
    assert h.core.active_count == 0 and h.store.count() == 0


def test_a_declared_type_is_accepted_with_any_json_object_payload(h):
    h.register(0, "w1", task_types=["GREET", "SLEEP"])
    job_id = h.submit_ok(1, task_type="GREET", payload={"nested": {"list": [1, "two", None]}})
    assert h.state(job_id) == "RUNNING"
    assert h.assign_of(job_id).payload == {"nested": {"list": [1, "two", None]}}
    bad = h.submit(2, task_type="GREET", payload={"x": float("nan")})
    assert isinstance(bad, m.Error) and "NaN" in bad.message


def test_built_in_payloads_are_still_validated_when_a_worker_declares_a_built_in(h):
    h.register(0, "w1", task_types=["SLEEP"])
    reply = h.submit(1, task_type="SLEEP", payload={"durationMillis": -1})
    assert isinstance(reply, m.Error)


def test_jobs_go_only_to_workers_that_declared_their_type(h):
    h.register(0, "plain", capacity=4)  # no taskTypes: the five built-ins
    h.register(0, "greeter", capacity=4, task_types=["GREET"])
    greets = [h.submit_ok(1, task_type="GREET", payload=GREET) for _ in range(3)]
    sleeps = [h.submit_ok(1) for _ in range(3)]
    assert assigned_types(h, "greeter") == ["GREET"] * 3
    assert assigned_types(h, "plain") == ["SLEEP"] * 3
    assert all(h.state(j) == "RUNNING" for j in greets + sleeps)


def test_a_job_no_free_worker_can_run_does_not_hold_back_others(h):
    # Given a busy GREET worker and a free built-in worker
    h.register(0, "greeter", capacity=1, task_types=["GREET"])
    h.register(0, "plain", capacity=2)
    first = h.submit_ok(1, task_type="GREET", payload=GREET)
    assert h.state(first) == "RUNNING"
    # When a HIGH GREET job waits (no free worker runs GREET) and NORMAL SLEEP jobs arrive
    waiting = h.submit_ok(2, task_type="GREET", payload=GREET, priority="HIGH")
    later = [h.submit_ok(3), h.submit_ok(3)]
    # Then the SLEEP jobs run at once; the GREET job waits QUEUED for its worker
    assert [h.state(j) for j in later] == ["RUNNING", "RUNNING"]
    assert h.state(waiting) == "QUEUED"
    # And it runs as soon as the GREET worker is free again
    h.report(4, first)
    assert h.state(waiting) == "RUNNING" and h.holder(waiting) is h.conns["greeter"]


def test_priority_order_holds_within_and_across_types_a_worker_runs(h):
    h.register(0, "both", capacity=1, task_types=["A", "B"])
    blocker = h.submit_ok(1, task_type="A", payload={})
    low_a = h.submit_ok(2, task_type="A", payload={}, priority="LOW")
    high_b = h.submit_ok(3, task_type="B", payload={}, priority="HIGH")
    normal_b = h.submit_ok(4, task_type="B", payload={})
    for job in (blocker, high_b, normal_b, low_a):  # one slot: each runs only after the one before
        assert h.state(job) == "RUNNING", job
        h.report(5, job)
    assert h.core.active_count == 0


def test_least_loaded_choice_is_among_the_workers_that_run_the_type(h):
    h.register(0, "g1", capacity=4, task_types=["GREET"])
    h.register(0, "g2", capacity=4, task_types=["GREET"])
    h.register(0, "idle-other", capacity=4, task_types=["OTHER"])
    for _ in range(4):
        h.submit_ok(1, task_type="GREET", payload=GREET)
    assert h.running("g1") == 2 and h.running("g2") == 2 and h.running("idle-other") == 0


def test_new_types_are_durable_and_known_after_a_restart(tmp_path):
    store = SQLiteStore(str(tmp_path / "jm.db"))
    h = Harness(store=store)
    h.register(0, "w1", task_types=["GREET", "SLEEP"])
    assert store.load_task_types() == ["GREET"]  # committed with the registration's batch (built-ins are implied)
    store.close()
    # A new core on the same database, with no worker attached, accepts GREET
    store2 = SQLiteStore(str(tmp_path / "jm.db"))
    core = CoordinatorCore(store2, CoreConfig())
    core.recover(10)
    assert "GREET" in core.table.known_types and set(TASK_TYPES) <= core.table.known_types
    reply = core.requests.submit_job(11, m.SubmitJob("GREET", GREET))
    assert isinstance(reply, m.JobSubmitted)
    store2.close()


def test_worker_list_items_carry_task_types(h):
    h.register(0, "w1", task_types=["GREET", "A.b:c-d_e"])
    h.register(0, "w2")
    items = {w["workerId"]: w for w in h.core.requests.list_workers(0).workers}
    assert items["w1"]["taskTypes"] == ["A.b:c-d_e", "GREET"]
    assert items["w2"]["taskTypes"] == sorted(TASK_TYPES)


def test_list_jobs_filters_by_task_type(h):
    h.register(0, "w1", capacity=1, task_types=["GREET", "SLEEP"])
    greets = [h.submit_ok(1, task_type="GREET", payload=GREET) for _ in range(3)]
    h.submit_ok(1)
    listed = h.list(task_type="GREET").jobs
    assert [j["jobId"] for j in listed] == list(reversed(greets))
    assert h.list(task_type="NOPE").jobs == []
    queued_greets = h.list(task_type="GREET", state="QUEUED").jobs
    assert [j["jobId"] for j in queued_greets] == list(reversed(greets[1:]))


# ==== scheduled jobs ============================================================================


def test_a_delayed_job_is_scheduled_then_queued_when_due(h):
    h.register(0, "w1")
    job_id = h.submit_ok(1000, delay=5000)
    snap = h.status(job_id)
    assert snap["state"] == "SCHEDULED" and snap["runAtMillis"] == 6000
    h.sweep(5999)
    assert h.state(job_id) == "SCHEDULED" and h.assigns() == []
    h.sweep(6000)
    assert h.state(job_id) == "RUNNING"
    assert h.status(job_id)["runAtMillis"] == 6000


def test_run_at_in_the_future_past_or_now(h):
    future = h.submit_ok(1000, run_at=2000)
    now = h.submit_ok(1000, run_at=1000)
    past = h.submit_ok(1000, run_at=10)
    zero_delay = h.submit_ok(1000, delay=0)
    assert [h.state(j) for j in (future, now, past, zero_delay)] == ["SCHEDULED", "QUEUED", "QUEUED", "QUEUED"]
    assert h.status(past)["runAtMillis"] == 10


@pytest.mark.parametrize("run_at, delay, words", [
    (5, 5, "not both"),
    (-1, None, "runAtMillis"),
    (None, -1, "delayMillis"),
    (MAX_RUN_AT_MILLIS + 1, None, "10000"),
    (None, MAX_RUN_AT_MILLIS, "10000"),
])
def test_bad_schedules_are_errors_and_create_no_job(h, run_at, delay, words):
    reply = h.submit(1000, run_at=run_at, delay=delay)
    assert isinstance(reply, m.Error) and words in reply.message
    assert h.core.active_count == 0 and h.store.count() == 0


def test_scheduled_jobs_count_against_admission_and_can_be_cancelled():
    h = Harness(max_active_jobs=2)
    a = h.submit_ok(0, delay=10_000)
    h.submit_ok(0, delay=10_000)
    assert isinstance(h.submit(0), m.SubmitRejected)
    reply = h.cancel(1, a)
    assert reply.cancelled and reply.job["state"] == "CANCELLED"
    h.register(2, "w1")
    h.sweep(10_000)
    assert h.state(a) == "CANCELLED"  # the stale due-heap entry is skipped
    assert len(h.assigns()) == 1


def test_aging_counts_from_the_due_time_not_the_submission(h):
    # A LOW job submitted long ago but due only now is not aged; an older NORMAL job wins.
    scheduled_low = h.submit_ok(0, priority="LOW", run_at=10 * STEP)
    normal = h.submit_ok(9 * STEP)
    h.sweep(10 * STEP)  # scheduled_low becomes QUEUED now
    order = h.core.json.queued.ordered(10 * STEP, STEP)
    assert order == [normal, scheduled_low]
    # Once it has waited two steps from its due time it reaches HIGH like any LOW job
    later_normal = h.submit_ok(12 * STEP)
    assert h.core.json.queued.ordered(12 * STEP, STEP)[:1] == [normal]
    assert h.core.json.queued.ordered(12 * STEP, STEP).index(scheduled_low) < \
        h.core.json.queued.ordered(12 * STEP, STEP).index(later_normal)


def test_a_running_job_can_be_put_back_to_scheduled(h):
    # RUNNING -> SCHEDULED (the Periodic port's SCHED_LATER): the slot frees, the lease ends
    h.register(0, "w1", capacity=1)
    job_id = h.submit_ok(1)
    job = h.core.table.jobs[job_id]
    h.core.table.transition(job, JobState.SCHEDULED, 2, due_at=500)
    h.step(2)
    assert h.state(job_id) == "SCHEDULED" and h.running("w1") == 0 and job.worker_id is None
    h.sweep(500)
    assert h.state(job_id) == "RUNNING"


def test_recovery_keeps_future_schedules_and_queues_those_that_fell_due(tmp_path):
    store = SQLiteStore(str(tmp_path / "jm.db"))
    h = Harness(store=store)
    soon = h.submit_ok(0, run_at=1000)
    later = h.submit_ok(0, run_at=50_000)
    store.close()
    store2 = SQLiteStore(str(tmp_path / "jm.db"))
    h2 = Harness(store=store2)
    stats = h2.core.recover(2000)
    h2.commit()
    assert stats.due == 1 and stats.scheduled == 1 and stats.queued == 1
    assert h2.state(soon) == "QUEUED" and h2.state(later) == "SCHEDULED"
    assert h2.status(later)["runAtMillis"] == 50_000
    h2.register(2001, "w1")
    assert h2.state(soon) == "RUNNING" and h2.state(later) == "SCHEDULED"
    h2.sweep(50_000)
    assert h2.state(later) == "RUNNING"
    store2.close()


def test_list_jobs_accepts_the_scheduled_state(h):
    job_id = h.submit_ok(0, delay=100)
    h.submit_ok(0)
    assert [j["jobId"] for j in h.list(state="SCHEDULED").jobs] == [job_id]
