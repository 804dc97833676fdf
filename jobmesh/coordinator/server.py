"""The worker and client ports: frames in, core events out; replies and frames back.

Connection handlers are blocking-style code running one greenlet per connection
(gevent ``StreamServer``). They decode frames and post events to the core's inbox; they
never touch core state. A framing or protocol violation gets a best-effort ERROR and
closes that one connection; nothing else is affected.

Worker connections have one writer greenlet each, draining an outbox the runtime fills
after each commit, so the core never blocks on a slow peer and frames from different
sources never interleave on the socket. Client connections are strict
request/response: the handler writes its own replies (several at once when the client
pipelined several requests).
"""

from __future__ import annotations

import logging
import socket
from collections import deque
from typing import Any, Callable

import gevent
from gevent.event import AsyncResult, Event

from jobmesh.errors import ProtocolError
from jobmesh.protocol import messages as m
from jobmesh.protocol.framing import FrameReader, encode_frame

log = logging.getLogger(__name__)

WRITER_JOIN_SECONDS = 2.0
MAX_PIPELINE = 64


class ShuttingDown(Exception):
    """The coordinator is stopping; the request was not applied."""


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


def _best_effort_send(sock, data: bytes) -> None:
    try:
        send_all(sock, data)
    except OSError:
        pass


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
        reader = FrameReader(sock.recv)
        try:
            while True:
                obj = reader.read_frame()
                if obj is None:
                    return
                pending = [self._ask_async(m.decode(obj, m.CLIENT_PORT_REQUESTS))]
                # A client may pipeline: take every request already buffered, answer in order.
                error = None
                while len(pending) < MAX_PIPELINE and reader.has_buffered_frame():
                    try:
                        pending.append(self._ask_async(m.decode(reader.read_frame(), m.CLIENT_PORT_REQUESTS)))
                    except ProtocolError as exc:
                        error = exc
                        break
                replies = []
                for result in pending:
                    try:
                        replies.append(encode_frame(result.get().to_wire()))
                    except ShuttingDown:
                        replies.append(encode_frame(m.Error("coordinator is shutting down").to_wire()))
                        _best_effort_send(sock, b"".join(replies))
                        return
                send_all(sock, b"".join(replies))
                if error is not None:
                    raise error
        except ProtocolError as exc:
            log.warning("protocol violation on client port peer=%s:%s: %s", addr[0], addr[1], exc)
            _best_effort_send(sock, encode_frame(m.Error(str(exc)).to_wire()))
        except OSError:
            pass

    def _ask_async(self, req: m.Message) -> AsyncResult:
        result = AsyncResult()
        self.post((req, result))
        return result
