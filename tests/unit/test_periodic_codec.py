"""The Periodic codec against the real bytes of docs (PERIODIC.md sections 2.1 and 11), every
command, every job version, any chunking, every malformed input, and hypothesis round trips."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import zlib
from dataclasses import fields
from pathlib import Path
from typing import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobmesh.errors import PeriodicError, ProtocolError
from jobmesh.periodic import codec
from jobmesh.periodic.codec import (MAGIC_REQ, MAGIC_RES, MAX_BODY, REPLIES, REQUESTS, Acquire, Acquired,
                                    Command, ConnType, Data, FuncStatus, Handle, Job, JobAssign, Message,
                                    PacketDecoder, Ping, StrayCommand, SubmitJob, WorkDone)


def h(text: str) -> bytes:
    return bytes.fromhex(text.replace("|", " "))


def bodies(stream: bytes, magic: bytes = MAGIC_REQ, chunks: list[int] | None = None) -> list[bytes]:
    """Every body in ``stream``, fed whole or in chunks of the given sizes (repeated as needed)."""
    decoder = PacketDecoder(magic)
    sizes = chunks or [len(stream)]
    out = []
    pos = i = 0
    while pos < len(stream):
        decoder.feed(stream[pos : pos + sizes[i % len(sizes)]])
        pos += sizes[i % len(sizes)]
        i += 1
        while (body := decoder.next_packet()) is not None:
            out.append(body)
    assert decoder.pending == 0
    return out


def one_body(frame: bytes, magic: bytes) -> bytes:
    (body,) = bodies(frame, magic)
    return body


ECHO = Job(b"echo", b"j1", b"hi", 1700000000, 0, 10)
HANDLE = Handle(b"echo", b"j1")

# ---- PERIODIC.md 2.1, byte for byte ------------------------------------------------------------

SUBMIT = h("00 52 45 51 | 00 00 00 20 | d9 06 11 a4 | 00 00 00 02 0d"
           "  04 65 63 68 6f  02 6a 31  00 00 00 02 68 69  00 00 00 00 65 53 f1 00  02  00 00 00 0a")
ASSIGN = h("00 52 45 53 | 00 00 00 20 | b7 ae 20 68 | 00 00 00 03 05") + SUBMIT[17:]
STATUS_REPLY = h("00 52 45 53 | 00 00 00 1c | 9e 6b 28 56 | 00 00 00 05 1e") + b"echo,1,0,0,0,1700000000"

PEER_EXAMPLES = [  # (bytes a peer sends, what decode_request gives, the message to encode)
    ("PING", h("00 52 45 51 | 00 00 00 05 | a6 e5 7e f8 | 00 00 00 01 09"), Ping(1)),
    ("GRAB_JOB", h("00 52 45 51 | 00 00 00 05 | 9a 08 94 48 | 00 00 00 03 01"), codec.GrabJob(3)),
    ("SUBMIT_JOB", SUBMIT, SubmitJob(2, ECHO)),
    ("WORK_DONE", h("00 52 45 51 | 00 00 00 0f | 7e 40 26 45 | 00 00 00 04 03 04 65 63 68 6f 02 6a 31 6f 6b"),
     WorkDone(4, HANDLE, b"ok")),
]

SERVER_EXAMPLES = [  # (bytes the server sends, the encoder call, the decoded reply)
    ("PONG", h("00 52 45 53 | 00 00 00 05 | 3f ec 2f 42 | 00 00 00 01 0a"), lambda: codec.encode_pong(1),
     codec.Pong(1)),
    ("JOB_ASSIGN", ASSIGN, lambda: codec.encode_job_assign(3, ECHO), JobAssign(3, ECHO)),
    ("STATUS", STATUS_REPLY, lambda: codec.encode_status(5, [FuncStatus(b"echo", 1, 0, 0, 0, 1700000000)]),
     Data(5, b"echo,1,0,0,0,1700000000")),
]


@pytest.mark.parametrize("conn_type, frame", [
    (ConnType.CLIENT, h("00 52 45 51 | 00 00 00 01 | a5 05 df 1b | 01")),
    (ConnType.WORKER, h("00 52 45 51 | 00 00 00 01 | 3c 0c 8e a1 | 02")),
])
def test_handshake_examples(conn_type, frame):
    assert codec.encode_handshake(conn_type) == frame
    assert codec.decode_handshake(one_body(frame, MAGIC_REQ)) == codec.Registration(conn_type)


def test_authenticated_handshake_example():
    # periodicd 1.2.9: type 4 (3 for a client), then the token's name and the token, each
    # a u64 big-endian length and its bytes (Haskell's Binary ByteString).
    body = h("04 | 00 00 00 00 00 00 00 02 | 77 31 | 00 00 00 00 00 00 00 03 | 74 6f 6b")
    frame = codec.encode_frame(body, MAGIC_REQ)
    assert codec.encode_handshake(ConnType.WORKER, b"w1", b"tok") == frame
    assert codec.decode_handshake(body) == codec.Registration(ConnType.WORKER, b"w1", b"tok")
    assert codec.decode_handshake(b"\x03" + bytes(16)) == codec.Registration(ConnType.CLIENT, b"", b"")


def test_connection_id_example():
    frame = h("00 52 45 53 | 00 00 00 05 | 0c 51 33 73 | 1e 9a 0b 11 42")
    assert codec.encode_handshake_reply(0x9A0B1142) == frame
    assert codec.decode_handshake_reply(one_body(frame, MAGIC_RES)) == 0x9A0B1142


@pytest.mark.parametrize("name, frame, msg", PEER_EXAMPLES, ids=[e[0] for e in PEER_EXAMPLES])
def test_peer_examples(name, frame, msg):
    assert codec.decode_request(one_body(frame, MAGIC_REQ)) == msg
    assert codec.encode_request(msg) == frame


@pytest.mark.parametrize("name, frame, encode, reply", SERVER_EXAMPLES, ids=[e[0] for e in SERVER_EXAMPLES])
def test_server_examples(name, frame, encode, reply):
    assert encode() == frame
    assert codec.decode_reply(one_body(frame, MAGIC_RES)) == reply


def test_job_assign_carries_the_same_27_job_bytes_as_submit_job():
    assert ASSIGN[17:] == SUBMIT[17:] and len(SUBMIT[17:]) == 27


# ---- PERIODIC.md 11: the minimal exchange, every frame byte for byte -------------------------

RUN_JOB_SENT = Job(b"echo", b"j1", b"hi", 0, 0, 10)
EXCHANGE = [  # (who, frame, decoded or the encoder call that must give it)
    ("W", "00 52 45 51 00 00 00 01 3c 0c 8e a1 02", ConnType.WORKER),
    ("S", "00 52 45 53 00 00 00 05 0c 51 33 73 1e 9a 0b 11 42", lambda: codec.encode_handshake_reply(0x9A0B1142)),
    ("W", "00 52 45 51 00 00 00 0a 9b 38 1a 94 00 00 00 01 07 04 65 63 68 6f", codec.CanDo(1, b"echo")),
    ("S", "00 52 45 53 00 00 00 05 c2 8e d6 38 00 00 00 01 10", lambda: codec.encode_success(1)),
    ("W", "00 52 45 51 00 00 00 05 83 13 a5 09 00 00 00 02 01", codec.GrabJob(2)),
    ("S", "00 52 45 53 00 00 00 05 e9 a3 85 fb 00 00 00 02 10", lambda: codec.encode_success(2)),
    ("C", "00 52 45 51 00 00 00 01 a5 05 df 1b 01", ConnType.CLIENT),
    ("S", "00 52 45 53 00 00 00 05 72 4d 08 30 1e 0c 0f fe e0", lambda: codec.encode_handshake_reply(0x0C0FFEE0)),
    ("C", "00 52 45 51 00 00 00 20 6e d2 5e cf 00 00 00 01 19 04 65 63 68 6f 02 6a 31 00 00 00 02 68 69"
          " 00 00 00 00 00 00 00 00 02 00 00 00 0a", codec.RunJob(1, RUN_JOB_SENT)),
    ("S", "00 52 45 53 00 00 00 20 d4 a9 f9 4c 00 00 00 02 05 04 65 63 68 6f 02 6a 31 00 00 00 02 68 69"
          " 00 00 00 00 65 53 f1 00 02 00 00 00 0a", lambda: codec.encode_job_assign(2, ECHO)),
    ("W", "00 52 45 51 00 00 00 05 b8 7d 85 c1 00 00 00 02 21", codec.JobAssigned(2)),
    ("W", "00 52 45 51 00 00 00 0f 05 7d 3c 4b 00 00 00 03 03 04 65 63 68 6f 02 6a 31 48 49",
     WorkDone(3, HANDLE, b"HI")),
    ("S", "00 52 45 53 00 00 00 05 f0 b8 b4 ba 00 00 00 03 10", lambda: codec.encode_success(3)),
    ("S", "00 52 45 53 00 00 00 07 04 c8 0a 58 00 00 00 01 1e 48 49", lambda: codec.encode_data(1, b"HI")),
    ("W", "00 52 45 51 00 00 00 05 83 13 a5 09 00 00 00 02 01", codec.GrabJob(2)),
    ("S", "00 52 45 53 00 00 00 05 e9 a3 85 fb 00 00 00 02 10", lambda: codec.encode_success(2)),
]


def test_minimal_exchange_byte_for_byte():
    for who, hexed, expected in EXCHANGE:
        frame = h(hexed)
        if who == "S":
            assert expected() == frame
        elif isinstance(expected, ConnType):
            assert codec.decode_handshake(one_body(frame, MAGIC_REQ)).kind is expected
            assert codec.encode_handshake(expected) == frame
        else:
            assert codec.decode_request(one_body(frame, MAGIC_REQ)) == expected
            assert codec.encode_request(expected) == frame


def test_minimal_exchange_worker_stream_in_any_chunking():
    # The worker's frames arrive pipelined on one connection: the handshake, then requests.
    stream = b"".join(h(x) for who, x, _ in EXCHANGE if who == "W")
    expected = [codec.decode_handshake(bodies(stream)[0])] + [codec.decode_request(b) for b in bodies(stream)[1:]]
    for chunks in ([1], [7, 3, 100], [len(stream)]):
        got = bodies(stream, chunks=chunks)
        assert [codec.decode_handshake(got[0])] + [codec.decode_request(b) for b in got[1:]] == expected


# ---- the command table -------------------------------------------------------------------------

COMMAND_NUMBERS = {
    "NOOP": 0, "GRAB_JOB": 1, "SCHED_LATER": 2, "WORK_DONE": 3, "WORK_FAIL": 4, "JOB_ASSIGN": 5, "NO_JOB": 6,
    "CAN_DO": 7, "CANT_DO": 8, "PING": 9, "PONG": 10, "SLEEP": 11, "UNKNOWN": 12, "SUBMIT_JOB": 13,
    "STATUS": 14, "DROP_FUNC": 15, "SUCCESS": 16, "REMOVE_JOB": 17, "DUMP": 18, "LOAD": 19, "SHUTDOWN": 20,
    "BROADCAST": 21, "CONFIG_GET": 22, "CONFIG_SET": 23, "CONFIG": 24, "RUN_JOB": 25, "ACQUIRED": 26,
    "ACQUIRE": 27, "RELEASE": 28, "NO_WORKER": 29, "DATA": 30, "RECV_DATA": 31, "WORK_DATA": 32,
    "JOB_ASSIGNED": 33, "JOB_UNASSIGNED": 34,
}
SERVER_ONLY = {0, 5, 6, 10, 16, 24, 26, 29, 30}


def test_command_numbers_are_periodic_md_section_5():
    assert {c.name: c.value for c in Command} == COMMAND_NUMBERS


def test_every_command_has_a_message_in_its_direction():
    assert set(REQUESTS) | set(REPLIES) == set(Command)
    assert {c.value for c in REPLIES} == SERVER_ONLY | {12}
    assert {c.value for c in REQUESTS} == set(range(35)) - SERVER_ONLY
    for table in (REQUESTS, REPLIES):
        for command, cls in table.items():
            assert cls.COMMAND is command and len(cls.LAYOUT) == len(fields(cls)) - 1


JOBS = [Job(b"f", b"n"), Job(b"f", b"n", b"w", 5, count=2), ECHO, Job(b"f" * 255, b"", b"x" * 300, -1, 7, 9)]
SAMPLE_VALUES = {
    "handle": HANDLE, "job": ECHO, "jobs": tuple(JOBS), "str8": b"echo", "rest": b"\x00bytes\xff",
    "u32": 0xFFFFFFFF, "i16": -2, "i64": -(1 << 63), "flag": True,
}


def sample(cls: type[Message], msgid: int = 0xFFFFFFFF) -> Message:
    return cls(msgid, *(SAMPLE_VALUES[kind] for kind in cls.LAYOUT))  # type: ignore[call-arg]


@pytest.mark.parametrize("cls", list(REQUESTS.values()), ids=[c.name for c in REQUESTS])
def test_every_request_round_trips(cls):
    msg = sample(cls)
    body = codec.encode_body(msg)
    assert body[:5] == b"\xff\xff\xff\xff" + bytes([cls.COMMAND])
    assert codec.decode_request(body) == msg
    assert codec.decode_request(one_body(codec.encode_request(msg), MAGIC_REQ)) == msg


@pytest.mark.parametrize("cls", list(REPLIES.values()), ids=[c.name for c in REPLIES])
def test_every_reply_round_trips(cls):
    msg = sample(cls, 0)
    assert codec.decode_reply(one_body(codec.encode_reply(msg), MAGIC_RES)) == msg


@pytest.mark.parametrize("number", sorted(SERVER_ONLY))
def test_server_commands_from_a_peer_are_stray_not_errors(number):
    # periodicd ignores them without a reply (PERIODIC.md 7.17), payload and all.
    body = b"\x00\x00\x00\x07" + bytes([number]) + b"junk"
    assert codec.decode_request(body) == StrayCommand(7, Command(number), b"junk")


def test_named_server_encoders_match_their_messages():
    job = Job(b"f", b"n", timeout=600)
    assert codec.encode_noop(1) == codec.encode_reply(codec.Noop(1))
    assert codec.encode_no_job(1) == codec.encode_reply(codec.NoJob(1))
    assert codec.encode_unknown(1) == codec.encode_reply(codec.Unknown(1))
    assert codec.encode_no_worker(9) == codec.encode_reply(codec.NoWorker(9))
    assert codec.encode_config(2, 600) == codec.encode_reply(codec.Config(2, 600))
    assert codec.encode_acquired(3, True)[-1:] == b"\x01" and codec.encode_acquired(3, False)[-1:] == b"\x00"
    assert codec.decode_reply(one_body(codec.encode_acquired(3, True), MAGIC_RES)) == Acquired(3, True)
    for text in (codec.RESULT_FAILED, codec.RESULT_REMOVED, codec.RESULT_EXPIRED, codec.STREAM_EOF):
        assert codec.decode_reply(one_body(codec.encode_data(4, text), MAGIC_RES)) == Data(4, text)
    dump = codec.decode_reply(one_body(codec.encode_dump(5, [job, ECHO]), MAGIC_RES))
    assert isinstance(dump, Data) and codec.decode_jobs(dump.data) == (job, ECHO)
    assert codec.decode_jobs(b"\x00" * 8) == ()


def test_acquired_grants_only_on_byte_1():
    # aio-periodic treats anything but ACQUIRED + 0x01 as refused.
    assert codec.decode_reply(b"\x00\x00\x00\x01\x1a\x02") == Acquired(1, False)


# ---- jobs (PERIODIC.md 4.1) --------------------------------------------------------------------


@pytest.mark.parametrize("count, timeout, version, tail", [
    (0, 0, 0, ""), (3, 0, 1, "00 00 00 03"), (0, 10, 2, "00 00 00 0a"), (3, 10, 3, "00 00 00 03 00 00 00 0a"),
    (-5, -1, 0, ""),  # non-positive values are not written, as both real writers do
])
def test_job_version_follows_count_and_timeout(count, timeout, version, tail):
    job = Job(b"f", b"n", b"", 1, count, timeout)
    body = codec.encode_body(SubmitJob(1, job))
    assert body[5:] == h("01 66 01 6e 00 00 00 00 00 00 00 00 00 00 00 01") + bytes([version]) + h(tail)
    decoded = codec.decode_request(body)
    assert isinstance(decoded, SubmitJob)
    assert decoded.job == Job(b"f", b"n", b"", 1, max(count, 0), max(timeout, 0))


def test_job_reader_accepts_an_unknown_version_as_0_like_periodicd():
    body = codec.encode_body(SubmitJob(1, Job(b"f", b"n")))
    assert codec.decode_request(body[:-1] + b"\x07") == SubmitJob(1, Job(b"f", b"n"))


def test_job_integers_are_read_signed_like_periodicd():
    # aio-periodic packs sched_at as u64 and count/timeout as u32; periodicd reads them signed.
    body = codec.encode_body(SubmitJob(1, Job(b"f", b"n", b"", 0, 1, 1)))
    body = body[:-17] + b"\xff" * 8 + b"\x03" + b"\xff" * 8
    assert codec.decode_request(body) == SubmitJob(1, Job(b"f", b"n", b"", -1, -1, -1))


def test_job_handle_is_func_and_name_as_str8():
    assert ECHO.handle == HANDLE
    assert codec.encode_body(codec.WorkFail(1, ECHO.handle))[5:] == SUBMIT[17:25]


def test_func_names_must_be_utf8():
    assert codec.decode_func("größe".encode()) == "größe"
    with pytest.raises(PeriodicError, match="not valid UTF-8"):
        codec.decode_func(b"\xff\xfe")


# ---- streaming ---------------------------------------------------------------------------------

STREAM = b"".join([codec.encode_handshake(ConnType.WORKER)] + [codec.encode_request(sample(cls, i))
                                                               for i, cls in enumerate(REQUESTS.values())])


def test_whole_byte_by_byte_and_random_chunks_give_the_same_packets():
    whole = bodies(STREAM)
    assert len(whole) == 1 + len(REQUESTS)
    assert bodies(STREAM, chunks=[1]) == whole
    rng = random.Random(7)
    for _ in range(20):
        chunks = [rng.randint(1, 200) for _ in range(10)]
        assert bodies(STREAM, chunks=chunks) == whole
    assert bodies(STREAM + STREAM, chunks=[len(STREAM) + 3, len(STREAM)]) == whole + whole


def test_truncated_input_waits_for_more():
    decoder = PacketDecoder()
    frame = codec.encode_request(SubmitJob(9, ECHO))
    for end in range(len(frame)):
        decoder = PacketDecoder()
        decoder.feed(frame[:end])
        assert decoder.next_packet() is None and decoder.pending == end
    decoder.feed(frame[end:])
    assert decoder.next_packet() == codec.encode_body(SubmitJob(9, ECHO))
    assert decoder.next_packet() is None and decoder.pending == 0


def test_a_server_stream_decodes_with_the_server_magic():
    stream = codec.encode_handshake_reply(1) + codec.encode_pong(2)
    got = bodies(stream, MAGIC_RES)
    assert codec.decode_handshake_reply(got[0]) == 1 and codec.decode_reply(got[1]) == codec.Pong(2)


# ---- malformed input ---------------------------------------------------------------------------


def decode_error(data: bytes, magic: bytes = MAGIC_REQ) -> str:
    decoder = PacketDecoder(magic)
    decoder.feed(data)
    with pytest.raises(PeriodicError) as info:
        decoder.next_packet()
    return str(info.value)


def test_bad_magic_fails_on_the_first_wrong_byte():
    assert "bad magic" in decode_error(b"G")  # e.g. an HTTP request: no need to wait for 4 bytes
    assert "bad magic 00 52 45 53" in decode_error(codec.encode_pong(1))  # a server frame sent to us
    assert "bad magic" in decode_error(b"\0RE!" + SUBMIT[4:])
    assert "bad magic" in decode_error(b"\0REQ", MAGIC_RES)


def test_bad_crc():
    bad = bytearray(SUBMIT)
    bad[-1] ^= 1
    assert decode_error(bytes(bad)) == "bad CRC: header says d90611a4, body of 32 bytes has %08x" % zlib.crc32(
        bytes(bad[12:]))


def test_oversized_frame_is_refused_from_its_header_alone():
    header = MAGIC_REQ + (MAX_BODY + 1).to_bytes(4, "big") + b"\0\0\0\0"
    assert "1048577 bytes exceeds the 1048576-byte (1 MiB) limit" in decode_error(header)
    assert "4294967295 bytes exceeds" in decode_error(MAGIC_REQ + b"\xff\xff\xff\xff")  # before the CRC field
    body = codec.encode_body(WorkDone(1, HANDLE, b"x" * (MAX_BODY - 13)))
    assert len(body) == MAX_BODY and bodies(codec.encode_frame(body, MAGIC_REQ)) == [body]


@pytest.mark.parametrize("body, message", [
    (b"\x00", "unknown handshake type 0"),
    (b"\x03", "truncated handshake of type 3: token name length needs 8 bytes at offset 1, 0 left"),
    (b"\x04" + bytes(7), "truncated handshake of type 4: token name length needs 8 bytes"),
    (b"\x03\x00\x00\x00\x00\x00\x00\x00\x01a", "truncated handshake of type 3: token length needs 8 bytes"),
    (b"\x04" + b"\xff" * 8 + b"a", "truncated handshake of type 4: token name needs 18446744073709551615 bytes"),
    (b"\x03" + bytes(16) + b"x", "1 trailing bytes after handshake of type 3"),
    (b"\x05", "unknown handshake type 5"),
    (b"\xff", "unknown handshake type 255"),
    (b"", "handshake body must hold the connection type, got 0 bytes"),
    (b"\x01\x00", "handshake body of type 1 must be 1 byte, got 2 bytes"),
])
def test_bad_handshakes_are_refused(body, message):
    with pytest.raises(PeriodicError, match=message.replace("(", r"\(").replace(")", r"\)")):
        codec.decode_handshake(body)


TRUNCATED = r"^truncated .*(needs \d+ bytes at offset \d+, \d+ left|cannot fit)"


def test_every_truncation_of_every_request_is_refused_with_the_field_named():
    for cls in REQUESTS.values():
        msg = sample(cls, 1)
        body = codec.encode_body(msg)
        # a cut inside a trailing "rest" field leaves a valid, shorter body
        valid_from = len(body) - (len(getattr(msg, fields(cls)[-1].name)) if cls.LAYOUT[-1:] == ("rest",) else 0)
        for end in range(valid_from):
            with pytest.raises(PeriodicError, match=TRUNCATED):
                codec.decode_request(body[:end])


def test_truncated_job_fields_name_the_field():
    body = codec.encode_body(SubmitJob(2, ECHO))
    cases = {0: "func length", 1: "func", 5: "name length", 6: "name", 8: "workload length", 12: "workload",
             14: "sched_at", 22: "version", 23: "timeout"}
    for end, field in cases.items():
        with pytest.raises(PeriodicError, match="^truncated SUBMIT_JOB payload \\(msgid 2\\): job %s needs" % field):
            codec.decode_request(body[: end + 5])


def test_trailing_bytes_unknown_commands_and_wrong_directions():
    with pytest.raises(PeriodicError, match="^1 trailing bytes after SUBMIT_JOB payload"):
        codec.decode_request(codec.encode_body(SubmitJob(2, ECHO)) + b"!")
    with pytest.raises(PeriodicError, match="^3 trailing bytes after PING payload"):
        codec.decode_request(b"\x00\x00\x00\x01\x09abc")
    with pytest.raises(PeriodicError, match=r"^unknown command 35 \(msgid 1\)$"):
        codec.decode_request(b"\x00\x00\x00\x01\x23")
    with pytest.raises(PeriodicError, match="GRAB_JOB is not a server-to-peer command"):
        codec.decode_reply(b"\x00\x00\x00\x01\x01")
    with pytest.raises(PeriodicError, match="jobs cannot fit"):
        codec.decode_request(b"\x00\x00\x00\x01\x13" + b"\xff" * 8)


def test_periodic_errors_are_protocol_errors():
    assert issubclass(PeriodicError, ProtocolError)


@pytest.mark.parametrize("make, message", [
    (lambda: codec.encode_request(codec.CanDo(1, b"f" * 256)), "CAN_DO msgid=1 func must be at most 255 bytes"),
    (lambda: codec.encode_request(codec.CanDo(1, "text")), "must be bytes, got str"),  # type: ignore[arg-type]
    (lambda: codec.encode_data(1, "text"), "DATA msgid=1 data must be bytes, got str"),  # type: ignore[arg-type]
    (lambda: codec.encode_job_assign(1, Job(b"f", b"n", None)), "job workload must be bytes"),  # type: ignore
    (lambda: codec.encode_pong(-1), "msgid must be an integer in 0..4294967295"),
    (lambda: codec.encode_pong(1 << 32), "msgid must be an integer"),
    (lambda: codec.encode_job_assign(1, Job(b"f", b"n", timeout=1 << 31)), "job timeout must be an integer"),
    (lambda: codec.encode_job_assign(1, Job(b"f", b"n", sched_at=1 << 63)), "job sched_at must be an integer"),
    (lambda: codec.encode_request(Acquire(1, b"l", 1 << 15, HANDLE)), "max_holders must be an integer"),
    (lambda: codec.encode_handshake_reply(1 << 32), "connection id must be an integer"),
])
def test_values_that_do_not_fit_the_wire_are_refused(make, message):
    with pytest.raises(PeriodicError, match=message):
        make()


# ---- STATUS text (PERIODIC.md 7.4) -------------------------------------------------------------


def test_status_text_is_sorted_comma_separated_without_trailing_newline():
    rows = [FuncStatus(b"zeta", 0, 3, 1, 1, 1700000001), FuncStatus(b"alpha", 2, 0, 0, 0, 1700000000)]
    text = codec.format_status(rows)
    assert text == b"alpha,2,0,0,0,1700000000\nzeta,0,3,1,1,1700000001"
    assert codec.parse_status(text) == sorted(rows)
    assert codec.format_status([]) == b"" and codec.parse_status(b"") == []


def test_status_parse_keeps_commas_in_func_names_and_refuses_garbage():
    assert codec.parse_status(b"a,b,1,2,3,4,5") == [FuncStatus(b"a,b", 1, 2, 3, 4, 5)]
    with pytest.raises(PeriodicError, match="bad STATUS line"):
        codec.parse_status(b"echo,1,2")
    with pytest.raises(PeriodicError, match="bad STATUS line"):
        codec.parse_status(b"echo,1,2,x,4,5")


# ---- property tests ----------------------------------------------------------------------------

str8s = st.binary(max_size=255)
i32s = st.integers(0, (1 << 31) - 1)
jobs = st.builds(Job, str8s, str8s, st.binary(max_size=300), st.integers(-(1 << 63), (1 << 63) - 1), i32s, i32s)
KIND_STRATEGIES = {
    "str8": str8s, "handle": st.builds(Handle, str8s, str8s), "job": jobs,
    "jobs": st.lists(jobs, max_size=4).map(tuple), "rest": st.binary(max_size=300),
    "u32": st.integers(0, 0xFFFFFFFF), "i16": st.integers(-(1 << 15), (1 << 15) - 1),
    "i64": st.integers(-(1 << 63), (1 << 63) - 1), "flag": st.booleans(),
}


def messages(table: dict[Command, type[Message]]) -> st.SearchStrategy[Message]:
    return st.one_of([st.builds(cls, st.integers(0, 0xFFFFFFFF), *(KIND_STRATEGIES[k] for k in cls.LAYOUT))
                      for cls in table.values()])


@settings(max_examples=300, deadline=None)
@given(messages(REQUESTS))
def test_property_requests_round_trip(msg):
    assert codec.decode_request(one_body(codec.encode_request(msg), MAGIC_REQ)) == msg


@settings(max_examples=200, deadline=None)
@given(messages(REPLIES))
def test_property_replies_round_trip(msg):
    assert codec.decode_reply(one_body(codec.encode_reply(msg), MAGIC_RES)) == msg


@settings(max_examples=200, deadline=None)
@given(jobs)
def test_property_every_encoded_job_round_trips(job):
    reply = codec.decode_reply(one_body(codec.encode_job_assign(1, job), MAGIC_RES))
    assert reply == JobAssign(1, job)
    assert codec.decode_jobs(codec.encode_body(codec.Load(0, (job, job)))[5:]) == (job, job)


@settings(max_examples=100, deadline=None)
@given(st.lists(messages(REQUESTS), min_size=1, max_size=8), st.lists(st.integers(1, 64), min_size=1))
def test_property_any_chunking_gives_the_same_packets(msgs, sizes):
    stream = b"".join(codec.encode_request(m) for m in msgs)
    assert [codec.decode_request(b) for b in bodies(stream, chunks=sizes)] == msgs


@settings(max_examples=100, deadline=None)
@given(st.lists(st.builds(FuncStatus, st.binary(max_size=20).filter(lambda f: b"\n" not in f),
                          *[st.integers(0, 1 << 40)] * 5), unique_by=lambda r: r.func))
def test_property_status_text_round_trips(rows):
    assert codec.parse_status(codec.format_status(rows)) == sorted(rows)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_property_garbage_bodies_raise_only_periodic_errors(body):
    for decode in (codec.decode_request, codec.decode_reply, codec.decode_handshake):
        try:
            decode(body)
        except PeriodicError:
            pass


# ---- cross-check with the real aio-periodic 1.0.0, in a subprocess ----------------------------

PROBE = Path(__file__).resolve().parents[1] / "periodic_aio_probe.py"
MSGIDS = range(64)


def server_tables(connid: int, replies: dict[Command, Callable[[int], bytes]], assigns: list[Job]) -> dict:
    """What the probe's fake server answers: every reply for every msgid it may need, as hex."""
    return {
        "connid": codec.encode_handshake_reply(connid).hex(),
        "replies": {str(int(cmd)): {str(m): make(m).hex() for m in MSGIDS} for cmd, make in replies.items()},
        "assigns": [{str(m): codec.encode_job_assign(m, job).hex() for m in MSGIDS} for job in assigns],
    }


