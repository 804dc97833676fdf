"""CoordinatorCore driven by hand: plain numbers for time, an in-memory SQLite store.

Specs: PROTOCOL.md (messages, admission, idempotency, priority), ARCHITECTURE.md (core,
sweep, leases, recovery), the lease-deadlines PR (deadlines, TASK_CANCEL, CANCELLED),
CONTRACT.md (list paging, worker list fields, ERROR vs close).

``Harness`` is the shared ``CoreDriver`` (core_driver.py) with the JSON ports' requests
and worker events: each goes through ``core.apply``, and ``step`` ends the batch as the
runtime does (``core.end_batch``, commit, invariant checks, release).
"""

from __future__ import annotations

import random
import sqlite3
from typing import Any

import pytest

from jobmesh.coordinator.core import table as table_mod
from jobmesh.coordinator.core import events as ev
from jobmesh.coordinator.core.figures import Recovery
from jobmesh.protocol import messages as m
from jobmesh.protocol.framing import MAX_FRAME, encode_frame
from jobmesh.protocol.jobs import JobState
from jobmesh.store.columns import insert_row
from jobmesh.store.sqlite import BASE_COLUMNS, SQLiteStore
from tests.unit.core_driver import Conn, CoreDriver

SLEEP = {"durationMillis": 10}
HB = 1000          # heartbeat timeout
TIMEOUT = 10_000   # task (attempt) timeout
BASE = 100         # retry base
CAP = 1000         # retry cap
STEP = 60_000      # aging step


class Harness(CoreDriver):
    def __init__(self, store: SQLiteStore | None = None, prefix: str = "id", **cfg: Any) -> None:
        config = dict(heartbeat_timeout_millis=HB, task_timeout_millis=TIMEOUT, max_active_jobs=1000,
                      aging_step_millis=STEP, retry_base_millis=BASE, retry_cap_millis=CAP,
                      default_max_attempts=3)
        config.update(cfg)
        super().__init__(store, prefix, **config)
        self.conns: dict[str, Conn] = {}

    def step(self, now: int) -> list[tuple[Any, m.Message | None]]:
        """End the batch: schedule, commit, check, release."""
        return self.end_batch(now)

    def commit(self) -> None:
        self.store.write(self.core.take_dirty())
        self.check()

    # -- client side ------------------------------------------------------------------------

    def submit(self, now: int, task_type: str = "SLEEP", payload: Any = None, max_attempts: int = 0,
               key: str | None = None, priority: str | None = None, run_at: int | None = None,
               delay: int | None = None) -> m.Message:
        req = m.SubmitJob(task_type, dict(SLEEP) if payload is None else payload, max_attempts, key, priority,
                          run_at, delay)
        reply = self.request(now, req)
        self.step(now)
        return reply

    def submit_ok(self, now: int, **kw: Any) -> str:
        reply = self.submit(now, **kw)
        assert isinstance(reply, m.JobSubmitted), reply
        return reply.job_id

    def status(self, job_id: str, now: int = 0) -> dict:
        reply = self.request(now, m.GetJobStatus(job_id))
        assert isinstance(reply, m.JobStatus), reply
        return reply.job

    def state(self, job_id: str) -> str:
        return self.status(job_id)["state"]

    def cancel(self, now: int, job_id: str) -> m.Message:
        reply = self.request(now, m.CancelJob(job_id))
        self.step(now)
        return reply

    def list(self, now: int = 0, **kw: Any) -> m.Message:
        return self.request(now, m.ListJobs(**kw))

    # -- worker side ------------------------------------------------------------------------

    def register(self, now: int, worker_id: str, capacity: int = 4, task_types: list[str] | None = None,
                 running: list[dict] | None = None) -> Conn:
        conn = Conn(worker_id)
        out = self.register_on(now, conn, worker_id, capacity, task_types, running)
        assert out[0] == (conn, m.WorkerRegistered(worker_id)), out
        self.conns[worker_id] = conn
        return conn

    def register_on(self, now: int, conn: Conn, worker_id: str, capacity: int,
                    task_types: list[str] | None = None, running: list[dict] | None = None) -> list:
        self.apply(now, ev.Registered(conn, m.WorkerRegister(worker_id, capacity, task_types, running)))
        return self.step(now)

    def heartbeat(self, now: int, worker_id: str) -> None:
        self.core.json.on_heartbeat(now, self.conns[worker_id], worker_id)
        self.step(now)

    def disconnect(self, now: int, worker_id: str) -> list:
        self.apply(now, ev.Disconnected(self.conns[worker_id]))
        return self.step(now)

    def sweep(self, now: int, beat: bool = True) -> list:
        """One sweep; by default every live worker heartbeats just before it, as a healthy
        worker does (pass ``beat=False`` to let silent workers time out)."""
        if beat:
            for session in self.core.json.workers:
                self.core.json.on_heartbeat(now, session.conn, session.worker_id)
        self.apply(now, ev.SWEEP)
        return self.step(now)

    def assigns(self, conn: Conn | None = None) -> list[m.TaskAssign]:
        return [msg for c, msg in self.sent if isinstance(msg, m.TaskAssign) and (conn is None or c is conn)]

    def cancels(self, conn: Conn) -> list[m.TaskCancel]:
        return [msg for c, msg in self.sent if c is conn and isinstance(msg, m.TaskCancel)]

    def assign_of(self, job_id: str) -> m.TaskAssign:
        """The latest TASK_ASSIGN for a job."""
        found = [a for a in self.assigns() if a.job_id == job_id]
        assert found, "job %s was never assigned" % job_id
        return found[-1]

    def holder(self, job_id: str) -> Conn:
        for c, msg in reversed(self.sent):
            if isinstance(msg, m.TaskAssign) and msg.job_id == job_id:
                return c
        raise AssertionError("job %s was never assigned" % job_id)

    def report(self, now: int, job_id: str, success: bool = True, result: dict | None = None,
               error: str | None = None, attempt: m.TaskAssign | None = None, conn: Conn | None = None,
               worker_id: str | None = None) -> list:
        attempt = attempt or self.assign_of(job_id)
        conn = conn or self.holder(job_id)
        worker_id = worker_id or conn.name
        if success and result is None:
            result = {"sleptMillis": 10}
        self.apply(now, ev.Result(conn, m.TaskResult(worker_id, job_id, attempt.attempt_id, success, result, error)))
        return self.step(now)

    def running(self, worker_id: str) -> int:
        return len(self.core.table.running(self.core.json.workers.get(worker_id)))


@pytest.fixture
def h() -> Harness:
    return Harness()


def row(h: Harness, job_id: str) -> tuple:
    return insert_row(h.store.get(job_id))


# ==== submission ==========================================================================


def test_submit_creates_a_queued_job(h):
    job_id = h.submit_ok(1234, payload={"durationMillis": 7}, max_attempts=5, priority="LOW")
    snap = h.status(job_id)
    assert snap == {
        "jobId": job_id, "taskType": "SLEEP", "state": "QUEUED", "attempts": 0, "maxAttempts": 5,
        "workerId": None, "result": None, "error": None, "createdAtMillis": 1234, "updatedAtMillis": 1234,
        "priority": "LOW", "runAtMillis": None, "retryAtMillis": None, "retryOf": None, "waitingReason": "NO_WORKER",
        "protocol": "json", "name": None, "submittedBy": None, "concurrencyKey": None, "uniqueKey": None,
        "progress": None, "workflowId": None, "ref": None,
    }
    stored = h.store.get(job_id)
    assert stored.state is JobState.QUEUED and stored.payload == {"durationMillis": 7}
    assert stored.execution_timeout == TIMEOUT
    assert h.core.active_count == 1 and job_id in h.core.json.queued


def test_submission_sequence_is_strictly_increasing_and_persisted(h):
    ids = [h.submit_ok(500) for _ in range(5)]  # same millisecond
    seqs = [h.store.get(i).seq for i in ids]
    assert seqs == sorted(seqs) and len(set(seqs)) == 5
    assert seqs == [1, 2, 3, 4, 5]
    assert h.core.table.next_seq == 6


