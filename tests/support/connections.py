"""Raw framed connections from the test process: ``RawConn`` sends dicts or bytes and
reads frames over a stdlib socket; ``read_until_closed`` collects frames up to the close;
``stranger()`` is a loopback address of its own to connect from."""

from __future__ import annotations

import itertools
import socket
import time

from jobmesh.protocol.framing import FrameReader, encode_frame


_strangers = itertools.count(1)


def stranger() -> str:
    """A loopback address of its own (127.0.X.Y, never 127.0.0.1) to connect from, so the
    failed attempts a test makes from it slow no other test's connections."""
    n = next(_strangers)
    return "127.0.%d.%d" % (1 + n // 250 % 250, 2 + n % 250)


class RawConn:
    """A stdlib framed connection: send dicts or raw bytes, receive dicts."""

    def __init__(self, addr, timeout: float = 10.0, source: str | None = None):
        """``source``: the local address to connect from (another loopback address, e.g.
        ``stranger()``, counts as another peer address for the coordinator's guard)."""
        self.sock = socket.create_connection(addr, timeout=timeout, source_address=(source, 0) if source else None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = FrameReader(self.sock.recv)

    def send(self, obj: dict) -> None:
        self.sock.sendall(encode_frame(obj))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self) -> dict | None:
        """The next frame, or None on a clean close."""
        return self.reader.read_frame()

    def request(self, obj: dict) -> dict:
        self.send(obj)
        reply = self.recv()
        if reply is None:
            raise AssertionError("connection closed instead of replying to %r" % (obj,))
        return reply

    def is_closed(self, timeout: float = 5.0) -> bool:
        """True if the peer closes the connection within ``timeout`` (frames before EOF are skipped)."""
        self.sock.settimeout(timeout)
        try:
            while True:
                if self.reader.read_frame() is None:
                    return True
        except (socket.timeout, TimeoutError):
            return False
        except (OSError, Exception):
            return True

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def read_until_closed(conn: RawConn, timeout: float = 5.0):
    """Collect frames until the peer closes; returns ``(frames, closed)``.

    A reset or a malformed frame counts as closed; ``closed`` is False if the
    connection is still open after ``timeout``.
    """
    frames: list[dict] = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return frames, False
        conn.sock.settimeout(left)
        try:
            frame = conn.reader.read_frame()
        except (socket.timeout, TimeoutError):
            return frames, False
        except Exception:
            return frames, True
        if frame is None:
            return frames, True
        frames.append(frame)
