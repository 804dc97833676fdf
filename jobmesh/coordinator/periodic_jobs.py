"""The Periodic part of the core: named jobs, funcs, grab tokens and STATUS (docs/PERIODIC.md).

``PeriodicJobs`` is a mixin of ``CoordinatorCore`` (core.py): the same single writer,
split across two files so that each stays readable. Everything here runs on the core
greenlet, changes jobs only through the core's ``_transition`` and sends only through
its ``outbound`` list; the Periodic connection handler (``periodic_port.py``) decodes
frames and posts events, and owns no state.

A Periodic job is a job whose ``periodic`` fields are set: taskType is its func, and
``name`` is unique per func among live jobs (``named``). It moves through the same
states as every job; ``_periodic_moved`` (called by ``_transition``) keeps the per-func
figures, the dispatch queue and the name index in step. Periodic connections get bytes
(codec frames) through ``outbound``, released after the batch's commit like every frame.
"""

from __future__ import annotations

import base64
import heapq
import logging
from typing import TYPE_CHECKING, Any

from jobmesh.config import CoreConfig
from jobmesh.coordinator.job import MAX_RUN_AT_MILLIS, Job
from jobmesh.coordinator.registry import PeriodicSession, Session
from jobmesh.errors import PeriodicError
from jobmesh.periodic import codec as pc
from jobmesh.protocol import messages as m
from jobmesh.protocol.jobs import TERMINAL, JobState, Priority

log = logging.getLogger(__name__)

PERIODIC_RETRY_MILLIS = 1000  # WORK_FAIL, a lost worker or an expired deadline: again after 1 s (periodicd)
PERIODIC_MAX_TOKENS = 4096  # grab tokens one Periodic worker may hold
PERIODIC_MAX_DELAY_SECONDS = 10 * 366 * 86400  # SCHED_LATER delays are capped at ten years
_PENDING = frozenset({JobState.QUEUED, JobState.SCHEDULED, JobState.RETRY_WAIT})


class PeriodicFunc:
    """What the core keeps per Periodic func (docs/PERIODIC.md): its workers, its live
    jobs, how many run, its queue of due jobs and the sched times of its pending jobs.
    Kept by ``_transition``; STATUS reads it without looking at any job but the earliest."""

    __slots__ = ("workers", "ids", "processing", "queue", "pending", "turn")

    def __init__(self) -> None:
        self.workers: list[PeriodicSession] = []  # connected sessions that declared it, in rotation order
        self.ids: set[str] = set()  # its live jobs (pending or running)
        self.processing = 0  # its RUNNING jobs
        self.queue: list[tuple[int, str, str]] = []  # (sched, name, job id) of QUEUED jobs; stale entries skipped
        self.pending: list[tuple[int, str]] = []  # (sched, job id) of pending jobs; stale entries skipped
        self.turn = 0  # where the next token search starts among ``workers``


def _text(raw: bytes) -> str | None:
    """A func or name as text; None if it is not UTF-8 (the connection is then closed)."""
    try:
        return pc.decode_func(raw)
    except PeriodicError:
        return None


def _as_text(raw: bytes) -> tuple[str, bool]:
    """Bytes as stored text: (the text, False) if UTF-8, else (base64, True)."""
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError:
        return base64.b64encode(raw).decode("ascii"), True


