"""Restarts that keep running work (CONTRACT.md): ``--lease-grace-millis`` in the core.

With a grace, a RUNNING JSON job found at start stays on its old lease, held by no
session; a worker that registers naming it (``running``) keeps it: the same attempt, no
new one, a fresh deadline, and its result is applied. Unclaimed, it is recovered when the
grace ends (RECOVERED; requeued, or FAILED on the final attempt). A claim of anything
else gets a TASK_CANCEL. Grace 0 is the seeds' recovery.
"""

from __future__ import annotations

from typing import Any

from jobmesh.coordinator.core import events as ev
from jobmesh.protocol import messages as m
from jobmesh.protocol.jobs import JobState
from jobmesh.store.sqlite import SQLiteStore
from tests.unit.core_driver import Conn
from tests.unit.test_core import TIMEOUT, Harness
from tests.unit.test_core_periodic import T0
from tests.unit.test_core_periodic import H as PeriodicHarness
from tests.unit.test_core_periodic import TimesHeard
from tests.unit.test_core_periodic import assigns as periodic_assigns

GRACE = 5000
RESTART = 1000  # core time of the restart


def lease(job: dict[str, Any] | m.TaskAssign) -> dict[str, str]:
    if isinstance(job, m.TaskAssign):
        return {"jobId": job.job_id, "attemptId": job.attempt_id}
    return {"jobId": job["jobId"], "attemptId": "%s.%d" % (job["jobId"], job["attempts"])}


def running_at_restart(grace: int = GRACE, max_attempts: int = 3, jobs: int = 1) -> tuple[Harness, list[str]]:
    """Jobs RUNNING on worker w1 at a crash; a new core recovered on the same store."""
    old = Harness()
    old.register(0, "w1", capacity=4)
    ids = [old.submit_ok(1, max_attempts=max_attempts) for _ in range(jobs)]
    assert all(old.state(i) == "RUNNING" for i in ids)
    h = Harness(store=old.store, prefix="new", lease_grace_millis=grace)
    h.stats = h.core.recover(RESTART)
    h.commit()
    return h, ids


def events(h: Harness, job_id: str) -> list[dict]:
    reply = h.request(0, m.GetJobEvents(job_id))
    assert isinstance(reply, m.JobEvents), reply
    return reply.events


def result(h: Harness, now: int, conn: Conn, job_id: str, attempt_id: str, worker_id: str) -> list:
    h.apply(now, ev.Result(conn, m.TaskResult(worker_id, job_id, attempt_id, True, {"sleptMillis": 10}, None)))
    return h.step(now)


def test_a_claimed_lease_is_the_same_attempt_with_a_fresh_deadline_and_its_result_applied():
    # Given a job RUNNING at the crash, kept on its lease by a restart with a grace
    h, [job_id] = running_at_restart()
    assert h.stats.kept == 1 and h.stats.requeued == 0
    snap = h.status(job_id)
    assert (snap["state"], snap["attempts"], snap["workerId"]) == ("RUNNING", 1, "w1")
    assert h.core.running_attempts == 0  # no live worker holds it yet

    # When its worker registers again naming it
    conn = h.register(RESTART + 200, "w1", capacity=1, running=[lease(snap)])

    # Then it keeps it: no cancel, no new attempt, a fresh deadline, and it fills the slot
    assert h.cancels(conn) == [] and h.assigns(conn) == []
    assert h.running("w1") == 1
    snap = h.status(job_id)
    assert (snap["state"], snap["attempts"], snap["workerId"]) == ("RUNNING", 1, "w1")
    assert h.store.get(job_id).deadline == RESTART + 200 + TIMEOUT
    queued = h.submit_ok(RESTART + 300)  # the claimed lease counts against its capacity
    assert h.state(queued) == "QUEUED"
    # The grace ending does not touch it
    h.sweep(RESTART + GRACE + 1)
    assert h.state(job_id) == "RUNNING" and h.cancels(conn) == []

    # And its result for that lease is applied
    result(h, RESTART + GRACE + 2, conn, job_id, job_id + ".1", "w1")
    snap = h.status(job_id)
    assert (snap["state"], snap["attempts"], snap["result"]) == ("COMPLETED", 1, {"sleptMillis": 10})
    assert [e["event"] for e in events(h, job_id)] == ["SUBMITTED", "ASSIGNED", "COMPLETED"]
    assert h.state(queued) == "RUNNING"  # the slot it freed


