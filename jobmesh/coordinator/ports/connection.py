"""The ordered output every socket connection writes through, and the TLS accept.

What the core, the mailbox and the shell may use of a connection is said by the
protocols of ``core/peers.py``; each port's connection class satisfies them.

``Output`` is the ordered, non-blocking output of one socket, shared by the worker,
client and Periodic ports (each port's connection class builds on it), and ``nodelay``
the socket option every port sets on accept. ``Receiver`` is how those ports read: one
syscall per read, after the socket is readable; ``FrameSource`` reads the JSON ports'
frames with it, every whole frame of a read at once.

TLS (``--tls-cert``): ``tls_accept`` runs the server side of the handshake in the
connection's own greenlet, bounded by a timeout, so a slow, silent or plaintext peer
costs only its own connection. After it the socket's timeout is 0: ``Output`` writes
through the TLS object without blocking (a full socket takes nothing, and the same bytes
are offered again later, as OpenSSL requires), and ``Receiver`` waits for the socket in
the handler's greenlet. Which write a connection uses is chosen once, when it is made:
a plaintext connection writes with ``os.write`` on its descriptor exactly as before.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import time
from collections import deque
from functools import partial
from typing import Any, Callable

import gevent
import gevent.ssl
from gevent.event import Event
from gevent.socket import wait, wait_write

from time import monotonic
from jobmesh.errors import ProtocolError
from jobmesh.protocol.framing import RECV_SIZE, decode_payload, encode_frame, split_frames
from jobmesh.protocol.messages import TLS_PORT_REFUSAL, Error

log = logging.getLogger(__name__)

MAX_UNSENT_BYTES = 8 * 1024 * 1024  # a peer holding more unsent output than this is closed
MAX_BACKLOG = 64  # a connection's events not yet applied before its handler stops reading
WRITER_JOIN_SECONDS = 2.0  # how long a leaving handler lets queued bytes go out


def nodelay(sock: socket.socket) -> None:
    """Send small frames at once (no Nagle delay); a socket that refuses keeps its default."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass


def tls_accept(context: ssl.SSLContext, sock: Any, addr: Any, timeout: float, what: str) -> Any | None:
    """The server side of the TLS handshake on an accepted socket, in the calling
    greenlet; the TLS socket, or None when the handshake failed or took longer than
    ``timeout`` seconds (the connection is then closed). The caller closes the TLS
    socket when it is done (the server's own close reaches only the plain socket)."""
    tls_sock = None
    timer = gevent.Timeout(timeout)
    timer.start()
    try:
        if sock.recv(1, socket.MSG_PEEK) == b"\x00":  # a frame's first byte; a TLS record's is never 0
            _refuse_plaintext(sock, addr, what)
            return None
        tls_sock = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        tls_sock.do_handshake()
        return tls_sock
    except gevent.Timeout as exc:
        if exc is not timer:  # the caller's (the auth timeout): the TLS socket owns the descriptor now
            (tls_sock if tls_sock is not None else sock).close()
            raise
        log.info("closing a %s connection peer=%s:%s: no TLS handshake within %.0f s", what, addr[0], addr[1], timeout)
    except OSError as exc:  # ssl.SSLError among them: a plaintext peer, a refused certificate
        log.info("TLS handshake failed on the %s port peer=%s:%s: %s", what, addr[0], addr[1], exc)
    finally:
        timer.close()
    (tls_sock if tls_sock is not None else sock).close()
    return None


def _refuse_plaintext(sock: Any, addr: Any, what: str) -> None:
    """A jobmesh frame in plaintext on a TLS port (a client or worker without --tls-ca):
    take what it sent, so that closing does not reset the connection under the answer,
    and answer an ERROR frame that says so; the caller's close follows."""
    log.info("closing a %s connection peer=%s:%s: it speaks plaintext on a TLS port", what, addr[0], addr[1])
    try:
        sock.recv(65536)
        sock.sendall(encode_frame(Error(TLS_PORT_REFUSAL).to_wire()))
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def read_buffer() -> memoryview:
    """The buffer a port's handlers read into, one for all of them: handlers run on one
    hub thread, and each takes out everything a read put in before it can yield."""
    return memoryview(bytearray(RECV_SIZE))


