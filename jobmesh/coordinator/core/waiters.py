"""Pending WAIT_JOB requests: who waits for which job, and until when.

Pure bookkeeping for ``CoordinatorCore`` (no gevent, no clock): times are core time in
milliseconds, given by the caller. A waiter is answered exactly once, either when its
job reaches a terminal state (``wake_job``, called from the core's one transition
method) or when its deadline passes (``expire``); ``take`` hands the answered waiters
to the core, which builds their JOB_STATUS replies at the end of the batch, so they
are released after the batch's commit like any reply.

Indexes:

* ``by_job``: job id -> waiters of that job, in arrival order;
* ``heap``: (deadline, arrival number, waiter), time-ordered; answered waiters stay in
  it until popped or until a rebuild (``_compact``: when dead entries outnumber live
  ones), so a steady stream of short waits keeps it the size of the live set;
* ``by_conn``: connection -> its waiters, so a client that goes away with waits pending
  costs O(its waits) to forget (at most the connection's 64 requests in flight).
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING

from jobmesh.protocol.messages import Message

if TYPE_CHECKING:  # a protocol only: this module stays pure
    from jobmesh.coordinator.core.peers import ReplyConnection

MAX_WAIT_MILLIS = 3_600_000  # the longest WAIT_JOB timeout


class Slot:
    """The place of a pending WAIT_JOB's reply in its connection's order; ``msg`` is set
    once the core answers it (the runtime holds later replies of that connection behind it)."""

    __slots__ = ("msg",)

    def __init__(self) -> None:
        self.msg: Message | None = None


class Waiter:
    """One pending WAIT_JOB. ``token`` is the reply's Slot on ``conn``; ``deadline`` is
    core time (ms); ``done`` once answered or dropped. With an empty ``job_id`` it is no
    wait but the Slot of a request held for a store read (``CoordinatorCore.resume_held``)."""

    __slots__ = ("conn", "token", "job_id", "deadline", "done")

    def __init__(self, conn: ReplyConnection, token: Slot, job_id: str, deadline: int) -> None:
        self.conn = conn
        self.token = token
        self.job_id = job_id
        self.deadline = deadline
        self.done = False

    def __repr__(self) -> str:
        return "<Waiter job=%s deadline=%d%s>" % (self.job_id, self.deadline, " done" if self.done else "")


class Waiters:
    def __init__(self) -> None:
        self.by_job: dict[str, list[Waiter]] = {}
        self.by_conn: dict[ReplyConnection, set[Waiter]] = {}
        self.heap: list[tuple[int, int, Waiter]] = []
        self.live = 0
        self._order = itertools.count()
        self._woken: list[Waiter] = []

    def __len__(self) -> int:
        return self.live

    def __bool__(self) -> bool:  # checked on every terminal transition: keep it O(1)
        return self.live > 0

    @property
    def answered(self) -> bool:
        """Whether ``take`` has waiters to hand over."""
        return bool(self._woken)

    def add(self, waiter: Waiter) -> None:
        waiter.done = False
        self.by_job.setdefault(waiter.job_id, []).append(waiter)
        self.by_conn.setdefault(waiter.conn, set()).add(waiter)
        self._compact()
        heapq.heappush(self.heap, (waiter.deadline, next(self._order), waiter))
        self.live += 1

    def _retire(self, waiter: Waiter) -> None:
        """Out of ``by_conn`` and the live count (``by_job`` is the caller's)."""
        waiter.done = True
        self.live -= 1
        mine = self.by_conn.get(waiter.conn)
        if mine is not None:
            mine.discard(waiter)
            if not mine:
                del self.by_conn[waiter.conn]

    def wake_job(self, job_id: str) -> None:
        """The job ended: every waiter of it is answered (in arrival order)."""
        waiting = self.by_job.pop(job_id, None)
        if waiting:
            for waiter in waiting:
                self._retire(waiter)
            self._woken.extend(waiting)

    def expire(self, now_millis: int) -> None:
        """Waiters whose deadline has come are answered with the job as it stands."""
        heap = self.heap
        while heap and heap[0][0] <= now_millis:
            waiter = heapq.heappop(heap)[2]
            if waiter.done:
                continue
            self._unlist(waiter)
            self._retire(waiter)
            self._woken.append(waiter)

    def _unlist(self, waiter: Waiter) -> None:
        waiting = self.by_job.get(waiter.job_id)
        if waiting is not None:
            waiting.remove(waiter)  # O(waiters of that job): usually one or a few
            if not waiting:
                del self.by_job[waiter.job_id]

    def drop_conn(self, conn: ReplyConnection) -> int:
        """Forget the waiters of a connection that has gone (nobody to answer); how many."""
        mine = self.by_conn.pop(conn, None)
        if not mine:
            return 0
        for waiter in mine:
            self._unlist(waiter)
            waiter.done = True
        self.live -= len(mine)
        return len(mine)

    def next_deadline(self) -> int | None:
        """The earliest deadline of a live waiter (core time), or None."""
        heap = self.heap
        while heap and heap[0][2].done:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def take(self) -> list[Waiter]:
        """The waiters answered since the last call, in the order they were answered."""
        woken, self._woken = self._woken, []
        return woken

    def pending(self) -> list[Waiter]:
        """Every live waiter (a reload hands them to the new core; a stop answers them)."""
        return [w for waiting in self.by_job.values() for w in waiting]

    def _compact(self) -> None:
        """Rebuild the heap from live waiters once answered ones outnumber them."""
        if len(self.heap) <= 2 * self.live + 1024:
            return
        live = [entry for entry in self.heap if not entry[2].done]
        heapq.heapify(live)
        self.heap = live
