r"""Periodic packets as periodicd and aio-periodic 1.0.0 put them on the wire (docs/PERIODIC.md).

::

    +---------------+------------------+-------------------+----------------------+
    | magic: 4      | size: u32 BE     | crc: u32 BE       | body: `size` bytes   |
    | "\0REQ" peer  | length of body   | CRC-32 of body    |                      |
    | "\0RES" server| (<= 1 MiB in)    | (zlib.crc32)      |                      |
    +---------------+------------------+-------------------+----------------------+

    handshake body, peer -> server:   type: u8 (1 client, 2 worker)
                                      or type: u8 (3 client, 4 worker) + name + token,
                                      each a u64 BE length and its bytes (periodicd 1.2.9)
    handshake body, server -> peer:   0x1E (DATA) + connection id: u32     (no msgid)
    every later body:                 msgid: u32 | command: u8 | payload

Payload pieces: str8 = u8 length + bytes (func, name, lock name, config key); handle =
str8 func + str8 name; job = str8 func, str8 name, u32-length workload, i64 sched_at,
u8 version, then i32 count if version & 1 and i32 timeout if version & 2; a job list is a
u64 count + jobs; "rest" is every remaining byte, no length. Integers are big-endian and
read signed where periodicd reads them signed (aio-periodic writes them unsigned).

This module is pure: no sockets, no clock. ``PacketDecoder`` turns bytes in any chunking
into frame bodies; ``decode_handshake`` and ``decode_request`` turn bodies into typed
values; the ``encode_*`` functions build whole server frames. Every malformed input
raises ``PeriodicError``; values that cannot be put on the wire raise it too.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Any, Callable, ClassVar, Iterable, NamedTuple, TypeVar, Union

from jobmesh.errors import PeriodicError
from jobmesh.protocol.framing import StreamBuffer

MAGIC_REQ = b"\0REQ"
MAGIC_RES = b"\0RES"
MAX_BODY = 1024 * 1024  # jobmesh's limit on received bodies; periodicd has none
HEADER = struct.Struct(">4sII")

# The DATA texts that end a RUN_JOB or a RECV_DATA stream (PERIODIC.md 7.3, 7.19).
RESULT_FAILED = b"failed"
RESULT_REMOVED = b"removed"
RESULT_EXPIRED = b"expired"
STREAM_EOF = b"EOF"


class Command(IntEnum):
    """Command byte of a body; the same numbers in both directions (PERIODIC.md 5)."""

    NOOP = 0
    GRAB_JOB = 1
    SCHED_LATER = 2
    WORK_DONE = 3
    WORK_FAIL = 4
    JOB_ASSIGN = 5
    NO_JOB = 6
    CAN_DO = 7
    CANT_DO = 8
    PING = 9
    PONG = 10
    SLEEP = 11
    UNKNOWN = 12
    SUBMIT_JOB = 13
    STATUS = 14
    DROP_FUNC = 15
    SUCCESS = 16
    REMOVE_JOB = 17
    DUMP = 18
    LOAD = 19
    SHUTDOWN = 20
    BROADCAST = 21
    CONFIG_GET = 22
    CONFIG_SET = 23
    CONFIG = 24
    RUN_JOB = 25
    ACQUIRED = 26
    ACQUIRE = 27
    RELEASE = 28
    NO_WORKER = 29
    DATA = 30
    RECV_DATA = 31
    WORK_DATA = 32
    JOB_ASSIGNED = 33
    JOB_UNASSIGNED = 34


class ConnType(IntEnum):
    """What a connection is, after its handshake (types 3 and 4 are an authenticated 1 and 2)."""

    CLIENT = 1
    WORKER = 2


AUTHENTICATED = {3: ConnType.CLIENT, 4: ConnType.WORKER}  # periodicd 1.2.9's authenticated types


class Registration(NamedTuple):
    """A peer's handshake: what it is, and the token's name and text it presents (types
    3 and 4; both None for 1 and 2)."""

    kind: ConnType
    name: bytes | None = None
    token: bytes | None = None


# ---- frames ------------------------------------------------------------------------------


def encode_frame(body: bytes, magic: bytes = MAGIC_RES) -> bytes:
    """One whole frame around ``body``. Server frames are limited only by the u32 size field:
    aio-periodic reads any size, and STATUS or DUMP can outgrow the 1 MiB receive limit."""
    if len(body) > 0xFFFFFFFF:
        raise PeriodicError("frame body of %d bytes does not fit a u32 size" % len(body))
    return HEADER.pack(magic, len(body), zlib.crc32(body)) + body


class PacketDecoder(StreamBuffer):
    """Incremental frame parser: ``feed`` bytes in any chunking, ``next_packet`` out checked bodies.

    Unlike periodicd it does not scan past a bad magic (it fails on the first byte that
    cannot start ``magic``), and it refuses bodies over ``max_body`` as soon as the size
    field is in. Truncated input is not an error: ``next_packet`` returns None until the
    rest arrives. After a ``PeriodicError`` the stream is unusable; close the connection.
    """

    def __init__(self, magic: bytes = MAGIC_REQ, max_body: int = MAX_BODY):
        super().__init__()
        self._magic = magic
        self._max = max_body

    def next_packet(self) -> bytes | None:
        """The next frame's body (size and CRC checked), or None if more input is needed."""
        avail = self.pending
        head = bytes(self._buf[self._pos : self._pos + min(avail, 4)])
        if head != self._magic[: len(head)]:
            raise PeriodicError("bad magic %s (expected %s %r)" % (head.hex(" "), self._magic.hex(" "), self._magic))
        if avail < 8:
            return None
        size = int.from_bytes(self._buf[self._pos + 4 : self._pos + 8], "big")
        if size > self._max:  # refused before the body is buffered
            raise PeriodicError("frame body of %d bytes exceeds the %d-byte (1 MiB) limit" % (size, self._max))
        if avail < HEADER.size + size:
            return None
        _magic, _size, crc = HEADER.unpack_from(self._buf, self._pos)
        start = self._pos + HEADER.size
        body = self._take(start, start + size)
        actual = zlib.crc32(body)
        if actual != crc:
            raise PeriodicError("bad CRC: header says %08x, body of %d bytes has %08x" % (crc, size, actual))
        return body