def written_requests(frames: list[str]) -> tuple[ConnType, list[object]]:
    stream = b"".join(bytes.fromhex(f) for f in frames)
    got = bodies(stream)
    return codec.decode_handshake(got[0]).kind, [codec.decode_request(b) for b in got[1:]]


@pytest.fixture(scope="module")
def aio_probe():
    pytest.importorskip("aio_periodic", reason="aio-periodic==1.0.0 is in the dev extra")
    status = [FuncStatus(b"echo", 1, 2, 0, 0, 1700000000), FuncStatus(b"idle", 0, 0, 0, 0, 1700000005)]
    client = server_tables(0x01020304, {
        Command.PING: codec.encode_pong, Command.SUBMIT_JOB: codec.encode_success,
        Command.STATUS: lambda m: codec.encode_status(m, status),
        Command.RUN_JOB: lambda m: codec.encode_no_worker(m) if m == 8 else codec.encode_data(m, b"HI"),
        Command.REMOVE_JOB: codec.encode_success, Command.DROP_FUNC: codec.encode_success}, [])
    assigns = [Job(b"echo", b"j1", b"hi", 1700000000, 0, 10), Job(b"later", "ü".encode(), b"", 1700000001, 4, 600),
               Job(b"broken", b"j3", b"{}", 5, 0, 600)]
    worker = server_tables(0xA0B0C0D0, {
        cmd: codec.encode_success for cmd in (Command.CAN_DO, Command.WORK_DONE, Command.WORK_FAIL,
                                              Command.SCHED_LATER, Command.WORK_DATA, Command.RELEASE)}
        | {Command.ACQUIRE: lambda m: codec.encode_acquired(m, True)}, assigns)
    proc = subprocess.run([sys.executable, str(PROBE)], input=json.dumps({"client": client, "worker": worker}),
                          capture_output=True, text=True, timeout=45)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), assigns