@pytest.mark.parametrize("given, effective", [(0, 3), (-1, 3), (-1000, 3), (1, 1), (7, 7)])
def test_max_attempts_at_or_below_zero_means_the_default(h, given, effective):
    job_id = h.submit_ok(0, max_attempts=given)
    assert h.status(job_id)["maxAttempts"] == effective


@pytest.mark.parametrize("kw", [
    dict(task_type="SHELL", payload={"cmd": "rm -rf /"}),
    dict(task_type="sleep", payload=SLEEP),
    dict(payload={}),
    dict(payload={"durationMillis": -1}),
    dict(payload={"durationMillis": 600_001}),
    dict(payload={"durationMillis": "10"}),
    dict(payload={"durationMillis": True}),
    dict(payload={"durationMillis": 1.5}),
    dict(task_type="WORD_COUNT", payload={"text": "x" * 200_001}),
    dict(task_type="SHA256", payload={"text": 5}),
    dict(task_type="PRIME_COUNT", payload={"limit": 1}),
    dict(task_type="PRIME_COUNT", payload={"limit": 50_000_001}),
    dict(task_type="FAIL", payload={"failUntilAttempt": 1001}),
    dict(priority="URGENT"),
    dict(priority="high"),
    dict(priority=""),
    dict(max_attempts=1_000_001),
    dict(key="k" * 1025),
    dict(key="k\x00"),
], ids=lambda kw: ",".join("%s=%.20r" % item for item in kw.items()))
def test_invalid_submission_is_an_error_and_creates_nothing(h, kw):
    h.submit_ok(0)
    before_count, before_seq = h.store.count(), h.core.table.next_seq
    reply = h.submit(1, **kw)
    assert isinstance(reply, m.Error) and reply.message
    assert h.store.count() == before_count
    assert h.core.table.next_seq == before_seq
    assert h.core.active_count == 1
    assert not any(h.core.take_dirty())
    assert h.core.outbox.items == []


def test_an_invalid_submission_does_not_bind_its_idempotency_key(h):
    assert isinstance(h.submit(0, payload={"durationMillis": -5}, key="k"), m.Error)
    job_id = h.submit_ok(1, key="k")
    assert h.status(job_id)["state"] == "QUEUED"
    assert h.store.find_by_key("k").job_id == job_id


# ==== admission control ====================================================================


def test_submissions_beyond_the_active_limit_are_rejected_as_retryable():
    h = Harness(max_active_jobs=2)
    h.submit_ok(0)
    h.submit_ok(0)
    reply = h.submit(1)
    assert isinstance(reply, m.SubmitRejected)
    assert (reply.active_count, reply.limit, reply.retryable) == (2, 2, True)
    assert reply.reason
    assert h.store.count() == 2
    rejected_with_key = h.submit(1, key="later")
    assert isinstance(rejected_with_key, m.SubmitRejected)
    assert h.store.find_by_key("later") is None


@pytest.mark.parametrize("finish", ["complete", "fail", "cancel", "cancel-running"])
def test_a_finished_job_frees_its_admission_slot(finish):
    h = Harness(max_active_jobs=1)
    job_id = h.submit_ok(0, max_attempts=1)
    assert isinstance(h.submit(1), m.SubmitRejected)
    if finish.startswith("cancel") and finish != "cancel-running":
        assert h.cancel(2, job_id).cancelled
    else:
        h.register(2, "w1")
        if finish == "complete":
            h.report(3, job_id)
        elif finish == "fail":
            h.report(3, job_id, success=False, error="bad")
        else:
            assert h.cancel(3, job_id).cancelled
    assert h.state(job_id) in ("COMPLETED", "FAILED", "CANCELLED")
    assert h.core.active_count == 0
    assert isinstance(h.submit(4), m.JobSubmitted)
    assert isinstance(h.submit(4), m.SubmitRejected)


def test_retries_do_not_pass_admission_control():
    h = Harness(max_active_jobs=1)
    job_id = h.submit_ok(0)
    h.register(0, "w1")
    h.report(10, job_id, success=False, error="first")
    assert h.state(job_id) == "RETRY_WAIT"
    assert isinstance(h.submit(11), m.SubmitRejected)  # still counts as active
    h.sweep(10 + BASE)
    assert h.state(job_id) == "RUNNING"
    assert h.assign_of(job_id).attempt_number == 2
    assert h.core.active_count == 1
    h.report(200, job_id)
    assert h.state(job_id) == "COMPLETED"


# ==== idempotency ========================================================================


def test_same_key_same_request_returns_the_same_job(h):
    job_id = h.submit_ok(0, key="k", payload={"durationMillis": 5}, max_attempts=2, priority="HIGH")
    seq_before = h.core.table.next_seq
    again = h.submit(5, key="k", payload={"durationMillis": 5}, max_attempts=2, priority="HIGH")
    assert again == m.JobSubmitted(job_id)
    assert h.store.count() == 1 and h.core.table.next_seq == seq_before
    assert h.status(job_id)["updatedAtMillis"] == 0


def test_omitted_priority_equals_normal_and_zero_attempts_equals_the_default(h):
    job_id = h.submit_ok(0, key="a")
    assert h.submit(1, key="a", priority="NORMAL") == m.JobSubmitted(job_id)
    assert h.submit(1, key="a", max_attempts=3) == m.JobSubmitted(job_id)
    assert h.submit(1, key="a", max_attempts=-2) == m.JobSubmitted(job_id)
    other = h.submit_ok(0, key="b", priority="NORMAL")
    assert h.submit(1, key="b", priority=None) == m.JobSubmitted(other)
    assert h.store.count() == 2


@pytest.mark.parametrize("change", [
    dict(task_type="WORD_COUNT", payload={"text": "a b"}),
    dict(payload={"durationMillis": 11}),
    dict(payload={"durationMillis": 10, "extra": 1}),
    dict(max_attempts=4),
    dict(max_attempts=0),
    dict(priority="HIGH"),
    dict(priority=None),
])
def test_same_key_different_request_is_an_error_and_leaves_the_original_untouched(h, change):
    original = dict(task_type="SLEEP", payload={"durationMillis": 10}, max_attempts=2, priority="LOW")
    job_id = h.submit_ok(0, key="k", **original)
    row_before = row(h, job_id)
    reply = h.submit(7, key="k", **{**original, **change})
    assert isinstance(reply, m.Error)
    assert job_id in reply.message or "k" in reply.message
    assert h.store.count() == 1
    assert row(h, job_id) == row_before
    assert h.submit(8, key="k", **original) == m.JobSubmitted(job_id)


@pytest.mark.parametrize("end", ["COMPLETED", "FAILED", "CANCELLED"])
def test_key_stays_bound_after_the_job_ended_and_never_reruns(h, end):
    job_id = h.submit_ok(0, key="k", max_attempts=1)
    if end == "CANCELLED":
        h.cancel(1, job_id)
    else:
        h.register(1, "w1")
        h.report(2, job_id, success=end == "COMPLETED", error=None if end == "COMPLETED" else "x")
    assert h.state(job_id) == end
    assigns_before = len(h.assigns())
    assert h.submit(10, key="k", max_attempts=1) == m.JobSubmitted(job_id)
    assert h.state(job_id) == end
    assert h.store.count() == 1
    h.register(11, "w2")
    h.sweep(20)
    assert len(h.assigns()) == assigns_before
    assert isinstance(h.submit(12, key="k", max_attempts=2), m.Error)


def test_known_key_is_answered_even_at_the_active_limit():
    h = Harness(max_active_jobs=1)
    job_id = h.submit_ok(0, key="k")
    assert h.submit(1, key="k") == m.JobSubmitted(job_id)
    assert isinstance(h.submit(1, key="other"), m.SubmitRejected)
    assert isinstance(h.submit(1, key="k", max_attempts=9), m.Error)