# ---- handshake ---------------------------------------------------------------------------


def decode_handshake(body: bytes) -> Registration:
    """A peer's first body (no msgid): the type byte, then for types 3 and 4 the token's
    name and text, each a u64 length and its bytes, and nothing after them."""
    if not body:
        raise PeriodicError("handshake body must hold the connection type, got 0 bytes")
    kind = body[0]
    if kind in AUTHENTICATED:
        reader = _Reader(body, 1, "handshake of type %d" % kind)
        name = reader.take(reader.int(8, False, "token name length"), "token name")
        token = reader.take(reader.int(8, False, "token length"), "token")
        reader.end()
        return Registration(AUTHENTICATED[kind], name, token)
    if len(body) != 1:
        raise PeriodicError("handshake body of type %d must be 1 byte, got %d bytes" % (kind, len(body)))
    try:
        return Registration(ConnType(kind))
    except ValueError:
        raise PeriodicError("unknown handshake type %d (1 = client, 2 = worker, 3 and 4 with a token)" % kind) from None


def encode_handshake(conn_type: ConnType, name: bytes | None = None, token: bytes | None = None) -> bytes:
    """A peer's handshake frame (for tests and test peers); with a token, type 3 or 4."""
    if token is None:
        return encode_frame(bytes([conn_type]), MAGIC_REQ)
    name = name or b""
    body = bytes([conn_type + 2]) + struct.pack(">Q", len(name)) + name + struct.pack(">Q", len(token)) + token
    return encode_frame(body, MAGIC_REQ)


def encode_handshake_reply(conn_id: int) -> bytes:
    """The server's first frame: DATA (0x1E) + the u32 connection id, no msgid (PERIODIC.md 3)."""
    return encode_frame(bytes([Command.DATA]) + _u32(conn_id, "connection id"), MAGIC_RES)


def decode_handshake_reply(body: bytes) -> int:
    """The connection id in the server's first body."""
    if len(body) != 5 or body[0] != Command.DATA:
        raise PeriodicError("handshake reply must be 0x1e + 4 bytes, got %s" % body.hex(" "))
    return int.from_bytes(body[1:], "big")


# ---- payload pieces ----------------------------------------------------------------------