def test_aio_client_requests_decode_and_our_replies_parse(aio_probe):
    out, _ = aio_probe
    conn_type, requests = written_requests(out["client"]["written"])
    assert conn_type is ConnType.CLIENT
    assert requests == [
        Ping(1),
        SubmitJob(2, Job(b"echo", b"j1", b"hi", 1700000000, 0, 10)),
        SubmitJob(3, Job(b"echo", b"j2", b"text", 0, 3, 0)),
        codec.Status(4),
        codec.RunJob(5, Job(b"echo", b"j3", b"hi", 0, 0, 10)),
        codec.RemoveJob(6, HANDLE),
        codec.DropFunc(7, b"echo"),
        codec.RunJob(8, Job(b"nobody", b"j4", b"", 0, 0, 10)),  # aio-periodic puts 10 s on a RUN_JOB without timeout
    ]
    results = out["client"]["results"]
    assert results["connid"] == "1e01020304"  # aio-periodic keeps the whole first body
    assert results["ping"] is results["submit"] is results["submit_counted"] is True
    assert results["status"] == {
        "echo": {"func_name": "echo", "worker_count": 1, "job_count": 2, "processing": 0, "locked": 0,
                 "sched_at": 1700000000},
        "idle": {"func_name": "idle", "worker_count": 0, "job_count": 0, "processing": 0, "locked": 0,
                 "sched_at": 1700000005}}
    assert results["run_job"] == b"HI".hex()
    assert results["remove"] is results["drop"] is True
    assert results["no_worker"] == "no worker"