def test_a_kept_lease_and_its_claim_go_through_the_table_which_tells_its_time_listeners():
    # Given a listener of the table's times on a core that recovers a job RUNNING at the crash
    old = Harness()
    old.register(0, "w1", capacity=4)
    job_id = old.submit_ok(1)
    h = Harness(store=old.store, prefix="new", lease_grace_millis=GRACE)
    heard = TimesHeard()
    h.core.table.listen_times(heard)
    h.core.recover(RESTART)
    h.commit()
    # Then keeping it on its lease for the grace is heard, with the grace's end as its deadline
    assert heard.jobs == [(job_id, JobState.RUNNING, RESTART + GRACE)]
    # And so is its claim, with the fresh deadline; the claimer's running set holds it
    h.register(RESTART + 200, "w1", capacity=2, running=[lease(h.status(job_id))])
    assert heard.jobs[1:] == [(job_id, JobState.RUNNING, RESTART + 200 + TIMEOUT)]
    assert h.core.table.running(h.core.json.workers.get("w1")) == {job_id}


def test_a_claimed_lease_expires_at_its_fresh_deadline():
    h, [job_id] = running_at_restart()
    conn = h.register(RESTART + 100, "w1", running=[lease(h.status(job_id))])
    h.sweep(RESTART + 100 + TIMEOUT - 1)
    assert h.state(job_id) == "RUNNING"
    h.sweep(RESTART + 100 + TIMEOUT)
    assert h.state(job_id) == "RETRY_WAIT"
    assert h.cancels(conn) == [m.TaskCancel(job_id, job_id + ".1")]
    assert [e["event"] for e in events(h, job_id)][-2:] == ["LEASE_EXPIRED", "RETRY_WAIT"]


def test_an_unclaimed_lease_is_requeued_when_the_grace_ends():
    h, [job_id] = running_at_restart()
    h.sweep(RESTART + GRACE - 1)
    assert h.state(job_id) == "RUNNING"
    assert [e["event"] for e in events(h, job_id)] == ["SUBMITTED", "ASSIGNED"]
    # When the grace ends with no claim, it is recovered as the seeds say
    h.sweep(RESTART + GRACE)
    snap = h.status(job_id)
    assert (snap["state"], snap["attempts"], snap["workerId"]) == ("QUEUED", 1, None)
    last = events(h, job_id)[-1]
    assert last["event"] == "RECOVERED" and last["attemptId"] == job_id + ".1"
    assert "no worker claimed it within 5000 ms" in last["detail"] and "requeued" in last["detail"]
    assert h.store.get(job_id).state is JobState.QUEUED
    # A late claim is not kept; the job runs again as attempt 2
    conn = h.register(RESTART + GRACE + 1, "w1", running=[{"jobId": job_id, "attemptId": job_id + ".1"}])
    assert h.cancels(conn) == [m.TaskCancel(job_id, job_id + ".1")]
    assert h.assign_of(job_id).attempt_number == 2


def test_an_unclaimed_final_attempt_fails_when_the_grace_ends():
    h, [job_id] = running_at_restart(max_attempts=1)
    h.sweep(RESTART + GRACE)
    snap = h.status(job_id)
    assert (snap["state"], snap["attempts"]) == ("FAILED", 1)
    assert snap["error"] == ("coordinator restarted during the final attempt (1 of 1), and no worker claimed it "
                             "within 5000 ms")
    assert [e["event"] for e in events(h, job_id)][-2:] == ["RECOVERED", "FAILED"]


def test_claims_of_another_attempt_or_an_unknown_job_are_cancelled():
    h, [job_id] = running_at_restart()
    wrong = [{"jobId": job_id, "attemptId": job_id + ".2"}, {"jobId": "nope", "attemptId": "nope.1"}]
    conn = h.register(RESTART + 10, "w1", running=wrong)
    assert h.cancels(conn) == [m.TaskCancel(job_id, job_id + ".2"), m.TaskCancel("nope", "nope.1")]
    assert h.running("w1") == 0
    # the real lease is still claimable, and recovered at the end of the grace (then runs again)
    assert job_id in h.core.table.unclaimed
    h.sweep(RESTART + GRACE)
    assert [e["event"] for e in events(h, job_id)][-2:] == ["RECOVERED", "ASSIGNED"]
    assert h.assign_of(job_id).attempt_number == 2


