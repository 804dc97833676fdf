"""Length-prefixed JSON frames, as both coordinator ports speak them.

::

    +--------------------+------------------------------------+
    | length: u32 big-   | payload: `length` bytes of UTF-8   |
    | endian, 1..1 MiB   | JSON text encoding one object      |
    +--------------------+------------------------------------+

A clean EOF between frames means the peer closed normally (``read_frame`` returns
``None``); an EOF inside a frame, a length of 0 or above ``MAX_FRAME``, bytes that are
not UTF-8, text that is not JSON, or JSON that is not an object raise ``ProtocolError``.

``FrameDecoder`` is the pure parser (feed bytes, take whole payloads); ``FrameReader``
drives it from any ``recv``-like callable, so it works on stdlib sockets, gevent
sockets and test doubles alike. ``split_frames`` takes every whole frame out of a buffer
at once: the coordinator's ports read with it (``ports/connection.py``).
"""

from __future__ import annotations

import struct
from typing import Any, Callable

import ujson

from jobmesh.errors import ProtocolError

MAX_FRAME = 1024 * 1024
HEADER = struct.Struct(">I")
RECV_SIZE = 65536


def encode_frame(obj: dict[str, Any]) -> bytes:
    """Encode one JSON object as a frame (header and payload in one bytes object)."""
    try:
        body = ujson.dumps(obj, ensure_ascii=False, escape_forward_slashes=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ProtocolError("message holds text that is not valid Unicode") from exc
    if len(body) > MAX_FRAME:
        raise ProtocolError("frame of %d bytes exceeds the %d-byte limit" % (len(body), MAX_FRAME))
    return HEADER.pack(len(body)) + body


def decode_payload(body: bytes) -> dict[str, Any]:
    """Parse one frame payload into a JSON object, or raise ``ProtocolError``."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError("frame payload is not valid UTF-8") from exc
    try:
        obj = ujson.loads(text)
    except (ValueError, OverflowError) as exc:
        raise ProtocolError("frame payload is not valid JSON: %s" % exc) from exc
    if not isinstance(obj, dict):
        raise ProtocolError("frame payload must be a JSON object, got %s" % type(obj).__name__)
    # UTF-8 input cannot hold surrogates, but a \uD800-style escape can smuggle a lone one
    # in, and such a string can be neither stored nor sent again. Only texts with such an
    # escape pay for the check.
    if b"\\ud" in body or b"\\uD" in body:
        try:
            ujson.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ProtocolError("frame payload holds a lone UTF-16 surrogate escape, which is not valid text") from exc
    return obj


def bad_length(data: bytes | bytearray | memoryview, pos: int, length: int, max_frame: int) -> ProtocolError:
    """The error for a header at ``data[pos:]`` that announces ``length`` bytes, outside 1..``max_frame``."""
    if data[pos:pos + 4] == b"HTTP":
        return ProtocolError("the peer answered in HTTP, not in frames: an HTTP port (a metrics port?)")
    return ProtocolError("invalid frame length %d (must be 1..%d)" % (length, max_frame))


def split_frames(data: memoryview, end: int, out: list[bytes], max_frame: int = MAX_FRAME) -> int:
    """Append the payload of every whole frame at the start of ``data[:end]`` to ``out``, in
    order; the number of bytes they took (the rest starts a frame not complete yet).

    A header that announces a bad length raises ``ProtocolError`` as soon as its four
    bytes are in (the frames before it are in ``out``), so no more than ``max_frame`` bytes
    of one frame are ever held.
    """
    pos = 0
    unpack = HEADER.unpack_from
    while end - pos >= 4:
        (length,) = unpack(data, pos)
        if length <= 0 or length > max_frame:
            raise bad_length(data, pos, length, max_frame)
        stop = pos + 4 + length
        if stop > end:
            break
        out.append(bytes(data[pos + 4:stop]))
        pos = stop
    return pos


class StreamBuffer:
    """Bytes fed in any chunking and taken from the front: the part every frame decoder shares
    (this one and ``jobmesh.periodic.codec.PacketDecoder``)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0

    def feed(self, data: bytes | memoryview) -> None:
        if self._pos and self._pos > len(self._buf) // 2:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    @property
    def pending(self) -> int:
        """Bytes received but not yet returned as a frame."""
        return len(self._buf) - self._pos

    def _take(self, start: int, end: int) -> bytes:
        """The bytes ``start:end`` of the buffer; everything before ``end`` is consumed."""
        body = bytes(self._buf[start:end])
        self._pos = end
        if self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        return body


class FrameDecoder(StreamBuffer):
    """Incremental parser: ``feed`` bytes in any chunking, ``next_payload`` out whole frames."""

    def __init__(self, max_frame: int = MAX_FRAME):
        super().__init__()
        self._max = max_frame

    def next_body(self) -> bytes | None:
        """The next whole payload's bytes, or None if more input is needed."""
        avail = len(self._buf) - self._pos
        if avail < 4:
            return None
        (length,) = HEADER.unpack_from(self._buf, self._pos)
        if length <= 0 or length > self._max:
            raise bad_length(self._buf, self._pos, length, self._max)
        if avail < 4 + length:
            return None
        start = self._pos + 4
        return self._take(start, start + length)

    def next_payload(self) -> dict[str, Any] | None:
        body = self.next_body()
        return None if body is None else decode_payload(body)


class FrameReader:
    """Read whole frames from a ``recv(n) -> bytes`` callable."""

    def __init__(self, recv: Callable[[int], bytes], max_frame: int = MAX_FRAME):
        self._recv = recv
        self._decoder = FrameDecoder(max_frame)

    def read_frame(self) -> dict[str, Any] | None:
        """The next frame's object; None on a clean EOF between frames.

        Raises ``ProtocolError`` on a bad frame or an EOF inside a frame; socket errors
        (``OSError``) propagate.
        """
        while True:
            obj = self._decoder.next_payload()
            if obj is not None:
                return obj
            data = self._recv(RECV_SIZE)
            if not data:
                if self._decoder.pending:
                    raise ProtocolError("connection closed inside a frame")
                return None
            self._decoder.feed(data)