class Handle(NamedTuple):
    """A job's identity: (func, name), both raw bytes (PERIODIC.md 4.2)."""

    func: bytes
    name: bytes


@dataclass(frozen=True)
class Job:
    """A job as SUBMIT_JOB, RUN_JOB, RECV_DATA, JOB_ASSIGN, DUMP and LOAD carry it (PERIODIC.md 4.1).

    ``sched_at`` is epoch seconds (0 = now); ``timeout`` seconds (0 = server default).
    count and timeout are written only when positive, as periodicd and aio-periodic do.
    """

    func: bytes
    name: bytes
    workload: bytes = b""
    sched_at: int = 0
    count: int = 0
    timeout: int = 0

    @property
    def handle(self) -> Handle:
        return Handle(self.func, self.name)


def decode_func(func: bytes) -> str:
    """A func name as text. jobmesh requires UTF-8 func names (aio-periodic's STATUS needs them too)."""
    try:
        return func.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PeriodicError("func name %r is not valid UTF-8" % func) from exc


def _int_packer(fmt: str, lo: int, hi: int) -> Callable[[int, str], bytes]:
    packer = struct.Struct(fmt)

    def pack(value: int, what: str) -> bytes:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise PeriodicError("%s must be an integer in %d..%d, got %r" % (what, lo, hi, value))
        return packer.pack(value)

    return pack


_u8 = _int_packer(">B", 0, 0xFF)
_i16 = _int_packer(">h", -(1 << 15), (1 << 15) - 1)
_u32 = _int_packer(">I", 0, 0xFFFFFFFF)
_i32 = _int_packer(">i", -(1 << 31), (1 << 31) - 1)
_i64 = _int_packer(">q", -(1 << 63), (1 << 63) - 1)
_u64 = _int_packer(">Q", 0, (1 << 64) - 1)


def _rest(value: bytes, what: str) -> bytes:
    if not isinstance(value, bytes):
        raise PeriodicError("%s must be bytes, got %s" % (what, type(value).__name__))
    return value


def _str8(value: bytes, what: str) -> bytes:
    if len(_rest(value, what)) > 0xFF:
        raise PeriodicError("%s must be at most 255 bytes, got %d" % (what, len(value)))
    return bytes([len(value)]) + value


def _handle(value: Handle, what: str) -> bytes:
    return _str8(value.func, what + " func") + _str8(value.name, what + " name")


def _bytes32(value: bytes, what: str) -> bytes:
    return _u32(len(_rest(value, what)), what + " length") + value


def _job(job: Job, what: str) -> bytes:
    version = (1 if job.count > 0 else 0) | (2 if job.timeout > 0 else 0)
    optional = (_i32(job.count, what + " count") if version & 1 else b"") + (
        _i32(job.timeout, what + " timeout") if version & 2 else b"")
    return b"".join((_handle(job.handle, what), _bytes32(job.workload, what + " workload"),
                     _i64(job.sched_at, what + " sched_at"), bytes([version]), optional))


def _jobs(jobs: tuple[Job, ...], what: str) -> bytes:
    return _u64(len(jobs), what + " count") + b"".join(_job(job, what) for job in jobs)


def _flag(value: bool, what: str) -> bytes:
    return b"\x01" if value else b"\x00"


