"""WAIT_JOB in the core: waiters answered at the job's end or at their deadline.

Spec: CONTRACT.md "Waiting without polling"; docs/PROTOCOL.md "WAIT_JOB". The Harness
(test_core.py) stands in for the runtime's batches; a pending wait's reply is a Slot,
which ``wait`` names with a token; ``answers`` takes what the core answered since the
last call, as ``(token, reply)``.
"""

from __future__ import annotations

import pytest

from jobmesh.coordinator.core.waiters import MAX_WAIT_MILLIS, Slot, Waiter
from jobmesh.coordinator.core import events as ev
from jobmesh.protocol import messages as m
from tests.unit.test_core import Conn, Harness


@pytest.fixture
def h() -> Harness:
    return Harness()


TOKENS: dict[int, object] = {}  # id(slot) -> the name a test gave that wait


def wait_on(h: Harness, now: int, conn: Conn, token: object, req: m.WaitJob) -> m.Message | None:
    """A WAIT_JOB through the core; None if it is pending (its Slot is named ``token``)."""
    reply = h.request(now, req, conn)
    if isinstance(reply, Slot):
        TOKENS[id(reply)] = token
        return None
    return reply


def wait(h: Harness, now: int, job_id: str, timeout: int, conn: Conn | None = None, token: object = "t") -> m.Message | None:
    reply = wait_on(h, now, conn or Conn("client"), token, m.WaitJob(job_id, timeout))
    h.step(now)
    return reply


def token(waiter: Waiter) -> object:
    return TOKENS[id(waiter.token)]


def answers(h: Harness) -> list[tuple[object, m.Message]]:
    return [(token(w), msg) for w, msg in h.take_answers()]


def running(h: Harness, now: int = 0) -> str:
    h.register(now, "w1", capacity=4)
    job_id = h.submit_ok(now)
    assert h.state(job_id) == "RUNNING"
    return job_id


@pytest.mark.parametrize("end", ["complete", "fail", "cancel"])
def test_a_wait_is_answered_when_its_job_ends(h, end):
    # Given a running job with one attempt and a waiter on it
    h.register(0, "w1", capacity=4)
    job_id = h.submit_ok(0, max_attempts=1)
    assert wait(h, 10, job_id, 60_000) is None
    assert answers(h) == [] and not h.core.requests.has_answers()
    # When the job ends
    if end == "complete":
        h.report(20, job_id)
    elif end == "fail":
        h.report(20, job_id, success=False, error="boom")
    else:
        h.cancel(20, job_id)
    # Then the waiter gets the JOB_STATUS of the ended job, once
    got = answers(h)
    state = {"complete": "COMPLETED", "fail": "FAILED", "cancel": "CANCELLED"}[end]
    assert len(got) == 1 and got[0][0] == "t"
    assert isinstance(got[0][1], m.JobStatus) and got[0][1].job["state"] == state
    assert got[0][1] == m.JobStatus(h.status(job_id))
    assert answers(h) == [] and len(h.core.requests.waiters) == 0 and h.core.requests.next_wait_deadline() is None


def test_a_failed_attempt_that_retries_does_not_answer(h):
    job_id = running(h)
    assert wait(h, 0, job_id, 60_000) is None
    h.report(10, job_id, success=False, error="again")
    assert h.state(job_id) == "RETRY_WAIT"
    assert answers(h) == []


def test_a_wait_times_out_with_the_snapshot_as_it_stands(h):
    job_id = h.submit_ok(0)  # no worker: stays QUEUED
    assert wait(h, 100, job_id, 200) is None
    assert h.core.requests.next_wait_deadline() == 300
    h.core.requests.expire_waits(299)
    assert answers(h) == []
    h.core.requests.expire_waits(300)
    [(token, reply)] = answers(h)
    assert token == "t" and reply == m.JobStatus(h.status(job_id))
    assert reply.job["state"] == "QUEUED" and reply.job["waitingReason"] == "NO_WORKER"
    assert h.core.requests.next_wait_deadline() is None


