"""The JSON ports' jobs and workers: typed queues, worker sessions, the scheduling pass.

``JsonJobs`` is the core's part for jobs submitted on the client port and run by workers
on the worker port (docs/PROTOCOL.md). It listens to the job table for JSON jobs (a job
entering QUEUED joins its type's queue, leaving it leaves), keeps the worker sessions and
which of them run each type, applies worker events (registration, heartbeats, results,
disconnects), detects dead workers, decides what follows an attempt that ended without a
result (backoff while attempts remain), and assigns queued jobs to free workers. It
changes jobs only through the table and sends only through the outbox.

A worker that registers again after losing its coordinator names the attempts it still
runs (``running``). Each one that recovery kept on its lease for a worker to claim
(``table.unclaimed``, --lease-grace-millis) is bound to the new session, as long as the
session has the workerId that held the lease, declared the job's type (which its token
allowed, or the registration was refused) and has room; it is the same attempt, with a
fresh deadline. Every other one (the job ended, moved on to another attempt, is held by
another session or worker, is of a type the session does not run, or is unknown) gets
a TASK_CANCEL after WORKER_REGISTERED, so the worker drops it, and changes nothing.
Claims are taken while the coordinator is draining or paused too: the attempt runs
anyway, and its result can be applied. A result is applied only from the session that
holds its lease: a kept lease nobody claimed takes no result.

A TASK_PROGRESS is kept only in memory, as its job's ``progress`` (the snapshot shows
it), and only from the session that holds the lease of that very attempt; the job's next
move clears it. It is never stored: a report costs a lookup and a small dict, and a
restart forgets it (the next report brings it back).

A session that asked for them (WORKER_REGISTER ``resultAcks``) gets one RESULT_ACK at
the end of each batch naming the results of it that were dealt with (applied, or
stale); the frame leaves after the batch's commit, so an acknowledged result is durable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable
import logging
from collections import Counter

import ujson

from jobmesh.coordinator.core import scheduler
from jobmesh.coordinator.core.figures import Counters
from jobmesh.coordinator.core.limits import Limits, TypeLimit
from jobmesh.store.job import Job
from jobmesh.coordinator.core.outbox import Outbox
from jobmesh.coordinator.core.registry import Session, WorkerRegistry
from jobmesh.coordinator.core.table import BUILTIN_TYPES, JobTable
from jobmesh.protocol import messages as m
from jobmesh.protocol.jobs import JobState
from jobmesh.protocol.messages import quote
from jobmesh.protocol.payloads import (MAX_NESTING, is_finite_json, progress_problem, result_too_large,
                                       task_defaults_problem, too_deep)

if TYPE_CHECKING:
    from jobmesh.coordinator.core.peers import OutboundConnection

log = logging.getLogger(__name__)

MAX_WORKER_ID_CHARS = 256
MAX_ERROR_CHARS = m.MAX_ERROR_CHARS
MAX_STALE_PER_SECOND = 100  # results for leases a worker does not hold, before it is cut off


def _attempt_number(job_id: str, attempt_id: str) -> int | None:
    """n of an attempt id ``<jobId>.<n>`` of this job; None if it is not one."""
    head, _, tail = attempt_id.rpartition(".")
    return int(tail) if head == job_id and tail.isdigit() and len(tail) < 10 else None


class JsonJobs:
    def __init__(self, table: JobTable, outbox: Outbox, counters: Counters, limits: Limits,
                 held_elsewhere: Callable[[str], bool] = lambda worker_id: False) -> None:
        self.table = table
        self.limits = limits
        self.held_elsewhere = held_elsewhere  # whether a live Periodic session has that worker id
        self.config = table.config
        self.outbox = outbox
        self.counters = counters
        self.queued = scheduler.TypedQueues()
        self.workers = WorkerRegistry()
        self.workers_by_type: dict[str, set[Session]] = {}  # task type -> live sessions that run it
        self.acking: list[Session] = []  # the sessions with results to acknowledge at the end of the batch
        # Set by the core between batches: assign nothing (draining, or storage failing).
        self.hold = False
        table.listen(self, periodic=False)
        limits.on_change(self._limit_changed)
        limits.on_open(self._key_opened)

    # ---- the table's listener ----------------------------------------------------------

    def entered(self, job: Job, now: int) -> None:
        if job.state is JobState.QUEUED:
            self.queued.add(job.job_id, job.task_type, job.priority.level, job.ready_at, job.seq, job.concurrency_key)

    def moved(self, job: Job, source: JobState, target: JobState, now: int) -> None:
        if source is JobState.QUEUED:
            self.queued.discard(job.job_id)
        if target is JobState.QUEUED:
            self.queued.add(job.job_id, job.task_type, job.priority.level, job.ready_at, job.seq, job.concurrency_key)

    # ---- limits: a limited type's jobs queue behind its gate ---------------------------

    def _limit_changed(self, task_type: str, limit: TypeLimit | None) -> None:
        jobs = self.table.jobs
        self.queued.set_gate(task_type, limit, lambda job_id: jobs[job_id].concurrency_key)

    def _key_opened(self, task_type: str, key: str | None) -> None:
        if key is not None:
            self.queued.unblock(task_type, key)

    def waiting_reason(self, job: Job) -> str:
        """Why a QUEUED job is not running: its type's limit, else the worker indexes
        (O(workers of its type))."""
        held = self.limits.reason(job)
        if held is not None:
            return held
        if not len(self.workers):
            return "NO_WORKER"
        able = self.workers_by_type.get(job.task_type)
        if not able:
            return "NO_WORKER_FOR_TYPE"
        running = self.table.running
        for session in able:
            if len(running(session)) < session.capacity:
                return "BEHIND_OTHER_JOBS"  # a worker has room: the next pass takes it, or better jobs
        return "WORKERS_BUSY"

    # ---- worker events -------------------------------------------------------------------

    def on_registered(self, now: int, conn: OutboundConnection, msg: m.WorkerRegister) -> None:
        worker_id, capacity = msg.worker_id, msg.capacity
        if not 1 <= capacity <= 1024:
            self._refuse(conn, "capacity must be 1..1024, got %s" % quote(capacity))
            return
        if not worker_id or len(worker_id) > MAX_WORKER_ID_CHARS:
            self._refuse(conn, "workerId must be 1..%d characters" % MAX_WORKER_ID_CHARS)
            return
        if self.workers.by_conn(conn) is not None:
            self._refuse(conn, "this connection is already registered")
            return
        if self.workers.get(worker_id) is not None:
            log.warning("refused duplicate registration worker=%s", worker_id)
            self._refuse(conn, "worker id %s belongs to a live session" % quote(worker_id))
            return
        if self.held_elsewhere(worker_id):  # one namespace of worker ids for both ports
            log.warning("refused registration worker=%s: a Periodic worker session holds that id", worker_id)
            self._refuse(conn, "worker id %s belongs to a live Periodic worker session" % quote(worker_id))
            return
        types = BUILTIN_TYPES if msg.task_types is None else frozenset(msg.task_types)
        if msg.task_defaults is not None:
            problem = self._defaults_problem(msg.task_defaults, types)
            if problem is not None:
                log.warning("refused registration worker=%s: %s", worker_id, problem)
                self._refuse(conn, problem)
                return
        for name in self.table.declare_types(types, now):
            log.info("new task type declared type=%s worker=%s", name, worker_id)
        if msg.task_defaults:
            for name in self.table.declare_defaults(msg.task_defaults):
                log.info("task type defaults declared type=%s worker=%s defaults=%s", name, worker_id,
                         ujson.dumps(self.table.defaults[name].to_wire()))
        session = Session(worker_id, capacity, conn, now, types, msg.result_acks)
        self.table.session_started(session)
        self.workers.add(session)
        for name in types:
            self.workers_by_type.setdefault(name, set()).add(session)
        self.outbox.send(conn, m.WorkerRegistered(worker_id, msg.result_acks))
        log.info("worker registered worker=%s capacity=%d types=%s", worker_id, capacity, ",".join(sorted(types)))
        if msg.running:
            self._claim(now, session, msg.running)

    @staticmethod
    def _defaults_problem(declared: dict[str, Any], types: frozenset[str]) -> str | None:
        """Why a registration's ``taskDefaults`` cannot be kept: a worker speaks only for
        the types it declares (which its token allows), within the bounds."""
        for name, body in declared.items():
            if name not in types:
                return "taskDefaults names task type %s, which this worker does not declare" % quote(name)
            problem = task_defaults_problem(name, body)
            if problem is not None:
                return problem
        return None

    def _claim(self, now: int, session: Session, running: list[dict[str, Any]]) -> None:
        """Keep the named leases that recovery kept for this worker; cancel the others.

        A lease is kept only for the workerId that held it and a type the session runs:
        attempt ids are ``<jobId>.<n>``, so anyone who knows a job id can name one."""
        table = self.table
        for item in running:
            job_id, attempt_id = item["jobId"], item["attemptId"]
            job = table.jobs.get(job_id)
            if job is None or job.attempt_id != attempt_id:
                why = "no such attempt"
            elif job_id in table.unclaimed:
                if job.worker_id != session.worker_id:
                    why = "held by worker %s" % job.worker_id
                elif job.task_type not in session.task_types:
                    why = "the worker does not run task type %s" % job.task_type
                elif len(table.running(session)) < session.capacity:
                    table.claim(job, session, now)
                    log.info("lease kept job=%s attempt=%s worker=%s", job_id, attempt_id, session.worker_id)
                    continue
                why = "the worker is at capacity"
            elif table.leases.get(job_id) is session:
                continue  # named twice
            else:
                why = "held by worker %s" % job.worker_id
            log.info("lease not kept job=%s attempt=%s worker=%s: %s", quote(job_id), quote(attempt_id),
                     session.worker_id, why)
            self.outbox.send(session.conn, m.TaskCancel(job_id, attempt_id))

    def _refuse(self, conn: OutboundConnection, reason: str) -> None:
        self.outbox.send(conn, m.Error(reason))
        self.outbox.send(conn, None)

    # ---- while storage fails (the core refuses writes before applying them) ------------

    def registration_writes(self, msg: m.WorkerRegister) -> bool:
        """Whether applying this registration would write a row: it declares a task type
        the database does not know yet or defaults other than those kept, or claims
        running attempts (a claim stores the lease's new holder and deadline)."""
        return (bool(msg.running) or (msg.task_types is not None and not set(msg.task_types) <= self.table.known_types)
                or (bool(msg.task_defaults) and self._defaults_change(msg)))

    def _defaults_change(self, msg: m.WorkerRegister) -> bool:
        types = BUILTIN_TYPES if msg.task_types is None else frozenset(msg.task_types)
        return (msg.task_defaults is not None and self._defaults_problem(msg.task_defaults, types) is None
                and self.table.changes_defaults(msg.task_defaults))

    def refuse_registration(self, conn: OutboundConnection, msg: m.WorkerRegister, reason: str) -> None:
        """A registration that would store a new task type: ERROR, closed (it registers again)."""
        log.warning("registration refused while storage fails worker=%s: %s", msg.worker_id, reason)
        self._refuse(conn, reason)

    def drop_result(self, res: m.TaskResult) -> None:
        """A result not applied (no lease is held while storage fails): dropped as stale,
        without the STALE_RESULT event a stale result otherwise leaves on its job."""
        log.warning("result dropped while storage fails job=%s attempt=%s worker=%s", res.job_id, res.attempt_id,
                    res.worker_id)
        self.counters.stale_results += 1

    def on_heartbeat(self, now: int, conn: OutboundConnection, worker_id: str) -> None:
        session = self.workers.by_conn(conn)
        if session is not None and session.worker_id == worker_id and now > session.last_heartbeat:
            session.last_heartbeat = now

    def on_result(self, now: int, conn: OutboundConnection, res: m.TaskResult) -> None:
        """Apply a result from the session that holds its lease (a lease is only ever
        given to a session that runs the job's type: assigned, or claimed); drop any other
        as stale. Either way, a session that asked is told (RESULT_ACK)."""
        session = self.workers.by_conn(conn)
        if session is not None and session.acks is not None:
            if not session.acks:
                self.acking.append(session)
            session.acks.append(res.attempt_id)
        job = self._held(session, res.worker_id, res.job_id, res.attempt_id)
        if job is None:
            log.warning("stale result dropped job=%s attempt=%s worker=%s", res.job_id, res.attempt_id, res.worker_id)
            self.counters.stale_results += 1
            if session is not None and self._stale_flood(session, now):
                return
            stale = self.table.jobs.get(res.job_id)
            if stale is not None:
                self.table.event(stale, now, "STALE_RESULT", "a result for a lease that had ended was dropped",
                                 attempt=_attempt_number(stale.job_id, res.attempt_id), worker_id=res.worker_id)
            return
        if res.success:
            result = res.result if res.result is not None else {}
            if too_deep(result):
                self.attempt_failed(job, now, "result nested deeper than %d levels" % MAX_NESTING, "ATTEMPT_FAILED")
                return
            if not is_finite_json(result):
                self.attempt_failed(job, now, "result holds NaN or Infinity, which JSON does not allow",
                                    "ATTEMPT_FAILED")
                return
            try:  # encoded once: the size check and the job's row both use this text
                stored: str | None = ujson.dumps(result, ensure_ascii=False, escape_forward_slashes=False)
            except (ValueError, OverflowError, TypeError, RecursionError):
                stored = None  # measured and encoded as it always was, failing with its own words
            too_large = result_too_large(result, stored)
            if too_large is not None:
                self.attempt_failed(job, now, too_large, "ATTEMPT_FAILED")
                return
            job.result, job.result_json = result, stored
            self.table.transition(job, JobState.COMPLETED, now)
            log.debug("completed job=%s attempt=%d", job.job_id, job.attempts)
        else:
            error = (res.error or "task failed without an error message")[:MAX_ERROR_CHARS]
            self.attempt_failed(job, now, error, "ATTEMPT_FAILED")

    def on_progress(self, now: int, conn: OutboundConnection, report: m.TaskProgress) -> None:
        """Keep a progress report as its job's ``progress`` if the session holds the lease of
        that attempt and the report is within bounds; drop it otherwise (the connection
        stays: a late report of an attempt that just ended is normal)."""
        job = self._held(self.workers.by_conn(conn), report.worker_id, report.job_id, report.attempt_id)
        if job is None or progress_problem(report.fraction, report.message) is not None:
            self.counters.progress_dropped += 1
            log.debug("progress dropped job=%s attempt=%s worker=%s", report.job_id, report.attempt_id,
                      report.worker_id)
            return
        self.counters.progress_reports += 1
        job.progress = {"fraction": report.fraction, "message": report.message, "atMillis": now + self.table.drift}

    def _held(self, session: Session | None, worker_id: str, job_id: str, attempt_id: str) -> Job | None:
        """The job whose running attempt ``attempt_id`` is leased to ``session``, which the
        frame says is ``worker_id``; None if it is not: the one check of results and progress."""
        job = self.table.jobs.get(job_id)
        if (
            session is None
            or session.worker_id != worker_id
            or job is None
            or job.state is not JobState.RUNNING
            or job.attempt_id != attempt_id
            or self.table.leases.get(job_id) is not session
            or job.periodic is not None
        ):
            return None
        return job

    def send_acks(self) -> None:
        """The end of a batch: each session that asked gets one RESULT_ACK for its results
        of the batch (released after the commit, like every frame)."""
        for session in self.acking:
            self.outbox.send(session.conn, m.ResultAck(session.acks or []))
            session.acks = []
        self.acking.clear()

    def _stale_flood(self, session: Session, now: int) -> bool:
        """Count a session's stale results; more than MAX_STALE_PER_SECOND in a second
        is a flood (or forgery): the connection is closed."""
        if now - session.stale_since >= 1000:
            session.stale_since, session.stale_count = now, 0
        session.stale_count += 1
        if session.stale_count <= MAX_STALE_PER_SECOND:
            return False
        log.warning("closing worker=%s: more than %d results a second for leases it does not hold",
                    session.worker_id, MAX_STALE_PER_SECOND)
        self._refuse(session.conn, "more than %d results a second for leases this worker does not hold"
                     % MAX_STALE_PER_SECOND)
        session.stale_count = -10**9  # refused once is enough
        return True

    def on_disconnected(self, now: int, conn: OutboundConnection) -> None:
        session = self.workers.by_conn(conn)
        if session is None:
            return
        log.warning("worker disconnected worker=%s running=%d", session.worker_id, len(self.table.running(session)))
        self._drop_session(session, now, "worker %s disconnected" % session.worker_id)

    def _drop_session(self, session: Session, now: int, reason: str) -> None:
        self.workers.remove(session)
        self.counters.workers_lost += 1
        for name in session.task_types:
            able = self.workers_by_type.get(name)
            if able is not None:
                able.discard(session)
                if not able:
                    del self.workers_by_type[name]
        jobs = self.table.jobs
        for job_id in sorted(self.table.running(session)):
            job = jobs.get(job_id)
            if job is not None and job.state is JobState.RUNNING and job.worker_id == session.worker_id:
                self.attempt_failed(job, now, "attempt %d lost: %s" % (job.attempts, reason), "WORKER_LOST")
        self.table.session_ended(session)

    def stamp_arrivals(self, now: int, arrival_millis: dict[OutboundConnection, int]) -> None:
        """Liveness by arrival: each worker is alive as of the last frame its handler read
        (``arrival_millis``, core time, by connection)."""
        for session in self.workers:
            at = arrival_millis.get(session.conn)
            if at is not None and at > session.last_heartbeat:
                session.last_heartbeat = at

    def detect_dead_workers(self, now: int) -> None:
        limit = self.config.heartbeat_timeout_millis
        for session in self.workers:
            silent = now - session.last_heartbeat
            if silent > limit:
                log.warning("worker presumed dead worker=%s silent=%dms running=%d",
                            session.worker_id, silent, len(self.table.running(session)))
                self.outbox.send(session.conn, None)
                self._drop_session(
                    session, now, "worker %s presumed dead (no heartbeat for %d ms)" % (session.worker_id, silent)
                )

    # ---- outcomes ---------------------------------------------------------------------

    def revoke_lease(self, job: Job, why: str) -> None:
        """Tell the lease holder to stop this attempt (best effort); the transition that
        follows frees its slot."""
        session = self.table.leases.get(job.job_id)
        if session is not None and job.attempt_id is not None:
            self.outbox.send(session.conn, m.TaskCancel(job.job_id, job.attempt_id))
        log.debug("revoked lease job=%s attempt=%s why=%s", job.job_id, job.attempt_id, why)

    def attempt_failed(self, job: Job, now: int, error: str, cause: str) -> None:
        """An attempt ended without a result: RETRY_WAIT while attempts remain, else FAILED."""
        self.table.attempt_ended(job, now, error, cause)
        if job.attempts < job.max_attempts:
            # The job's own backoff (its task type's, kept at creation), else the coordinator's.
            base = self.config.retry_base_millis if job.retry_base is None else job.retry_base
            cap = self.config.retry_cap_millis if job.retry_cap is None else job.retry_cap
            delay = scheduler.retry_delay_millis(job.attempts, base, cap)
            self.table.transition(job, JobState.RETRY_WAIT, now, due_at=now + delay)
            log.info("retry job=%s attempt=%d/%d in=%dms error=%s", job.job_id, job.attempts, job.max_attempts, delay, error)
        else:
            self.table.transition(job, JobState.FAILED, now)
            log.info("failed job=%s attempts=%d error=%s", job.job_id, job.attempts, error)

    # ---- scheduling ---------------------------------------------------------------------

    def schedule(self, now: int) -> int:
        """Assign queued jobs, best first, each to the least-loaded free worker that runs its type.

        Only the types some free worker declared are candidates, so a job no free worker
        can run never holds back one that a free worker can run. Held (draining, or
        storage failing), it assigns nothing.
        """
        queued = self.queued
        if not len(queued) or self.hold:
            return 0
        # each free session's running set, looked up once a pass (the table keeps it current)
        load = {s: held for s in self.workers if len(held := self.table.running(s)) < s.capacity}
        if not load:
            return 0
        free = list(load)
        runnable: Counter[str] = Counter()  # type -> free workers that run it
        for session in free:
            runnable.update(session.task_types)
        assigned = 0
        step = self.config.aging_step_millis
        jobs = self.table.jobs
        transition = self.table.transition
        while free and len(queued):
            picked = queued.pop_best(now, step, runnable)
            if picked is None:
                break
            job_id, task_type = picked
            worker = scheduler.least_loaded(
                (s for s in free if task_type in s.task_types), lambda s: len(load[s]), lambda s: s.capacity
            )
            assert worker is not None, "runnable counts a free worker for this type"
            job = jobs[job_id]
            transition(job, JobState.RUNNING, now, session=worker)
            self.outbox.send(worker.conn, m.TaskAssign(job.job_id, job.attempt_id or "", job.attempts, job.task_type,
                                                       job.payload, job.parents))
            log.debug("assigned job=%s attempt=%s worker=%s", job.job_id, job.attempt_id, worker.worker_id)
            assigned += 1
            if len(load[worker]) >= worker.capacity:
                free.remove(worker)
                for name in worker.task_types:
                    runnable[name] -= 1
                    if runnable[name] <= 0:
                        del runnable[name]  # no free worker runs it any more
        return assigned

    @property
    def running_attempts(self) -> int:
        running = self.table.running
        return sum(len(running(s)) for s in self.workers)