def test_aio_worker_reads_our_job_assign_and_its_requests_decode(aio_probe):
    out, assigns = aio_probe
    conn_type, requests = written_requests(out["worker"]["written"])
    assert conn_type is ConnType.WORKER
    assert out["worker"]["connid"] == "1ea0b0c0d0"
    # What aio-periodic decoded from our JOB_ASSIGN frames, as its tasks saw it.
    assert out["worker"]["seen"] == [
        {"func": job.func.decode(), "name": job.name.decode(), "workload": job.workload.hex(),
         "sched_at": job.sched_at, "timeout": job.timeout, "count": job.count,
         "handle": codec.encode_body(codec.WorkFail(0, job.handle))[5:].hex()} | extra
        for job, extra in zip(assigns, [{"acquired": True, "released": True}, {}, {}])]
    # Its requests, in order: CAN_DO per func, then per job GRAB_JOB, JOB_ASSIGNED on the
    # grab msgid, the task's requests and the final report; msgids count up from 1.
    grab = requests[3].msgid
    echo, later, broken = (job.handle for job in assigns)
    assert requests == [
        codec.CanDo(1, b"echo"), codec.CanDo(2, b"later"), codec.CanDo(3, b"broken"),
        codec.GrabJob(grab), codec.JobAssigned(grab),
        codec.WorkData(5, echo, b"chunk"), codec.Acquire(6, b"lk", 2, echo), codec.Release(7, b"lk", echo),
        WorkDone(8, echo, b"HI"),
        codec.GrabJob(grab), codec.JobAssigned(grab), codec.SchedLater(9, later, 30, 2),
        codec.GrabJob(grab), codec.JobAssigned(grab), codec.WorkFail(10, broken),
        codec.GrabJob(grab),
    ]
