"""The func index: each Periodic func's workers, live jobs and dispatch order (docs/PERIODIC.md).

``FuncIndex`` keeps, per func (``PeriodicFunc``), the sessions that declared it in
rotation order, its live jobs, how many run or wait for a lock, its queue of due jobs in
(sched, name) order and the sched times of its pending jobs (STATUS's earliest); beside
them the live job of each (func, name) (``named``), the funcs worth a dispatch pass and
the idle funcs to forget. Queue and pending entries are never removed in place: an entry
that no longer describes its job is skipped, and a heap is rebuilt once stale entries
outnumber live ones. It reads jobs, never changes one: the façade feeds it the table's
moves. Also here: a func or name as text, and a job as JOB_ASSIGN and DUMP carry it.
"""

from __future__ import annotations

import base64
import heapq
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Container, Iterable

from jobmesh.coordinator.core.outbox import Outbox
from jobmesh.coordinator.core.registry import PeriodicSession
from jobmesh.coordinator.core.table import JobTable
from jobmesh.errors import PeriodicError
from jobmesh.periodic import codec as pc
from jobmesh.protocol.jobs import TERMINAL, JobState
from jobmesh.store.job import Job

if TYPE_CHECKING:
    from jobmesh.coordinator.core.peers import OutboundConnection

log = logging.getLogger(__name__)

FORGET_PER_SWEEP = 10_000  # idle funcs forgotten by one sweep at most (the rest by the next)
I32_MAX = 2**31 - 1  # count and timeout travel as signed 32-bit integers
_PENDING = frozenset({JobState.QUEUED, JobState.SCHEDULED, JobState.RETRY_WAIT})


class PeriodicFunc:
    """What the core keeps per Periodic func (docs/PERIODIC.md): its workers, its live
    jobs, how many run, its queue of due jobs and the sched times of its pending jobs.
    STATUS reads it without looking at any job but the earliest."""

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


def i32(n: int) -> int:
    """``n`` saturated to a signed 32-bit integer (SCHED_LATER steps a count without bound)."""
    return max(-I32_MAX - 1, min(n, I32_MAX))


def text(raw: bytes) -> str | None:
    """A func or name as text; None if it is not UTF-8 (the connection is then closed)."""
    try:
        return pc.decode_func(raw)
    except PeriodicError:
        return None


def func_name(raw: bytes) -> str | None:
    """A func as text; None if it is not UTF-8 or holds a separator of STATUS's lines (a
    comma or a line break would break every client's STATUS parse for good)."""
    func = text(raw)
    if func is None or "," in func or "\n" in func or "\r" in func:
        return None
    return func


def as_text(raw: bytes) -> tuple[str, bool]:
    """Bytes as stored text: (the text, False) if UTF-8, else (base64, True)."""
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError:
        return base64.b64encode(raw).decode("ascii"), True


def close_not_text(outbox: Outbox, conn: OutboundConnection) -> None:
    """A func, name or lock name that is not UTF-8, or a func holding a comma or a line
    break: jobmesh cannot store or list it; the connection is closed."""
    log.warning("closing periodic connection %r: a func, name or lock name is not valid UTF-8,"
                " or a func holds a comma or a line break", conn)
    outbox.send(conn, None)


def attempt_timeout(fields: dict[str, Any], default_millis: int) -> int:
    """A Periodic job's per-attempt timeout (ms): its own (seconds), else ``default_millis``."""
    timeout = int(fields.get("timeout") or 0)
    return timeout * 1000 if timeout > 0 else default_millis


