"""The worker and client ports: frames in, core events out; replies and frames back.

Connection handlers are blocking-style code running one greenlet per connection
(gevent ``StreamServer``). They decode frames and post events to the core's inbox; they
never touch core state. A framing or protocol violation gets an ERROR and closes that
one connection; nothing else is affected.

Handlers only read. After a batch's commit the core writes what the batch released
itself: one non-blocking write per connection (``Output``), which the socket almost
always takes whole, so a request costs no reply handoff and no second wake-up of its
handler, and a TASK_ASSIGN leaves as soon as its commit is done. Bytes a full socket did
not take go to a flusher greenlet and later frames queue behind them, so the core never
blocks on a slow peer and frames never interleave on a socket.

Client connections are request/response, answered in request order: the handler posts
each request with its ``ClientConn`` and goes back to reading. A pending WAIT_JOB counts
as unanswered, and the runtime holds the replies that follow it until it is answered.
A connection that ends with requests unanswered posts ``ClientClosed``, so the core
forgets its waits. It stops reading while
its connection has unsent bytes or ``MAX_PIPELINE`` unanswered requests, so a client
that pipelines without reading can grow neither the mailbox nor the coordinator's memory.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import deque
from typing import Any, Callable

import gevent
from gevent.event import Event

from jobmesh.coordinator import events as ev
from jobmesh.coordinator.clock import monotonic
from jobmesh.errors import ProtocolError
from jobmesh.protocol import messages as m
from jobmesh.protocol.framing import FrameReader, encode_frame
from jobmesh.protocol.payloads import TASK_NAME_RULE, is_task_type_name

log = logging.getLogger(__name__)

WRITER_JOIN_SECONDS = 2.0  # how long a leaving worker handler lets queued frames go out
MAX_PIPELINE = 64  # unanswered requests per client connection before its handler stops reading
MAX_WORKER_BACKLOG = 64  # a worker's events not yet applied before its handler stops reading
MAX_UNSENT_BYTES = 8 * 1024 * 1024  # a peer holding more unsent output than this is closed
MAX_HEARTBEATS_PER_SECOND = 50  # more from one worker is a flood: the connection is closed
IDLE_TIMEOUT_SECONDS = 120.0  # default: a client's first frame / a worker's registration must complete in this
DRAIN_SECONDS = 30.0  # at EOF, how long a client handler waits for its replies to go out

MAX_TASK_TYPES = 1024  # task types one worker may declare

SHUTTING_DOWN = m.Error("coordinator is shutting down")


def check_task_types(msg: m.WorkerRegister) -> None:
    """A malformed ``taskTypes`` is a protocol violation (the connection closes)."""
    names = msg.task_types
    if names is None:
        return
    if len(names) > MAX_TASK_TYPES:
        raise ProtocolError("WORKER_REGISTER declares %d task types; at most %d" % (len(names), MAX_TASK_TYPES))
    for name in names:
        if not is_task_type_name(name):
            shown = m.quote(name) if isinstance(name, str) else "a %s" % type(name).__name__
            raise ProtocolError("WORKER_REGISTER taskTypes holds %s; a task type is %s" % (shown, TASK_NAME_RULE))


def _nodelay(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass


class Output:
    """Ordered, non-blocking output of one connection; only the hub's thread touches it.

    ``write`` tries the socket at once (the common case: it takes everything) and never
    blocks its caller, the core. Bytes a full socket does not take go to a flusher
    greenlet, and later writes queue behind them, so frames never interleave or reorder.
    ``closed`` is set before the socket closes (by the handler on its way out, or here
    on a failed write), and every write checks it first, so nothing is ever written to
    a descriptor number the kernel has since given to another connection.
    """

    __slots__ = ("sock", "fileno", "closed", "_closing", "_leftover", "_flusher", "_progress", "inbox",
                 "last_arrival", "paused")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fileno = sock.fileno()
        self.closed = False
        self._closing = False  # shut the socket down once what is queued is out
        self._leftover: bytearray | None = None  # bytes the socket has not taken yet
        self._flusher: gevent.Greenlet | None = None
        self._progress = Event()  # set whenever bytes go out, events are taken, or the connection ends
        self.inbox: deque = deque()  # this connection's events not yet taken by the core (mailbox.py)
        self.last_arrival = monotonic()  # when its last frame was read (clock.monotonic): liveness by arrival
        self.paused = False  # its handler is not reading because the core is behind on it

    def drained(self) -> None:
        """The core took events from this connection's inbox: wake a paused reader."""
        if self.paused:
            self._progress.set()

    def write(self, data: bytes, close: bool = False) -> None:
        """Send ``data`` after everything written before; with ``close``, shut down after it."""
        if close:
            self._closing = True
        if not self.closed:
            if self._leftover is not None:
                self._leftover += data
                if len(self._leftover) > MAX_UNSENT_BYTES:
                    log.warning("closing a connection that holds %d unsent bytes (limit %d): its peer does not read",
                                len(self._leftover), MAX_UNSENT_BYTES)
                    self._fail()
                    return
            else:
                try:
                    sent = os.write(self.fileno, data) if data else 0
                except BlockingIOError:
                    sent = 0
                except OSError:
                    self._fail()
                    return
                if sent < len(data):
                    self._leftover = bytearray(memoryview(data)[sent:])
                    self._flusher = gevent.spawn(self._flush)
                elif self._closing:
                    self._shutdown()
        self._progress.set()

    def _flush(self) -> None:
        try:
            while self._leftover:
                data, self._leftover = bytes(self._leftover), bytearray()
                self.sock.sendall(data)
        except OSError:
            self._fail()
            return
        finally:
            self._flusher = None
        self._leftover = None
        if self._closing:
            self._shutdown()
        self._progress.set()

    def _fail(self) -> None:
        self.closed = True
        self._leftover = None
        self._shutdown()
        self._progress.set()

    def _shutdown(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _wait_for(self, done: Callable[[], bool], timeout: float | None = None) -> bool:
        """Block the calling greenlet until ``done()`` or the connection ends; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not (self.closed or done()):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._progress.clear()
            self._progress.wait(left)
        return True

    def flushed(self, timeout: float) -> bool:
        """Wait until nothing written is left unsent (or the connection ended); False on timeout."""
        return self._wait_for(lambda: self._leftover is None, timeout)

    def abort(self) -> None:
        """Shut the socket down now (coordinator stopping); the handler then exits."""
        self.closed = True
        self._leftover = None
        self._shutdown()

    def release(self) -> None:
        """The handler is leaving and its socket is about to close: write nothing more."""
        self.closed = True
        self._leftover = None
        if self._flusher is not None:
            self._flusher.kill(block=False)


def _encode(msgs: list[m.Message], worker_id: str | None) -> bytes:
    frames = []
    for msg in msgs:
        try:
            frames.append(encode_frame(msg.to_wire()))
        except ProtocolError as exc:  # a bug upstream; never let it wedge the session
            log.error("dropped an unencodable %s for worker=%s: %s", msg.TYPE, worker_id, exc)
    return b"".join(frames)


class WorkerConn(Output):
    """One worker connection: the core sends it TASK_ASSIGN, TASK_CANCEL and ERROR frames."""

    __slots__ = ("addr", "worker_id")

    def __init__(self, sock: socket.socket, addr: tuple[Any, ...]) -> None:
        super().__init__(sock)
        self.addr = addr
        self.worker_id: str | None = None

    def __repr__(self) -> str:
        return "<WorkerConn %s %s:%s>" % (self.worker_id, *self.addr[:2])

    def send(self, msg: m.Message | None) -> None:
        """Send one message; None closes the connection once what came before it is sent."""
        self.send_many([msg])

    def send_many(self, msgs: list) -> None:
        """Send messages in order with one write; a None among them closes after what precedes it."""
        close = None in msgs
        if close:
            msgs = msgs[: msgs.index(None)]
        self.write(_encode(msgs, self.worker_id), close)

    def finish(self) -> None:
        """Called by the handler on its way out: let queued bytes go (bounded), then stop writing.

        ``release`` runs even if the wait is interrupted (the server killing handlers at
        stop): the socket closes right after, and nothing may write to its number again.
        """
        try:
            self.flushed(WRITER_JOIN_SECONDS)
        finally:
            self.release()


class ClientConn(Output):
    """A client connection as the core sees it: a destination for replies, in request order."""

    __slots__ = ("inflight",)

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self.inflight = 0  # requests posted to the core and not answered yet

    def reply(self, data: bytes, count: int, close: bool = False) -> None:
        """Write ``count`` replies' bytes without blocking; called by the core only."""
        self.inflight -= count
        self.write(data, close)

    def wait_for_room(self) -> None:
        """Block the reader while the client is too far ahead of its replies."""
        if self.inflight >= MAX_PIPELINE or self._leftover is not None:  # rare: checked per request
            self._wait_for(lambda: self.inflight < MAX_PIPELINE and self._leftover is None)

    def drain(self, timeout: float) -> bool:
        """Wait until every posted request is answered and written; False on timeout."""
        return self._wait_for(lambda: self.inflight == 0 and self._leftover is None, timeout)


class Servers:
    """Handlers for both ports; ``post(item)`` feeds the core, ``ask(req)`` waits for its reply."""

    def __init__(self, post: Callable[[Any], None], post_urgent: Callable[[Any], None],
                 idle_timeout: float = IDLE_TIMEOUT_SECONDS) -> None:
        self.post = post  # client requests
        self.post_worker = post_urgent  # worker events go first (they free capacity)
        self.idle_timeout = idle_timeout
        self.worker_conns: set[WorkerConn] = set()
        self.connections = {"worker": 0, "client": 0}  # open connections per port (metrics)

    def _first_frame(self, reader: FrameReader, what: str, addr: Any) -> dict | None:
        """The first frame, which must complete within the idle timeout (so connections
        that send nothing, or part of a frame, cannot hold descriptors forever)."""
        timer = gevent.Timeout(self.idle_timeout)
        timer.start()
        try:
            return reader.read_frame()
        except gevent.Timeout as exc:
            if exc is not timer:
                raise
            log.info("closing an idle %s connection peer=%s:%s: no complete frame within %.0f s",
                     what, addr[0], addr[1], self.idle_timeout)
            return None
        finally:
            timer.close()

    # ---- worker port ---------------------------------------------------------------

    def handle_worker(self, sock: socket.socket, addr: tuple[Any, ...]) -> None:
        _nodelay(sock)
        conn = WorkerConn(sock, addr)
        self.worker_conns.add(conn)
        self.connections["worker"] += 1
        reader = FrameReader(sock.recv)
        registered = False
        window_start, beats = time.monotonic(), 0
        try:
            obj = self._first_frame(reader, "worker", addr)
            if obj is None:
                return
            msg = m.decode(obj, m.WORKER_PORT_REQUESTS)
            if not isinstance(msg, m.WorkerRegister):
                raise ProtocolError("the first message on the worker port must be WORKER_REGISTER, got %s" % msg.TYPE)
            check_task_types(msg)
            conn.worker_id = msg.worker_id
            self.post_worker(ev.Registered(conn, msg))
            registered = True
            while True:
                if len(conn.inbox) >= MAX_WORKER_BACKLOG:
                    conn.paused = True  # the core is behind on us: stop reading (the sweep counts us alive)
                    conn._wait_for(lambda: len(conn.inbox) < MAX_WORKER_BACKLOG)
                    conn.paused = False
                obj = reader.read_frame()
                if obj is None:
                    return
                conn.last_arrival = monotonic()
                msg = m.decode(obj, m.WORKER_PORT_REQUESTS)
                if isinstance(msg, m.WorkerRegister):
                    raise ProtocolError("WORKER_REGISTER sent twice on one connection")
                assert isinstance(msg, (m.TaskResult, m.Heartbeat)), "the rest of WORKER_PORT_REQUESTS"
                if msg.worker_id != conn.worker_id:
                    raise ProtocolError(
                        "%s workerId %s does not match this session's %s"
                        % (msg.TYPE, m.quote(msg.worker_id), m.quote(conn.worker_id))
                    )
                if isinstance(msg, m.TaskResult):
                    self.post_worker(ev.Result(conn, msg))
                else:  # a HEARTBEAT: its arrival is all it says, stamped above
                    beats += 1
                    if beats > MAX_HEARTBEATS_PER_SECOND:
                        if time.monotonic() - window_start < 1.0:
                            raise ProtocolError("more than %d heartbeats in one second; a worker sends one "
                                                "every few seconds" % MAX_HEARTBEATS_PER_SECOND)
                        window_start, beats = time.monotonic(), 0
        except ProtocolError as exc:
            log.warning("protocol violation on worker port peer=%s:%s worker=%s: %s", addr[0], addr[1], conn.worker_id, exc)
            conn.send(m.Error(str(exc)))
        except OSError as exc:
            log.info("worker connection error peer=%s:%s worker=%s: %s", addr[0], addr[1], conn.worker_id, exc)
        finally:
            if registered:
                self.post_worker(ev.Disconnected(conn))
            conn.finish()
            self.worker_conns.discard(conn)
            self.connections["worker"] -= 1

    # ---- client port ----------------------------------------------------------------

    def handle_client(self, sock: socket.socket, addr: tuple[Any, ...]) -> None:
        _nodelay(sock)
        conn = ClientConn(sock)
        self.connections["client"] += 1
        reader = FrameReader(sock.recv)
        first = True
        try:
            while not conn.closed:
                if first:
                    obj = self._first_frame(reader, "client", addr)
                    first = False
                else:
                    obj = reader.read_frame()
                if obj is None:
                    if not conn.drain(DRAIN_SECONDS):
                        log.warning("client peer=%s:%s closed with %d replies still unwritten after %.0f s",
                                    addr[0], addr[1], conn.inflight, DRAIN_SECONDS)
                    return
                req = m.decode(obj, m.CLIENT_PORT_REQUESTS)
                conn.inflight += 1
                self.post(ev.Request(conn, req))
                conn.wait_for_room()
        except ProtocolError as exc:
            log.warning("protocol violation on client port peer=%s:%s: %s", addr[0], addr[1], exc)
            # Answered in order, after the replies to what came before; then the connection closes.
            conn.inflight += 1
            self.post(ev.Request(conn, ev.Refusal(str(exc))))
            conn.drain(DRAIN_SECONDS)
        except OSError:
            pass
        finally:
            conn.release()
            if conn.inflight > 0:  # pending WAIT_JOBs (or a drain that timed out): tell the core
                self.post(ev.ClientClosed(conn))
            self.connections["client"] -= 1
