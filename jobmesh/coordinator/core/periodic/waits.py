"""Run-and-wait and streaming waiters of the Periodic port: RUN_JOB and RECV_DATA.

A waiter is a RUN_JOB (it gets the job's result) or a RECV_DATA (it gets the job's
WORK_DATA chunks, then EOF) registered on a (func, name). ``PeriodicWaits`` keeps them by
key, by deadline and per connection, answers them when their job ends (``fire``, from the
Periodic part's transition listener) or when their time is up, never twice, and remembers
recent job ends (a RECV_DATA that comes moments after its job ended gets EOF at once).
Frames for a RECV_DATA go out ``Paced`` (docs/PERIODIC.md, "Streaming"): each one on its
own write. A connection may hold at most ``MAX_WAITS_PER_CONN`` waits. Pure bookkeeping
over the core's outbox: which job a key names is the Periodic part's business.

A RUN_JOB caller's RECV_DATA may be applied after its job sent chunks, or even ended: it
follows the RUN_JOB on the wire, and the mailbox applies a worker's frames before a
client's in a batch. So the chunks of a job are kept for each RUN_JOB caller whose
connection has no RECV_DATA attached yet (``KEPT_BYTES`` in all), handed to that
connection's RECV_DATA when it comes (while the job runs, or within ``RECENT_MILLIS``
of its end), and RUN_JOB results are released at the end of the batch
(``release_results``), after the frames of every RECV_DATA applied in it.
"""

from __future__ import annotations

import base64
import heapq
import logging
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING, Iterator

from jobmesh.store.job import Job
from jobmesh.coordinator.core.outbox import Outbox
from jobmesh.periodic import codec as pc
from jobmesh.protocol.jobs import JobState

if TYPE_CHECKING:
    from jobmesh.coordinator.core.peers import OutboundConnection

log = logging.getLogger(__name__)

WAIT_MILLIS = 60_000  # a RUN_JOB / RECV_DATA wait for a job without a timeout (periodicd)
MAX_WAIT_MILLIS = 3_600_000  # and at most, whatever the job's timeout
RECENT_MILLIS = 10_000  # a RECV_DATA this soon after its job ended gets EOF at once
RECENT_KEPT = 4096  # job ends remembered for that
EXPIRED_ERROR = "expired"  # how the error of a job ended by its RUN_JOB wait begins
MAX_WAITS_PER_CONN = 10_000  # RUN_JOB + RECV_DATA waits one connection may hold; more closes it
KEPT_BYTES = 8 * 1024 * 1024  # chunks kept for RECV_DATAs yet to come, all connections together


class PeriodicWaiter:
    """A RUN_JOB (result) or RECV_DATA (``stream``: chunks, then EOF) waiting for the job of
    ``key`` = (func, name); ``deadline`` is core time; ``done`` once answered."""

    __slots__ = ("key", "conn", "msgid", "stream", "deadline", "done", "kept")

    def __init__(self, key: tuple[str, str], conn: OutboundConnection, msgid: int, stream: bool, deadline: int) -> None:
        self.key = key
        self.conn = conn
        self.msgid = msgid
        self.stream = stream
        self.deadline = deadline
        self.done = False
        self.kept: list[bytes] | None = None  # a RUN_JOB's: chunks for its connection's RECV_DATA to come


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
        # Chunks kept for RECV_DATAs to come: on live RUN_JOB waiters, and after their job
        # ended by (connection, key), with the end's time; their bytes, all together.
        self._kept_ended: OrderedDict[tuple[OutboundConnection, tuple[str, str]], tuple[int, list[bytes]]] = \
            OrderedDict()
        self.kept_bytes = 0
        self._results: list[tuple[OutboundConnection, bytes]] = []  # RUN_JOB results of this batch

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
        self._unkeep(waiter)
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
            self._unkeep(waiter)
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
        """WORK_DATA: the chunk goes to every RECV_DATA waiter of the key, each its own
        write, and is kept for each RUN_JOB waiter whose connection has none attached."""
        waiters = self.by_key.get(key, ())
        streaming = {w.conn for w in waiters if w.stream}
        for waiter in waiters:
            if waiter.done:
                continue
            if waiter.stream:
                self.outbox.send(waiter.conn, pc.Paced(waiter.msgid, pc.encode_data(waiter.msgid, data)))
            elif waiter.conn not in streaming:
                self._keep(waiter, data)

    def _keep(self, waiter: PeriodicWaiter, data: bytes) -> None:
        while self.kept_bytes + len(data) > KEPT_BYTES and self._kept_ended:
            self._drop_oldest_ended()
        if self.kept_bytes + len(data) > KEPT_BYTES:
            log.debug("periodic chunk not kept for a RECV_DATA to come: %d bytes kept already", self.kept_bytes)
            return
        if waiter.kept is None:
            waiter.kept = []
        waiter.kept.append(data)
        self.kept_bytes += len(data)

    def _unkeep(self, waiter: PeriodicWaiter) -> None:
        if waiter.kept:
            self.kept_bytes -= sum(len(c) for c in waiter.kept)
        waiter.kept = None

    def _drop_oldest_ended(self) -> None:
        _, (_, chunks) = self._kept_ended.popitem(last=False)
        self.kept_bytes -= sum(len(c) for c in chunks)

    def take_kept(self, conn: OutboundConnection, key: tuple[str, str], now: int, live: bool) -> list[bytes]:
        """The chunks kept for ``conn``'s RECV_DATA of ``key``: of the live job (``live``),
        or of the one that ended lately; once."""
        if live:
            chunks: list[bytes] = []
            for waiter in self.by_key.get(key, ()):
                if waiter.conn is conn and not waiter.stream and waiter.kept:
                    chunks = chunks or waiter.kept  # every RUN_JOB of it kept the same chunks
                    self._unkeep(waiter)
            return chunks
        kept = self._kept_ended.pop((conn, key), None)
        if kept is None:
            return []
        ended, chunks = kept
        self.kept_bytes -= sum(len(c) for c in chunks)
        return chunks if ended == self._ended.get(key) and now - ended <= RECENT_MILLIS else []

    def release_results(self) -> None:
        """The end of a batch: the RUN_JOB results of jobs that ended in it, after every
        other frame of the batch (a RECV_DATA applied after its job's end gets its chunks
        and EOF first)."""
        if self._results:
            for conn, frame in self._results:
                self.outbox.send(conn, frame)
            self._results = []

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
                self._results.append((waiter.conn, pc.encode_data(waiter.msgid, outcome)))
                if waiter.kept:  # for the RECV_DATA that may still come on its connection
                    old = self._kept_ended.pop((waiter.conn, key), None)
                    if old is not None:
                        self.kept_bytes -= sum(len(c) for c in old[1])
                    self._kept_ended[(waiter.conn, key)] = (now, waiter.kept)
                    waiter.kept = None
            self._retire(waiter)
        kept = self._kept_ended
        while kept and (len(kept) > RECENT_KEPT or now - next(iter(kept.values()))[0] > RECENT_MILLIS):
            self._drop_oldest_ended()

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