class _Reader:
    """Reads payload pieces off a body, naming the field and the message in every error."""

    def __init__(self, body: bytes, pos: int, context: str):
        self.body = body
        self.pos = pos
        self._context = context
        self.command: Command | None = None  # once known, the context names it (formatted on error only)
        self.msgid = 0

    @property
    def context(self) -> str:
        if self.command is None:
            return self._context
        return "%s payload (msgid %d)" % (self.command.name, self.msgid)

    def take(self, n: int, what: str) -> bytes:
        if len(self.body) - self.pos < n:
            raise PeriodicError("truncated %s: %s needs %d bytes at offset %d, %d left"
                                % (self.context, what, n, self.pos, len(self.body) - self.pos))
        self.pos += n
        return self.body[self.pos - n : self.pos]

    def int(self, size: int, signed: bool, what: str) -> int:
        return int.from_bytes(self.take(size, what), "big", signed=signed)

    def str8(self, what: str) -> bytes:
        return self.take(self.int(1, False, what + " length"), what)

    def handle(self, what: str) -> Handle:
        body, pos = self.body, self.pos
        end = len(body)
        if pos < end:  # fast path; anything short goes the slow way, which names the field
            func_end = pos + 1 + body[pos]
            if func_end < end:
                name_end = func_end + 1 + body[func_end]
                if name_end <= end:
                    self.pos = name_end
                    return Handle(body[pos + 1 : func_end], body[func_end + 1 : name_end])
        return Handle(self.str8(what + " func"), self.str8(what + " name"))

    def job(self, what: str) -> Job:
        func, name = self.handle(what)
        body, pos = self.body, self.pos
        end = len(body)
        if pos + 4 <= end:  # fast path, as in ``handle``
            fixed = pos + 4 + int.from_bytes(body[pos : pos + 4], "big")  # after the workload
            if fixed + 9 <= end:
                version = body[fixed + 8]
                if version > 3:  # periodicd reads an unknown version as 0 (PERIODIC.md 4.1)
                    version = 0
                last = fixed + 9 + (4 if version & 1 else 0) + (4 if version & 2 else 0)
                if last <= end:
                    at = fixed + 9
                    count = timeout = 0
                    if version & 1:
                        count = int.from_bytes(body[at : at + 4], "big", signed=True)
                        at += 4
                    if version & 2:
                        timeout = int.from_bytes(body[at : at + 4], "big", signed=True)
                    self.pos = last
                    return Job(func, name, body[pos + 4 : fixed],
                               int.from_bytes(body[fixed : fixed + 8], "big", signed=True), count, timeout)
        workload = self.take(self.int(4, False, what + " workload length"), what + " workload")
        sched_at = self.int(8, True, what + " sched_at")
        version = self.int(1, False, what + " version")
        if version > 3:  # periodicd reads an unknown version as 0 (PERIODIC.md 4.1)
            version = 0
        count = self.int(4, True, what + " count") if version & 1 else 0
        timeout = self.int(4, True, what + " timeout") if version & 2 else 0
        return Job(func, name, workload, sched_at, count, timeout)

    def jobs(self, what: str) -> tuple[Job, ...]:
        count = self.int(8, False, what + " count")
        if count > (len(self.body) - self.pos) // 15:  # a job takes at least 15 bytes
            raise PeriodicError("truncated %s: %d jobs cannot fit in %d bytes"
                                % (self.context, count, len(self.body) - self.pos))
        return tuple(self.job("%s %d" % (what, i)) for i in range(count))

    def rest(self, what: str) -> bytes:
        return self.take(len(self.body) - self.pos, what)

    def end(self) -> None:
        if self.pos != len(self.body):
            raise PeriodicError("%d trailing bytes after %s" % (len(self.body) - self.pos, self.context))


# kind -> (writer, reader) for the LAYOUT of a message
_KINDS: dict[str, tuple[Callable[[Any, str], bytes], Callable[[_Reader, str], Any]]] = {
    "str8": (_str8, _Reader.str8),
    "handle": (_handle, _Reader.handle),
    "job": (_job, _Reader.job),
    "jobs": (_jobs, _Reader.jobs),
    "rest": (_rest, _Reader.rest),
    "u32": (_u32, lambda r, what: r.int(4, False, what)),
    "i16": (_i16, lambda r, what: r.int(2, True, what)),
    "i64": (_i64, lambda r, what: r.int(8, True, what)),
    "flag": (_flag, lambda r, what: r.int(1, False, what) == 1),  # aio-periodic: only 1 grants
}


# ---- messages ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """A body after the handshake. Subclasses list their payload fields' kinds in ``LAYOUT``."""

    COMMAND: ClassVar[Command]
    LAYOUT: ClassVar[tuple[str, ...]] = ()
    msgid: int


_M = TypeVar("_M", bound="type[Message]")


def _message(command: Command, *layout: str) -> Callable[[_M], _M]:
    def register(cls: _M) -> _M:
        cls.COMMAND = command
        cls.LAYOUT = layout
        return cls
    return register


# Peer -> server.
@_message(Command.GRAB_JOB)
@dataclass(frozen=True)
class GrabJob(Message):
    pass


@_message(Command.SCHED_LATER, "handle", "i64", "i16")
@dataclass(frozen=True)
class SchedLater(Message):
    handle: Handle
    delay: int  # seconds
    step: int  # added to the job's count