def test_key_found_after_eviction_from_the_finished_cache(monkeypatch):
    monkeypatch.setattr(table_mod, "FINISHED_CACHE", 1)
    h = Harness()
    h.register(0, "w1", capacity=1)
    first = h.submit_ok(0, key="first")
    h.report(1, first)
    second = h.submit_ok(2, key="second")
    h.report(3, second)
    assert first not in h.core.table.finished and "first" not in h.core.table.keys  # evicted
    assert h.submit(4, key="first") == m.JobSubmitted(first)
    assert h.state(first) == "COMPLETED"
    assert isinstance(h.submit(5, key="first", payload={"durationMillis": 1}), m.Error)
    assert h.store.count() == 2
    assert len(h.assigns()) == 2


def test_key_found_by_a_new_core_over_the_same_store(h):
    h.register(0, "w1")
    done = h.submit_ok(0, key="done")
    h.report(1, done, result={"sleptMillis": 10})
    h2 = Harness(store=h.store, prefix="b")
    h2.core.recover(100)
    h2.commit()
    row_before = row(h2, done)
    assert h2.submit(101, key="done") == m.JobSubmitted(done)
    assert isinstance(h2.submit(102, key="done", priority="HIGH"), m.Error)
    assert row(h2, done) == row_before
    assert h2.store.count() == 1
    assert h2.status(done)["result"] == {"sleptMillis": 10}
    # Without recovery too (nothing loaded; the key is read back from the table).
    h3 = Harness(store=h.store, prefix="c")
    assert h3.submit(103, key="done") == m.JobSubmitted(done)
    assert h3.store.count() == 1


# ==== registration =========================================================================


def test_registration_is_acknowledged_and_listed(h):
    h.register(50, "w1", capacity=3)
    workers = h.core.requests.list_workers(60).workers
    assert len(workers) == 1
    w = workers[0]
    assert (w["workerId"], w["capacity"], w["activeJobs"], w["lastHeartbeatMillis"]) == ("w1", 3, 0, 50)


def test_duplicate_live_worker_id_is_refused_with_error_then_close(h):
    first = h.register(0, "w1", capacity=2)
    job_id = h.submit_ok(1)
    intruder = Conn("w1-again")
    out = h.register_on(2, intruder, "w1", 4)
    assert len(out) == 2
    assert out[0][0] is intruder and isinstance(out[0][1], m.Error) and "w1" in out[0][1].message
    assert out[1] == (intruder, None)
    # The live session is untouched.
    assert h.core.json.workers.get("w1").conn is first
    assert h.holder(job_id) is first and h.state(job_id) == "RUNNING"
    assert [w["capacity"] for w in h.core.requests.list_workers(3).workers] == [2]


@pytest.mark.parametrize("capacity", [0, -1, 1025, 10**6])
def test_capacity_out_of_range_is_refused(h, capacity):
    conn = Conn("bad")
    out = h.register_on(0, conn, "bad", capacity)
    assert [c for c, _ in out] == [conn, conn]
    assert isinstance(out[0][1], m.Error) and out[1][1] is None
    assert h.core.requests.list_workers(0).workers == []


@pytest.mark.parametrize("capacity", [1, 1024])
def test_capacity_at_the_bounds_is_accepted(h, capacity):
    h.register(0, "w", capacity=capacity)
    assert h.core.requests.list_workers(0).workers[0]["capacity"] == capacity


def test_worker_id_can_register_again_after_disconnect(h):
    h.register(0, "w1")
    h.disconnect(1, "w1")
    assert h.core.requests.list_workers(1).workers == []
    h.register(2, "w1", capacity=8)
    assert h.core.requests.list_workers(2).workers[0]["capacity"] == 8


def test_worker_id_can_register_again_after_heartbeat_timeout(h):
    old = h.register(0, "w1")
    out = h.sweep(HB + 1, beat=False)
    assert (old, None) in out
    h.register(HB + 2, "w1")
    # A late disconnect of the old connection does not touch the new session.
    h.core.json.on_disconnected(HB + 3, old)
    h.step(HB + 3)
    assert [w["workerId"] for w in h.core.requests.list_workers(0).workers] == ["w1"]


# ==== scheduling ============================================================================


def test_task_assign_carries_the_lease(h):
    job_id = h.submit_ok(0, task_type="WORD_COUNT", payload={"text": "a b c"})
    conn = h.register(100, "w1")
    (assign,) = h.assigns(conn)
    job = h.core.table.jobs[job_id]
    assert assign == m.TaskAssign(job_id, job.attempt_id, 1, "WORD_COUNT", {"text": "a b c"})
    snap = h.status(job_id)
    assert (snap["state"], snap["attempts"], snap["workerId"], snap["updatedAtMillis"]) == ("RUNNING", 1, "w1", 100)
    stored = h.store.get(job_id)
    assert stored.attempt_id == assign.attempt_id and stored.deadline == 100 + TIMEOUT
    assert h.core.requests.list_workers(100).workers[0]["activeJobs"] == 1


def test_each_job_goes_to_the_least_loaded_worker(h):
    a = h.register(0, "a", capacity=4)
    b = h.register(0, "b", capacity=4)
    j1 = h.submit_ok(1)
    assert h.holder(j1) is a  # tie: the first registered wins
    j2 = h.submit_ok(2)
    assert h.holder(j2) is b
    j3 = h.submit_ok(3)
    assert h.holder(j3) is a
    h.report(4, j1)
    h.report(4, j3)  # a has 0, b has 1
    j4 = h.submit_ok(5)
    assert h.holder(j4) is a
    c = h.register(6, "c", capacity=1)
    j5 = h.submit_ok(7)
    assert h.holder(j5) is c  # 0 active beats 1 active
    j6 = h.submit_ok(8)
    assert h.holder(j6) is a  # c is full; a and b tie at 1, a registered first


def test_never_above_capacity_and_freed_slots_are_reused(h):
    w = h.register(0, "w1", capacity=2)
    ids = [h.submit_ok(1) for _ in range(5)]
    assert [h.state(i) for i in ids] == ["RUNNING", "RUNNING", "QUEUED", "QUEUED", "QUEUED"]
    assert h.running("w1") == 2
    h.sweep(2)
    assert len(h.assigns(w)) == 2
    h.report(3, ids[0])
    assert h.state(ids[2]) == "RUNNING" and h.running("w1") == 2
    assert len(h.assigns(w)) == 3


def test_every_job_is_assigned_exactly_once_across_workers():
    h = Harness()
    rng = random.Random(3)
    for name, cap in (("a", 4), ("b", 2), ("c", 5)):
        h.register(0, name, capacity=cap)
    ids = [h.submit_ok(1) for _ in range(60)]
    now = 2
    while any(h.state(i) != "COMPLETED" for i in ids):
        running = [i for i in ids if h.state(i) == "RUNNING"]
        assert 0 < len(running) <= 11
        for job_id in rng.sample(running, rng.randint(1, len(running))):
            h.report(now, job_id)
        h.sweep(now)
        now += 1
    counts: dict[str, int] = {}
    for a in h.assigns():
        counts[a.job_id] = counts.get(a.job_id, 0) + 1
    assert counts == {i: 1 for i in ids}
    assert len({a.attempt_id for a in h.assigns()}) == 60


def test_queued_jobs_are_assigned_in_priority_then_fifo_order(h):
    low = h.submit_ok(0, priority="LOW")
    n1 = h.submit_ok(0)
    high = h.submit_ok(0, priority="HIGH")
    n2 = h.submit_ok(0, priority="NORMAL")
    h.register(10, "w1", capacity=1)
    order = []
    for t in range(11, 15):
        (job_id,) = [j for j in (low, n1, high, n2) if h.state(j) == "RUNNING"]
        order.append(job_id)
        h.report(t, job_id)
    assert order == [high, n1, n2, low]