class Receiver:
    """Reads of one connection's socket, in its handler's greenlet, one syscall each.

    A read waits until the socket is readable and then reads once (gevent's own ``recv``
    tries first and waits only after the syscall failed: two syscalls for every request
    of a peer that waits for its answers). A read that filled the whole buffer reads
    again at once, since more is likely waiting. A TLS socket (timeout 0, see ``Output``)
    may hold decrypted bytes that the descriptor's readability does not show
    (``pending``): they are read without waiting.
    """

    __slots__ = ("_sock", "_readable", "_tls", "_more")

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._readable = gevent.get_hub().loop.io(sock.fileno(), 1)  # its readability, watched only while it waits
        self._tls = isinstance(sock, gevent.ssl.SSLSocket)
        self._more = False  # the last read filled the buffer: read again before waiting

    def read_into(self, buffer: memoryview) -> int:
        """Read what the socket has into ``buffer``, waiting for it if need be: the number of
        bytes, 0 at EOF. Socket errors (``OSError``) propagate."""
        sock = self._sock
        while True:
            if not (self._more or (self._tls and sock.pending())):
                wait(self._readable)
            try:
                n: int = sock.recv_into(buffer)
            except ssl.SSLWantReadError:  # readable, but not a whole TLS record yet
                self._more = False
                continue
            except ssl.SSLWantWriteError:
                wait_write(sock.fileno())
                self._more = True
                continue
            self._more = n == len(buffer)
            return n


class FrameSource:
    """Whole frames of one connection: each read takes every frame complete in what it got
    (a burst of pipelined frames costs one read), and keeps what starts the next one.

    Reads go into the port's shared buffer (``read_buffer``); frames are copied out of it
    at once, and the start of an incomplete frame into a buffer of the connection's own
    (``_partial``, only while there is one). A header that announces a bad length is an
    error as soon as its four bytes are in; the frames before it are returned first, so
    their answers go out before the connection's ERROR.
    """

    __slots__ = ("_receiver", "_buffer", "_frames", "_partial", "_error")

    def __init__(self, sock: Any, buffer: memoryview) -> None:
        self._receiver = Receiver(sock)
        self._buffer = buffer
        self._frames: list[bytes] = []  # payloads read and not returned yet, the next one last
        self._partial: bytearray | None = None  # the start of a frame not complete yet
        self._error: ProtocolError | None = None  # found after the frames in ``_frames``

    def read_frame(self) -> dict[str, Any] | None:
        """The next frame's object; None on a clean EOF between frames.

        Raises ``ProtocolError`` on a bad frame or an EOF inside a frame; socket errors
        (``OSError``) propagate."""
        frames = self._frames
        while not frames:
            if self._error is not None:
                raise self._error
            n = self._receiver.read_into(self._buffer)
            if not n:
                if self._partial:
                    raise ProtocolError("connection closed inside a frame")
                return None
            self._split(n)
        return decode_payload(frames.pop())

    def _split(self, n: int) -> None:
        buffer, frames, partial = self._buffer, self._frames, self._partial
        try:
            if partial is None:
                used = split_frames(buffer, n, frames)
                if used < n:
                    self._partial = bytearray(buffer[used:n])
            else:
                partial += buffer[:n]
                with memoryview(partial) as data:
                    used = split_frames(data, len(partial), frames)
                if used == len(partial):
                    self._partial = None
                elif used:
                    del partial[:used]
        except ProtocolError as exc:
            self._error = exc
            self._partial = None
        frames.reverse()


def _tls_send(sock: Any, data: bytes) -> int:
    """Offer ``data`` to a TLS socket whose timeout is 0: all of it is taken, or 0 when the
    socket is full (OpenSSL then expects the same bytes again, perhaps with more after
    them; ``Output`` offers exactly that: what it keeps unsent starts with them)."""
    return sock.send(data)


def _tls_sendall(sock: Any, data: bytes) -> None:
    """Write all of ``data`` to a TLS socket whose timeout is 0, waiting in the calling
    greenlet (the flusher) while the socket is full."""
    while not sock.send(data):
        wait_write(sock.fileno())