@_message(Command.WORK_DONE, "handle", "rest")
@dataclass(frozen=True)
class WorkDone(Message):
    handle: Handle
    data: bytes


@_message(Command.WORK_FAIL, "handle")
@dataclass(frozen=True)
class WorkFail(Message):
    handle: Handle


@_message(Command.CAN_DO, "str8")
@dataclass(frozen=True)
class CanDo(Message):
    func: bytes


@_message(Command.CANT_DO, "str8")
@dataclass(frozen=True)
class CantDo(Message):
    func: bytes


@_message(Command.PING)
@dataclass(frozen=True)
class Ping(Message):
    pass


@_message(Command.SLEEP)
@dataclass(frozen=True)
class Sleep(Message):
    pass


@_message(Command.UNKNOWN)
@dataclass(frozen=True)
class Unknown(Message):
    """Both directions: periodicd >= 1.2.6 answers UNKNOWN with UNKNOWN."""


@_message(Command.SUBMIT_JOB, "job")
@dataclass(frozen=True)
class SubmitJob(Message):
    job: Job


@_message(Command.STATUS)
@dataclass(frozen=True)
class Status(Message):
    pass


@_message(Command.DROP_FUNC, "str8")
@dataclass(frozen=True)
class DropFunc(Message):
    func: bytes


@_message(Command.REMOVE_JOB, "handle")
@dataclass(frozen=True)
class RemoveJob(Message):
    handle: Handle


@_message(Command.DUMP)
@dataclass(frozen=True)
class Dump(Message):
    pass


@_message(Command.LOAD, "jobs")
@dataclass(frozen=True)
class Load(Message):
    jobs: tuple[Job, ...]


@_message(Command.SHUTDOWN)
@dataclass(frozen=True)
class Shutdown(Message):
    pass


@_message(Command.BROADCAST, "str8")
@dataclass(frozen=True)
class Broadcast(Message):
    func: bytes


@_message(Command.CONFIG_GET, "str8")
@dataclass(frozen=True)
class ConfigGet(Message):
    key: bytes


@_message(Command.CONFIG_SET, "str8", "u32")
@dataclass(frozen=True)
class ConfigSet(Message):
    key: bytes
    value: int


@_message(Command.RUN_JOB, "job")
@dataclass(frozen=True)
class RunJob(Message):
    job: Job


@_message(Command.ACQUIRE, "str8", "i16", "handle")
@dataclass(frozen=True)
class Acquire(Message):
    lock: bytes
    max_holders: int
    handle: Handle


@_message(Command.RELEASE, "str8", "handle")
@dataclass(frozen=True)
class Release(Message):
    lock: bytes
    handle: Handle


@_message(Command.RECV_DATA, "job")
@dataclass(frozen=True)
class RecvData(Message):
    job: Job  # only func and name matter


@_message(Command.WORK_DATA, "handle", "rest")
@dataclass(frozen=True)
class WorkData(Message):
    handle: Handle
    data: bytes


@_message(Command.JOB_ASSIGNED)
@dataclass(frozen=True)
class JobAssigned(Message):
    pass  # msgid = the JOB_ASSIGN's (its grab token)


@_message(Command.JOB_UNASSIGNED)
@dataclass(frozen=True)
class JobUnassigned(Message):
    pass


@dataclass(frozen=True)
class StrayCommand:
    """A server-to-peer command sent by a peer; periodicd ignores it without a reply (PERIODIC.md 7.17)."""

    msgid: int
    command: Command
    payload: bytes


# Server -> peer.
@_message(Command.NOOP)
@dataclass(frozen=True)
class Noop(Message):
    pass


@_message(Command.JOB_ASSIGN, "job")
@dataclass(frozen=True)
class JobAssign(Message):
    job: Job  # msgid = a grab token of the worker


@_message(Command.NO_JOB)
@dataclass(frozen=True)
class NoJob(Message):
    pass


@_message(Command.PONG)
@dataclass(frozen=True)
class Pong(Message):
    pass


@_message(Command.SUCCESS)
@dataclass(frozen=True)
class Success(Message):
    pass


@_message(Command.CONFIG, "u32")
@dataclass(frozen=True)
class Config(Message):
    value: int


@_message(Command.ACQUIRED, "flag")
@dataclass(frozen=True)
class Acquired(Message):
    granted: bool


