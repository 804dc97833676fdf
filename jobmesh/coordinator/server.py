"""The worker and client ports: frames in, core events out; replies and frames back.

Connection handlers are blocking-style code running one greenlet per connection
(gevent ``StreamServer``). They decode frames and post events to the core's inbox; they
never touch core state. A framing or protocol violation gets a best-effort ERROR and
closes that one connection; nothing else is affected.

Worker connections have one writer greenlet each, draining an outbox the runtime fills
after each commit, so the core never blocks on a slow peer and frames from different
sources never interleave on the socket.

Client connections are request/response, answered in request order. Their handler only
reads: it posts each request with its ``ClientConn`` and goes back to reading. After the
batch's commit the core writes every reply itself with one non-blocking write per
connection (the common case: the socket takes it all), so a request costs no reply
handoff and no second wake-up of its handler. Bytes a full socket did not take go to a
flusher greenlet; until it has drained them, later replies queue behind them and the
handler stops reading. A handler that reaches ``MAX_PIPELINE`` unanswered requests
stops reading too, so a client that pipelines without reading can grow neither the
mailbox nor the coordinator's memory.
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

from jobmesh.errors import ProtocolError
from jobmesh.protocol import messages as m
from jobmesh.protocol.framing import FrameReader, encode_frame

log = logging.getLogger(__name__)

WRITER_JOIN_SECONDS = 2.0
MAX_PIPELINE = 64


DRAIN_SECONDS = 30.0  # at EOF, how long a handler waits for its replies to go out

SHUTTING_DOWN = m.Error("coordinator is shutting down")


class Refusal:
    """A request-shaped item whose answer is fixed: the ERROR for a protocol violation.

    It travels through the mailbox like a request so that it is written after the replies
    to everything the client sent before it; the connection closes once it is out.
    """

    __slots__ = ("error",)

    def __init__(self, message: str) -> None:
        self.error = m.Error(message)


def _nodelay(sock) -> None:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass


def send_all(sock, data: bytes) -> None:
    """``sendall`` without its per-call getsockopt: one ``send`` usually takes it all."""
    sent = sock.send(data)
    if sent < len(data):
        sock.sendall(memoryview(data)[sent:])


class WorkerConn:
    """One worker connection's outbox and its single writer greenlet."""

    def __init__(self, sock, addr) -> None:
        self.sock = sock
        self.addr = addr
        self.worker_id: str | None = None
        self._outbox: deque = deque()
        self._wake = Event()
        self._closed = False
        self._writer = gevent.spawn(self._write_loop)

    def __repr__(self) -> str:
        return "<WorkerConn %s %s:%s>" % (self.worker_id, *self.addr[:2])

    def send(self, msg: m.Message | None) -> None:
        """Queue a message; None closes the connection once what is queued before it is sent."""
        if self._closed:
            return
        self._outbox.append(msg)
        self._wake.set()

    def _write_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            frames = []
            close = False
            while self._outbox:
                msg = self._outbox.popleft()
                if msg is None:
                    close = True
                    break
                try:
                    frames.append(encode_frame(msg.to_wire()))
                except ProtocolError as exc:  # a bug upstream; never let it wedge the session
                    log.error("dropped an unencodable %s for worker=%s: %s", msg.TYPE, self.worker_id, exc)
            if frames:
                try:
                    send_all(self.sock, b"".join(frames))
                except OSError:
                    close = True
            if close:
                self._closed = True
                try:
                    self.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return

    def abort(self) -> None:
        """Shut the socket down now (coordinator stopping); the handler then exits."""
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def finish(self) -> None:
        """Called by the handler on its way out: flush what is queued, then stop the writer."""
        self.send(None)
        self._writer.join(WRITER_JOIN_SECONDS)
        self._writer.kill(block=False)
        self._closed = True


