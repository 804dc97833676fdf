"""The Periodic part of the core: named jobs, funcs, grab tokens, locks and waits (docs/PERIODIC.md).

``PeriodicJobs`` is the core's part for the Periodic port, and its one face: it composes
the parts below, each owning its state, as the Periodic protocol divides the work:

* ``index`` (``index.py``): per func, its workers, live jobs, dispatch queue and STATUS
  figures; the live job of each (func, name); idle funcs to forget;
* ``sessions`` (``workers.py``): worker sessions, grab tokens, dispatch, broadcast;
* ``locking`` (``locking.py``, over ``locks.py``): ACQUIRE / RELEASE;
* ``named_jobs`` (``named.py``): SUBMIT_JOB, REMOVE_JOB, DROP_FUNC, DUMP / LOAD and a
  worker's outcomes, retries without a budget;
* ``streams`` (``streams.py``, over ``waits.py``): RUN_JOB, RECV_DATA, WORK_DATA;
* ``commands`` (``commands.py``): the request type -> handler table.

Everything here runs on the core greenlet, changes jobs only through the job table and
sends only through the outbox; the Periodic connection handler (``ports/periodic.py``)
decodes frames and posts events, and owns no state. A Periodic job is a job whose
``periodic`` fields are set: taskType is its func, and ``name`` is unique per func among
live jobs. It moves through the same states as every job; this façade is the table's
listener for Periodic jobs (``entered``, ``moved``) and keeps the parts in step.
Periodic connections get bytes (codec frames) through the outbox, released after the
batch's commit like every frame.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from jobmesh.coordinator.core.figures import Counters
from jobmesh.coordinator.core.limits import Limits
from jobmesh.coordinator.core.outbox import Outbox
from jobmesh.coordinator.core.periodic.commands import PeriodicCommands
from jobmesh.coordinator.core.periodic.index import FuncIndex, PeriodicFunc
from jobmesh.coordinator.core.periodic.locking import JobLocks
from jobmesh.coordinator.core.periodic.locks import LockTable
from jobmesh.coordinator.core.periodic.named import NamedJobs
from jobmesh.coordinator.core.periodic.streams import Streams
from jobmesh.coordinator.core.periodic.waits import PeriodicWaits
from jobmesh.coordinator.core.periodic.workers import WorkerSessions
from jobmesh.coordinator.core.registry import PeriodicSession
from jobmesh.coordinator.core.table import JobTable
from jobmesh.protocol.jobs import TERMINAL, JobState
from jobmesh.store.job import Job

if TYPE_CHECKING:
    from jobmesh.coordinator.core.peers import OutboundConnection


class PeriodicJobs:
    """The core's Periodic requests and events; see the module docstring."""

    def __init__(self, table: JobTable, outbox: Outbox, counters: Counters, limits: Limits,
                 held_elsewhere: Callable[[str], bool] = lambda worker_id: False) -> None:
        self.table = table
        self.limits = limits  # a func's jobs obey the limit of the task type of its name
        locks = LockTable()
        self.index = FuncIndex(table, locks.waiting)
        # ``held_elsewhere``: whether a live JSON worker session has that worker id
        self.sessions = WorkerSessions(table, self.index, outbox, counters, limits, held_elsewhere)
        self.locking = JobLocks(table, self.index, self.sessions, locks, outbox, counters)
        self.waits = PeriodicWaits(outbox)
        self.named_jobs = NamedJobs(table, self.index, self.sessions, self.locking, self.waits, outbox,
                                    counters)
        self.streams = Streams(table, self.index, self.sessions, self.named_jobs, self.waits, outbox, counters)
        self.commands = PeriodicCommands(outbox, self.index, self.sessions, self.locking, self.named_jobs,
                                         self.streams)
        table.listen(self, json=False)
        limits.on_open(self.index.opened)

    # ---- the table's listener ----------------------------------------------------------

    def entered(self, job: Job, now_millis: int) -> None:
        """A Periodic job is in the table (submitted, or recovered as it was stored)."""
        assert job.periodic is not None
        self.table.set_periodic(job, job.periodic, timeout=self.named_jobs.timeout(job.periodic))
        self.index.entered(job)

    def moved(self, job: Job, source: JobState, target: JobState, now_millis: int) -> None:
        """A Periodic job moved: the sessions it ran on, its locks (a job that stops running
        lets go of them, unless a lock just refused it), its RUN_JOB / RECV_DATA waiters
        (answered when the job ends) and the func index."""
        waited = self.locking.waits(job.job_id)
        if source is JobState.RUNNING:
            self.sessions.stopped(job)
        self.locking.moved(job, source, target, waited)
        if target in TERMINAL:
            self.waits.fire(job, target, now_millis)
        self.index.moved(job, source, target, now_millis, waited)

    # ---- what the core calls -----------------------------------------------------------

    def on_packet(self, now_millis: int, conn: OutboundConnection, msg: Any, submitted_by: str | None = None) -> None:
        """One decoded Periodic request, through the command table (``commands.py``)."""
        self.commands.on_packet(now_millis, conn, msg, submitted_by)

    def writes(self, msg: Any) -> bool:
        """Whether the request may store or end a job (refused while storage fails)."""
        return self.commands.writes(msg)

    def refuse(self, conn: OutboundConnection, msg: Any, reason: str) -> None:
        """A write refused while storage fails: DATA with the reason."""
        self.commands.refuse(conn, msg, reason)

    def on_closed(self, now_millis: int, conn: OutboundConnection) -> None:
        """A Periodic connection ended: its RUN_JOB / RECV_DATA waits are forgotten; its
        funcs lose a worker, its running jobs go back to be retried (after 1 s), its tokens
        vanish."""
        self.streams.closed(conn)
        for job in self.sessions.closed(now_millis, conn):
            self.named_jobs.attempt_failed(job, now_millis, "attempt %d lost: Periodic worker %s disconnected"
                                           % (job.attempts, job.worker_id), "WORKER_LOST")

    def attempt_failed(self, job: Job, now_millis: int, error: str, cause: str) -> None:
        """An attempt ended without a result (its deadline passed): retried after 1 s."""
        self.named_jobs.attempt_failed(job, now_millis, error, cause)

    def dispatch(self, now_millis: int) -> int:
        """Hand due Periodic jobs to grab tokens; how many were assigned."""
        return self.sessions.dispatch(now_millis)

    def end_batch(self, now_millis: int) -> None:
        """After each batch: dispatch, then the RUN_JOB results of the batch's job ends
        (after the frames of any RECV_DATA applied in it; ``waits.py``)."""
        self.sessions.dispatch(now_millis)
        self.waits.release_results()

    def expire_waits(self, now_millis: int) -> None:
        """The sweep's step: RUN_JOB / RECV_DATA waits whose time is up."""
        self.streams.expire_waits(now_millis)

    def forget_idle(self, now_millis: int) -> None:
        """The sweep's step: forget the funcs idle for --periodic-forget-idle-millis."""
        self.index.forget_idle(now_millis)

    def waiting_reason(self, job: Job) -> str:
        """Why a QUEUED Periodic job is not running."""
        held = self.limits.reason(job)
        if held is not None:
            return held
        if self.locking.waits(job.job_id):
            return "LOCK_WAIT"
        return self.index.worker_wait(job.task_type)

    def sizes(self) -> tuple[int, int]:
        """(live Periodic jobs, funcs)."""
        return self.index.sizes()

    @property
    def running_attempts(self) -> int:
        return self.sessions.running_attempts

    @property
    def funcs(self) -> dict[str, PeriodicFunc]:
        """The funcs known now (a limit may name one)."""
        return self.index.funcs

    @property
    def workers(self) -> dict[str, PeriodicSession]:
        """The worker sessions by worker id (WORKER_LIST; one namespace with the JSON port's)."""
        return self.sessions.by_id

    @property
    def hold(self) -> bool:
        return self.sessions.hold

    @hold.setter
    def hold(self, value: bool) -> None:
        """Set by the core between batches: assign nothing (draining, or storage failing)."""
        self.sessions.hold = value
