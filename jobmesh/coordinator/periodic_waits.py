"""Run-and-wait and streaming for the Periodic port: RUN_JOB, RECV_DATA and WORK_DATA.

``PeriodicWaits`` is a mixin of ``PeriodicJobs`` (periodic_jobs.py), itself part of the
single-writer core. A waiter is a RUN_JOB (it gets the job's result) or a RECV_DATA (it
gets the job's WORK_DATA chunks, then EOF) registered on a (func, name); waiters are
answered when the job ends (``_pfire``, called by the core's transition hook), when
their time is up (``expire_periodic_waits``, from the sweep), never twice. Frames for a
RECV_DATA go out ``Paced`` (docs/PERIODIC.md, "Streaming"): each one on its own write.
A connection may hold at most ``PERIODIC_MAX_WAITS_PER_CONN`` waits.
"""

from __future__ import annotations

import base64
import heapq
import logging
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING, Any

from jobmesh.coordinator.corebase import CoreBase
from jobmesh.periodic import codec as pc
from jobmesh.protocol.jobs import JobState
from jobmesh.store.job import Job

if TYPE_CHECKING:  # a protocol only: the core imports no gevent
    from jobmesh.coordinator.connection import OutboundConnection

log = logging.getLogger(__name__)

PERIODIC_WAIT_MILLIS = 60_000  # a RUN_JOB / RECV_DATA wait for a job without a timeout (periodicd)
PERIODIC_MAX_WAIT_MILLIS = 3_600_000  # and at most, whatever the job's timeout
PERIODIC_RECENT_MILLIS = 10_000  # a RECV_DATA this soon after its job ended gets EOF at once
PERIODIC_RECENT_KEPT = 4096  # job ends remembered for that
EXPIRED_ERROR = "expired"  # how the error of a job ended by its RUN_JOB wait begins
PERIODIC_MAX_WAITS_PER_CONN = 10_000  # RUN_JOB + RECV_DATA waits one connection may hold; more closes it


class PeriodicWaiter:
    """A RUN_JOB (result) or RECV_DATA (``stream``: chunks, then EOF) waiting for the job of
    ``key`` = (func, name); ``deadline`` is core time; ``done`` once answered."""

    __slots__ = ("key", "conn", "msgid", "stream", "deadline", "done")

    def __init__(self, key: tuple[str, str], conn: OutboundConnection, msgid: int, stream: bool, deadline: int) -> None:
        self.key = key
        self.conn = conn
        self.msgid = msgid
        self.stream = stream
        self.deadline = deadline
        self.done = False