def test_a_lease_is_kept_once_a_second_claim_is_cancelled():
    h, [job_id] = running_at_restart()
    named = lease(h.status(job_id))
    # Named twice in one registration: kept once, nothing cancelled
    w1 = h.register(RESTART + 10, "w1", running=[named, named])
    assert h.cancels(w1) == [] and h.running("w1") == 1
    # Named by another worker: that worker is told to drop it; w1 keeps it
    w2 = h.register(RESTART + 20, "w2", running=[named])
    assert h.cancels(w2) == [m.TaskCancel(job_id, job_id + ".1")]
    assert h.running("w2") == 0 and h.status(job_id)["workerId"] == "w1"
    result(h, RESTART + 30, w1, job_id, job_id + ".1", "w1")
    assert h.status(job_id)["attempts"] == 1 and h.state(job_id) == "COMPLETED"


def test_claims_beyond_capacity_are_cancelled():
    h, ids = running_at_restart(jobs=2)
    conn = h.register(RESTART + 10, "w1", capacity=1, running=[lease(h.status(i)) for i in ids])
    assert h.running("w1") == 1
    assert h.cancels(conn) == [m.TaskCancel(ids[1], ids[1] + ".1")]
    assert [h.state(i) for i in ids] == ["RUNNING", "RUNNING"]
    h.sweep(RESTART + GRACE)
    assert [h.state(i) for i in ids] == ["RUNNING", "QUEUED"]


def test_a_cancelled_unclaimed_job_is_not_kept():
    h, [job_id] = running_at_restart()
    named = lease(h.status(job_id))
    assert h.cancel(RESTART + 10, job_id).cancelled is True
    assert job_id not in h.core.table.unclaimed
    conn = h.register(RESTART + 20, "w1", running=[named])
    assert h.cancels(conn) == [m.TaskCancel(job_id, job_id + ".1")]
    assert h.state(job_id) == "CANCELLED"


def test_claims_are_kept_while_draining():
    h, [job_id] = running_at_restart()
    h.core.draining = True
    conn = h.register(RESTART + 10, "w1", running=[lease(h.status(job_id))])
    assert h.cancels(conn) == [] and h.core.running_attempts == 1
    result(h, RESTART + 20, conn, job_id, job_id + ".1", "w1")
    assert h.state(job_id) == "COMPLETED"


def test_without_a_grace_recovery_requeues_and_claims_are_cancelled():
    h, [job_id] = running_at_restart(grace=0)
    assert h.stats.requeued == 1 and h.stats.kept == 0
    assert h.status(job_id)["state"] == "QUEUED"
    assert events(h, job_id)[-1]["detail"] == "coordinator restarted: attempt 1 requeued"
    conn = h.register(RESTART + 10, "w1", running=[{"jobId": job_id, "attemptId": job_id + ".1"}])
    # the old attempt is cancelled before the new one is assigned
    sent = [msg for c, msg in h.sent if c is conn and not isinstance(msg, m.WorkerRegistered)]
    assert sent == [m.TaskCancel(job_id, job_id + ".1"), h.assign_of(job_id)]
    assert h.assign_of(job_id).attempt_number == 2


def test_a_restart_during_the_grace_keeps_the_lease_again():
    h, [job_id] = running_at_restart()
    h2 = Harness(store=h.store, prefix="newer", lease_grace_millis=GRACE)
    assert h2.core.recover(RESTART + 100).kept == 1
    h2.commit()
    conn = h2.register(RESTART + 200, "w1", running=[lease(h2.status(job_id))])
    assert h2.cancels(conn) == []
    h2.sweep(RESTART + 100 + GRACE)
    assert h2.state(job_id) == "RUNNING"


def test_periodic_jobs_are_requeued_at_once_whatever_the_grace(tmp_path):
    db = str(tmp_path / "p.db")
    h = PeriodicHarness(SQLiteStore(db))
    h.submit(T0, name="running")
    w = Conn("w")
    h.worker(T0, w)
    assert h.job(name="running").state is JobState.RUNNING
    h.store.close()
    h2 = PeriodicHarness(SQLiteStore(db), lease_grace_millis=GRACE)
    stats = h2.core.recover(T0 + 10)
    assert stats.kept == 0 and stats.requeued == 1
    assert h2.job(name="running").state is JobState.QUEUED
    out = h2.worker(T0 + 10, Conn("w2"))
    assert [a.job.name for a in periodic_assigns(out)] == [b"running"]