@_message(Command.NO_WORKER)
@dataclass(frozen=True)
class NoWorker(Message):
    pass


@_message(Command.DATA, "rest")
@dataclass(frozen=True)
class Data(Message):
    data: bytes


Request = Union[GrabJob, SchedLater, WorkDone, WorkFail, CanDo, CantDo, Ping, Sleep, Unknown, SubmitJob,
                Status, DropFunc, RemoveJob, Dump, Load, Shutdown, Broadcast, ConfigGet, ConfigSet, RunJob,
                Acquire, Release, RecvData, WorkData, JobAssigned, JobUnassigned, StrayCommand]
Reply = Union[Noop, JobAssign, NoJob, Pong, Unknown, Success, Config, Acquired, NoWorker, Data]

REQUESTS: dict[Command, type[Message]] = {cls.COMMAND: cls for cls in (
    GrabJob, SchedLater, WorkDone, WorkFail, CanDo, CantDo, Ping, Sleep, Unknown, SubmitJob, Status,
    DropFunc, RemoveJob, Dump, Load, Shutdown, Broadcast, ConfigGet, ConfigSet, RunJob, Acquire, Release,
    RecvData, WorkData, JobAssigned, JobUnassigned)}
REPLIES: dict[Command, type[Message]] = {cls.COMMAND: cls for cls in (
    Noop, JobAssign, NoJob, Pong, Unknown, Success, Config, Acquired, NoWorker, Data)}


_Spec = tuple[tuple[Callable[[Any, str], bytes], Callable[["_Reader", str], Any], str], ...]
_SPECS: dict[type, _Spec] = {}
_MSGID_COMMAND = struct.Struct(">IB")


def _spec(cls: type[Message]) -> _Spec:
    """(writer, reader, field name) of each payload field of ``cls``, computed once."""
    spec = _SPECS.get(cls)
    if spec is None:
        names = [f.name for f in fields(cls)][1:]
        spec = _SPECS[cls] = tuple((_KINDS[kind][0], _KINDS[kind][1], name) for kind, name in zip(cls.LAYOUT, names))
    return spec


def encode_body(msg: Message) -> bytes:
    """msgid + command + payload of ``msg``. Fields are checked with their bare names; only
    when one does not fit is the body encoded again to name the message in the error."""
    spec = _spec(type(msg))
    try:
        if not spec:  # SUCCESS, PONG, NO_WORKER, ...: the most frequent frames
            return _MSGID_COMMAND.pack(msg.msgid, msg.COMMAND)
        payload = b"".join(write(getattr(msg, name), name) for write, _, name in spec)
        return _u32(msg.msgid, "msgid") + bytes([msg.COMMAND]) + payload
    except struct.error:
        _u32(msg.msgid, "msgid")  # raises the PeriodicError that names it
        raise
    except PeriodicError:
        context = "%s msgid=%s" % (msg.COMMAND.name, msg.msgid)
        for write, _, name in spec:
            write(getattr(msg, name), "%s %s" % (context, name))
        raise


def _decode(body: bytes, table: dict[Command, type[Message]], direction: str) -> Message | StrayCommand:
    reader = _Reader(body, 0, "body")
    msgid = reader.int(4, False, "msgid")
    byte = reader.int(1, False, "command")
    cls = table.get(byte)  # type: ignore[call-overload]  # Command is an IntEnum: its bytes are keys too
    if cls is None:
        try:
            command = Command(byte)
        except ValueError:
            raise PeriodicError("unknown command %d (msgid %d)" % (byte, msgid)) from None
        if table is REQUESTS and command in REPLIES:
            return StrayCommand(msgid, command, reader.rest("payload"))
        raise PeriodicError("%s is not a %s command (msgid %d)" % (command.name, direction, msgid))
    reader.command, reader.msgid = cls.COMMAND, msgid
    values = [read(reader, name) for _, read, name in _spec(cls)]
    reader.end()
    build: Callable[..., Message] = cls
    return build(msgid, *values)


def decode_request(body: bytes) -> Request:
    """A peer's body after the handshake. Raises ``PeriodicError`` on an unknown command, a
    payload too short for its command, or trailing bytes (periodicd closes the connection)."""
    return _decode(body, REQUESTS, "peer-to-server")  # type: ignore[return-value]