class PeriodicWaits(CoreBase):
    """RUN_JOB, RECV_DATA and WORK_DATA; see the module docstring."""

    if TYPE_CHECKING:  # what periodic_jobs.py provides
        named: dict[tuple[str, str], str]
        pfuncs: dict[str, Any]

        def _periodic_store(self, now_millis: int, func: str, name: str, pj: pc.Job) -> bytes | None: ...
        def _plive(self, handle: pc.Handle) -> tuple[tuple[str, str] | None, Job | None]: ...
        def _not_text(self, conn: OutboundConnection) -> None: ...

    def _init_waits(self) -> None:
        # Waiters by (func, name), their deadlines, counts, and recent job ends.
        self.pwaits: dict[tuple[str, str], list[PeriodicWaiter]] = {}
        self._pwait_heap: list[tuple[int, int, PeriodicWaiter]] = []
        self._pwait_live = 0
        self._pwait_conns: Counter[Any] = Counter()  # connection -> its live waits
        self._pwait_seq = 0
        self._ended: OrderedDict[tuple[str, str], int] = OrderedDict()

    def _p_run(self, now_millis: int, conn: OutboundConnection, msg: pc.RunJob) -> None:
        """RUN_JOB: NO_WORKER at once if no connected worker declared the func; else store
        (or attach to the job of that name) and answer when the job ends (``_pfire``)."""
        key, _job = self._plive(pc.Handle(msg.job.func, msg.job.name))
        if key is None:
            self._not_text(conn)
            return
        func, name = key
        pf = self.pfuncs.get(func)
        if pf is None or not pf.workers:
            self._send(conn, pc.encode_no_worker(msg.msgid))
            return
        if not self._may_wait(conn):
            return
        problem = self._periodic_store(now_millis, func, name, msg.job)
        if problem is not None:
            self._send(conn, pc.encode_data(msg.msgid, problem))
            return
        wait = msg.job.timeout * 1000 if msg.job.timeout > 0 else PERIODIC_WAIT_MILLIS
        self._pwait((func, name), conn, msg.msgid, False, now_millis + min(wait, PERIODIC_MAX_WAIT_MILLIS))

    def _p_recv_data(self, now_millis: int, conn: OutboundConnection, msg: pc.RecvData) -> None:
        """RECV_DATA: SUCCESS, then the job's WORK_DATA chunks, then EOF when it ends. It
        attaches to the live job of that name, or to the next one; one that ended moments
        ago (aio-periodic sends RECV_DATA after RUN_JOB) gets its EOF at once."""
        key, job = self._plive(pc.Handle(msg.job.func, msg.job.name))
        if key is None:
            self._not_text(conn)
            return
        pf = self.pfuncs.get(key[0])
        if pf is None or not pf.workers:
            self._send(conn, pc.Paced(msg.msgid, pc.encode_no_worker(msg.msgid)))
            return
        if not self._may_wait(conn):
            return
        self._send(conn, pc.Paced(msg.msgid, pc.encode_success(msg.msgid)))
        ended = self._ended.get(key)
        if job is None and ended is not None and now_millis - ended <= PERIODIC_RECENT_MILLIS:
            self._send(conn, pc.Paced(msg.msgid, pc.encode_data(msg.msgid, pc.STREAM_EOF)))
            return
        wait = msg.job.timeout * 1000 if msg.job.timeout > 0 else PERIODIC_WAIT_MILLIS
        self._pwait(key, conn, msg.msgid, True, now_millis + min(wait, PERIODIC_MAX_WAIT_MILLIS))

    def _p_work_data(self, now_millis: int, conn: OutboundConnection, msg: pc.WorkData) -> None:
        """WORK_DATA: the chunk goes to every RECV_DATA waiter of the job, each its own write."""
        key, _job = self._plive(msg.handle)
        for waiter in self.pwaits.get(key, ()) if key is not None else ():
            if waiter.stream and not waiter.done:
                self._send(waiter.conn, pc.Paced(waiter.msgid, pc.encode_data(waiter.msgid, msg.data)))
        self._send(conn, pc.encode_success(msg.msgid))

    def _may_wait(self, conn: OutboundConnection) -> bool:
        """Whether the connection may register one more wait; if not, it is closed (a
        peer that piles up waits would otherwise hold memory for up to an hour each)."""
        if self._pwait_conns[conn] < PERIODIC_MAX_WAITS_PER_CONN:
            return True
        log.warning("closing periodic connection %r: more than %d RUN_JOB / RECV_DATA waits pending",
                    conn, PERIODIC_MAX_WAITS_PER_CONN)
        self._send(conn, None)
        return False

    def _pwait(self, key: tuple[str, str], conn: OutboundConnection, msgid: int, stream: bool, deadline: int) -> None:
        waiter = PeriodicWaiter(key, conn, msgid, stream, deadline)
        self.pwaits.setdefault(key, []).append(waiter)
        self._pwait_live += 1
        self._pwait_conns[conn] += 1
        heap = self._pwait_heap
        if len(heap) > 2 * self._pwait_live + 1024:
            heap[:] = [entry for entry in heap if not entry[2].done]
            heapq.heapify(heap)
        self._pwait_seq += 1
        heapq.heappush(heap, (deadline, self._pwait_seq, waiter))

    def _pwait_retire(self, waiter: PeriodicWaiter) -> None:
        """Answered: out of the live count and its connection's count."""
        waiter.done = True
        self._pwait_live -= 1
        conns = self._pwait_conns
        conns[waiter.conn] -= 1
        if conns[waiter.conn] <= 0:
            del conns[waiter.conn]

    def _run_waited(self, job: Job) -> bool:
        """Whether a RUN_JOB caller waits for this job (its failures then end it)."""
        return any(not w.stream for w in self.pwaits.get((job.task_type, job.name or ""), ()))

    def _pfire(self, job: Job, target: JobState, now_millis: int) -> None:
        """The job ended: its RECV_DATA waiters get EOF, then its RUN_JOB waiters the result."""
        key = (job.task_type, job.name or "")
        ended = self._ended
        ended[key] = now_millis
        ended.move_to_end(key)
        if len(ended) > PERIODIC_RECENT_KEPT:
            ended.popitem(last=False)
        waiters = self.pwaits.pop(key, None)
        if not waiters:
            return
        if target is JobState.COMPLETED:
            result = job.result or {}
            data = result.get("data")
            outcome = data.encode("utf-8") if data is not None else base64.b64decode(result.get("dataBase64", ""))
        elif (job.error or "").startswith(EXPIRED_ERROR):
            outcome = pc.RESULT_EXPIRED
        else:
            outcome = pc.RESULT_REMOVED if target is JobState.CANCELLED else pc.RESULT_FAILED
        for waiter in waiters:
            if waiter.stream:
                self._send(waiter.conn, pc.Paced(waiter.msgid, pc.encode_data(waiter.msgid, pc.STREAM_EOF)))
        for waiter in waiters:
            if not waiter.stream:
                self._send(waiter.conn, pc.encode_data(waiter.msgid, outcome))
            self._pwait_retire(waiter)

    def expire_periodic_waits(self, now_millis: int) -> None:
        """RUN_JOB / RECV_DATA waits whose time is up: a RUN_JOB wait ends its job (every
        waiter hears ``expired`` / EOF); a RECV_DATA wait alone gets its EOF."""
        heap = self._pwait_heap
        while heap and heap[0][0] <= now_millis:
            waiter = heapq.heappop(heap)[2]
            if waiter.done:
                continue
            job_id = self.named.get(waiter.key)
            job = self.jobs.get(job_id) if job_id is not None else None
            if not waiter.stream and job is not None:
                job.error = "%s: no result within the RUN_JOB wait" % EXPIRED_ERROR
                log.info("periodic run_job wait expired job=%s func=%s name=%s", job.job_id, *waiter.key)
                # _pfire answers every waiter; a job that never ran is cancelled, not failed
                self._transition(job, JobState.FAILED if job.state is JobState.RUNNING else JobState.CANCELLED,
                                 now_millis)
                continue
            waiting = self.pwaits.get(waiter.key, [])
            waiting.remove(waiter)
            if not waiting:
                self.pwaits.pop(waiter.key, None)
            self._pwait_retire(waiter)
            if waiter.stream:
                self._send(waiter.conn, pc.Paced(waiter.msgid, pc.encode_data(waiter.msgid, pc.STREAM_EOF)))
            else:
                self._send(waiter.conn, pc.encode_data(waiter.msgid, pc.RESULT_EXPIRED))
