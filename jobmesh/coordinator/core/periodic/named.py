"""The named-job lifecycle of the Periodic port (PERIODIC.md 7.2, 7.5-7.7, 7.10-7.13).

``NamedJobs`` creates a job per (func, name) on SUBMIT_JOB (and RUN_JOB, LOAD), replaces
a pending one of that name or drops the submit while it runs; ends jobs on REMOVE_JOB
and DROP_FUNC; lists them for DUMP; and applies a worker's outcome: WORK_DONE completes
the job, WORK_FAIL (or a lost worker, or an expired deadline) retries it after a second
without any attempt budget, SCHED_LATER makes it pending again later. Jobs are created,
changed and moved only through the table.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from jobmesh.coordinator.core.figures import Counters
from jobmesh.coordinator.core.outbox import Outbox
from jobmesh.coordinator.core.periodic.index import (
    FuncIndex, as_text, attempt_timeout, close_not_text, func_name, i32, text, wire_job)
from jobmesh.coordinator.core.periodic.locking import JobLocks
from jobmesh.coordinator.core.periodic.waits import PeriodicWaits
from jobmesh.coordinator.core.periodic.workers import WorkerSessions
from jobmesh.coordinator.core.table import JobTable
from jobmesh.periodic import codec as pc
from jobmesh.protocol.jobs import JobState, Priority
from jobmesh.store.job import MAX_RUN_AT_MILLIS, Job

if TYPE_CHECKING:
    from jobmesh.coordinator.core.peers import OutboundConnection

log = logging.getLogger(__name__)

RETRY_MILLIS = 1000  # WORK_FAIL, a lost worker or an expired deadline: again after 1 s (periodicd)
MAX_DELAY_SECONDS = 10 * 366 * 86400  # SCHED_LATER delays are capped at ten years
REJECTED = b"rejected: the coordinator is at its active-job limit"  # SUBMIT_JOB / RUN_JOB at admission
TOO_LATE = b"rejected: sched_at must be before the year 10000"


class NamedJobs:
    def __init__(self, table: JobTable, index: FuncIndex, sessions: WorkerSessions,
                 locking: JobLocks, waits: PeriodicWaits, outbox: Outbox, counters: Counters) -> None:
        self.table = table
        self.index = index
        self.sessions = sessions
        self.locking = locking
        self.waits = waits  # a job a RUN_JOB caller waits for ends at its first failure
        self.outbox = outbox
        self.counters = counters

    def timeout(self, fields: dict[str, Any]) -> int:
        """The effective per-attempt timeout (ms): the job's, else the coordinator's."""
        return attempt_timeout(fields, self.table.config.task_timeout_millis)

    # ---- submits --------------------------------------------------------------------------

    def store(self, now: int, func: str, name: str, pj: pc.Job, submitted_by: str | None) -> bytes | None:
        """SUBMIT_JOB's work (RUN_JOB and LOAD too): create, replace a pending job of that
        name, or drop it if it runs. None, or why it was refused (the DATA text).
        ``submitted_by`` (a token's name, or None) is kept by a job it creates and named
        by the SUBMITTED or REPLACED event, as on the JSON ports."""
        wall = now + self.table.drift
        if pj.sched_at > MAX_RUN_AT_MILLIS // 1000:
            return TOO_LATE  # (the JSON port refuses such times too)
        sched = min(max(pj.sched_at * 1000 if pj.sched_at > 0 else 0, wall), MAX_RUN_AT_MILLIS)
        workload, b64 = as_text(pj.workload)
        fields = {"workload": workload, "b64": b64, "count": pj.count, "timeout": max(pj.timeout, 0),
                  "sched": sched}
        existing = self.index.job_of((func, name))
        if existing is not None:
            if existing.state is not JobState.RUNNING:
                self._replace(existing, fields, now, submitted_by)
            else:
                log.debug("periodic submit dropped: job=%s func=%s name=%s is running", existing.job_id, func, name)
            return None
        if self.table.active_count >= self.table.config.max_active_jobs:
            self.counters.rejected += 1
            return REJECTED
        later = sched > wall
        job = self.table.new_job(now, func, {}, 0, Priority.NORMAL,
                                 JobState.SCHEDULED if later else JobState.QUEUED,
                                 execution_timeout=self.timeout(fields), run_at=sched, name=name, periodic=fields)
        detail = None
        if submitted_by is not None:
            self.table.record(job, submitted_by=submitted_by)
            detail = "by %s" % submitted_by
        self.table.admit(job, now, detail)  # the façade's entered() indexes it
        log.debug("periodic submit job=%s func=%s name=%s sched=%d", job.job_id, func, name, sched)
        return None

    def _replace(self, job: Job, fields: dict[str, Any], now: int, submitted_by: str | None) -> None:
        """A pending named job resubmitted: new workload, sched time, count and timeout
        (REPLACED); one waiting for a lock stops waiting (periodicd: Locked -> Pending)."""
        unlocked = self.locking.stop_waiting(job)
        old_sched = job.periodic["sched"] if job.periodic is not None else None
        sched = fields["sched"]
        self.table.set_periodic(job, fields, timeout=self.timeout(fields), run_at=sched)
        self.table.event(job, now, "REPLACED", None if submitted_by is None else "by %s" % submitted_by)
        later = sched > now + self.table.drift
        target = JobState.SCHEDULED if later else JobState.QUEUED
        if job.state is target:  # same state: re-index if the time moved (or a lock let it go)
            if sched != old_sched or unlocked:
                if later:
                    self.table.retime(job)
                self.index.enter(job)
        else:
            self.table.transition(job, target, now, due_at=sched - self.table.drift if later else None, event=None)

    def on_submit(self, now: int, conn: OutboundConnection, msg: pc.SubmitJob, submitted_by: str | None) -> None:
        func, name = func_name(msg.job.func), text(msg.job.name)
        if func is None or name is None:
            close_not_text(self.outbox, conn)
            return
        problem = self.store(now, func, name, msg.job, submitted_by)
        self.outbox.send(conn, pc.encode_success(msg.msgid) if problem is None else pc.encode_data(msg.msgid, problem))

    def on_load(self, now: int, conn: OutboundConnection, msg: pc.Load, submitted_by: str | None) -> None:
        """LOAD: each job of the list as a SUBMIT_JOB; a refused one ends the load with its reason."""
        for pj in msg.jobs:
            func, name = func_name(pj.func), text(pj.name)
            if func is None or name is None:
                close_not_text(self.outbox, conn)
                return
            problem = self.store(now, func, name, pj, submitted_by)
            if problem is not None:
                self.outbox.send(conn, pc.encode_data(msg.msgid, problem))
                return
        self.outbox.send(conn, pc.encode_success(msg.msgid))

    def on_dump(self, now: int, conn: OutboundConnection, msg: pc.Dump) -> None:
        """DUMP: every live Periodic job, as a job list (a backup LOAD can read back)."""
        default = self.table.config.task_timeout_millis
        jobs = [wire_job(job, default, dump=True) for job in self.index.live_jobs()]
        self.outbox.send(conn, pc.encode_dump(msg.msgid, jobs))

    # ---- removals -------------------------------------------------------------------------

    def on_remove(self, now: int, conn: OutboundConnection, msg: pc.RemoveJob) -> None:
        key, job = self.index.live(msg.handle)
        if key is None:
            close_not_text(self.outbox, conn)
            return
        if job is not None:
            self.table.record(job, error="removed by a Periodic client (REMOVE_JOB)")
            self.table.transition(job, JobState.CANCELLED, now)
        self.outbox.send(conn, pc.encode_success(msg.msgid))

    def on_drop_func(self, now: int, conn: OutboundConnection, msg: pc.DropFunc) -> None:
        """DROP_FUNC: with no worker declaring it, all its jobs go, and the func with them
        at once."""
        func = func_name(msg.func)
        if func is None:
            close_not_text(self.outbox, conn)
            return
        for job_id in self.index.droppable(func):
            job = self.table.jobs.get(job_id)
            if job is not None:
                self.table.record(job, error="removed by a Periodic client (DROP_FUNC)")
                self.table.transition(job, JobState.CANCELLED, now)
        self.index.drop(func)
        self.outbox.send(conn, pc.encode_success(msg.msgid))

    # ---- a worker's outcome -----------------------------------------------------------------

    def on_outcome(self, now: int, conn: OutboundConnection, msg: pc.WorkDone | pc.WorkFail | pc.SchedLater) -> None:
        """WORK_DONE, WORK_FAIL, SCHED_LATER from the worker the job runs on (others are stale)."""
        session = self.sessions.session(conn, now)
        _key, job = self.index.live(msg.handle)
        if job is None or not self.sessions.runs_on(job, session):
            self.counters.stale_results += 1
            log.info("periodic outcome for a job not running on this worker dropped worker=%s func=%r name=%r",
                     session.worker_id, msg.handle.func, msg.handle.name)
        elif type(msg) is pc.WorkDone:
            data, b64 = as_text(msg.data)
            self.table.record(job, result={"dataBase64": data} if b64 else {"data": data})
            self.table.transition(job, JobState.COMPLETED, now)
        elif type(msg) is pc.WorkFail:
            self.attempt_failed(job, now, "the Periodic worker reported WORK_FAIL (attempt %d)"
                                % job.attempts, "ATTEMPT_FAILED")
        else:
            assert isinstance(msg, pc.SchedLater)
            self._sched_later(job, now, msg.delay, msg.step)
        self.outbox.send(conn, pc.encode_success(msg.msgid))

    def attempt_failed(self, job: Job, now: int, error: str, cause: str) -> None:
        """An attempt ended without a result: again after 1 s, without any attempt budget
        (periodicd); but a job a RUN_JOB caller waits for ends (the caller hears ``failed``)."""
        assert job.periodic is not None
        self.table.attempt_ended(job, now, error, cause)
        if self.waits and self.waits.run_waited(job):
            self.table.transition(job, JobState.FAILED, now)
            return
        self.table.set_periodic(job, dict(job.periodic, sched=now + self.table.drift + RETRY_MILLIS))
        self.table.transition(job, JobState.RETRY_WAIT, now, due_at=now + RETRY_MILLIS)
        log.info("retry periodic job=%s func=%s in=%dms error=%s", job.job_id, job.task_type,
                 RETRY_MILLIS, error)

    def _sched_later(self, job: Job, now: int, delay: int, step: int) -> None:
        """SCHED_LATER: back to pending, due in ``delay`` seconds, count += step; a job a
        RUN_JOB caller waits for ends instead (``failed``), as periodicd does."""
        assert job.periodic is not None
        if self.waits and self.waits.run_waited(job):
            self.table.record(job, error="the Periodic worker asked SCHED_LATER while a RUN_JOB caller waited")
            self.table.transition(job, JobState.FAILED, now)
            return
        delay_ms = min(max(delay, 0), MAX_DELAY_SECONDS) * 1000
        sched = now + self.table.drift + delay_ms
        fields = dict(job.periodic, count=i32(int(job.periodic.get("count") or 0) + step), sched=sched)
        if delay_ms > 0:
            self.table.set_periodic(job, fields)
            self.table.transition(job, JobState.SCHEDULED, now, due_at=now + delay_ms)
        else:
            self.table.set_periodic(job, fields, run_at=sched)
            self.table.transition(job, JobState.QUEUED, now, event="RESCHEDULED")
