"""ACQUIRE / RELEASE: running Periodic jobs take, wait for and give back locks (PERIODIC.md 7.14).

``JobLocks`` applies the answers of the lock table (``locks.py``) to jobs: a running job
refused a lock leaves its worker and waits QUEUED (LOCK_WAIT), out of its func's queue,
until a release hands it the lock and puts it back in the queue (``index.py``); a job
whose run ends gives up the locks it holds, and one that ends gives up its wait too.
It answers the two requests, and is told of every move of a Periodic job by the façade.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from jobmesh.coordinator.core.figures import Counters
from jobmesh.coordinator.core.outbox import Outbox
from jobmesh.coordinator.core.periodic.index import FuncIndex, close_not_text, text
from jobmesh.coordinator.core.periodic.locks import LockTable
from jobmesh.coordinator.core.periodic.workers import WorkerSessions
from jobmesh.coordinator.core.table import JobTable
from jobmesh.periodic import codec as pc
from jobmesh.protocol.jobs import TERMINAL, JobState
from jobmesh.store.job import Job

if TYPE_CHECKING:
    from jobmesh.coordinator.core.peers import OutboundConnection

log = logging.getLogger(__name__)


class JobLocks:
    def __init__(self, table: JobTable, index: FuncIndex, sessions: WorkerSessions, locks: LockTable,
                 outbox: Outbox, counters: Counters) -> None:
        self.table = table
        self.index = index
        self.sessions = sessions
        self.locks = locks
        self.outbox = outbox
        self.counters = counters

    def waits(self, job_id: str) -> bool:
        """Whether the job waits for a lock (QUEUED, LOCK_WAIT)."""
        return job_id in self.locks.waiting

    def moved(self, job: Job, source: JobState, target: JobState, waited: bool) -> None:
        """A Periodic job moved: one whose run ended lets go of its locks (a refused job
        gives them up too), one that ended stops waiting as well (``waited``: it did)."""
        held = self.locks.held
        if not held and not waited:
            return
        job_id = job.job_id
        if source is JobState.RUNNING and job_id in held:
            self._promote(self.locks.release_held(job_id))
        if target in TERMINAL and (waited or job_id in held):
            self._promote(self.locks.release_all(job_id))

    def stop_waiting(self, job: Job) -> bool:
        """A resubmit replaces a job waiting for a lock: it waits no more (periodicd:
        Locked -> Pending), and its caller indexes it. Whether it waited."""
        lock = self.locks.waiting.get(job.job_id)
        if lock is None:
            return False
        self.index.lock_waited(job, enter=False)
        self.locks.release(lock, job.job_id)
        return True

    def on_acquire(self, now: int, conn: OutboundConnection, msg: pc.Acquire) -> None:
        """ACQUIRE: granted (1) or refused (0). A refused job leaves its worker and waits
        QUEUED (LOCK_WAIT) until a release gives it the lock; a job that is not running
        is granted without taking anything, as periodicd does."""
        lock = text(msg.lock)
        key, job = self.index.live(msg.handle)
        if lock is None or key is None:
            close_not_text(self.outbox, conn)
            return
        granted = True
        if job is not None and job.state is JobState.RUNNING and not self.sessions.runs_on(job, self.sessions.of(conn)):
            granted = False  # an attempt that has ended (its job runs elsewhere now): nothing recorded
        elif job is not None and job.state is JobState.RUNNING:
            granted, promoted = self.locks.acquire(lock, msg.max_holders, job.job_id)
            self._promote(promoted)
            if not granted:
                self.index.lock_wait(job)
                self.table.transition(job, JobState.QUEUED, now, event=None)
                self.table.event(job, now, "QUEUED", "waiting for lock %s (%d holders at most)"
                                 % (lock, self.locks.max_holders(lock)), attempt=job.attempts)
        self.outbox.send(conn, pc.encode_acquired(msg.msgid, granted))

    def on_release(self, now: int, conn: OutboundConnection, msg: pc.Release) -> None:
        lock = text(msg.lock)
        key, job = self.index.live(msg.handle)
        if lock is None or key is None:
            close_not_text(self.outbox, conn)
            return
        if job is not None and job.state is JobState.RUNNING and not self.sessions.runs_on(job, self.sessions.of(conn)):
            # an attempt that has ended (its job runs elsewhere now): its locks went with it
            self.counters.stale_results += 1
            log.info("periodic RELEASE from a worker the job does not run on ignored job=%s lock=%s",
                     job.job_id, lock)
        elif job is not None:
            waited = self.locks.waiting.get(job.job_id) == lock
            self._promote(self.locks.release(lock, job.job_id))
            if waited:  # it stops waiting: pending again (periodicd: Locked -> Pending)
                self.index.lock_waited(job)
        self.outbox.send(conn, pc.encode_success(msg.msgid))

    def _promote(self, job_ids: list[str]) -> None:
        """Jobs a release gave a lock to: back in their func's dispatch queue."""
        for job_id in job_ids:
            job = self.table.jobs.get(job_id)
            if job is not None and job.state is JobState.QUEUED:
                self.index.lock_waited(job)