def test_the_sweep_expires_waits(h):
    job_id = h.submit_ok(0)
    wait(h, 0, job_id, 50)
    h.sweep(49)
    assert answers(h) == []
    h.sweep(50)
    assert [msg.job["state"] for _, msg in answers(h)] == ["QUEUED"]


def test_an_error_in_one_sweep_step_does_not_skip_the_others(monkeypatch):
    from jobmesh.coordinator.core.json_jobs import JsonJobs

    def broken(self: JsonJobs, now: int) -> None:
        raise RuntimeError("a bug in one step")

    monkeypatch.setattr(JsonJobs, "detect_dead_workers", broken)  # the sweep's first step
    h = Harness()
    job_id = h.submit_ok(0)
    wait(h, 0, job_id, 50)
    h.sweep(50)
    assert [msg.job["state"] for _, msg in answers(h)] == ["QUEUED"]  # the last step still ran


def test_timeout_zero_answers_at_once(h):
    job_id = h.submit_ok(0)
    reply = wait(h, 0, job_id, 0)
    assert reply == m.JobStatus(h.status(job_id))
    assert len(h.core.requests.waiters) == 0


def test_a_finished_job_is_answered_at_once(h):
    job_id = running(h)
    h.report(10, job_id)
    reply = wait(h, 20, job_id, 60_000)
    assert isinstance(reply, m.JobStatus) and reply.job["state"] == "COMPLETED"
    assert len(h.core.requests.waiters) == 0


def test_a_finished_job_read_back_from_the_store_is_answered_at_once():
    h = Harness()
    job_id = running(h)
    h.report(10, job_id)
    fresh = Harness(store=h.store)  # a restart: the job is only on disk
    fresh.core.recover(100)
    reply = wait_on(fresh, 100, Conn("c"), "t", m.WaitJob(job_id, 1000))
    assert isinstance(reply, m.JobStatus) and reply.job["state"] == "COMPLETED"


def test_unknown_job_is_an_error_at_once(h):
    reply = wait(h, 0, "nope", 1000)
    assert isinstance(reply, m.Error) and "unknown job" in reply.message
    assert len(h.core.requests.waiters) == 0


@pytest.mark.parametrize("timeout", [-1, MAX_WAIT_MILLIS + 1, 10 ** 12])
def test_a_timeout_out_of_range_is_an_error(h, timeout):
    job_id = h.submit_ok(0)
    reply = wait(h, 0, job_id, timeout)
    assert isinstance(reply, m.Error) and "timeoutMillis" in reply.message
    assert len(h.core.requests.waiters) == 0


def test_the_longest_timeout_is_accepted(h):
    job_id = h.submit_ok(0)
    assert wait(h, 0, job_id, MAX_WAIT_MILLIS) is None
    assert h.core.requests.next_wait_deadline() == MAX_WAIT_MILLIS


def test_several_waiters_on_one_job_and_on_several_jobs(h):
    h.register(0, "w1", capacity=4)
    a, b = h.submit_ok(0), h.submit_ok(0)
    one, two = Conn("one"), Conn("two")
    wait(h, 0, a, 60_000, one, "a1")
    wait(h, 0, a, 60_000, two, "a2")
    wait(h, 0, b, 100, one, "b1")
    wait(h, 0, a, 30, one, "a3")
    assert len(h.core.requests.waiters) == 4
    h.sweep(30)  # a3 times out
    assert [t for t, _ in answers(h)] == ["a3"]
    h.report(40, a)
    got = answers(h)
    assert [t for t, _ in got] == ["a1", "a2"] and all(r.job["state"] == "COMPLETED" for _, r in got)
    assert h.core.requests.next_wait_deadline() == 100
    h.sweep(100)
    got = answers(h)
    assert [t for t, _ in got] == ["b1"] and got[0][1].job["state"] == "RUNNING"
    assert len(h.core.requests.waiters) == 0


def test_a_wait_answered_early_leaves_no_live_deadline(h):
    job_id = running(h)
    wait(h, 0, job_id, 1000)
    h.report(10, job_id)
    answers(h)
    assert h.core.requests.next_wait_deadline() is None
    h.sweep(2000)
    assert answers(h) == []


