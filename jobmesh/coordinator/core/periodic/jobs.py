"""The Periodic part of the core: named jobs, funcs, grab tokens, locks and waits (docs/PERIODIC.md).

``PeriodicJobs`` is the core's part for the Periodic port. Everything here runs on the
core greenlet, changes jobs only through the job table and sends only through the outbox;
the Periodic connection handler (``periodic_port.py``) decodes frames and posts events,
and owns no state.

A Periodic job is a job whose ``periodic`` fields are set: taskType is its func, and
``name`` is unique per func among live jobs (``named``). It moves through the same
states as every job; as the table's listener for Periodic jobs (``entered``, ``moved``)
this part keeps the per-func figures, the dispatch queue, the name index, the locks and
the RUN_JOB / RECV_DATA waiters (``periodic_waits.py``) in step. Periodic connections get
bytes (codec frames) through the outbox, released after the batch's commit like every frame.
"""

from __future__ import annotations

import base64
import heapq
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable

from jobmesh.coordinator.core.figures import Counters
from jobmesh.coordinator.core.limits import Limits
from jobmesh.store.job import MAX_RUN_AT_MILLIS, Job
from jobmesh.coordinator.core.periodic.locks import LockTable
from jobmesh.coordinator.core.outbox import Outbox
from jobmesh.coordinator.core.periodic.waits import EXPIRED_ERROR, PeriodicWaits, wait_deadline
from jobmesh.coordinator.core.registry import PeriodicSession
from jobmesh.coordinator.core.table import JobTable
from jobmesh.errors import PeriodicError
from jobmesh.periodic import codec as pc
from jobmesh.protocol.jobs import TERMINAL, JobState, Priority

if TYPE_CHECKING:
    from jobmesh.coordinator.core.peers import OutboundConnection

log = logging.getLogger(__name__)

RETRY_MILLIS = 1000  # WORK_FAIL, a lost worker or an expired deadline: again after 1 s (periodicd)
MAX_TOKENS = 4096  # grab tokens one Periodic worker may hold
MAX_FUNCS = 10_000  # funcs one Periodic connection may declare (CAN_DO, BROADCAST)
# Funcs one connection's declarations may bring into the listing over its life: one it
# withdraws (CANT_DO) stays listed for the forget time, so churning new names is bounded too.
MAX_NEW_FUNCS = 10 * MAX_FUNCS
FORGET_PER_SWEEP = 10_000  # idle funcs forgotten by one sweep at most (the rest by the next)
MAX_DELAY_SECONDS = 10 * 366 * 86400  # SCHED_LATER delays are capped at ten years
REJECTED = b"rejected: the coordinator is at its active-job limit"  # SUBMIT_JOB / RUN_JOB at admission
TOO_LATE = b"rejected: sched_at must be before the year 10000"
I32_MAX = 2**31 - 1  # count and timeout travel as signed 32-bit integers
_PENDING = frozenset({JobState.QUEUED, JobState.SCHEDULED, JobState.RETRY_WAIT})
# The client requests that store jobs or end them; refused while storage fails. (A worker's
# outcomes write nothing then: no Periodic job runs while the core is paused.)
WRITES = frozenset({pc.SubmitJob, pc.RunJob, pc.RemoveJob, pc.DropFunc, pc.Load})


class PeriodicFunc:
    """What the core keeps per Periodic func (docs/PERIODIC.md): its workers, its live
    jobs, how many run, its queue of due jobs and the sched times of its pending jobs.
    Kept by ``_transition``; STATUS reads it without looking at any job but the earliest."""

    __slots__ = ("workers", "ids", "processing", "locked", "queue", "pending", "turn", "broadcast")

    def __init__(self) -> None:
        self.workers: list[PeriodicSession] = []  # connected sessions that declared it, in rotation order
        self.ids: set[str] = set()  # its live jobs (pending or running)
        self.processing = 0  # its RUNNING jobs
        self.locked = 0  # its jobs waiting for a lock (QUEUED, out of ``queue``)
        self.queue: list[tuple[int, str, str]] = []  # (sched, name, job id) of QUEUED jobs; stale entries skipped
        self.pending: list[tuple[int, str]] = []  # (sched, job id) of pending jobs; stale entries skipped
        self.turn = 0  # where the next token search starts among ``workers``
        self.broadcast = False  # declared with BROADCAST: each job goes to every worker holding a token


def _i32(n: int) -> int:
    """``n`` saturated to a signed 32-bit integer (SCHED_LATER steps a count without bound)."""
    return max(-I32_MAX - 1, min(n, I32_MAX))


def _text(raw: bytes) -> str | None:
    """A func or name as text; None if it is not UTF-8 (the connection is then closed)."""
    try:
        return pc.decode_func(raw)
    except PeriodicError:
        return None


def _func_name(raw: bytes) -> str | None:
    """A func as text; None if it is not UTF-8 or holds a separator of STATUS's lines (a
    comma or a line break would break every client's STATUS parse for good)."""
    func = _text(raw)
    if func is None or "," in func or "\n" in func or "\r" in func:
        return None
    return func