def test_an_aged_low_job_ties_with_a_fresh_normal_and_wins_by_seq(h):
    low = h.submit_ok(0, priority="LOW")
    normal = h.submit_ok(STEP, priority="NORMAL")
    h.register(STEP, "w1", capacity=1)
    assert h.state(low) == "RUNNING" and h.state(normal) == "QUEUED"


def test_a_not_yet_aged_low_job_waits_behind_normal(h):
    low = h.submit_ok(0, priority="LOW")
    normal = h.submit_ok(STEP - 1, priority="NORMAL")
    h.register(STEP - 1, "w1", capacity=1)
    assert h.state(normal) == "RUNNING" and h.state(low) == "QUEUED"


# ==== results ===============================================================================


def test_success_completes_the_job_and_frees_the_slot(h):
    job_id = h.submit_ok(0)
    h.register(1, "w1")
    h.report(5, job_id, result={"sleptMillis": 10, "ü": "✓"})
    snap = h.status(job_id)
    assert (snap["state"], snap["result"], snap["workerId"], snap["attempts"], snap["updatedAtMillis"]) == (
        "COMPLETED", {"sleptMillis": 10, "ü": "✓"}, None, 1, 5)
    assert h.running("w1") == 0
    assert h.core.active_count == 0 and job_id not in h.core.table.jobs
    assert h.store.get(job_id).result == {"sleptMillis": 10, "ü": "✓"}


def stale_cases():
    return ["wrong-attempt", "other-worker", "other-conn-claims-holder", "holder-claims-other-id",
            "unknown-job", "after-retry", "after-cancel", "while-retry-wait", "after-completion",
            "after-disconnect"]


@pytest.mark.parametrize("case", stale_cases())
def test_results_that_do_not_match_the_lease_are_dropped(h, case):
    w1 = h.register(0, "w1", capacity=2)
    w2 = h.register(0, "w2", capacity=2)
    job_id = h.submit_ok(1)
    assert h.holder(job_id) is w1
    first = h.assign_of(job_id)
    target, attempt, conn, worker_id = job_id, first, w1, "w1"
    if case == "wrong-attempt":
        attempt = m.TaskAssign(job_id, "not-the-lease", 1, "SLEEP", SLEEP)
    elif case == "other-worker":
        conn, worker_id = w2, "w2"
    elif case == "other-conn-claims-holder":
        conn, worker_id = w2, "w1"
    elif case == "holder-claims-other-id":
        worker_id = "w2"
    elif case == "unknown-job":
        target = "no-such-job"
    elif case == "after-retry":
        h.report(2, job_id, success=False, error="x")
        h.sweep(2 + BASE)
        assert h.assign_of(job_id).attempt_number == 2
        conn = h.holder(job_id)
        worker_id = conn.name
    elif case == "after-cancel":
        h.cancel(2, job_id)
    elif case == "while-retry-wait":
        h.report(2, job_id, success=False, error="x")
    elif case == "after-completion":
        h.report(2, job_id, result={"sleptMillis": 1})
    elif case == "after-disconnect":
        h.disconnect(2, "w1")  # the reader may still deliver a frame it had buffered
    snap_before = h.status(job_id)
    row_before = row(h, job_id)
    workers_before = h.core.requests.list_workers(3).workers
    out = h.report(3, target, result={"sleptMillis": 999}, attempt=attempt, conn=conn, worker_id=worker_id)
    assert h.status(job_id) == snap_before
    assert row(h, job_id)[:-1] == row_before[:-1]  # all but the timeline (events, last): it notes the result
    assert h.core.requests.list_workers(3).workers == workers_before
    assert out == []


def test_failure_with_budget_waits_then_retries_only_when_due(h):
    job_id = h.submit_ok(0, max_attempts=3)
    w = h.register(0, "w1")
    h.report(1000, job_id, success=False, error="boom 1")
    snap = h.status(job_id)
    assert (snap["state"], snap["attempts"], snap["error"], snap["workerId"]) == ("RETRY_WAIT", 1, "boom 1", None)
    assert h.core.table.jobs[job_id].retry_at == 1000 + BASE
    assert h.store.get(job_id).retry_at == 1000 + BASE
    assert h.running("w1") == 0
    h.sweep(1000 + BASE - 1)
    assert h.state(job_id) == "RETRY_WAIT"
    h.core.json.schedule(1000 + BASE - 1)  # scheduling alone does not promote
    h.step(1000 + BASE - 1)
    assert h.state(job_id) == "RETRY_WAIT"
    h.sweep(1000 + BASE)
    assert h.state(job_id) == "RUNNING"
    second = h.assign_of(job_id)
    assert second.attempt_number == 2 and second.attempt_id != h.assigns(w)[0].attempt_id
    # Backoff doubles on the next failure.
    h.report(2000, job_id, success=False, error="boom 2")
    assert h.core.table.jobs[job_id].retry_at == 2000 + 2 * BASE
    assert h.status(job_id)["error"] == "boom 2"


def test_a_retry_keeps_its_priority_and_submission_sequence(h):
    # PROTOCOL.md: "A retry keeps the job's original priority and submission sequence."
    h.register(0, "w1", capacity=1)
    first = h.submit_ok(0, priority="LOW")
    second = h.submit_ok(1, priority="LOW")
    third = h.submit_ok(2, priority="LOW")
    assert h.state(first) == "RUNNING"
    h.report(3, first, success=False, error="x")   # frees the slot: second runs
    assert h.state(second) == "RUNNING"
    h.sweep(3 + BASE)                               # first is queued again, beside third
    assert h.core.json.queued.ordered(3 + BASE, STEP) == [first, third]
    h.report(4 + BASE, second)
    assert h.state(first) == "RUNNING" and h.state(third) == "QUEUED"
    assert h.status(first)["priority"] == "LOW" and h.store.get(first).seq == 1


def test_failure_without_budget_fails_the_job(h):
    job_id = h.submit_ok(0, max_attempts=2)
    h.register(0, "w1")
    h.report(1, job_id, success=False, error="one")
    h.sweep(1 + BASE)
    h.report(500, job_id, success=False, error="two")
    snap = h.status(job_id)
    assert (snap["state"], snap["attempts"], snap["error"], snap["result"]) == ("FAILED", 2, "two", None)
    assert h.core.active_count == 0
    h.sweep(10_000)
    assert h.state(job_id) == "FAILED" and len(h.assigns()) == 2


def test_error_is_kept_after_a_later_success(h):
    job_id = h.submit_ok(0, task_type="FAIL", payload={"failUntilAttempt": 2})
    h.register(0, "w1")
    h.report(1, job_id, success=False, error="attempt 1 failed")
    h.sweep(1 + BASE)
    h.report(300, job_id, result={"attempt": 2})
    snap = h.status(job_id)
    assert (snap["state"], snap["attempts"], snap["result"], snap["error"]) == (
        "COMPLETED", 2, {"attempt": 2}, "attempt 1 failed")
    assert h.store.get(job_id).error == "attempt 1 failed"


def test_failure_without_an_error_message_still_records_one(h):
    job_id = h.submit_ok(0, max_attempts=1)
    h.register(0, "w1")
    h.report(1, job_id, success=False, error=None)
    snap = h.status(job_id)
    assert snap["state"] == "FAILED" and snap["error"]


# ==== worker loss ===========================================================================


@pytest.mark.parametrize("how", ["disconnect", "heartbeat-timeout"])
def test_worker_loss_retries_or_fails_its_running_jobs(h, how):
    conn = h.register(0, "w1", capacity=3)
    retried = h.submit_ok(0, max_attempts=2)
    final = h.submit_ok(0, max_attempts=1)
    if how == "disconnect":
        out = h.disconnect(500, "w1")
        now = 500
        assert (conn, None) not in out  # the connection is already gone
    else:
        now = HB + 1
        out = h.sweep(now, beat=False)
        assert (conn, None) in out  # the runtime closes the silent worker's connection
    assert h.core.requests.list_workers(now).workers == []
    snap = h.status(retried)
    assert (snap["state"], snap["workerId"], snap["attempts"]) == ("RETRY_WAIT", None, 1)
    assert "w1" in snap["error"]
    snap = h.status(final)
    assert snap["state"] == "FAILED" and "w1" in snap["error"]
    assert h.core.active_count == 1
    # The retry goes to a new worker when due.
    w2 = h.register(now, "w2")
    h.sweep(now + BASE)
    assert h.holder(retried) is w2 and h.state(retried) == "RUNNING"
    assert h.assign_of(retried).attempt_number == 2