class ClientConn:
    """A client connection as the core sees it: a destination for replies, in order.

    Only the hub's thread touches it. ``closed`` is set before the socket closes (the
    handler sets it on its way out, the core or the flusher on a failed write), and the
    core checks it before every write, so a reply never reaches a reused descriptor.
    """

    __slots__ = ("sock", "fileno", "inflight", "closed", "_closing", "_leftover", "_flusher", "_progress")

    def __init__(self, sock) -> None:
        self.sock = sock
        self.fileno = sock.fileno()
        self.inflight = 0  # requests posted to the core and not answered yet
        self.closed = False
        self._closing = False  # shut the socket down once what is queued is out
        self._leftover: bytearray | None = None  # reply bytes the socket has not taken yet
        self._flusher: gevent.Greenlet | None = None
        self._progress = Event()  # set whenever replies go out or the connection ends

    # ---- core side -------------------------------------------------------------

    def reply(self, data: bytes, count: int, close: bool = False) -> None:
        """Write ``count`` replies' bytes without blocking; called by the core only."""
        self.inflight -= count
        if close:
            self._closing = True
        if not self.closed:
            if self._leftover is not None:
                self._leftover += data
            else:
                try:
                    sent = os.write(self.fileno, data)
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

    # ---- handler side ----------------------------------------------------------

    def wait_for_room(self) -> None:
        """Block the reader while the client is too far ahead of its replies."""
        while not self.closed and (self.inflight >= MAX_PIPELINE or self._leftover is not None):
            self._progress.clear()
            self._progress.wait()

    def drain(self, timeout: float) -> bool:
        """Wait until every posted request is answered and written; False on timeout."""
        deadline = time.monotonic() + timeout
        while not self.closed and (self.inflight > 0 or self._leftover is not None):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._progress.clear()
            self._progress.wait(left)
        return True

    def release(self) -> None:
        """The handler is leaving and its socket is about to close: drop later replies."""
        self.closed = True
        self._leftover = None
        if self._flusher is not None:
            self._flusher.kill(block=False)


class Servers:
    """Handlers for both ports; ``post(item)`` feeds the core, ``ask(req)`` waits for its reply."""

    def __init__(self, post: Callable[[Any], None], post_urgent: Callable[[Any], None]) -> None:
        self.post = post  # client requests
        self.post_worker = post_urgent  # worker events go first (they free capacity)
        self.worker_conns: set[WorkerConn] = set()

    # ---- worker port ---------------------------------------------------------------

    def handle_worker(self, sock, addr) -> None:
        _nodelay(sock)
        conn = WorkerConn(sock, addr)
        self.worker_conns.add(conn)
        reader = FrameReader(sock.recv)
        registered = False
        try:
            obj = reader.read_frame()
            if obj is None:
                return
            msg = m.decode(obj, m.WORKER_PORT_REQUESTS)
            if not isinstance(msg, m.WorkerRegister):
                raise ProtocolError("the first message on the worker port must be WORKER_REGISTER, got %s" % msg.TYPE)
            conn.worker_id = msg.worker_id
            self.post_worker(("register", conn, msg.worker_id, msg.capacity))
            registered = True
            while True:
                obj = reader.read_frame()
                if obj is None:
                    return
                msg = m.decode(obj, m.WORKER_PORT_REQUESTS)
                if isinstance(msg, m.WorkerRegister):
                    raise ProtocolError("WORKER_REGISTER sent twice on one connection")
                if msg.worker_id != conn.worker_id:
                    raise ProtocolError(
                        "%s workerId %r does not match this session's %r" % (msg.TYPE, msg.worker_id, conn.worker_id)
                    )
                if isinstance(msg, m.Heartbeat):
                    self.post_worker(("heartbeat", conn, msg.worker_id))
                else:
                    self.post_worker(("result", conn, msg))
        except ProtocolError as exc:
            log.warning("protocol violation on worker port peer=%s:%s worker=%s: %s", addr[0], addr[1], conn.worker_id, exc)
            conn.send(m.Error(str(exc)))
        except OSError as exc:
            log.info("worker connection error peer=%s:%s worker=%s: %s", addr[0], addr[1], conn.worker_id, exc)
        finally:
            if registered:
                self.post_worker(("disconnected", conn))
            conn.finish()
            self.worker_conns.discard(conn)

    # ---- client port ----------------------------------------------------------------

    def handle_client(self, sock, addr) -> None:
        _nodelay(sock)
        conn = ClientConn(sock)
        reader = FrameReader(sock.recv)
        try:
            while not conn.closed:
                obj = reader.read_frame()
                if obj is None:
                    if not conn.drain(DRAIN_SECONDS):
                        log.warning("client peer=%s:%s closed with %d replies still unwritten after %.0f s",
                                    addr[0], addr[1], conn.inflight, DRAIN_SECONDS)
                    return
                req = m.decode(obj, m.CLIENT_PORT_REQUESTS)
                conn.inflight += 1
                self.post((req, conn))
                conn.wait_for_room()
        except ProtocolError as exc:
            log.warning("protocol violation on client port peer=%s:%s: %s", addr[0], addr[1], exc)
            # Answered in order, after the replies to what came before; then the connection closes.
            conn.inflight += 1
            self.post((Refusal(str(exc)), conn))
            conn.drain(DRAIN_SECONDS)
        except OSError:
            pass
        finally:
            conn.release()