def test_a_coordinator_that_saw_the_worker_go_keeps_none_of_its_leases():
    # Given a coordinator with a grace that never restarted, and a job running on w1
    h = Harness(lease_grace_millis=GRACE)
    h.register(0, "w1", capacity=1)
    job_id = h.submit_ok(1)
    named = lease(h.assign_of(job_id))
    # When w1's connection ends, its lease is revoked at once (the grace is about restarts)
    h.disconnect(2, "w1")
    assert [e["event"] for e in events(h, job_id)][-2:] == ["WORKER_LOST", "RETRY_WAIT"]
    # Then registering again it keeps nothing: its attempt is cancelled, and the job runs
    # again as a new attempt once its backoff has passed
    conn = h.register(3, "w1", capacity=1, running=[named])
    assert h.cancels(conn) == [m.TaskCancel(job_id, job_id + ".1")]
    h.sweep(10_000)
    assert h.assign_of(job_id).attempt_number == 2 and h.holder(job_id) is conn


def test_a_storage_outage_gives_the_kept_leases_their_grace_again_when_it_ends():
    # Given two jobs kept on their leases by a restart, and storage that fails at once:
    # a registration naming them writes, so it is refused until storage works
    h, [claimed, unclaimed] = running_at_restart(jobs=2)
    leases = {job_id: lease(h.status(job_id)) for job_id in (claimed, unclaimed)}
    h.core.refusal = m.Error("storage unavailable: disk full")
    h.sweep(RESTART + GRACE + 1000)
    # When storage works again after the grace has passed
    end = RESTART + GRACE + 2000
    h.core.refusal = None
    h.sweep(end)
    # Then the leases are still kept, for a whole grace from then
    assert h.state(claimed) == h.state(unclaimed) == "RUNNING"
    conn = h.register(end + 100, "w1", capacity=2, running=[leases[claimed]])
    assert h.cancels(conn) == [] and h.status(claimed)["attempts"] == 1
    h.sweep(end + GRACE - 1)
    assert h.state(unclaimed) == "RUNNING"
    h.sweep(end + GRACE)
    assert h.state(claimed) == "RUNNING" and h.state(unclaimed) in ("QUEUED", "RUNNING")
    assert events(h, unclaimed)[2]["event"] == "RECOVERED"


def test_a_kept_lease_is_kept_only_for_its_worker_id_and_a_type_its_session_runs():
    # Given a job RUNNING on w1 at the crash, kept on its lease
    h, [job_id] = running_at_restart()
    snap = h.status(job_id)
    # When another worker id names it, and w1's id names it without declaring its type
    other = h.register(RESTART + 100, "w2", capacity=4, running=[lease(snap)])
    assert h.cancels(other) == [m.TaskCancel(job_id, lease(snap)["attemptId"])]
    conn = Conn("w1-limited")
    h.register_on(RESTART + 150, conn, "w1", 4, ["etl.load"], [lease(snap)])
    assert h.cancels(conn) == [m.TaskCancel(job_id, lease(snap)["attemptId"])]
    # and that session, without a claim, sends a result for the lease
    result(h, RESTART + 160, conn, job_id, lease(snap)["attemptId"], "w1")
    # Then nothing changed: the lease still waits for w1, unclaimed, and no result is stored
    snap = h.status(job_id)
    assert (snap["state"], snap["attempts"], snap["workerId"], snap["result"]) == ("RUNNING", 1, "w1", None)
    assert job_id in h.core.table.unclaimed
    assert h.core.running_attempts == 0


def test_results_of_a_session_that_asked_are_acknowledged_once_per_batch():
    h, [applied, other] = running_at_restart(jobs=2)
    leases = [lease(h.status(job_id)) for job_id in (applied, other)]
    conn = Conn("w1")
    h.apply(RESTART + 100, ev.Registered(conn, m.WorkerRegister("w1", 4, None, leases[:1], result_acks=True)))
    assert h.step(RESTART + 100)[0] == (conn, m.WorkerRegistered("w1", result_acks=True))
    # One result applied, one for a lease this session did not claim (stale), in one batch
    h.apply(RESTART + 200, ev.Result(conn, m.TaskResult("w1", applied, leases[0]["attemptId"], True, {}, None)))
    sent = result(h, RESTART + 200, conn, other, leases[1]["attemptId"], "w1")
    assert [msg for c, msg in sent if isinstance(msg, m.ResultAck)] == [
        m.ResultAck([leases[0]["attemptId"], leases[1]["attemptId"]])]
    assert h.state(applied) == "COMPLETED" and h.state(other) == "RUNNING"
    # A session that did not ask gets none
    plain = h.register(RESTART + 300, "w9", capacity=1)
    sent = result(h, RESTART + 300, plain, other, leases[1]["attemptId"], "w9")
    assert not [msg for _c, msg in sent if isinstance(msg, m.ResultAck)]