def test_heartbeats_keep_a_worker_alive(h):
    h.register(0, "w1")
    job_id = h.submit_ok(0)
    for now in range(HB // 2, 5 * HB, HB // 2):
        h.heartbeat(now, "w1")
        h.sweep(now + HB // 4, beat=False)
    assert [w["workerId"] for w in h.core.requests.list_workers(0).workers] == ["w1"]
    assert h.state(job_id) == "RUNNING"
    assert h.core.requests.list_workers(0).workers[0]["lastHeartbeatMillis"] == 5 * HB - HB // 2


def test_worker_silent_for_exactly_the_timeout_is_still_alive(h):
    # ARCHITECTURE.md: presumed dead when the last heartbeat is *older than* the timeout.
    h.register(0, "w1")
    h.heartbeat(100, "w1")
    assert all(msg is not None for _, msg in h.sweep(100 + HB, beat=False))
    assert len(h.core.requests.list_workers(0).workers) == 1
    h.sweep(100 + HB + 1, beat=False)
    assert h.core.requests.list_workers(0).workers == []


def test_disconnect_of_an_unknown_connection_is_harmless(h):
    h.register(0, "w1")
    h.core.json.on_disconnected(1, Conn("stranger"))
    h.step(1)
    assert len(h.core.requests.list_workers(1).workers) == 1


# ==== deadlines =============================================================================


def test_deadline_expiry_revokes_the_lease_and_retries(h):
    conn = h.register(0, "w1", capacity=1)
    job_id = h.submit_ok(1000)
    first = h.assign_of(job_id)
    deadline = 1000 + TIMEOUT
    h.sweep(deadline - 1)
    assert h.state(job_id) == "RUNNING" and h.cancels(conn) == []
    out = h.sweep(deadline + 1)
    assert (conn, m.TaskCancel(job_id, first.attempt_id)) in out
    assert (conn, None) not in out  # the worker itself is fine
    snap = h.status(job_id)
    assert (snap["state"], snap["workerId"]) == ("RETRY_WAIT", None)
    assert "deadline" in snap["error"]
    assert h.running("w1") == 0  # slot freed
    other = h.submit_ok(deadline + 2)
    assert h.holder(other) is conn  # the freed slot is usable at once
    h.report(deadline + 3, other)
    h.sweep(deadline + 1 + BASE)
    second = h.assign_of(job_id)
    assert second.attempt_number == 2 and second.attempt_id != first.attempt_id
    assert h.store.get(job_id).deadline == deadline + 1 + BASE + TIMEOUT


def test_deadline_expiry_on_the_final_attempt_fails_the_job(h):
    conn = h.register(0, "w1")
    job_id = h.submit_ok(0, max_attempts=1)
    attempt = h.assign_of(job_id)
    out = h.sweep(TIMEOUT + 1)
    assert (conn, m.TaskCancel(job_id, attempt.attempt_id)) in out
    snap = h.status(job_id)
    assert snap["state"] == "FAILED" and "deadline" in snap["error"] and str(TIMEOUT) in snap["error"]
    assert h.core.active_count == 0 and h.running("w1") == 0


def test_late_result_from_an_expired_attempt_is_dropped(h):
    conn = h.register(0, "w1", capacity=1)
    job_id = h.submit_ok(0)
    first = h.assign_of(job_id)
    h.sweep(TIMEOUT + 1)
    # Late result while the job waits for its retry.
    h.report(TIMEOUT + 2, job_id, attempt=first, conn=conn)
    assert h.state(job_id) == "RETRY_WAIT"
    h.sweep(TIMEOUT + 1 + BASE)
    second = h.assign_of(job_id)
    assert h.holder(job_id) is conn and second.attempt_id != first.attempt_id
    # Late result of attempt 1 while attempt 2 runs on the same worker.
    h.report(TIMEOUT + 200, job_id, attempt=first, conn=conn, result={"sleptMillis": 1})
    snap = h.status(job_id)
    assert (snap["state"], snap["attempts"], snap["result"]) == ("RUNNING", 2, None)
    assert h.running("w1") == 1
    h.report(TIMEOUT + 300, job_id, attempt=second, conn=conn, result={"sleptMillis": 2})
    assert h.status(job_id)["result"] == {"sleptMillis": 2}


def test_a_completed_attempt_is_not_expired_later(h):
    conn = h.register(0, "w1")
    job_id = h.submit_ok(0)
    h.report(5, job_id)
    h.sweep(TIMEOUT * 3)
    assert h.state(job_id) == "COMPLETED" and h.cancels(conn) == []


# ==== cancellation ==========================================================================


def test_cancel_a_queued_job_and_it_is_never_scheduled(h):
    job_id = h.submit_ok(0)
    reply = h.cancel(5, job_id)
    assert isinstance(reply, m.JobCancel) and reply.cancelled is True
    assert reply.job["state"] == "CANCELLED" and reply.job["updatedAtMillis"] == 5
    assert h.store.get(job_id).state is JobState.CANCELLED
    assert h.core.active_count == 0 and job_id not in h.core.json.queued
    h.register(6, "w1")
    h.sweep(100_000)
    assert h.assigns() == [] and h.state(job_id) == "CANCELLED"


def test_cancel_a_job_waiting_for_its_retry(h):
    h.register(0, "w1")
    job_id = h.submit_ok(0)
    h.report(1, job_id, success=False, error="x")
    reply = h.cancel(2, job_id)
    assert reply.cancelled and reply.job["state"] == "CANCELLED" and reply.job["error"] == "x"
    h.sweep(1 + BASE * 100)
    assert h.state(job_id) == "CANCELLED" and len(h.assigns()) == 1


def test_cancel_a_running_job_revokes_the_lease_and_frees_capacity(h):
    conn = h.register(0, "w1", capacity=1)
    job_id = h.submit_ok(0)
    waiting = h.submit_ok(0)
    attempt = h.assign_of(job_id)
    assert h.state(waiting) == "QUEUED"
    h.sent.clear()
    reply = h.core.requests.cancel_job(3, job_id)
    out = h.step(3)
    assert reply.cancelled and reply.job["state"] == "CANCELLED" and reply.job["workerId"] is None
    assert out[0] == (conn, m.TaskCancel(job_id, attempt.attempt_id))
    assert h.holder(waiting) is conn and h.state(waiting) == "RUNNING"  # slot reused
    # The worker ignores the cancel and reports success: the job stays CANCELLED.
    h.report(4, job_id, attempt=attempt, conn=conn)
    assert h.state(job_id) == "CANCELLED" and h.status(job_id)["result"] is None
    assert h.running("w1") == 1
    h.sweep(TIMEOUT * 2)  # its old deadline does nothing
    assert h.state(job_id) == "CANCELLED"


@pytest.mark.parametrize("end", ["COMPLETED", "FAILED", "CANCELLED"])
def test_cancel_a_terminal_job_reports_its_real_state(h, end):
    conn = h.register(0, "w1")
    job_id = h.submit_ok(0, max_attempts=1)
    if end == "CANCELLED":
        h.cancel(1, job_id)
    else:
        h.report(1, job_id, success=end == "COMPLETED", error="e")
    row_before = row(h, job_id)
    cancels_before = len(h.cancels(conn))
    reply = h.cancel(2, job_id)
    assert reply == m.JobCancel(False, h.status(job_id))
    assert reply.job["state"] == end
    assert row(h, job_id) == row_before
    assert len(h.cancels(conn)) == cancels_before


def test_cancel_a_terminal_job_known_only_to_the_store(h):
    h.register(0, "w1")
    job_id = h.submit_ok(0)
    h.report(1, job_id)
    h2 = Harness(store=h.store, prefix="b")
    h2.core.recover(10)
    reply = h2.cancel(11, job_id)
    assert reply.cancelled is False and reply.job["state"] == "COMPLETED"


def test_cancel_or_status_of_an_unknown_job_is_an_error(h):
    assert isinstance(h.cancel(0, "nope"), m.Error)
    assert isinstance(h.core.requests.get_job_status(0, "nope"), m.Error)
    assert h.store.count() == 0


# ==== list_jobs =============================================================================


def test_list_jobs_is_newest_first(h):
    ids = [h.submit_ok(t) for t in range(5)]
    reply = h.list()
    assert isinstance(reply, m.JobList)
    assert [j["jobId"] for j in reply.jobs] == ids[::-1]
    assert reply.next_cursor is None
    assert reply.jobs[0] == h.status(ids[-1])


def test_list_jobs_limit_defaults_to_100_and_is_clamped_to_1000():
    h = Harness(max_active_jobs=2000)
    for t in range(1001):
        h.core.requests.submit_job(t, m.SubmitJob("SLEEP", SLEEP))
    h.commit()
    default = h.list()
    assert len(default.jobs) == 100 and default.next_cursor is not None
    big = h.list(limit=5000)
    assert len(big.jobs) == 1000 and big.next_cursor is not None
    rest = h.list(limit=5000, cursor=big.next_cursor)
    assert len(rest.jobs) == 1 and rest.next_cursor is None
    assert rest.jobs[0]["createdAtMillis"] == 0
    assert len(h.list(limit=1).jobs) == 1


def test_list_jobs_filters_by_state(h):
    h.register(0, "w1", capacity=2)
    ids = [h.submit_ok(0, max_attempts=1) for _ in range(6)]
    h.report(1, ids[0])
    h.report(1, ids[1], success=False, error="x")
    h.cancel(2, ids[5])
    expected = {
        "COMPLETED": [ids[0]], "FAILED": [ids[1]], "RUNNING": [ids[3], ids[2]], "QUEUED": [ids[4]],
        "CANCELLED": [ids[5]], "RETRY_WAIT": [],
    }
    for state, want in expected.items():
        reply = h.list(state=state)
        assert [j["jobId"] for j in reply.jobs] == want, state
        assert all(j["state"] == state for j in reply.jobs)


@pytest.mark.parametrize("state", [None, "QUEUED"])
def test_cursor_paging_visits_each_job_exactly_once(h, state):
    h.register(0, "w1", capacity=3)
    ids = [h.submit_ok(t) for t in range(23)]
    expected = [i for i in ids[::-1] if state is None or h.state(i) == state]
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        reply = h.list(limit=5, state=state, cursor=cursor)
        assert len(reply.jobs) <= 5
        seen += [j["jobId"] for j in reply.jobs]
        pages += 1
        if pages == 2:
            h.submit_ok(100)  # newer jobs do not disturb an ongoing walk
        cursor = reply.next_cursor
        if cursor is None:
            break
    assert seen == expected
    assert pages == -(-len(expected) // 5)


def test_paging_with_an_exact_multiple_of_the_limit_ends_cleanly(h):
    for t in range(10):
        h.submit_ok(t)
    first = h.list(limit=5)
    second = h.list(limit=5, cursor=first.next_cursor)
    assert len(second.jobs) == 5 and second.next_cursor is None


@pytest.mark.parametrize("kw", [
    dict(cursor="abc"), dict(cursor="0"), dict(cursor="-3"), dict(cursor=""), dict(cursor="1.5"),
    dict(state="DONE"), dict(state="queued"), dict(state=""),
    dict(limit=0), dict(limit=-1),
])
def test_bad_list_arguments_are_errors(h, kw):
    h.submit_ok(0)
    assert isinstance(h.list(**kw), m.Error)


def test_a_job_list_page_always_fits_in_one_frame(h):
    h.register(0, "w1", capacity=1)
    ids = []
    for t in range(30):
        job_id = h.submit_ok(t)
        h.report(t, job_id, result={"blob": "é" * 30_000})
        ids.append(job_id)
    seen = []
    cursor = None
    while True:
        reply = h.list(limit=1000, cursor=cursor)
        assert len(encode_frame(reply.to_wire())) <= MAX_FRAME + 4
        assert reply.jobs
        seen += [j["jobId"] for j in reply.jobs]
        cursor = reply.next_cursor
        if cursor is None:
            break
    assert seen == ids[::-1]


def test_state_filter_follows_live_state_before_the_commit(h):
    # In the runtime a LIST_JOBS can run in the same batch as a sweep that moved jobs,
    # before that batch is committed: a filtered page must not show another state.
    job_id = h.submit_ok(0)
    cancelled = h.submit_ok(0)
    h.core.json.on_registered(1, Conn("w1"), m.WorkerRegister("w1", 1))
    h.core.json.schedule(1)      # job_id -> RUNNING, not committed yet
    h.core.requests.cancel_job(1, cancelled)     # cancelled -> CANCELLED, not committed yet
    for state in ("QUEUED", "RUNNING", "CANCELLED"):
        reply = h.list(state=state)
        assert all(j["state"] == state for j in reply.jobs), (state, reply.jobs)
    assert job_id not in [j["jobId"] for j in h.list(state="QUEUED").jobs]
    h.commit()
    assert [j["jobId"] for j in h.list(state="RUNNING").jobs] == [job_id]
    assert [j["jobId"] for j in h.list(state="CANCELLED").jobs] == [cancelled]


def test_list_workers_fields(h):
    h.register(10, "w1", capacity=2)
    h.register(20, "w2", capacity=5)
    h.submit_ok(30)
    h.heartbeat(40, "w2")
    workers = {w["workerId"]: w for w in h.core.requests.list_workers(50).workers}
    assert set(workers) == {"w1", "w2"}
    assert {k: workers["w1"][k] for k in ("capacity", "activeJobs", "lastHeartbeatMillis")} == {
        "capacity": 2, "activeJobs": 1, "lastHeartbeatMillis": 10}
    assert {k: workers["w2"][k] for k in ("capacity", "activeJobs", "lastHeartbeatMillis")} == {
        "capacity": 5, "activeJobs": 0, "lastHeartbeatMillis": 40}


# ==== recovery ==============================================================================


def make_recovery_history() -> tuple[Harness, dict[str, str]]:
    h = Harness()
    ids = {}
    h.register(0, "w1", capacity=3)
    ids["completed"] = h.submit_ok(1)
    h.report(2, ids["completed"])
    ids["cancelled"] = h.submit_ok(3)
    h.cancel(3, ids["cancelled"])
    ids["failed"] = h.submit_ok(4, max_attempts=1)
    h.report(5, ids["failed"], success=False, error="no")
    ids["final"] = h.submit_ok(6, max_attempts=2)
    h.report(7, ids["final"], success=False, error="first")
    h.sweep(7 + BASE)  # attempt 2 of 2 runs
    ids["running"] = h.submit_ok(200, max_attempts=3)   # attempt 1 of 3 runs
    ids["retry"] = h.submit_ok(201)
    h.report(202, ids["retry"], success=False, error="later")  # RETRY_WAIT until 302
    # w1 is full now: final, running + one free slot; fill it and queue the rest.
    ids["filler"] = h.submit_ok(203)
    ids["q-low"] = h.submit_ok(204, priority="LOW")
    ids["q-high"] = h.submit_ok(205, priority="HIGH")
    ids["q-normal"] = h.submit_ok(206)
    expected = {"completed": "COMPLETED", "cancelled": "CANCELLED", "failed": "FAILED", "final": "RUNNING",
                "running": "RUNNING", "retry": "RETRY_WAIT", "filler": "RUNNING", "q-low": "QUEUED",
                "q-high": "QUEUED", "q-normal": "QUEUED"}
    assert {k: h.state(v) for k, v in ids.items()} == expected
    assert h.status(ids["final"])["attempts"] == 2
    return h, ids


def test_recovery_requeues_running_jobs_with_budget_and_fails_final_attempts():
    old, ids = make_recovery_history()
    h = Harness(store=old.store, prefix="new")  # the old core and its sessions are gone
    stats = h.core.recover(1000)
    h.commit()
    assert stats == Recovery(queued=5, retry_wait=1, requeued=2, failed=1, active=6, task_types=5,
                             next_seq=11)
    for name in ("running", "filler"):
        snap = h.status(ids[name])
        assert (snap["state"], snap["attempts"], snap["workerId"]) == ("QUEUED", 1, None)
        stored = h.store.get(ids[name])
        assert stored.attempt_id is None and stored.deadline is None and stored.state is JobState.QUEUED
    snap = h.status(ids["final"])
    assert snap["state"] == "FAILED" and snap["attempts"] == 2
    assert "restart" in snap["error"]
    assert h.store.get(ids["final"]).state is JobState.FAILED
    retry = h.core.table.jobs[ids["retry"]]
    assert retry.state is JobState.RETRY_WAIT and retry.retry_at == 202 + BASE and retry.error == "later"
    for name in ("q-low", "q-high", "q-normal"):
        assert h.state(ids[name]) == "QUEUED"
    # Terminal jobs stay in the store only.
    assert set(h.core.table.jobs) == {ids[n] for n in ("running", "filler", "retry", "q-low", "q-high", "q-normal")}
    for name in ("completed", "cancelled", "failed"):
        assert h.status(ids[name])["state"] == old.status(ids[name])["state"]
    assert h.core.active_count == 6
    assert h.core.table.next_seq == h.store.max_seq() + 1 == 11


def test_recovery_reproduces_the_scheduling_order():
    old, ids = make_recovery_history()
    h = Harness(store=old.store, prefix="new")
    h.core.recover(1000)
    h.commit()
    for now in (1000, 204 + STEP, 10 * STEP):
        model = sorted(
            (j for j in h.core.table.jobs.values() if j.state is JobState.QUEUED),
            key=lambda j: (-min(2, j.priority.level + max(0, now - j.created_at) // STEP), j.seq),
        )
        assert h.core.json.queued.ordered(now, STEP) == [j.job_id for j in model]
    assert h.core.json.queued.ordered(1000, STEP) == [
        ids["q-high"], ids["running"], ids["filler"], ids["q-normal"], ids["q-low"]]
    # New work sorts after recovered work of the same level.
    newer = h.submit_ok(1001)
    assert h.store.get(newer).seq == 11
    h.register(1002, "w9", capacity=1)
    order = []
    for t in range(1003, 1010):
        running = [j for j in h.core.table.jobs.values() if j.state is JobState.RUNNING]
        if not running:
            h.sweep(t)
            continue
        order.append(running[0].job_id)
        h.report(t, running[0].job_id)
    assert order[:6] == [ids["q-high"], ids["running"], ids["filler"], ids["q-normal"], newer, ids["q-low"]]


def test_recovered_retry_is_promoted_when_due():
    old, ids = make_recovery_history()
    h = Harness(store=old.store, prefix="new")
    h.core.recover(250)
    h.commit()
    h.register(250, "w2", capacity=10)
    assert h.state(ids["retry"]) == "RETRY_WAIT"
    h.sweep(202 + BASE - 1)
    assert h.state(ids["retry"]) == "RETRY_WAIT"
    h.sweep(202 + BASE)
    assert h.state(ids["retry"]) == "RUNNING"
    assert h.assign_of(ids["retry"]).attempt_number == 2


def test_recovered_running_job_gets_a_fresh_deadline():
    old, ids = make_recovery_history()
    h = Harness(store=old.store, prefix="new")
    h.core.recover(10 * TIMEOUT)
    h.commit()
    conn = h.register(10 * TIMEOUT, "w2", capacity=10)
    h.sweep(10 * TIMEOUT + 1)
    assert h.state(ids["running"]) == "RUNNING"
    assert h.store.get(ids["running"]).deadline == 10 * TIMEOUT + TIMEOUT
    assert h.cancels(conn) == []
    assert h.assign_of(ids["running"]).attempt_number == 2


def test_recovering_twice_is_stable():
    old, ids = make_recovery_history()
    h = Harness(store=old.store, prefix="new")
    h.core.recover(1000)
    h.commit()
    rows = {i: row(h, i) for i in ids.values()}
    h2 = Harness(store=old.store, prefix="newer")
    stats = h2.core.recover(2000)
    h2.commit()
    assert stats == Recovery(queued=5, retry_wait=1, active=6, task_types=5, next_seq=11)
    assert {i: row(h2, i) for i in ids.values()} == rows


def test_legacy_rows_recover_in_creation_order_before_new_work(tmp_path):
    path = tmp_path / "legacy.db"
    conn = sqlite3.connect(str(path))
    conn.execute("CREATE TABLE jobs (%s)" % BASE_COLUMNS)
    for job_id, created in (("c", 300), ("a", 100), ("b", 200)):
        conn.execute(
            "INSERT INTO jobs VALUES (?, 'SLEEP', '{\"durationMillis\": 1}', 'QUEUED', 0, 3,"
            " NULL, NULL, NULL, NULL, ?, ?, NULL, NULL)", (job_id, created, created))
    conn.commit()
    conn.close()
    h = Harness(store=SQLiteStore(str(path)))
    h.core.recover(400)
    h.commit()
    # Opening numbered the legacy rows (seq 0) 1..3 in creation order; new work follows them.
    assert [h.store.get(i).seq for i in ("a", "b", "c")] == [1, 2, 3]
    assert h.core.table.next_seq == 4
    newer = h.submit_ok(400)
    assert h.store.get(newer).seq == 4
    assert h.core.json.queued.ordered(400, STEP) == ["a", "b", "c", newer]
    assert all(h.status(i)["priority"] == "NORMAL" for i in ("a", "b", "c"))
    h.store.close()


def test_recovered_retry_wait_without_retry_time_is_still_retried():
    # A RETRY_WAIT row with no retry_at (written by an older or foreign writer): recover()
    # queues it "due now" (``job.retry_at or now_millis``), so it must be retried.
    store = SQLiteStore(":memory:")
    seed = Harness(store=store, prefix="old")
    job_id = seed.submit_ok(0)
    store.conn.execute("UPDATE jobs SET state='RETRY_WAIT', attempts=1, retry_at=NULL WHERE job_id=?", (job_id,))
    h = Harness(store=store, prefix="new")
    h.core.recover(100)
    h.commit = lambda: (store.write(h.core.take_dirty()))  # the row itself breaks the retry_at invariant
    h.register(100, "w1")
    for now in (100, 101, 10_000):
        h.sweep(now)
    assert h.status(job_id)["state"] == "RUNNING"


# ==== progress (TASK_PROGRESS) ================================================================


def progress(h: Harness, now: int, job_id: str, fraction: Any, message: Any = None, attempt_id: str | None = None,
             conn: Conn | None = None, worker_id: str | None = None) -> list:
    conn = conn or h.holder(job_id)
    report = m.TaskProgress(worker_id or conn.name, job_id, attempt_id or h.assign_of(job_id).attempt_id, fraction,
                            message)
    h.apply(now, ev.Progress(conn, report))
    batch = h.core.take_dirty()
    assert not (batch.inserts or batch.updates), "a progress report is never written to the store"
    return h.step(now)


def test_progress_from_the_lease_holder_is_the_running_jobs_snapshot_progress():
    # Given a running job
    h = Harness()
    h.register(0, "w1")
    job_id = h.submit_ok(10)
    assert h.status(job_id)["state"] == "RUNNING" and h.status(job_id)["progress"] is None
    # When its worker reports progress twice
    progress(h, 20, job_id, 0.25, "chunk 2")
    progress(h, 30, job_id, 1, None)
    # Then the snapshot shows the latest, at the wall-clock time it arrived
    wall = 30 + h.core.table.drift
    assert h.status(job_id)["progress"] == {"fraction": 1, "message": None, "atMillis": wall}
    assert h.core.counters.progress_reports == 2
    # And it leaves with the attempt: the completed job shows none
    h.report(40, job_id)
    assert h.status(job_id)["state"] == "COMPLETED" and h.status(job_id)["progress"] is None


def test_progress_is_dropped_unless_in_bounds_and_from_the_current_lease_the_connection_stays():
    h = Harness()
    w1, w2 = h.register(0, "w1", capacity=1), h.register(0, "w2", capacity=1)
    job_id = h.submit_ok(10)
    holder = h.holder(job_id)
    other = w2 if holder is w1 else w1
    progress(h, 20, job_id, 0.5, "kept")
    kept = h.status(job_id)["progress"]
    attempt_id = h.assign_of(job_id).attempt_id
    # When reports arrive for another attempt, from the other worker, or out of bounds
    progress(h, 30, job_id, 0.6, attempt_id=job_id + ".2")
    progress(h, 30, job_id, 0.6, conn=other)
    progress(h, 30, job_id, 0.6, conn=other, worker_id=holder.name)
    for fraction, message in ((1.5, None), (-0.1, None), (float("nan"), None), (float("inf"), None),
                              (0.6, "x" * 1001)):
        progress(h, 30, job_id, fraction, message)
    progress(h, 30, "no-such-job", 0.6, attempt_id=attempt_id, conn=holder)
    # Then none of them changes anything and no connection is closed or told off
    assert h.status(job_id)["progress"] == kept and kept["message"] == "kept"
    assert h.core.counters.progress_dropped == 9
    assert not [msg for _c, msg in h.sent if msg is None or isinstance(msg, m.Error)], h.sent
    # And a message of exactly 1,000 characters is kept
    progress(h, 40, job_id, 0.7, "y" * 1000)
    assert h.status(job_id)["progress"]["message"] == "y" * 1000


def test_a_new_attempt_starts_without_the_last_ones_progress():
    h = Harness()
    h.register(0, "w1")
    job_id = h.submit_ok(10, max_attempts=2)
    progress(h, 20, job_id, 0.9, "almost")
    # When the attempt fails, the job waits for its retry without progress
    h.report(30, job_id, success=False, error="boom")
    assert h.status(job_id)["state"] == "RETRY_WAIT" and h.status(job_id)["progress"] is None
    # And the next attempt runs without any until it reports; the first attempt's reports are stale
    first = h.assign_of(job_id)
    h.sweep(30 + CAP + 1)
    assert h.status(job_id)["state"] == "RUNNING" and h.assign_of(job_id).attempt_id != first.attempt_id
    progress(h, 2000, job_id, 0.95, "stale", attempt_id=first.attempt_id)
    assert h.status(job_id)["progress"] is None
    progress(h, 2000, job_id, 0.1, "second")
    assert h.status(job_id)["progress"]["message"] == "second"


# ==== a randomized run checked against the invariants =======================================


@pytest.mark.parametrize("seed", range(6))
def test_random_event_sequences_keep_the_invariants(seed):
    """Random submissions, workers, results, losses, cancels and sweeps; ``check`` runs
    after every step (store == core, capacity, one lease holder per RUNNING job)."""
    rng = random.Random(seed)
    h = Harness(max_active_jobs=40)
    now = 0
    names = ["w%d" % i for i in range(4)]
    live: set[str] = set()
    assigned: dict[str, list[str]] = {}
    for _ in range(300):
        now += rng.choice([0, 1, 10, BASE, HB // 2, TIMEOUT // 3])
        r = rng.random()
        if r < 0.3:
            reply = h.submit(now, max_attempts=rng.randint(0, 3), priority=rng.choice([None, "LOW", "HIGH"]),
                             key=rng.choice([None, None, "k%d" % rng.randrange(20)]))
            assert isinstance(reply, (m.JobSubmitted, m.SubmitRejected, m.Error))
        elif r < 0.4:
            name = rng.choice(names)
            if name in live:
                h.disconnect(now, name)
                live.discard(name)
            else:
                h.register(now, name, capacity=rng.randint(1, 3))
                live.add(name)
        elif r < 0.65:
            running = sorted(j for j, job in h.core.table.jobs.items() if job.state is JobState.RUNNING)
            if running:
                job_id = rng.choice(running)
                h.report(now, job_id, success=rng.random() < 0.6, error="e")
        elif r < 0.7:
            if h.core.table.jobs:
                h.cancel(now, rng.choice(sorted(h.core.table.jobs)))
        elif r < 0.8:
            for name in sorted(live):
                h.heartbeat(now, name)
        else:
            h.sweep(now, beat=rng.random() < 0.7)
            live = {s.worker_id for s in h.core.json.workers}
    for a in h.assigns():
        assigned.setdefault(a.job_id, []).append(a.attempt_id)
    for job_id, attempts in assigned.items():
        assert len(set(attempts)) == len(attempts)
        stored = h.store.get(job_id)
        assert stored.attempts == len(attempts) <= stored.max_attempts


def test_deadline_index_stays_bounded_by_running_leases():
    # Given one worker completing thousands of jobs, each with a long deadline
    from jobmesh.coordinator.core.face import CoordinatorCore, CoreConfig
    from jobmesh.protocol import messages as mm
    from jobmesh.store.sqlite import SQLiteStore

    core = CoordinatorCore(SQLiteStore(":memory:"), CoreConfig(task_timeout_millis=600_000, max_active_jobs=10**6))
    conn = object()
    core.json.on_registered(0, conn, m.WorkerRegister("w", 4))
    now = 1
    for i in range(5000):
        core.requests.submit_job(now, mm.SubmitJob("SLEEP", {"durationMillis": 0}))
        core.json.schedule(now)
        for c, msg in core.take_outbound():
            if isinstance(msg, mm.TaskAssign):
                core.json.on_result(now, conn, mm.TaskResult("w", msg.job_id, msg.attempt_id, True, {}))
        core.take_dirty()
        if i % 100 == 0:
            core.sweep(now)
        now += 1
    # Then ended leases were dropped from the deadline index
    assert len(core.timers.deadline_heap) <= 2 * 4 + 1024
    assert core.active_count == 0


def test_cursor_out_of_rowid_range_is_an_error_not_a_crash():
    from jobmesh.coordinator.core.face import CoordinatorCore, CoreConfig
    from jobmesh.protocol import messages as mm
    from jobmesh.store.sqlite import SQLiteStore

    core = CoordinatorCore(SQLiteStore(":memory:"), CoreConfig())
    for cursor in ("99999999999999999999999", "0", "-5", "abc"):
        reply = core.requests.list_jobs(0, mm.ListJobs(cursor=cursor))
        assert isinstance(reply, mm.Error), cursor
        assert "cursor" in reply.message


def test_worker_ids_must_be_short_and_non_empty():
    from jobmesh.coordinator.core.face import CoordinatorCore, CoreConfig
    from jobmesh.coordinator.core.json_jobs import MAX_WORKER_ID_CHARS
    from jobmesh.protocol import messages as mm
    from jobmesh.store.sqlite import SQLiteStore

    core = CoordinatorCore(SQLiteStore(":memory:"), CoreConfig())
    for bad in ("", "w" * (MAX_WORKER_ID_CHARS + 1)):
        conn = object()
        core.json.on_registered(0, conn, m.WorkerRegister(bad, 1))
        out = core.take_outbound()
        assert isinstance(out[0][1], mm.Error) and out[1] == (conn, None)
    conn = object()
    core.json.on_registered(0, conn, m.WorkerRegister("w" * MAX_WORKER_ID_CHARS, 1))
    assert isinstance(core.take_outbound()[0][1], mm.WorkerRegistered)