def test_a_closed_client_drops_its_waits(h):
    a, b = h.submit_ok(0), h.submit_ok(0)
    gone, stays = Conn("gone"), Conn("stays")
    wait(h, 0, a, 100, gone, "g1")
    wait(h, 0, b, 100, gone, "g2")
    wait(h, 0, a, 100, stays, "s1")
    h.core.requests.on_client_closed(10, gone)
    assert len(h.core.requests.waiters) == 1
    h.cancel(20, a)
    h.cancel(20, b)
    assert [t for t, _ in answers(h)] == ["s1"]


def test_waits_carry_over_to_a_reloaded_core(h):
    # A failed commit throws the core away; its waits wait again on the reloaded state.
    h.register(0, "w1", capacity=4)
    live = h.submit_ok(0)
    wait(h, 10, live, 500, token="live")
    fresh = Harness(store=h.store)
    fresh.core.recover(20, h.core)
    # The wait keeps its deadline on the new core.
    assert fresh.core.adopt_from(h.core, 20, []) == []
    assert len(fresh.core.requests.waiters) == 1 and fresh.core.next_deadlines().waits == 510
    fresh.core.requests.expire_waits(510)
    [(waiter, reply)] = fresh.take_answers()
    assert token(waiter) == "live" and reply.job["state"] == "QUEUED"  # recovery requeued it


def test_the_waits_a_failed_batch_answered_wait_again_on_the_reloaded_core(h):
    # A batch completes a job and so answers its wait; its commit fails, so the core is
    # thrown away: the completion was never durable, and the wait waits again.
    job_id = running(h)
    wait(h, 0, job_id, 500, token="w")
    fresh = Harness(store=h.store, prefix="fresh")  # the store as committed: the job RUNNING
    attempt, conn = h.assign_of(job_id), h.holder(job_id)
    h.apply(10, ev.Result(conn, m.TaskResult("w1", job_id, attempt.attempt_id, True, {"sleptMillis": 1})))
    batch = h.batch
    h.core.finish_batch(batch, 10)
    answered = [waiter for waiter, _ in batch.waits]
    assert [token(w) for w in answered] == ["w"] and h.core.pending_waits() == []
    fresh.core.recover(20, h.core)  # the job is queued again
    assert fresh.core.adopt_from(h.core, 20, answered) == []
    assert fresh.core.pending_waits() == answered and fresh.core.next_deadlines().waits == 500
    # and it is answered when the job ends on the reloaded core
    fresh.cancel(30, job_id)
    [(waiter, reply)] = fresh.take_answers()
    assert token(waiter) == "w" and reply.job["state"] == "CANCELLED"


def test_adopted_waits_of_ended_or_unknown_jobs_are_answered_at_once(h):
    job_id = running(h)
    wait(h, 0, job_id, 500, token="ended")
    wait(h, 0, job_id, 500, token="ended2")
    pending = h.core.pending_waits()
    other = Harness(prefix="other")
    got = other.core.adopt_from(h.core, 20, [])  # the job is unknown to this store
    assert [token(w) for w, _ in got] == ["ended", "ended2"]
    assert all(isinstance(r, m.Error) for _, r in got)
    h.report(10, job_id)
    h.take_answers()
    again = Harness(store=h.store, prefix="again")
    again.core.recover(20)
    got = again.core.adopt_from(Harness().core, 20, pending)  # ended before the reload
    assert [r.job["state"] for _, r in got] == ["COMPLETED", "COMPLETED"]


def test_many_short_waits_keep_the_deadline_heap_bounded(h):
    job_ids = [h.submit_ok(0) for _ in range(5)]
    h.register(1, "w1", capacity=5)
    for i in range(5000):
        wait_on(h, 1, Conn("c"), i, m.WaitJob(job_ids[i % 5], 3_600_000))
    for job_id in job_ids:
        h.report(2, job_id)
    assert len(h.take_answers()) == 5000
    later = h.submit_ok(3)
    for i in range(3000):
        assert wait_on(h, 3, Conn("c"), i, m.WaitJob(later, 3_600_000)) is None
    # Answered entries were dropped from the heap once they outnumbered live ones.
    assert len(h.core.requests.waiters.heap) <= 2 * len(h.core.requests.waiters) + 1025