class Output:
    """Ordered, non-blocking output of one connection; only the hub's thread touches it.

    ``write`` tries the socket at once (the common case: it takes everything) and never
    blocks its caller, the core. Bytes a full socket does not take go to a flusher
    greenlet, and later writes queue behind them, so frames never interleave or reorder.
    ``closed`` is set before the socket closes (by the handler on its way out, or here
    on a failed write), and every write checks it first, so nothing is ever written to
    a descriptor number the kernel has since given to another connection.

    It also holds what the mailbox keeps per connection (``inbox``) and the handler's
    liveness stamps (``last_arrival``, ``paused``), so every port's connection is a
    ``Connection``.
    """

    __slots__ = ("sock", "fileno", "closed", "_closing", "_leftover", "_flusher", "_progress", "inbox",
                 "last_arrival", "paused", "_send", "_target", "_drain")

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.fileno = sock.fileno()
        # How bytes go out, chosen once: a non-blocking ``send(target, data) -> taken`` for
        # the core's writes and a blocking ``drain(data)`` for the flusher.
        if isinstance(sock, gevent.ssl.SSLSocket):
            sock.settimeout(0.0)  # sends never block; ``Receiver`` waits for reads
            self._send: Callable[[Any, bytes], int] = _tls_send
            self._target: Any = sock
            self._drain: Callable[[bytes], Any] = partial(_tls_sendall, sock)
        else:
            self._send, self._target, self._drain = os.write, self.fileno, sock.sendall
        self.closed = False
        self._closing = False  # shut the socket down once what is queued is out
        self._leftover: bytearray | None = None  # bytes the socket has not taken yet
        self._flusher: gevent.Greenlet | None = None
        self._progress = Event()  # set whenever bytes go out, events are taken, or the connection ends
        self.inbox: deque[Any] = deque()  # this connection's events not yet taken by the core (mailbox.py)
        self.last_arrival = monotonic()  # when its last frame was read (clock.monotonic): liveness by arrival
        self.paused = False  # its handler is not reading because the core is behind on it

    def drained(self) -> None:
        """The core took events from this connection's inbox: wake a paused reader."""
        if self.paused:
            self._progress.set()

    def wake(self) -> None:
        """Something its handler may be waiting for changed: let it look again."""
        self._progress.set()

    @property
    def unsent(self) -> bool:
        """Whether written bytes wait for the socket to take them."""
        return self._leftover is not None

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
                    sent = self._send(self._target, data) if data else 0
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
                self._drain(data)
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

    def wait_until(self, done: Callable[[], bool], timeout: float | None = None) -> bool:
        """Block the calling greenlet (its handler) until ``done()`` or the connection ends;
        False on timeout. ``done`` is checked whenever bytes go out, the core takes events
        or the connection ends."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not (self.closed or done()):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._progress.clear()
            self._progress.wait(left)
        return True

    def wait_for_core(self, limit: int = MAX_BACKLOG, timeout: float | None = None) -> bool:
        """Called by the handler before it reads: while ``limit`` or more of this
        connection's events wait for the core, stop reading (``paused``: the sweep counts
        the connection alive meanwhile); stamped as an arrival when reading resumes.
        False if ``timeout`` seconds passed first (still paused: call it again)."""
        if len(self.inbox) >= limit:
            self.paused = True
            if not self.wait_until(lambda: len(self.inbox) < limit, timeout):
                return False
            self.paused = False
            self.last_arrival = monotonic()
        return True

    def flushed(self, timeout: float) -> bool:
        """Wait until nothing written is left unsent (or the connection ended); False on timeout."""
        return self.wait_until(lambda: self._leftover is None, timeout)

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

    def finish(self) -> None:
        """Called by the handler on its way out: let queued bytes go (bounded), then stop writing.

        ``release`` runs even if the wait is interrupted (the server killing handlers at
        stop): the socket closes right after, and nothing may write to its number again.
        """
        try:
            self.flushed(WRITER_JOIN_SECONDS)
        finally:
            self.release()