class PeriodicJobs:
    """The core's Periodic requests and events; see the module docstring."""

    if TYPE_CHECKING:  # what the core (core.py) provides
        jobs: dict[str, Job]
        config: CoreConfig
        drift: int
        stats: dict[str, int]
        counts: Any
        next_seq: int
        _new: set[str]
        draining: bool
        paused: bool

        @property
        def active_count(self) -> int: ...
        def _job_id(self, seq: int) -> str: ...
        def _event(self, job: Job, now_millis: int, event: str, detail: str | None = None,
                   retry_at: int | None = None, attempt: int | None = None,
                   worker_id: str | None = None) -> None: ...
        def _transition(self, job: Job, target: JobState, now_millis: int, *, due_at: int | None = None,
                        session: Session | None = None, event: str | None = "") -> None: ...
        def _wait_until(self, job: Job, wake_at: int) -> None: ...
        def _send(self, conn: Any, msg: m.Message | bytes | None) -> None: ...
        def _retry_or_fail(self, job: Job, now_millis: int, error: str, cause: str) -> None: ...

    def _init_periodic(self) -> None:
        # Funcs, the live job of each (func, name), worker sessions by id and by
        # connection, and the funcs worth a dispatch pass.
        self.pfuncs: dict[str, PeriodicFunc] = {}
        self.named: dict[tuple[str, str], str] = {}
        self.pworkers: dict[str, PeriodicSession] = {}
        self.pconns: dict[Any, PeriodicSession] = {}
        self._pready: set[str] = set()
        self._pseq = 0

    def _periodic_waiting(self, job: Job) -> str:
        """Why a QUEUED Periodic job is not running."""
        pf = self.pfuncs.get(job.task_type)
        if pf is None or not pf.workers:
            return "NO_WORKER_FOR_TYPE"
        return "BEHIND_OTHER_JOBS" if any(s.tokens for s in pf.workers) else "WORKERS_BUSY"

    def _periodic_retry(self, job: Job, now_millis: int, error: str) -> None:
        """An attempt ended without a result: again after 1 s, without any attempt budget (periodicd)."""
        assert job.periodic is not None
        job.periodic = dict(job.periodic, sched=now_millis + self.drift + PERIODIC_RETRY_MILLIS)
        self._transition(job, JobState.RETRY_WAIT, now_millis, due_at=now_millis + PERIODIC_RETRY_MILLIS)
        log.info("retry periodic job=%s func=%s in=%dms error=%s", job.job_id, job.task_type,
                 PERIODIC_RETRY_MILLIS, error)

    def _pfunc(self, func: str) -> PeriodicFunc:
        pf = self.pfuncs.get(func)
        if pf is None:
            pf = self.pfuncs[func] = PeriodicFunc()
        return pf

    def _periodic_adopt(self, job: Job) -> None:
        """Recovery: index a Periodic job read back from the store."""
        assert job.periodic is not None
        pf = self._pfunc(job.task_type)
        pf.ids.add(job.job_id)
        self.named[(job.task_type, job.name or "")] = job.job_id
        job.execution_timeout = self._ptimeout(job.periodic)
        if job.state is JobState.RUNNING:
            pf.processing += 1  # recovery moves it on through _transition

    def _periodic_moved(self, job: Job, source: JobState, target: JobState) -> None:
        """``_transition``'s part for Periodic jobs: per-func figures, queue and name index."""
        pf = self._pfunc(job.task_type)
        if source is JobState.RUNNING:
            pf.processing -= 1
        if target is JobState.RUNNING:
            pf.processing += 1
        elif target in TERMINAL:
            pf.ids.discard(job.job_id)
            key = (job.task_type, job.name or "")
            if self.named.get(key) == job.job_id:
                del self.named[key]
        else:
            self._periodic_enter(job, pf)

    def _periodic_enter(self, job: Job, pf: PeriodicFunc) -> None:
        """A Periodic job is pending (again, or with a new sched time): index it."""
        assert job.periodic is not None
        sched = job.periodic["sched"]
        if len(pf.pending) > 2 * len(pf.ids) + 64:
            pf.pending = [(t, i) for t, i in pf.pending if self._pvalid(i, t)]
            heapq.heapify(pf.pending)
        heapq.heappush(pf.pending, (sched, job.job_id))
        if job.state is JobState.QUEUED:
            if len(pf.queue) > 2 * len(pf.ids) + 64:
                pf.queue = [e for e in pf.queue if self._pvalid(e[2], e[0], JobState.QUEUED)]
                heapq.heapify(pf.queue)
            heapq.heappush(pf.queue, (sched, job.name or "", job.job_id))
            self._pready.add(job.task_type)

    def _pvalid(self, job_id: str, sched: int, state: JobState | None = None) -> bool:
        """Whether a queue or pending entry still describes its job."""
        job = self.jobs.get(job_id)
        if job is None or job.periodic is None or job.periodic["sched"] != sched:
            return False
        return job.state is state if state is not None else job.state in _PENDING

    def _ptimeout(self, fields: dict[str, Any]) -> int:
        """The effective per-attempt timeout (ms): the job's, else the coordinator's."""
        timeout = int(fields.get("timeout") or 0)
        return timeout * 1000 if timeout > 0 else self.config.task_timeout_millis

    def _psession(self, conn: Any, now_millis: int) -> PeriodicSession:
        session = self.pconns.get(conn)
        if session is None:
            self._pseq += 1
            session = PeriodicSession("periodic-%d" % self._pseq, conn, now_millis)
            self.pconns[conn] = session
            self.pworkers[session.worker_id] = session
        return session

    def _pjob(self, job: Job) -> pc.Job:
        """The job as JOB_ASSIGN carries it, with its effective timeout."""
        fields = job.periodic
        assert fields is not None
        text = fields["workload"]
        workload = base64.b64decode(text) if fields.get("b64") else text.encode("utf-8")
        return pc.Job(job.task_type.encode("utf-8"), (job.name or "").encode("utf-8"), workload,
                      fields["sched"] // 1000, int(fields.get("count") or 0),
                      max(1, min((job.execution_timeout or self.config.task_timeout_millis) // 1000, 2**31 - 1)))

    def _prunning(self, session: PeriodicSession, handle: pc.Handle) -> Job | None:
        """The job of ``handle`` if it is RUNNING on this session."""
        func, name = _text(handle.func), _text(handle.name)
        job_id = self.named.get((func, name)) if func is not None and name is not None else None
        job = self.jobs.get(job_id) if job_id is not None else None
        if job is None or job.state is not JobState.RUNNING or job.worker_id != session.worker_id:
            return None
        return job

    def on_periodic(self, now_millis: int, conn: Any, msg: Any) -> None:
        """One decoded Periodic request (``jobmesh.periodic.codec``) the connection handler
        does not answer itself. Replies are frames on ``conn``, after this batch's commit."""
        msgid = msg.msgid
        kind = type(msg)
        if kind is pc.SubmitJob:
            self._send(conn, self._periodic_submit(now_millis, conn, msg))
            return
        if kind is pc.Status:
            self._send(conn, self.periodic_status(now_millis, msgid))
            return
        if kind is pc.RemoveJob or kind is pc.DropFunc:
            func = _text(msg.func if kind is pc.DropFunc else msg.handle.func)
            if func is None:
                self._send(conn, None)
                return
            if kind is pc.DropFunc:
                self._drop_func(now_millis, func)
            else:
                name = _text(msg.handle.name)
                job_id = self.named.get((func, name)) if name is not None else None
                job = self.jobs.get(job_id) if job_id is not None else None
                if job is not None:
                    job.error = "removed by a Periodic client (REMOVE_JOB)"
                    self._transition(job, JobState.CANCELLED, now_millis)
        elif kind is pc.CanDo or kind is pc.Broadcast or kind is pc.CantDo:
            func = _text(msg.func)
            if func is None:
                self._send(conn, None)
                return
            session = self._psession(conn, now_millis)
            if kind is pc.CantDo:
                if func in session.funcs:
                    session.funcs.discard(func)
                    pf = self.pfuncs.get(func)
                    if pf is not None and session in pf.workers:
                        pf.workers.remove(session)
            elif func not in session.funcs:
                session.funcs.add(func)
                self._pfunc(func).workers.append(session)
                self._pready.add(func)
        elif kind is pc.GrabJob:
            session = self._psession(conn, now_millis)
            if msgid not in session.tokens and len(session.tokens) < PERIODIC_MAX_TOKENS:
                session.tokens.append(msgid)
                self._pready.update(session.funcs)
        elif kind is pc.JobUnassigned:  # the worker gives the job back: pending again, at once; no reply
            session = self._psession(conn, now_millis)
            job_id = session.assigned.pop(msgid, None)
            job = self.jobs.get(job_id) if job_id is not None else None
            if job is not None and job.state is JobState.RUNNING and job.worker_id == session.worker_id:
                self._transition(job, JobState.QUEUED, now_millis)
            return
        elif kind is pc.WorkDone or kind is pc.WorkFail or kind is pc.SchedLater:
            session = self._psession(conn, now_millis)
            job = self._prunning(session, msg.handle)
            if job is None:
                self.stats["stale_results"] += 1
                log.info("periodic outcome for a job not running on this worker dropped worker=%s func=%r name=%r",
                         session.worker_id, msg.handle.func, msg.handle.name)
            elif kind is pc.WorkDone:
                text, b64 = _as_text(msg.data)
                job.result = {"dataBase64": text} if b64 else {"data": text}
                self._transition(job, JobState.COMPLETED, now_millis)
            elif kind is pc.WorkFail:
                self._retry_or_fail(job, now_millis, "the Periodic worker reported WORK_FAIL (attempt %d)"
                                    % job.attempts, "ATTEMPT_FAILED")
            else:
                self._sched_later(job, now_millis, msg.delay, msg.step)
        else:
            log.warning("periodic request %s not handled by the core", kind.__name__)
        self._send(conn, pc.encode_success(msgid))

    def _periodic_submit(self, now_millis: int, conn: Any, msg: pc.SubmitJob) -> bytes | None:
        """SUBMIT_JOB: create, replace a pending job of that name, or drop it if it runs."""
        pj = msg.job
        func, name = _text(pj.func), _text(pj.name)
        if func is None or name is None:
            return None  # closes the connection
        wall = now_millis + self.drift
        sched = min(max(pj.sched_at * 1000 if 0 < pj.sched_at < MAX_RUN_AT_MILLIS // 1000 else 0, wall),
                    MAX_RUN_AT_MILLIS)
        workload, b64 = _as_text(pj.workload)
        fields = {"workload": workload, "b64": b64, "count": pj.count, "timeout": max(pj.timeout, 0),
                  "sched": sched}
        job_id = self.named.get((func, name))
        existing = self.jobs.get(job_id) if job_id is not None else None
        if existing is not None:
            if existing.state is not JobState.RUNNING:
                self._replace(existing, fields, now_millis)
            else:
                log.debug("periodic submit dropped: job=%s func=%s name=%s is running", existing.job_id, func, name)
            return pc.encode_success(msg.msgid)
        if self.active_count >= self.config.max_active_jobs:
            self.stats["rejected"] += 1
            return pc.encode_data(msg.msgid, b"rejected: the coordinator is at its active-job limit")
        later = sched > wall
        job = Job(
            job_id=self._job_id(self.next_seq), seq=self.next_seq, task_type=func, payload={}, max_attempts=0,
            priority=Priority.NORMAL, created_at=wall, execution_timeout=self._ptimeout(fields), run_at=sched,
            state=JobState.SCHEDULED if later else JobState.QUEUED, ready_at=now_millis, event_count=0,
            name=name, periodic=fields,
        )
        self.next_seq += 1
        self.jobs[job.job_id] = job
        self._new.add(job.job_id)
        self.stats["submitted"] += 1
        self.counts[(job.state, func, job.priority)] += 1
        self._event(job, now_millis, "SUBMITTED")
        self.named[(func, name)] = job.job_id
        pf = self._pfunc(func)
        pf.ids.add(job.job_id)
        if later:
            self._wait_until(job, sched - self.drift)
        self._periodic_enter(job, pf)
        log.debug("periodic submit job=%s func=%s name=%s sched=%d", job.job_id, func, name, sched)
        return pc.encode_success(msg.msgid)

    def _replace(self, job: Job, fields: dict[str, Any], now_millis: int) -> None:
        """A pending named job resubmitted: new workload, sched time, count and timeout (REPLACED)."""
        job.periodic = fields
        job.execution_timeout = self._ptimeout(fields)
        sched = fields["sched"]
        job.run_at = sched
        self._event(job, now_millis, "REPLACED")
        later = sched > now_millis + self.drift
        target = JobState.SCHEDULED if later else JobState.QUEUED
        if job.state is target:  # same state, new time: re-index
            if later:
                self._wait_until(job, sched - self.drift)
            self._periodic_enter(job, self._pfunc(job.task_type))
        else:
            self._transition(job, target, now_millis, due_at=sched - self.drift if later else None, event=None)

    def _sched_later(self, job: Job, now_millis: int, delay: int, step: int) -> None:
        """SCHED_LATER: back to pending, due in ``delay`` seconds, count += step."""
        assert job.periodic is not None
        delay_ms = min(max(delay, 0), PERIODIC_MAX_DELAY_SECONDS) * 1000
        job.periodic = dict(job.periodic, count=int(job.periodic.get("count") or 0) + step,
                            sched=now_millis + self.drift + delay_ms)
        if delay_ms > 0:
            self._transition(job, JobState.SCHEDULED, now_millis, due_at=now_millis + delay_ms)
        else:
            job.run_at = job.periodic["sched"]
            self._transition(job, JobState.QUEUED, now_millis, event="RESCHEDULED")

    def _drop_func(self, now_millis: int, func: str) -> None:
        """DROP_FUNC: with no worker declaring it, the func and all its jobs go."""
        pf = self.pfuncs.get(func)
        if pf is None or pf.workers:
            return
        for job_id in sorted(pf.ids):
            job = self.jobs.get(job_id)
            if job is not None:
                job.error = "removed by a Periodic client (DROP_FUNC)"
                self._transition(job, JobState.CANCELLED, now_millis)
        self.pfuncs.pop(func, None)
        self._pready.discard(func)

    def periodic_status(self, now_millis: int, msgid: int) -> bytes:
        """STATUS: one line per func from the per-func figures (PERIODIC.md 7.4)."""
        now_s = (now_millis + self.drift) // 1000
        rows = []
        for func, pf in self.pfuncs.items():
            sched = now_s
            pending = pf.pending
            while pending:
                at, job_id = pending[0]
                if self._pvalid(job_id, at):
                    sched = at // 1000
                    break
                heapq.heappop(pending)
            rows.append(pc.FuncStatus(func.encode("utf-8"), len(pf.workers), len(pf.ids), pf.processing, 0, sched))
        return pc.encode_status(msgid, rows)

    def dispatch_periodic(self, now_millis: int) -> int:
        """Hand due Periodic jobs to grab tokens: per func, (sched, name) order, rotating
        over the func's workers, the newest token of the chosen worker."""
        if self.draining or self.paused:
            return 0
        assigned = 0
        for func in list(self._pready):
            self._pready.discard(func)
            pf = self.pfuncs.get(func)
            if pf is None:
                continue
            queue = pf.queue
            while queue:
                session = self._token_holder(pf)
                if session is None:
                    break
                sched, _, job_id = heapq.heappop(queue)
                if not self._pvalid(job_id, sched, JobState.QUEUED):
                    continue
                job = self.jobs[job_id]
                token = session.tokens.pop()
                self._transition(job, JobState.RUNNING, now_millis, session=session)
                session.assigned[token] = job_id
                self._send(session.conn, pc.encode_job_assign(token, self._pjob(job)))
                log.debug("periodic assign job=%s func=%s worker=%s token=%d", job_id, func, session.worker_id, token)
                assigned += 1
        return assigned

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

    def on_periodic_closed(self, now_millis: int, conn: Any) -> None:
        """A Periodic connection ended: its funcs lose a worker, its running jobs go back
        to be retried (after 1 s), its tokens vanish."""
        session = self.pconns.pop(conn, None)
        if session is None:
            return
        self.pworkers.pop(session.worker_id, None)
        for func in session.funcs:
            pf = self.pfuncs.get(func)
            if pf is not None and session in pf.workers:
                pf.workers.remove(session)
        session.tokens.clear()
        if session.running:
            self.stats["workers_lost"] += 1
            log.warning("periodic worker disconnected worker=%s running=%d", session.worker_id, len(session.running))
        for job_id in sorted(session.running):
            job = self.jobs.get(job_id)
            if job is not None and job.state is JobState.RUNNING and job.worker_id == session.worker_id:
                self._retry_or_fail(job, now_millis, "attempt %d lost: Periodic worker %s disconnected"
                                    % (job.attempts, session.worker_id), "WORKER_LOST")
        session.running.clear()