def wire_job(job: Job, default_millis: int, dump: bool = False) -> pc.Job:
    """The job as JOB_ASSIGN carries it, with its effective timeout (as DUMP lists it:
    with its own timeout, 0 for none)."""
    fields = job.periodic
    assert fields is not None
    workload = base64.b64decode(fields["workload"]) if fields.get("b64") else fields["workload"].encode("utf-8")
    timeout = int(fields.get("timeout") or 0) if dump else max(1, (job.execution_timeout or default_millis) // 1000)
    return pc.Job(job.task_type.encode("utf-8"), (job.name or "").encode("utf-8"), workload,
                  fields["sched"] // 1000, i32(int(fields.get("count") or 0)), min(timeout, I32_MAX))


class FuncIndex:
    def __init__(self, table: JobTable, lock_waiting: Container[str]) -> None:
        self.table = table
        self.lock_waiting = lock_waiting  # the jobs waiting for a lock: out of their func's queue
        self.funcs: dict[str, PeriodicFunc] = {}
        # Funcs that have had no worker and no live job since (core time), oldest first;
        # an entry whose func got a worker or a job since is skipped when it comes due.
        self.idle: OrderedDict[str, int] = OrderedDict()
        self.named: dict[tuple[str, str], str] = {}  # (func, name) -> its live job
        self._ready: set[str] = set()  # funcs worth a dispatch pass

    # ---- jobs in and out (the table's moves, through the façade) ---------------------------

    def entered(self, job: Job) -> None:
        """A Periodic job is in the table (submitted, or recovered as it was stored)."""
        pf = self.func(job.task_type)
        pf.ids.add(job.job_id)
        self.named[(job.task_type, job.name or "")] = job.job_id
        if job.state is JobState.RUNNING:
            pf.processing += 1  # recovery moves it on through the table
        else:
            self.enter(job, pf)

    def moved(self, job: Job, source: JobState, target: JobState, now: int, waited_lock: bool) -> None:
        """A Periodic job moved (``waited_lock``: it was waiting for a lock before)."""
        pf = self.func(job.task_type)
        if source is JobState.RUNNING:
            pf.processing -= 1
        if target is JobState.RUNNING:
            pf.processing += 1
        elif target in TERMINAL:
            if waited_lock:
                pf.locked -= 1
            pf.ids.discard(job.job_id)
            key = (job.task_type, job.name or "")
            if self.named.get(key) == job.job_id:
                del self.named[key]
            if not pf.ids:
                self.note_idle(job.task_type, now)
        elif not waited_lock:
            self.enter(job, pf)

    def enter(self, job: Job, pf: PeriodicFunc | None = None) -> None:
        """A Periodic job is pending (again, or with a new sched time): index it."""
        assert job.periodic is not None
        if pf is None:
            pf = self.func(job.task_type)
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
        if job is None or job.periodic is None or job.periodic["sched"] != sched or job_id in self.lock_waiting:
            return False
        return job.state is state if state is not None else job.state in _PENDING

    def lock_wait(self, job: Job) -> None:
        """The job waits for a lock now: counted, out of its func's queue."""
        self.func(job.task_type).locked += 1

    def lock_waited(self, job: Job, enter: bool = True) -> None:
        """The job stopped waiting for a lock; pending again (``enter``) unless it moves next."""
        pf = self.func(job.task_type)
        pf.locked -= 1
        if enter:
            self.enter(job, pf)

    # ---- funcs and their workers ----------------------------------------------------------

    def func(self, func: str) -> PeriodicFunc:
        pf = self.funcs.get(func)
        if pf is None:
            pf = self.funcs[func] = PeriodicFunc()
        return pf

    def knows(self, func: str) -> bool:
        """Whether the func is listed (STATUS)."""
        return func in self.funcs

    def has_workers(self, func: str) -> bool:
        """Whether a connected worker declared the func."""
        pf = self.funcs.get(func)
        return pf is not None and bool(pf.workers)

    def worker_wait(self, func: str) -> str:
        """Why a due job of the func waits for a worker (its waitingReason)."""
        pf = self.funcs.get(func)
        if pf is None or not pf.workers:
            return "NO_WORKER_FOR_TYPE"
        return "BEHIND_OTHER_JOBS" if any(s.tokens for s in pf.workers) else "WORKERS_BUSY"

    def add_worker(self, func: str, session: PeriodicSession, broadcast: bool, declared: bool) -> None:
        """CAN_DO / BROADCAST: the func is known, broadcast once declared so; a session
        that had not ``declared`` it joins its rotation."""
        pf = self.func(func)
        pf.broadcast = pf.broadcast or broadcast
        if not declared:
            pf.workers.append(session)
            self._ready.add(func)

    def remove_worker(self, func: str, session: PeriodicSession, now: int) -> None:
        """CANT_DO, or the session's connection ended."""
        pf = self.funcs.get(func)
        if pf is not None and session in pf.workers:
            pf.workers.remove(session)
            self.note_idle(func, now)

    def wake(self, funcs: Iterable[str]) -> None:
        """A worker's funcs may dispatch again (it holds a new token)."""
        self._ready.update(funcs)

    def opened(self, func: str, key: str | None) -> None:
        """The func's limit may let a job start again: worth a dispatch pass."""
        if func in self.funcs:
            self._ready.add(func)

    def take_ready(self) -> list[str]:
        """The funcs worth a dispatch pass now (each leaves the set as ``take`` takes it)."""
        return list(self._ready) if self._ready else []

    def take(self, func: str) -> PeriodicFunc | None:
        self._ready.discard(func)
        return self.funcs.get(func)

    @staticmethod
    def token_holder(pf: PeriodicFunc) -> PeriodicSession | None:
        """The func's next worker in rotation that holds a grab token."""
        workers = pf.workers
        n = len(workers)
        for i in range(n):
            session = workers[(pf.turn + i) % n]
            if session.tokens:
                pf.turn = (pf.turn + i + 1) % n
                return session
        return None

    @staticmethod
    def has_queued(pf: PeriodicFunc) -> bool:
        return bool(pf.queue)

    @staticmethod
    def others(pf: PeriodicFunc, session: PeriodicSession) -> list[PeriodicSession]:
        """A broadcast func's other workers that hold a token (none for another func)."""
        return [s for s in pf.workers if s is not session and s.tokens] if pf.broadcast else []

    def pop_queued(self, pf: PeriodicFunc) -> Job | None:
        """The func's first due job, popped; None for a stale entry (the caller goes on)."""
        sched, _, job_id = heapq.heappop(pf.queue)
        return self.table.jobs[job_id] if self.entry_current(job_id, sched, JobState.QUEUED) else None

    # ---- idle funcs -----------------------------------------------------------------------

    def note_idle(self, func: str, now: int) -> None:
        """A func no connected worker declares and no live job belongs to stays in STATUS
        (clients poll it for a func's counts to reach 0) until ``forget_idle`` forgets it,
        --periodic-forget-idle-millis later, or a DROP_FUNC; docs/PERIODIC.md."""
        pf = self.funcs.get(func)
        if pf is not None and not pf.workers and not pf.ids:
            self.idle[func] = now
            self.idle.move_to_end(func)

    def forget_idle(self, now: int) -> None:
        """The sweep's step: forget the funcs idle for --periodic-forget-idle-millis, so
        funcs declared by workers that left, or whose jobs ended, do not grow memory and
        STATUS for good. Waiters are kept by (func, name), not by func, so one waiting for
        the next job of a func holds nothing here."""
        idle = self.idle
        limit = now - self.table.config.periodic_forget_idle_millis
        for _ in range(min(len(idle), FORGET_PER_SWEEP)):
            func, since = next(iter(idle.items()))
            if since > limit:
                break
            del idle[func]
            pf = self.funcs.get(func)
            if pf is not None and not pf.workers and not pf.ids:
                self.forget(func)

    def forget(self, func: str) -> None:
        del self.funcs[func]
        self.idle.pop(func, None)
        self._ready.discard(func)

    def droppable(self, func: str) -> list[str]:
        """DROP_FUNC: the live jobs of a func no connected worker declares (none if one does)."""
        pf = self.funcs.get(func)
        return sorted(pf.ids) if pf is not None and not pf.workers else []

    def drop(self, func: str) -> None:
        """DROP_FUNC, its jobs ended: a func with no worker and no live job goes at once."""
        pf = self.funcs.get(func)
        if pf is not None and not pf.workers and not pf.ids:
            self.forget(func)

    # ---- lookups --------------------------------------------------------------------------

    def live(self, handle: pc.Handle) -> tuple[tuple[str, str] | None, Job | None]:
        """(the handle as text, or None if it is not UTF-8; its live job, or None)."""
        func, name = func_name(handle.func), text(handle.name)
        if func is None or name is None:
            return None, None
        key = (func, name)
        return key, self.job_of(key)

    def job_of(self, key: tuple[str, str]) -> Job | None:
        """The live job of (func, name), if any."""
        job_id = self.named.get(key)
        return self.table.jobs.get(job_id) if job_id is not None else None

    def live_jobs(self) -> list[Job]:
        """Every live Periodic job, func by func (DUMP)."""
        jobs = self.table.jobs
        return [jobs[job_id] for pf in self.funcs.values() for job_id in sorted(pf.ids) if job_id in jobs]

    def sizes(self) -> tuple[int, int]:
        """(live Periodic jobs, funcs)."""
        return sum(len(pf.ids) for pf in self.funcs.values()), len(self.funcs)

    def status(self, now: int, msgid: int) -> bytes:
        """STATUS: one line per func from the per-func figures (PERIODIC.md 7.4)."""
        now_s = (now + self.table.drift) // 1000
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
