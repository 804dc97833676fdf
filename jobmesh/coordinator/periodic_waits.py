"""Run-and-wait and streaming waiters of the Periodic port: RUN_JOB and RECV_DATA.

A waiter is a RUN_JOB (it gets the job's result) or a RECV_DATA (it gets the job's
WORK_DATA chunks, then EOF) registered on a (func, name). ``PeriodicWaits`` keeps them by
key, by deadline and per connection, answers them when their job ends (``fire``, from the
Periodic part's transition listener) or when their time is up, never twice, and remembers
recent job ends (a RECV_DATA that comes moments after its job ended gets EOF at once).
Frames for a RECV_DATA go out ``Paced`` (docs/PERIODIC.md, "Streaming"): each one on its
own write. A connection may hold at most ``MAX_WAITS_PER_CONN`` waits. Pure bookkeeping
over the core's outbox: which job a key names is the Periodic part's business.
"""

from __future__ import annotations

import base64
import heapq
import logging
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING, Iterator

from jobmesh.store.job import Job
from jobmesh.coordinator.outbox import Outbox
from jobmesh.periodic import codec as pc
from jobmesh.protocol.jobs import JobState

if TYPE_CHECKING:
    from jobmesh.coordinator.connection import OutboundConnection

log = logging.getLogger(__name__)

WAIT_MILLIS = 60_000  # a RUN_JOB / RECV_DATA wait for a job without a timeout (periodicd)
MAX_WAIT_MILLIS = 3_600_000  # and at most, whatever the job's timeout
RECENT_MILLIS = 10_000  # a RECV_DATA this soon after its job ended gets EOF at once
RECENT_KEPT = 4096  # job ends remembered for that
EXPIRED_ERROR = "expired"  # how the error of a job ended by its RUN_JOB wait begins
MAX_WAITS_PER_CONN = 10_000  # RUN_JOB + RECV_DATA waits one connection may hold; more closes it


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


def wait_deadline(now: int, timeout_seconds: int) -> int:
    """When a wait for a job with this timeout (0: none) gives up, core time."""
    wait = timeout_seconds * 1000 if timeout_seconds > 0 else WAIT_MILLIS
    return now + min(wait, MAX_WAIT_MILLIS)


