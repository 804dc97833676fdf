"""Client connections for the load generator: gevent sockets, framed JSON, bounded waits.

Uses ``gevent.socket`` explicitly, so it works in an unpatched process. One ``Conn`` is
one TCP connection used strictly request/response (or a bounded pipeline), like a
jobmesh client. Failures are classified into a few error kinds for the report.

``use_tls(ca)`` and ``use_token(token)`` set, for every connection opened afterwards,
the TLS and the AUTH frame a coordinator with ``--tls-cert`` and ``--auth-file`` asks
for (``dial`` and ``authenticate`` do the same for a worker connection); a connection
opened with ``secured=False`` (the echo baseline's) has neither.
"""

from __future__ import annotations

import errno
import socket as _stdsocket
from collections import Counter
from typing import Any

import gevent
import gevent.ssl
from gevent import socket

from jobmesh.coordinator.shell.housekeeping import raise_fd_limit  # noqa: F401  (re-exported for bench/)
from jobmesh.errors import ProtocolError
from jobmesh.protocol.framing import FrameReader, encode_frame
from jobmesh.tls import ClientTls, client_context

REQUEST_TIMEOUT = 30.0
CONNECT_TIMEOUT = 10.0
_tls: Any = None  # the client connections' TLS context (gevent's), when the coordinator speaks TLS
_token: str | None = None  # the token every client connection presents first, when it asks for one


def use_tls(ca: str | None) -> None:
    """Connect every client connection with TLS, trusting the certificates in ``ca``
    (None: plaintext)."""
    global _tls
    _tls = client_context(ClientTls(ca), gevent.ssl.SSLContext) if ca else None


def use_token(token: str | None) -> None:
    """Send AUTH with ``token`` first on every client connection (None: no AUTH)."""
    global _token
    _token = token


def dial(addr: tuple[str, int], timeout: float = CONNECT_TIMEOUT, secured: bool = True):
    """A connected socket, with TLS when ``use_tls`` set it (and ``secured``), TCP_NODELAY."""
    sock = socket.create_connection(addr, timeout=timeout)
    if secured and _tls is not None:
        sock = _tls.wrap_socket(sock, server_hostname=addr[0])
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def authenticate(sock, reader: FrameReader, token: str) -> None:
    """AUTH with ``token`` and its AUTH_OK; ``ConnError("auth_refused")`` otherwise."""
    sock.sendall(encode_frame({"type": "AUTH", "token": token}))
    reply = reader.read_frame()
    if reply is None or reply.get("type") != "AUTH_OK":
        raise ConnError("auth_refused", "closed" if reply is None else str(reply.get("message", reply.get("type"))))


class ConnError(Exception):
    """A request or connect failed; ``kind`` is the report's error class."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__("%s: %s" % (kind, detail) if detail else kind)
        self.kind = kind


def classify(exc: BaseException) -> str:
    if isinstance(exc, ConnError):
        return exc.kind
    if isinstance(exc, (_stdsocket.timeout, TimeoutError, gevent.Timeout)):
        return "timeout"
    if isinstance(exc, ProtocolError):
        return "protocol"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, ConnectionResetError):
        return "reset"
    if isinstance(exc, BrokenPipeError):
        return "broken_pipe"
    if isinstance(exc, OSError):
        name = errno.errorcode.get(exc.errno or 0, "")
        return "oserror_%s" % name.lower() if name else "oserror"
    return type(exc).__name__


class Conn:
    """One framed connection; ``request`` sends one frame and returns the reply object."""

    __slots__ = ("sock", "reader")

    def __init__(self, sock) -> None:
        self.sock = sock
        self.reader = FrameReader(sock.recv)

    @classmethod
    def open(cls, addr: tuple[str, int], timeout: float = CONNECT_TIMEOUT, secured: bool = True) -> "Conn":
        """A connection with the TLS and token set by ``use_tls`` and ``use_token``
        (neither when not ``secured``), authenticated when a token is set."""
        sock = dial(addr, timeout, secured)
        sock.settimeout(REQUEST_TIMEOUT)
        conn = cls(sock)
        if secured and _token is not None:
            try:
                authenticate(sock, conn.reader, _token)
            except BaseException:
                conn.close()
                raise
        return conn

    def request(self, frame: bytes) -> dict[str, Any]:
        self.sock.sendall(frame)
        reply = self.reader.read_frame()
        if reply is None:
            raise ConnError("eof", "connection closed instead of replying")
        return reply

    def request_obj(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self.request(encode_frame(obj))

    def pipeline(self, frames: list[bytes]) -> list[dict[str, Any]]:
        """Send several requests in one write and read their replies, in order."""
        self.sock.sendall(b"".join(frames))
        out = []
        for _ in frames:
            reply = self.reader.read_frame()
            if reply is None:
                raise ConnError("eof", "connection closed inside a pipeline")
            out.append(reply)
        return out

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def open_many(addr: tuple[str, int], count: int, burst: int, errors: Counter,
              deadline_s: float = 120.0, on_progress=None, secured: bool = True) -> list[Conn]:
    """Open ``count`` connections, at most ``burst`` connects in flight at a time.

    Bounded bursts keep the coordinator's accept backlog from overflowing (a dropped
    SYN costs a 1 s retransmit). The whole phase is bounded by ``deadline_s``;
    connections that failed are counted in ``errors`` (kind ``connect_<kind>``).
    """
    conns: list[Conn] = []

    def one() -> None:
        try:
            conns.append(Conn.open(addr, secured=secured))
        except Exception as exc:  # noqa: BLE001 - every failure is reported, by kind
            errors["connect_" + classify(exc)] += 1

    batch: list[gevent.Greenlet] = []
    try:
        with gevent.Timeout(deadline_s, False):
            started = 0
            while started < count:
                n = min(burst, count - started)
                batch = [gevent.spawn(one) for _ in range(n)]
                gevent.joinall(batch)
                started += n
                if on_progress is not None:
                    on_progress(len(conns))
    finally:
        gevent.killall(batch)
    return conns