def decode_reply(body: bytes) -> Reply:
    """A server body after the handshake (for tests and test peers)."""
    return _decode(body, REPLIES, "server-to-peer")  # type: ignore[return-value]


def encode_request(msg: Message) -> bytes:
    """A whole peer frame (for tests and test peers)."""
    return encode_frame(encode_body(msg), MAGIC_REQ)


def encode_reply(msg: Message) -> bytes:
    """A whole server frame."""
    return encode_frame(encode_body(msg), MAGIC_RES)


# ---- server frames by name ---------------------------------------------------------------


def encode_noop(msgid: int) -> bytes:
    return encode_reply(Noop(msgid))


def encode_job_assign(msgid: int, job: Job) -> bytes:
    return encode_reply(JobAssign(msgid, job))


def encode_no_job(msgid: int) -> bytes:
    return encode_reply(NoJob(msgid))


def encode_pong(msgid: int) -> bytes:
    return encode_reply(Pong(msgid))


def encode_unknown(msgid: int) -> bytes:
    return encode_reply(Unknown(msgid))


def encode_success(msgid: int) -> bytes:
    return encode_reply(Success(msgid))


def encode_config(msgid: int, value: int) -> bytes:
    return encode_reply(Config(msgid, value))


def encode_acquired(msgid: int, granted: bool) -> bytes:
    return encode_reply(Acquired(msgid, granted))


def encode_no_worker(msgid: int) -> bytes:
    return encode_reply(NoWorker(msgid))


def encode_data(msgid: int, data: bytes) -> bytes:
    """DATA: a RUN_JOB result (or ``RESULT_FAILED`` / ``RESULT_REMOVED`` / ``RESULT_EXPIRED``),
    a RECV_DATA chunk (or ``STREAM_EOF``). Periodic has no error reply; these texts are its failures."""
    return encode_reply(Data(msgid, data))


class Paced(NamedTuple):
    """A frame its connection must write on its own: after every earlier frame has left,
    and not sooner than a short pause after the previous frame on the same msgid.
    aio-periodic keeps only the newest unread frame of a msgid, so a RECV_DATA's SUCCESS,
    chunks and EOF must not reach it in one read (docs/PERIODIC.md, "Streaming")."""

    msgid: int
    frame: bytes


def encode_dump(msgid: int, jobs: Iterable[Job]) -> bytes:
    """DUMP's reply: DATA + job list."""
    return encode_data(msgid, _jobs(tuple(jobs), "DUMP job"))


def decode_jobs(data: bytes) -> tuple[Job, ...]:
    """A job list (DUMP's DATA payload)."""
    reader = _Reader(data, 0, "job list")
    jobs = reader.jobs("job")
    reader.end()
    return jobs


# ---- STATUS text (PERIODIC.md 7.4) -------------------------------------------------------


class FuncStatus(NamedTuple):
    """One STATUS line. ``jobs`` counts pending + running + locked; ``sched_at`` is the earliest
    pending job's sched_at, or the current time when none is pending (epoch seconds)."""

    func: bytes
    workers: int
    jobs: int
    processing: int
    locked: int
    sched_at: int


def format_status(rows: Iterable[FuncStatus]) -> bytes:
    """One comma-separated line per func in byte order, joined by ``\\n``, no trailing newline."""
    return b"\n".join(b"%s,%d,%d,%d,%d,%d" % (r.func, r.workers, r.jobs, r.processing, r.locked, r.sched_at)
                      for r in sorted(rows))


def parse_status(text: bytes) -> list[FuncStatus]:
    """The rows of a STATUS text (a func may itself hold commas: the numbers are the last five fields)."""
    rows = []
    for line in text.split(b"\n") if text else []:
        parts = line.rsplit(b",", 5)
        try:
            if len(parts) != 6:
                raise ValueError("%d fields" % len(parts))
            rows.append(FuncStatus(parts[0], *(int(p) for p in parts[1:])))
        except ValueError as exc:
            raise PeriodicError("bad STATUS line %r: %s" % (line[:80], exc)) from exc
    return rows


def encode_status(msgid: int, rows: Iterable[FuncStatus]) -> bytes:
    """STATUS's reply: DATA + the status text."""
    return encode_data(msgid, format_status(rows))