class PeriodicWaits:
    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        self.by_key: dict[tuple[str, str], list[PeriodicWaiter]] = {}
        self.live = 0
        self.per_conn: Counter[OutboundConnection] = Counter()  # connection -> its live waits
        self._by_conn: dict[OutboundConnection, list[PeriodicWaiter]] = {}  # its waiters (some answered)
        self.heap: list[tuple[int, int, PeriodicWaiter]] = []
        self._seq = 0
        self._ended: OrderedDict[tuple[str, str], int] = OrderedDict()

    def __bool__(self) -> bool:
        return bool(self.by_key)

    def may_wait(self, conn: OutboundConnection) -> bool:
        """Whether the connection may register one more wait; if not, it is closed (a
        peer that piles up waits would otherwise hold memory for up to an hour each)."""
        if self.per_conn[conn] < MAX_WAITS_PER_CONN:
            return True
        log.warning("closing periodic connection %r: more than %d RUN_JOB / RECV_DATA waits pending",
                    conn, MAX_WAITS_PER_CONN)
        self.outbox.send(conn, None)
        return False

    def add(self, key: tuple[str, str], conn: OutboundConnection, msgid: int, stream: bool, deadline: int) -> None:
        waiter = PeriodicWaiter(key, conn, msgid, stream, deadline)
        self.by_key.setdefault(key, []).append(waiter)
        self.live += 1
        self.per_conn[conn] += 1
        mine = self._by_conn.setdefault(conn, [])
        if len(mine) > 2 * self.per_conn[conn] + 64:  # answered ones outnumber the live: drop them
            mine[:] = [w for w in mine if not w.done]
        mine.append(waiter)
        heap = self.heap
        if len(heap) > 2 * self.live + 1024:
            heap[:] = [entry for entry in heap if not entry[2].done]
            heapq.heapify(heap)
        self._seq += 1
        heapq.heappush(heap, (deadline, self._seq, waiter))

    def _retire(self, waiter: PeriodicWaiter) -> None:
        """Answered: out of the live count and its connection's count."""
        waiter.done = True
        self.live -= 1
        conns = self.per_conn
        conns[waiter.conn] -= 1
        if conns[waiter.conn] <= 0:
            del conns[waiter.conn]
            self._by_conn.pop(waiter.conn, None)

    def run_waited(self, job: Job) -> bool:
        """Whether a RUN_JOB caller waits for this job (its failures then end it)."""
        return any(not w.stream for w in self.by_key.get((job.task_type, job.name or ""), ()))

    def drop_conn(self, conn: OutboundConnection) -> int:
        """The connection has gone: its waits are forgotten (their answers have nowhere to
        go; their jobs go on). How many."""
        mine = self._by_conn.pop(conn, None)
        if not mine:
            return 0
        dropped = 0
        for waiter in mine:
            if waiter.done:
                continue
            waiting = self.by_key.get(waiter.key, [])
            waiting.remove(waiter)
            if not waiting:
                self.by_key.pop(waiter.key, None)
            waiter.done = True
            self.live -= 1
            dropped += 1
        self.per_conn.pop(conn, None)
        return dropped

    def ended_lately(self, key: tuple[str, str], now: int) -> bool:
        """Whether the job of that key ended at most RECENT_MILLIS ago."""
        ended = self._ended.get(key)
        return ended is not None and now - ended <= RECENT_MILLIS

    def chunk(self, key: tuple[str, str], data: bytes) -> None:
        """WORK_DATA: the chunk goes to every RECV_DATA waiter of the key, each its own write."""
        for waiter in self.by_key.get(key, ()):
            if waiter.stream and not waiter.done:
                self.outbox.send(waiter.conn, pc.Paced(waiter.msgid, pc.encode_data(waiter.msgid, data)))

    def fire(self, job: Job, target: JobState, now: int) -> None:
        """The job ended: its RECV_DATA waiters get EOF, then its RUN_JOB waiters the result."""
        key = (job.task_type, job.name or "")
        ended = self._ended
        ended[key] = now
        ended.move_to_end(key)
        if len(ended) > RECENT_KEPT:
            ended.popitem(last=False)
        waiters = self.by_key.pop(key, None)
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
        send = self.outbox.send
        for waiter in waiters:
            if waiter.stream:
                send(waiter.conn, pc.Paced(waiter.msgid, pc.encode_data(waiter.msgid, pc.STREAM_EOF)))
        for waiter in waiters:
            if not waiter.stream:
                send(waiter.conn, pc.encode_data(waiter.msgid, outcome))
            self._retire(waiter)

    def due(self, now: int) -> Iterator[PeriodicWaiter]:
        """Live waiters whose time is up, earliest first (the caller answers each one,
        directly with ``give_up`` or by ending its job, before taking the next)."""
        heap = self.heap
        while heap and heap[0][0] <= now:
            waiter = heapq.heappop(heap)[2]
            if not waiter.done:
                yield waiter

    def give_up(self, waiter: PeriodicWaiter) -> None:
        """Answer one waiter whose time is up: EOF for a RECV_DATA, ``expired`` for a RUN_JOB."""
        waiting = self.by_key.get(waiter.key, [])
        waiting.remove(waiter)
        if not waiting:
            self.by_key.pop(waiter.key, None)
        self._retire(waiter)
        if waiter.stream:
            self.outbox.send(waiter.conn, pc.Paced(waiter.msgid, pc.encode_data(waiter.msgid, pc.STREAM_EOF)))
        else:
            self.outbox.send(waiter.conn, pc.encode_data(waiter.msgid, pc.RESULT_EXPIRED))