def _as_text(raw: bytes) -> tuple[str, bool]:
    """Bytes as stored text: (the text, False) if UTF-8, else (base64, True)."""
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError:
        return base64.b64encode(raw).decode("ascii"), True


class PeriodicJobs:
    """The core's Periodic requests and events; see the module docstring."""

    def __init__(self, table: JobTable, outbox: Outbox, counters: Counters, limits: Limits,
                 held_elsewhere: Callable[[str], bool] = lambda worker_id: False) -> None:
        self.table = table
        self.limits = limits  # a func's jobs obey the limit of the task type of its name
        self.held_elsewhere = held_elsewhere  # whether a live JSON worker session has that worker id
        self.outbox = outbox
        self.counters = counters
        # Funcs, the live job of each (func, name), worker sessions by id and by
        # connection, and the funcs worth a dispatch pass.
        self.funcs: dict[str, PeriodicFunc] = {}
        # Funcs that have had no worker and no live job since (core time), oldest first;
        # an entry whose func got a worker or a job since is skipped when it comes due.
        self.idle: OrderedDict[str, int] = OrderedDict()
        self.named: dict[tuple[str, str], str] = {}
        self.workers: dict[str, PeriodicSession] = {}
        self.conns: dict[OutboundConnection, PeriodicSession] = {}
        self._ready: set[str] = set()
        self._session_seq = 0
        self.waits = PeriodicWaits(outbox)  # RUN_JOB / RECV_DATA
        # A broadcast job's other workers (its lease holder is ``worker_id``), while it runs.
        self.fanout: dict[str, set[str]] = {}
        self.locks = LockTable()  # ACQUIRE / RELEASE
        # Set by the core between batches: assign nothing (draining, or storage failing).
        self.hold = False
        # The requests that create jobs take the name of the token that sent them too.
        self._creators: dict[type, Callable[[int, OutboundConnection, Any, str | None], None]] = {
            pc.SubmitJob: self._on_submit, pc.RunJob: self._on_run, pc.Load: self._on_load}
        self._handlers: dict[type, Callable[[int, OutboundConnection, Any], None]] = {
            pc.RecvData: self._on_recv_data,
            pc.WorkData: self._on_work_data, pc.Status: self._on_status, pc.RemoveJob: self._on_remove,
            pc.DropFunc: self._on_drop_func, pc.Dump: self._on_dump,
            pc.CanDo: self._on_can_do, pc.Broadcast: self._on_can_do, pc.CantDo: self._on_can_do,
            pc.GrabJob: self._on_grab, pc.JobUnassigned: self._on_unassigned,
            pc.WorkDone: self._on_outcome, pc.WorkFail: self._on_outcome, pc.SchedLater: self._on_outcome,
            pc.Acquire: self._on_acquire, pc.Release: self._on_release,
        }
        table.listen(self, json=False)
        limits.on_open(self._func_opened)

    # ---- the table's listener ----------------------------------------------------------

    def entered(self, job: Job, now_millis: int) -> None:
        """A Periodic job is in the table (submitted, or recovered as it was stored)."""
        assert job.periodic is not None
        pf = self._func(job.task_type)
        pf.ids.add(job.job_id)
        self.named[(job.task_type, job.name or "")] = job.job_id
        job.execution_timeout = self._timeout(job.periodic)
        if job.state is JobState.RUNNING:
            pf.processing += 1  # recovery moves it on through the table
        else:
            self._enter(job, pf)

    def moved(self, job: Job, source: JobState, target: JobState, now_millis: int) -> None:
        """A Periodic job moved: per-func figures, queue, name index,
        locks (a job that stops running lets go of them, unless a lock just refused it)
        and RUN_JOB / RECV_DATA waiters (answered when the job ends)."""
        pf = self._func(job.task_type)
        waits_lock = job.job_id in self.locks.waiting
        if source is JobState.RUNNING:
            pf.processing -= 1
            if self.fanout:  # (the table ends the copies its other workers ran)
                self.fanout.pop(job.job_id, None)
            if job.job_id in self.locks.held:  # its run ended (a refused job gives them up too)
                self._promote(self.locks.release_held(job.job_id))
        if target is JobState.RUNNING:
            pf.processing += 1
        elif target in TERMINAL:
            if waits_lock or job.job_id in self.locks.held:
                if waits_lock:
                    pf.locked -= 1
                self._promote(self.locks.release_all(job.job_id))
            pf.ids.discard(job.job_id)
            key = (job.task_type, job.name or "")
            if self.named.get(key) == job.job_id:
                del self.named[key]
            self.waits.fire(job, target, now_millis)
            if not pf.ids:
                self._note_idle(job.task_type, now_millis)
        elif not waits_lock:
            self._enter(job, pf)

    def _func_opened(self, func: str, key: str | None) -> None:
        """The func's limit may let a job start again: worth a dispatch pass."""
        if func in self.funcs:
            self._ready.add(func)

    def waiting_reason(self, job: Job) -> str:
        """Why a QUEUED Periodic job is not running."""
        held = self.limits.reason(job)
        if held is not None:
            return held
        if job.job_id in self.locks.waiting:
            return "LOCK_WAIT"
        pf = self.funcs.get(job.task_type)
        if pf is None or not pf.workers:
            return "NO_WORKER_FOR_TYPE"
        return "BEHIND_OTHER_JOBS" if any(s.tokens for s in pf.workers) else "WORKERS_BUSY"

    def attempt_failed(self, job: Job, now_millis: int, error: str, cause: str) -> None:
        """An attempt ended without a result: again after 1 s, without any attempt budget
        (periodicd); but a job a RUN_JOB caller waits for ends (the caller hears ``failed``)."""
        assert job.periodic is not None
        self.table.attempt_ended(job, now_millis, error, cause)
        if self.waits and self.waits.run_waited(job):
            self.table.transition(job, JobState.FAILED, now_millis)
            return
        job.periodic = dict(job.periodic, sched=now_millis + self.table.drift + RETRY_MILLIS)
        self.table.transition(job, JobState.RETRY_WAIT, now_millis, due_at=now_millis + RETRY_MILLIS)
        log.info("retry periodic job=%s func=%s in=%dms error=%s", job.job_id, job.task_type,
                 RETRY_MILLIS, error)

    def sizes(self) -> tuple[int, int]:
        """(live Periodic jobs, funcs)."""
        return sum(len(pf.ids) for pf in self.funcs.values()), len(self.funcs)

    @property
    def running_attempts(self) -> int:
        running = self.table.running
        return sum(len(running(s)) for s in self.workers.values())

    def _func(self, func: str) -> PeriodicFunc:
        pf = self.funcs.get(func)
        if pf is None:
            pf = self.funcs[func] = PeriodicFunc()
        return pf

    def _note_idle(self, func: str, now_millis: int) -> None:
        """A func no connected worker declares and no live job belongs to stays in STATUS
        (clients poll it for a func's counts to reach 0) until ``forget_idle`` forgets it,
        --periodic-forget-idle-millis later, or a DROP_FUNC; docs/PERIODIC.md."""
        pf = self.funcs.get(func)
        if pf is not None and not pf.workers and not pf.ids:
            self.idle[func] = now_millis
            self.idle.move_to_end(func)

    def forget_idle(self, now_millis: int) -> None:
        """The sweep's step: forget the funcs idle for --periodic-forget-idle-millis, so
        funcs declared by workers that left, or whose jobs ended, do not grow memory and
        STATUS for good. Waiters are kept by (func, name), not by func, so one waiting for
        the next job of a func holds nothing here."""
        idle = self.idle
        limit = now_millis - self.table.config.periodic_forget_idle_millis
        for _ in range(min(len(idle), FORGET_PER_SWEEP)):
            func, since = next(iter(idle.items()))
            if since > limit:
                break
            del idle[func]
            pf = self.funcs.get(func)
            if pf is not None and not pf.workers and not pf.ids:
                self._forget(func)

    def _forget(self, func: str) -> None:
        del self.funcs[func]
        self.idle.pop(func, None)
        self._ready.discard(func)

    def _enter(self, job: Job, pf: PeriodicFunc) -> None:
        """A Periodic job is pending (again, or with a new sched time): index it."""
        assert job.periodic is not None
        sched = job.periodic["sched"]
        if len(pf.pending) > 2 * len(pf.ids) + 64:
            pf.pending = [(t, i) for t, i in set(pf.pending) if self.entry_current(i, t)]
            heapq.heapify(pf.pending)
        heapq.heappush(pf.pending, (sched, job.job_id))
        if job.state is JobState.QUEUED:
            if len(pf.queue) > 2 * len(pf.ids) + 64:
                pf.queue = [e for e in set(pf.queue) if self.entry_current(e[2], e[0], JobState.QUEUED)]
                heapq.heapify(pf.queue)
            heapq.heappush(pf.queue, (sched, job.name or "", job.job_id))
            self._ready.add(job.task_type)

    def entry_current(self, job_id: str, sched: int, state: JobState | None = None) -> bool:
        """Whether a queue or pending entry still describes its job."""
        job = self.table.jobs.get(job_id)
        if job is None or job.periodic is None or job.periodic["sched"] != sched or job_id in self.locks.waiting:
            return False
        return job.state is state if state is not None else job.state in _PENDING

    def _timeout(self, fields: dict[str, Any]) -> int:
        """The effective per-attempt timeout (ms): the job's, else the coordinator's."""
        timeout = int(fields.get("timeout") or 0)
        return timeout * 1000 if timeout > 0 else self.table.config.task_timeout_millis

    def _session(self, conn: OutboundConnection, now_millis: int) -> PeriodicSession:
        session = self.conns.get(conn)
        if session is None:
            worker_id = ""
            while not worker_id or self.held_elsewhere(worker_id):  # one namespace of worker ids
                self._session_seq += 1
                worker_id = "periodic-%d" % self._session_seq
            session = PeriodicSession(worker_id, conn, now_millis)
            self.table.session_started(session)
            self.conns[conn] = session
            self.workers[session.worker_id] = session
        session.last_heartbeat = now_millis
        return session

    def _wire_job(self, job: Job, dump: bool = False) -> pc.Job:
        """The job as JOB_ASSIGN carries it, with its effective timeout (as DUMP lists it:
        with its own timeout, 0 for none)."""
        fields = job.periodic
        assert fields is not None
        text = fields["workload"]
        workload = base64.b64decode(text) if fields.get("b64") else text.encode("utf-8")
        timeout = int(fields.get("timeout") or 0) if dump else \
            max(1, (job.execution_timeout or self.table.config.task_timeout_millis) // 1000)
        return pc.Job(job.task_type.encode("utf-8"), (job.name or "").encode("utf-8"), workload,
                      fields["sched"] // 1000, _i32(int(fields.get("count") or 0)), min(timeout, I32_MAX))

    def live(self, handle: pc.Handle) -> tuple[tuple[str, str] | None, Job | None]:
        """(the handle as text, or None if it is not UTF-8; its live job, or None)."""
        func, name = _func_name(handle.func), _text(handle.name)
        if func is None or name is None:
            return None, None
        key = (func, name)
        job_id = self.named.get(key)
        return key, (self.table.jobs.get(job_id) if job_id is not None else None)

    def on_packet(self, now_millis: int, conn: OutboundConnection, msg: Any, submitted_by: str | None = None) -> None:
        """One decoded Periodic request (``jobmesh.periodic.codec``) the connection handler
        does not answer itself. Replies are frames on ``conn``, after this batch's commit;
        a func or name that is not UTF-8 closes the connection (None). ``submitted_by``:
        the name of the token the connection registered with (types 3 and 4), which the
        jobs it creates carry."""
        creator = self._creators.get(type(msg))
        if creator is not None:
            creator(now_millis, conn, msg, submitted_by)
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            log.warning("periodic request %s not handled by the core", type(msg).__name__)
            self.outbox.send(conn, pc.encode_unknown(msg.msgid))
            return
        handler(now_millis, conn, msg)

    @staticmethod
    def writes(msg: Any) -> bool:
        """Whether the request may store or end a job (refused while storage fails)."""
        return type(msg) in WRITES

    def refuse(self, conn: OutboundConnection, msg: Any, reason: str) -> None:
        """A write refused while storage fails: DATA with the reason, as a SUBMIT_JOB
        refused at the active-job limit is answered."""
        self.outbox.send(conn, pc.encode_data(msg.msgid, reason.encode("utf-8")))

    def _not_text(self, conn: OutboundConnection) -> None:
        """A func, name or lock name that is not UTF-8, or a func holding a comma or a line
        break: jobmesh cannot store or list it; closed."""
        log.warning("closing periodic connection %r: a func, name or lock name is not valid UTF-8,"
                    " or a func holds a comma or a line break", conn)
        self.outbox.send(conn, None)

    def _on_submit(self, now_millis: int, conn: OutboundConnection, msg: pc.SubmitJob,
                   submitted_by: str | None) -> None:
        func, name = _func_name(msg.job.func), _text(msg.job.name)
        if func is None or name is None:
            self._not_text(conn)
            return
        problem = self._store(now_millis, func, name, msg.job, submitted_by)
        self.outbox.send(conn, pc.encode_success(msg.msgid) if problem is None else pc.encode_data(msg.msgid, problem))

    def _on_status(self, now_millis: int, conn: OutboundConnection, msg: pc.Status) -> None:
        self.outbox.send(conn, self.status(now_millis, msg.msgid))

    def _on_remove(self, now_millis: int, conn: OutboundConnection, msg: pc.RemoveJob) -> None:
        key, job = self.live(msg.handle)
        if key is None:
            self._not_text(conn)
            return
        if job is not None:
            job.error = "removed by a Periodic client (REMOVE_JOB)"
            self.table.transition(job, JobState.CANCELLED, now_millis)
        self.outbox.send(conn, pc.encode_success(msg.msgid))

    def _on_drop_func(self, now_millis: int, conn: OutboundConnection, msg: pc.DropFunc) -> None:
        func = _func_name(msg.func)
        if func is None:
            self._not_text(conn)
            return
        self._drop_func(now_millis, func)
        self.outbox.send(conn, pc.encode_success(msg.msgid))

    def _on_dump(self, now_millis: int, conn: OutboundConnection, msg: pc.Dump) -> None:
        """DUMP: every live Periodic job, as a job list (a backup LOAD can read back)."""
        jobs = [self._wire_job(self.table.jobs[job_id], dump=True) for pf in self.funcs.values() for job_id in sorted(pf.ids)
                if job_id in self.table.jobs]
        self.outbox.send(conn, pc.encode_dump(msg.msgid, jobs))

    def _on_load(self, now_millis: int, conn: OutboundConnection, msg: pc.Load, submitted_by: str | None) -> None:
        """LOAD: each job of the list as a SUBMIT_JOB; a refused one ends the load with its reason."""
        for pj in msg.jobs:
            func, name = _func_name(pj.func), _text(pj.name)
            if func is None or name is None:
                self._not_text(conn)
                return
            problem = self._store(now_millis, func, name, pj, submitted_by)
            if problem is not None:
                self.outbox.send(conn, pc.encode_data(msg.msgid, problem))
                return
        self.outbox.send(conn, pc.encode_success(msg.msgid))

    def _on_can_do(self, now_millis: int, conn: OutboundConnection, msg: pc.CanDo | pc.Broadcast | pc.CantDo) -> None:
        func = _func_name(msg.func)
        if func is None:
            self._not_text(conn)
            return
        session = self._session(conn, now_millis)
        if type(msg) is pc.CantDo:
            if func in session.funcs:
                session.funcs.discard(func)
                session.task_types = frozenset(session.funcs)
                pf = self.funcs.get(func)
                if pf is not None and session in pf.workers:
                    pf.workers.remove(session)
                    self._note_idle(func, now_millis)
        elif func not in session.funcs and len(session.funcs) >= MAX_FUNCS:
            log.warning("refused periodic %s of func %r worker=%s: a connection may declare %d funcs at most",
                        type(msg).__name__, func, session.worker_id, MAX_FUNCS)
            self.outbox.send(conn, pc.encode_no_worker(msg.msgid))
            return
        elif func not in self.funcs and session.new_funcs >= MAX_NEW_FUNCS:
            log.warning("refused periodic %s of func %r worker=%s: a connection may bring %d new funcs at most",
                        type(msg).__name__, func, session.worker_id, MAX_NEW_FUNCS)
            self.outbox.send(conn, pc.encode_no_worker(msg.msgid))
            return
        else:
            if func not in self.funcs:
                session.new_funcs += 1
            pf = self._func(func)
            pf.broadcast = pf.broadcast or type(msg) is pc.Broadcast
            if func not in session.funcs:
                session.funcs.add(func)
                session.task_types = frozenset(session.funcs)
                pf.workers.append(session)
                self._ready.add(func)
        self.outbox.send(conn, pc.encode_success(msg.msgid))

    def _on_grab(self, now_millis: int, conn: OutboundConnection, msg: pc.GrabJob) -> None:
        session = self._session(conn, now_millis)
        if msg.msgid not in session.tokens and len(session.tokens) < MAX_TOKENS:
            session.tokens.append(msg.msgid)
            self._ready.update(session.funcs)
        self.outbox.send(conn, pc.encode_success(msg.msgid))

    def _on_unassigned(self, now_millis: int, conn: OutboundConnection, msg: pc.JobUnassigned) -> None:
        """The worker gives the job back: pending again, at once; no reply."""
        session = self._session(conn, now_millis)
        job_id = session.assigned.pop(msg.msgid, None)
        job = self.table.jobs.get(job_id) if job_id is not None else None
        if job is not None and job.state is JobState.RUNNING and job.worker_id == session.worker_id:
            self.table.transition(job, JobState.QUEUED, now_millis)

    def _on_outcome(self, now_millis: int, conn: OutboundConnection, msg: pc.WorkDone | pc.WorkFail | pc.SchedLater) -> None:
        """WORK_DONE, WORK_FAIL, SCHED_LATER from the worker the job runs on (others are stale)."""
        session = self._session(conn, now_millis)
        _key, job = self.live(msg.handle)
        if job is None or not self._runs_on(job, session):
            self.counters.stale_results += 1
            log.info("periodic outcome for a job not running on this worker dropped worker=%s func=%r name=%r",
                     session.worker_id, msg.handle.func, msg.handle.name)
        elif type(msg) is pc.WorkDone:
            text, b64 = _as_text(msg.data)
            job.result = {"dataBase64": text} if b64 else {"data": text}
            self.table.transition(job, JobState.COMPLETED, now_millis)
        elif type(msg) is pc.WorkFail:
            self.attempt_failed(job, now_millis, "the Periodic worker reported WORK_FAIL (attempt %d)"
                                % job.attempts, "ATTEMPT_FAILED")
        else:
            assert isinstance(msg, pc.SchedLater)
            self._sched_later(job, now_millis, msg.delay, msg.step)
        self.outbox.send(conn, pc.encode_success(msg.msgid))

    def _runs_on(self, job: Job, session: PeriodicSession | None) -> bool:
        """Whether the job is RUNNING on that session: its lease holder, or (broadcast) one
        of the other workers it went to."""
        return session is not None and job.state is JobState.RUNNING and (
            job.worker_id == session.worker_id or session.worker_id in self.fanout.get(job.job_id, ()))

    def _on_acquire(self, now_millis: int, conn: OutboundConnection, msg: pc.Acquire) -> None:
        """ACQUIRE: granted (1) or refused (0). A refused job leaves its worker and waits
        QUEUED (LOCK_WAIT) until a release gives it the lock; a job that is not running
        is granted without taking anything, as periodicd does."""
        lock = _text(msg.lock)
        key, job = self.live(msg.handle)
        if lock is None or key is None:
            self._not_text(conn)
            return
        granted = True
        if job is not None and job.state is JobState.RUNNING and not self._runs_on(job, self.conns.get(conn)):
            granted = False  # an attempt that has ended (its job runs elsewhere now): nothing recorded
        elif job is not None and job.state is JobState.RUNNING:
            granted, promoted = self.locks.acquire(lock, msg.max_holders, job.job_id)
            self._promote(promoted)
            if not granted:
                self._func(job.task_type).locked += 1
                self.table.transition(job, JobState.QUEUED, now_millis, event=None)
                self.table.event(job, now_millis, "QUEUED", "waiting for lock %s (%d holders at most)"
                            % (lock, self.locks.locks[lock].max_holders), attempt=job.attempts)
        self.outbox.send(conn, pc.encode_acquired(msg.msgid, granted))

    def _on_release(self, now_millis: int, conn: OutboundConnection, msg: pc.Release) -> None:
        lock = _text(msg.lock)
        key, job = self.live(msg.handle)
        if lock is None or key is None:
            self._not_text(conn)
            return
        if job is not None and job.state is JobState.RUNNING and not self._runs_on(job, self.conns.get(conn)):
            # an attempt that has ended (its job runs elsewhere now): its locks went with it
            self.counters.stale_results += 1
            log.info("periodic RELEASE from a worker the job does not run on ignored job=%s lock=%s",
                     job.job_id, lock)
        elif job is not None:
            waited = self.locks.waiting.get(job.job_id) == lock
            self._promote(self.locks.release(lock, job.job_id))
            if waited:  # it stops waiting: pending again (periodicd: Locked -> Pending)
                pf = self._func(job.task_type)
                pf.locked -= 1
                self._enter(job, pf)
        self.outbox.send(conn, pc.encode_success(msg.msgid))

    def _promote(self, job_ids: list[str]) -> None:
        """Jobs a release gave a lock to: back in their func's dispatch queue."""
        for job_id in job_ids:
            job = self.table.jobs.get(job_id)
            if job is not None and job.state is JobState.QUEUED:
                pf = self._func(job.task_type)
                pf.locked -= 1
                self._enter(job, pf)

    def _store(self, now_millis: int, func: str, name: str, pj: pc.Job, submitted_by: str | None) -> bytes | None:
        """SUBMIT_JOB's work (RUN_JOB and LOAD too): create, replace a pending job of that
        name, or drop it if it runs. None, or why it was refused (the DATA text).
        ``submitted_by`` (a token's name, or None) is kept by a job it creates and named
        by the SUBMITTED or REPLACED event, as on the JSON ports."""
        wall = now_millis + self.table.drift
        if pj.sched_at > MAX_RUN_AT_MILLIS // 1000:
            return TOO_LATE  # (the JSON port refuses such times too)
        sched = min(max(pj.sched_at * 1000 if pj.sched_at > 0 else 0, wall), MAX_RUN_AT_MILLIS)
        workload, b64 = _as_text(pj.workload)
        fields = {"workload": workload, "b64": b64, "count": pj.count, "timeout": max(pj.timeout, 0),
                  "sched": sched}
        job_id = self.named.get((func, name))
        existing = self.table.jobs.get(job_id) if job_id is not None else None
        if existing is not None:
            if existing.state is not JobState.RUNNING:
                self._replace(existing, fields, now_millis, submitted_by)
            else:
                log.debug("periodic submit dropped: job=%s func=%s name=%s is running", existing.job_id, func, name)
            return None
        if self.table.active_count >= self.table.config.max_active_jobs:
            self.counters.rejected += 1
            return REJECTED
        later = sched > wall
        job = self.table.new_job(now_millis, func, {}, 0, Priority.NORMAL,
                                 JobState.SCHEDULED if later else JobState.QUEUED,
                                 execution_timeout=self._timeout(fields), run_at=sched, name=name, periodic=fields)
        detail = None
        if submitted_by is not None:
            job.submitted_by = submitted_by
            detail = "by %s" % submitted_by
        self.table.admit(job, now_millis, detail)  # entered() indexes it
        log.debug("periodic submit job=%s func=%s name=%s sched=%d", job.job_id, func, name, sched)
        return None

    def _replace(self, job: Job, fields: dict[str, Any], now_millis: int, submitted_by: str | None) -> None:
        """A pending named job resubmitted: new workload, sched time, count and timeout
        (REPLACED); one waiting for a lock stops waiting (periodicd: Locked -> Pending)."""
        lock = self.locks.waiting.get(job.job_id)
        if lock is not None:
            self._func(job.task_type).locked -= 1
            self.locks.release(lock, job.job_id)
        old_sched = job.periodic["sched"] if job.periodic is not None else None
        job.periodic = fields
        job.execution_timeout = self._timeout(fields)
        sched = fields["sched"]
        job.run_at = sched
        self.table.event(job, now_millis, "REPLACED", None if submitted_by is None else "by %s" % submitted_by)
        later = sched > now_millis + self.table.drift
        target = JobState.SCHEDULED if later else JobState.QUEUED
        if job.state is target:  # same state: re-index if the time moved (or a lock let it go)
            if sched != old_sched or lock is not None:
                if later:
                    self.table.retime(job)
                self._enter(job, self._func(job.task_type))
        else:
            self.table.transition(job, target, now_millis, due_at=sched - self.table.drift if later else None, event=None)

    def _sched_later(self, job: Job, now_millis: int, delay: int, step: int) -> None:
        """SCHED_LATER: back to pending, due in ``delay`` seconds, count += step; a job a
        RUN_JOB caller waits for ends instead (``failed``), as periodicd does."""
        assert job.periodic is not None
        if self.waits and self.waits.run_waited(job):
            job.error = "the Periodic worker asked SCHED_LATER while a RUN_JOB caller waited"
            self.table.transition(job, JobState.FAILED, now_millis)
            return
        delay_ms = min(max(delay, 0), MAX_DELAY_SECONDS) * 1000
        job.periodic = dict(job.periodic, count=_i32(int(job.periodic.get("count") or 0) + step),
                            sched=now_millis + self.table.drift + delay_ms)
        if delay_ms > 0:
            self.table.transition(job, JobState.SCHEDULED, now_millis, due_at=now_millis + delay_ms)
        else:
            job.run_at = job.periodic["sched"]
            self.table.transition(job, JobState.QUEUED, now_millis, event="RESCHEDULED")

    def _drop_func(self, now_millis: int, func: str) -> None:
        """DROP_FUNC: with no worker declaring it, all its jobs go, and the func with them
        at once."""
        pf = self.funcs.get(func)
        if pf is None or pf.workers:
            return
        for job_id in sorted(pf.ids):
            job = self.table.jobs.get(job_id)
            if job is not None:
                job.error = "removed by a Periodic client (DROP_FUNC)"
                self.table.transition(job, JobState.CANCELLED, now_millis)
        if not pf.ids:
            self._forget(func)

    def status(self, now_millis: int, msgid: int) -> bytes:
        """STATUS: one line per func from the per-func figures (PERIODIC.md 7.4)."""
        now_s = (now_millis + self.table.drift) // 1000
        rows = []
        for func, pf in self.funcs.items():
            sched = now_s
            pending = pf.pending
            while pending:
                at, job_id = pending[0]
                if self.entry_current(job_id, at):
                    sched = at // 1000
                    break
                heapq.heappop(pending)
            rows.append(pc.FuncStatus(func.encode("utf-8"), len(pf.workers), len(pf.ids), pf.processing, pf.locked,
                                      sched))
        return pc.encode_status(msgid, rows)

    # ---- run-and-wait and streaming --------------------------------------------------------

    def _on_run(self, now_millis: int, conn: OutboundConnection, msg: pc.RunJob, submitted_by: str | None) -> None:
        """RUN_JOB: NO_WORKER at once if no connected worker declared the func; else store
        (or attach to the job of that name) and answer when the job ends."""
        key, _job = self.live(pc.Handle(msg.job.func, msg.job.name))
        if key is None:
            self._not_text(conn)
            return
        func, name = key
        pf = self.funcs.get(func)
        if pf is None or not pf.workers:
            self.outbox.send(conn, pc.encode_no_worker(msg.msgid))
            return
        if not self.waits.may_wait(conn):
            return
        problem = self._store(now_millis, func, name, msg.job, submitted_by)
        if problem is not None:
            self.outbox.send(conn, pc.encode_data(msg.msgid, problem))
            return
        self.waits.add(key, conn, msg.msgid, False, wait_deadline(now_millis, msg.job.timeout))

    def _on_recv_data(self, now_millis: int, conn: OutboundConnection, msg: pc.RecvData) -> None:
        """RECV_DATA: SUCCESS, then the job's WORK_DATA chunks, then EOF when it ends. It
        attaches to the live job of that name, or to the next one; one that ended moments
        ago (aio-periodic sends RECV_DATA after RUN_JOB) gets its EOF at once."""
        key, job = self.live(pc.Handle(msg.job.func, msg.job.name))
        if key is None:
            self._not_text(conn)
            return
        pf = self.funcs.get(key[0])
        if pf is None or not pf.workers:
            self.outbox.send(conn, pc.Paced(msg.msgid, pc.encode_no_worker(msg.msgid)))
            return
        if not self.waits.may_wait(conn):
            return
        self.outbox.send(conn, pc.Paced(msg.msgid, pc.encode_success(msg.msgid)))
        ended = job is None and self.waits.ended_lately(key, now_millis)
        # chunks the job sent before this RECV_DATA was applied (its RUN_JOB kept them)
        for data in self.waits.take_kept(conn, key, now_millis, live=not ended):
            self.outbox.send(conn, pc.Paced(msg.msgid, pc.encode_data(msg.msgid, data)))
        if ended:
            self.outbox.send(conn, pc.Paced(msg.msgid, pc.encode_data(msg.msgid, pc.STREAM_EOF)))
            return
        self.waits.add(key, conn, msg.msgid, True, wait_deadline(now_millis, msg.job.timeout))

    def _on_work_data(self, now_millis: int, conn: OutboundConnection, msg: pc.WorkData) -> None:
        """WORK_DATA: the chunk goes to every RECV_DATA waiter of the job, if it comes from
        a worker the job runs on (anything else is stale, or forged, and dropped)."""
        key, job = self.live(msg.handle)
        if key is not None and job is not None and self._runs_on(job, self.conns.get(conn)):
            self.waits.chunk(key, msg.data)
        elif key is not None:
            self.counters.stale_results += 1
            log.info("periodic WORK_DATA from a worker the job does not run on dropped func=%s name=%s", *key)
        self.outbox.send(conn, pc.encode_success(msg.msgid))

    def expire_waits(self, now_millis: int) -> None:
        """RUN_JOB / RECV_DATA waits whose time is up: a RUN_JOB wait ends its job (every
        waiter hears ``expired`` / EOF); a RECV_DATA wait alone gets its EOF."""
        for waiter in self.waits.due(now_millis):
            job_id = self.named.get(waiter.key)
            job = self.table.jobs.get(job_id) if job_id is not None else None
            if not waiter.stream and job is not None:
                job.error = "%s: no result within the RUN_JOB wait" % EXPIRED_ERROR
                log.info("periodic run_job wait expired job=%s func=%s name=%s", job.job_id, *waiter.key)
                # the job's end answers every waiter; a job that never ran is cancelled, not failed
                self.table.transition(job, JobState.FAILED if job.state is JobState.RUNNING else JobState.CANCELLED,
                                      now_millis)
            else:
                self.waits.give_up(waiter)

    def end_batch(self, now_millis: int) -> None:
        """After each batch: dispatch, then the RUN_JOB results of the batch's job ends
        (after the frames of any RECV_DATA applied in it; ``periodic_waits.py``)."""
        self.dispatch(now_millis)
        self.waits.release_results()

    def dispatch(self, now_millis: int) -> int:
        """Hand due Periodic jobs to grab tokens: per func, (sched, name) order, rotating
        over the func's workers, the newest token of the chosen worker."""
        if self.hold or not self._ready:
            return 0
        assigned = 0
        for func in list(self._ready):
            self._ready.discard(func)
            pf = self.funcs.get(func)
            if pf is None:
                continue
            queue = pf.queue
            gate = self.limits.gate(func)
            while queue:
                if gate is not None and not gate.open(now_millis):
                    break  # held by its limit: the limit says when it may start again (``_func_opened``)
                session = self._token_holder(pf)
                if session is None:
                    break
                sched, _, job_id = heapq.heappop(queue)
                if not self.entry_current(job_id, sched, JobState.QUEUED):
                    continue
                job = self.table.jobs[job_id]
                try:  # before the job moves: one that cannot be sent must not hold a worker
                    wire = self._wire_job(job)
                    frame = pc.encode_job_assign(session.tokens[-1], wire)
                except Exception as exc:
                    log.exception("periodic job=%s func=%s cannot be assigned; cancelling it", job_id, func)
                    job.error = "cannot be assigned: %s" % str(exc)[:200]
                    self.table.transition(job, JobState.CANCELLED, now_millis)
                    continue
                self.table.transition(job, JobState.RUNNING, now_millis, session=session)
                self._assign(session, job, frame)
                if pf.broadcast:  # and to every other worker of the func that holds a token
                    others = [s for s in pf.workers if s is not session and s.tokens]
                    if others:
                        self.fanout[job_id] = {s.worker_id for s in others}
                        for other in others:
                            self.table.run_copy(job, other)
                            self._assign(other, job, pc.encode_job_assign(other.tokens[-1], wire))
                assigned += 1
        return assigned

    def _assign(self, session: PeriodicSession, job: Job, frame: bytes) -> None:
        """JOB_ASSIGN ``frame``, encoded for the session's newest token (the job is RUNNING already)."""
        token = session.tokens.pop()
        session.assigned[token] = job.job_id
        self.outbox.send(session.conn, frame)
        log.debug("periodic assign job=%s func=%s worker=%s token=%d", job.job_id, job.task_type,
                  session.worker_id, token)

    @staticmethod
    def _token_holder(pf: PeriodicFunc) -> PeriodicSession | None:
        workers = pf.workers
        n = len(workers)
        for i in range(n):
            session = workers[(pf.turn + i) % n]
            if session.tokens:
                pf.turn = (pf.turn + i + 1) % n
                return session
        return None

    def on_closed(self, now_millis: int, conn: OutboundConnection) -> None:
        """A Periodic connection ended: its RUN_JOB / RECV_DATA waits are forgotten; its
        funcs lose a worker, its running jobs go back to be retried (after 1 s), its tokens
        vanish."""
        if self.waits.per_conn.get(conn):
            log.debug("dropped periodic waits=%d of a closed connection", self.waits.drop_conn(conn))
        session = self.conns.pop(conn, None)
        if session is None:
            return
        self.workers.pop(session.worker_id, None)
        for func in session.funcs:
            pf = self.funcs.get(func)
            if pf is not None and session in pf.workers:
                pf.workers.remove(session)
                self._note_idle(func, now_millis)
        session.tokens.clear()
        running = self.table.running(session)
        if running:
            self.counters.workers_lost += 1
            log.warning("periodic worker disconnected worker=%s running=%d", session.worker_id, len(running))
        for job_id in sorted(running):
            job = self.table.jobs.get(job_id)
            if job is not None and job.state is JobState.RUNNING and job.worker_id == session.worker_id:
                self.attempt_failed(job, now_millis, "attempt %d lost: Periodic worker %s disconnected"
                                    % (job.attempts, session.worker_id), "WORKER_LOST")
            elif job_id in self.fanout:  # one of a broadcast job's other workers: the rest go on
                self.fanout[job_id].discard(session.worker_id)
        self.table.session_ended(session)
