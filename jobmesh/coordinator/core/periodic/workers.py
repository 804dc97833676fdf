"""Periodic worker sessions, their grab tokens and dispatch (PERIODIC.md 7.9, 7.15).

``WorkerSessions`` keeps a session per worker connection (made by its first worker
request; worker ids share one namespace with the JSON port's), answers CAN_DO, CANT_DO,
BROADCAST, GRAB_JOB and JOB_UNASSIGNED, and hands due jobs to grab tokens: per func, in
(sched, name) order, rotating over the func's workers, the newest token of the chosen
worker; a broadcast job goes to every other worker of its func holding a token too
(``fanout``). A job moves to RUNNING through the table before its JOB_ASSIGN is sent.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from jobmesh.coordinator.core.figures import Counters
from jobmesh.coordinator.core.limits import Limits
from jobmesh.coordinator.core.outbox import Outbox
from jobmesh.coordinator.core.periodic.index import FuncIndex, close_not_text, func_name, wire_job
from jobmesh.coordinator.core.registry import PeriodicSession
from jobmesh.coordinator.core.table import JobTable
from jobmesh.periodic import codec as pc
from jobmesh.protocol.jobs import JobState
from jobmesh.store.job import Job

if TYPE_CHECKING:
    from jobmesh.coordinator.core.peers import OutboundConnection

log = logging.getLogger(__name__)

MAX_TOKENS = 4096  # grab tokens one Periodic worker may hold
MAX_FUNCS = 10_000  # funcs one Periodic connection may declare (CAN_DO, BROADCAST)
# Funcs one connection's declarations may bring into the listing over its life: one it
# withdraws (CANT_DO) stays listed for the forget time, so churning new names is bounded too.
MAX_NEW_FUNCS = 10 * MAX_FUNCS


class WorkerSessions:
    def __init__(self, table: JobTable, index: FuncIndex, outbox: Outbox, counters: Counters, limits: Limits,
                 held_elsewhere: Callable[[str], bool]) -> None:
        self.table = table
        self.index = index
        self.outbox = outbox
        self.counters = counters
        self.limits = limits  # a func's jobs obey the limit of the task type of its name
        self.held_elsewhere = held_elsewhere  # whether a live JSON worker session has that worker id
        self.by_id: dict[str, PeriodicSession] = {}
        self.conns: dict[OutboundConnection, PeriodicSession] = {}
        # A broadcast job's other workers (its lease holder is ``worker_id``), while it runs.
        self.fanout: dict[str, set[str]] = {}
        # Set by the core between batches: assign nothing (draining, or storage failing).
        self.hold = False
        self._seq = 0

    def session(self, conn: OutboundConnection, now: int) -> PeriodicSession:
        """The connection's session, made by its first worker request."""
        session = self.conns.get(conn)
        if session is None:
            worker_id = ""
            while not worker_id or self.held_elsewhere(worker_id):  # one namespace of worker ids
                self._seq += 1
                worker_id = "periodic-%d" % self._seq
            session = PeriodicSession(worker_id, conn, now)
            self.table.session_started(session)
            self.conns[conn] = session
            self.by_id[session.worker_id] = session
        session.last_heartbeat = now
        return session

    def of(self, conn: OutboundConnection) -> PeriodicSession | None:
        return self.conns.get(conn)

    def runs_on(self, job: Job, session: PeriodicSession | None) -> bool:
        """Whether the job is RUNNING on that session: its lease holder, or (broadcast) one
        of the other workers it went to."""
        return session is not None and job.state is JobState.RUNNING and (
            job.worker_id == session.worker_id or session.worker_id in self.fanout.get(job.job_id, ()))

    def stopped(self, job: Job) -> None:
        """The job's run ended (the table ends the copies a broadcast job's other workers ran)."""
        if self.fanout:
            self.fanout.pop(job.job_id, None)

    @property
    def running_attempts(self) -> int:
        running = self.table.running
        return sum(len(running(s)) for s in self.by_id.values())

    # ---- worker requests --------------------------------------------------------------------

    def on_can_do(self, now: int, conn: OutboundConnection, msg: pc.CanDo | pc.Broadcast | pc.CantDo) -> None:
        func = func_name(msg.func)
        if func is None:
            close_not_text(self.outbox, conn)
            return
        session = self.session(conn, now)
        if type(msg) is pc.CantDo:
            if func in session.funcs:
                session.funcs.discard(func)
                session.task_types = frozenset(session.funcs)
                self.index.remove_worker(func, session, now)
        elif func not in session.funcs and len(session.funcs) >= MAX_FUNCS:
            log.warning("refused periodic %s of func %r worker=%s: a connection may declare %d funcs at most",
                        type(msg).__name__, func, session.worker_id, MAX_FUNCS)
            self.outbox.send(conn, pc.encode_no_worker(msg.msgid))
            return
        elif not self.index.knows(func) and session.new_funcs >= MAX_NEW_FUNCS:
            log.warning("refused periodic %s of func %r worker=%s: a connection may bring %d new funcs at most",
                        type(msg).__name__, func, session.worker_id, MAX_NEW_FUNCS)
            self.outbox.send(conn, pc.encode_no_worker(msg.msgid))
            return
        else:
            if not self.index.knows(func):
                session.new_funcs += 1
            declared = func in session.funcs
            self.index.add_worker(func, session, type(msg) is pc.Broadcast, declared)
            if not declared:
                session.funcs.add(func)
                session.task_types = frozenset(session.funcs)
        self.outbox.send(conn, pc.encode_success(msg.msgid))

    def on_grab(self, now: int, conn: OutboundConnection, msg: pc.GrabJob) -> None:
        session = self.session(conn, now)
        if msg.msgid not in session.tokens and len(session.tokens) < MAX_TOKENS:
            session.tokens.append(msg.msgid)
            self.index.wake(session.funcs)
        self.outbox.send(conn, pc.encode_success(msg.msgid))

    def on_unassigned(self, now: int, conn: OutboundConnection, msg: pc.JobUnassigned) -> None:
        """The worker gives the job back: pending again, at once; no reply."""
        session = self.session(conn, now)
        job_id = session.assigned.pop(msg.msgid, None)
        job = self.table.jobs.get(job_id) if job_id is not None else None
        if job is not None and job.state is JobState.RUNNING and job.worker_id == session.worker_id:
            self.table.transition(job, JobState.QUEUED, now)

    def closed(self, now: int, conn: OutboundConnection) -> list[Job]:
        """The connection ended: its funcs lose a worker, its tokens vanish; the jobs whose
        lease it held, for the caller to retry (a broadcast job's other workers go on)."""
        session = self.conns.pop(conn, None)
        if session is None:
            return []
        self.by_id.pop(session.worker_id, None)
        for func in session.funcs:
            self.index.remove_worker(func, session, now)
        session.tokens.clear()
        running = self.table.running(session)
        if running:
            self.counters.workers_lost += 1
            log.warning("periodic worker disconnected worker=%s running=%d", session.worker_id, len(running))
        lost = []
        for job_id in sorted(running):
            job = self.table.jobs.get(job_id)
            if job is not None and job.state is JobState.RUNNING and job.worker_id == session.worker_id:
                lost.append(job)
            elif job_id in self.fanout:  # one of a broadcast job's other workers: the rest go on
                self.fanout[job_id].discard(session.worker_id)
        self.table.session_ended(session)
        return lost

    # ---- dispatch ---------------------------------------------------------------------------

    def dispatch(self, now: int) -> int:
        """Hand due Periodic jobs to grab tokens: per func, (sched, name) order, rotating
        over the func's workers, the newest token of the chosen worker."""
        if self.hold:
            return 0
        index = self.index
        assigned = 0
        for func in index.take_ready():
            pf = index.take(func)
            if pf is None:
                continue
            gate = self.limits.gate(func)
            while index.has_queued(pf):
                if gate is not None and not gate.open(now):
                    break  # held by its limit: the limit says when it may start again (``FuncIndex.opened``)
                session = index.token_holder(pf)
                if session is None:
                    break
                job = index.pop_queued(pf)
                if job is None:
                    continue
                try:  # before the job moves: one that cannot be sent must not hold a worker
                    wire = wire_job(job, self.table.config.task_timeout_millis)
                    frame = pc.encode_job_assign(session.tokens[-1], wire)
                except Exception as exc:
                    log.exception("periodic job=%s func=%s cannot be assigned; cancelling it", job.job_id, func)
                    self.table.record(job, error="cannot be assigned: %s" % str(exc)[:200])
                    self.table.transition(job, JobState.CANCELLED, now)
                    continue
                self.table.transition(job, JobState.RUNNING, now, session=session)
                self._assign(session, job, frame)
                others = index.others(pf, session)  # a broadcast job: every other worker with a token too
                if others:
                    self.fanout[job.job_id] = {s.worker_id for s in others}
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
