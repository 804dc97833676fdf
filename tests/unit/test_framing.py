import random
import struct

import pytest

from jobmesh.errors import ProtocolError
from jobmesh.protocol.framing import MAX_FRAME, FrameDecoder, FrameReader, encode_frame


def frames_bytes(objs):
    return b"".join(encode_frame(o) for o in objs)


def reader_over(chunks):
    it = iter(chunks)

    def recv(_n):
        return next(it, b"")

    return FrameReader(recv)


def read_all(reader):
    out = []
    while True:
        obj = reader.read_frame()
        if obj is None:
            return out
        out.append(obj)


OBJS = [{"type": "HEARTBEAT", "workerId": "w-%d" % i, "text": "é✓" * i} for i in range(20)]


def test_whole_stream_in_one_chunk():
    assert read_all(reader_over([frames_bytes(OBJS)])) == OBJS


def test_byte_by_byte():
    data = frames_bytes(OBJS)
    assert read_all(reader_over([data[i : i + 1] for i in range(len(data))])) == OBJS


def test_random_chunks():
    data = frames_bytes(OBJS)
    rng = random.Random(7)
    for _ in range(50):
        chunks, i = [], 0
        while i < len(data):
            n = rng.randint(1, 40)
            chunks.append(data[i : i + n])
            i += n
        assert read_all(reader_over(chunks)) == OBJS


def test_eof_inside_header_and_body_is_an_error():
    data = encode_frame({"type": "X"})
    for cut in (2, 6):
        with pytest.raises(ProtocolError, match="inside a frame"):
            read_all(reader_over([data[:cut]]))


@pytest.mark.parametrize("length", [0, MAX_FRAME + 1, 0xFFFFFFFF])
def test_bad_lengths(length):
    with pytest.raises(ProtocolError, match="invalid frame length"):
        read_all(reader_over([struct.pack(">I", length) + b"{}"]))


@pytest.mark.parametrize(
    "body,match",
    [(b"\xff\xfe{}", "UTF-8"), (b"not json", "JSON"), (b"[1,2]", "object"), (b'"s"', "object")],
)
def test_bad_bodies(body, match):
    with pytest.raises(ProtocolError, match=match):
        read_all(reader_over([struct.pack(">I", len(body)) + body]))


def test_max_frame_is_accepted_and_oversize_refused_on_encode():
    text = "a" * (MAX_FRAME - 20)
    frame = encode_frame({"t": text})
    assert len(frame) - 4 <= MAX_FRAME
    assert read_all(reader_over([frame]))[0]["t"] == text
    with pytest.raises(ProtocolError):
        encode_frame({"t": "a" * MAX_FRAME})


def test_decoder_pending_and_partial():
    d = FrameDecoder()
    data = encode_frame({"a": 1})
    d.feed(data[:5])
    assert d.next_payload() is None
    assert d.pending == 5
    d.feed(data[5:] + data)
    assert d.next_payload() == {"a": 1}
    assert d.next_payload() == {"a": 1}
    assert d.pending == 0


def test_lone_surrogate_escapes_are_refused_but_pairs_are_text():
    from jobmesh.protocol.framing import decode_payload

    assert decode_payload(b'{"t": "\\ud83d\\ude00"}') == {"t": "\U0001F600"}
    for body in (b'{"t": "x\\ud800"}', b'{"t": "\\uDC00y"}', b'{"\\ud800": 1}', b'{"a": ["\\udfff"]}'):
        with pytest.raises(ProtocolError, match="surrogate"):
            decode_payload(body)


def test_encoding_text_that_is_not_unicode_is_a_protocol_error():
    with pytest.raises(ProtocolError):
        encode_frame({"t": "\ud800"})


def test_an_http_answer_is_named_as_such():
    dec = FrameDecoder()
    dec.feed(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    with pytest.raises(ProtocolError, match="answered in HTTP"):
        dec.next_payload()
