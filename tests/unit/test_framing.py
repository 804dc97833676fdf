import random
import ssl
import struct

import gevent
import gevent.socket
import gevent.ssl
import pytest

from jobmesh.coordinator.ports.connection import FrameSource, read_buffer
from jobmesh.errors import ProtocolError
from jobmesh.protocol.framing import HEADER, MAX_FRAME, FrameDecoder, FrameReader, encode_frame
from tests.tls_support import make_certs


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


# ---- the coordinator's reads: FrameSource on real gevent sockets --------------------------


class CountingSocket(gevent.socket.socket):
    """A gevent socket that counts its ``recv_into`` syscalls, and those that found
    nothing to read (``EAGAIN``) before gevent waited for the socket."""

    def recv_into(self, buffer, nbytes=0, flags=0):
        self.reads = getattr(self, "reads", 0) + 1
        try:
            return self._sock.recv_into(buffer, nbytes, flags)
        except BlockingIOError:
            self.empty = getattr(self, "empty", 0) + 1
            return super().recv_into(buffer, nbytes, flags)


def counting_pair():
    """A counting gevent socket (the coordinator's side) and its plain gevent peer."""
    ours, peer = gevent.socket.socketpair()
    counted = CountingSocket(ours.family, ours.type, 0, ours.detach())
    counted.reads = counted.empty = 0
    return counted, peer


def read_frames(source, count, into):
    for _ in range(count):
        into.append(source.read_frame())


def settle(cond):
    """Let the hub run (the reader reads what was sent, then waits for the socket) until ``cond()``."""
    for _ in range(1000):
        gevent.idle()
        if cond():
            return
    raise AssertionError("the reader did not get there")


def test_a_peer_that_waits_for_each_answer_costs_one_read_per_frame():
    sock, peer = counting_pair()
    source, got = FrameSource(sock, read_buffer()), []
    reader = gevent.spawn(read_frames, source, len(OBJS), got)
    for i, obj in enumerate(OBJS):
        peer.sendall(encode_frame(obj))
        settle(lambda: len(got) == i + 1)  # the reader has it, and waits for the next
    reader.get(timeout=5)
    assert got == OBJS
    assert (sock.reads, sock.empty) == (len(OBJS), 0)
    peer.close()
    assert source.read_frame() is None
    assert (sock.reads, sock.empty) == (len(OBJS) + 1, 0)  # the EOF
    sock.close()


def test_pipelined_frames_take_one_read():
    sock, peer = counting_pair()
    source = FrameSource(sock, read_buffer())
    peer.sendall(frames_bytes(OBJS * 10))
    peer.close()
    assert [source.read_frame() for _ in range(len(OBJS) * 10)] == OBJS * 10
    assert source.read_frame() is None
    assert (sock.reads, sock.empty) == (2, 0)  # all the frames, then the EOF
    sock.close()


def test_frames_split_byte_by_byte_across_reads():
    sock, peer = counting_pair()
    source, got = FrameSource(sock, read_buffer()), []
    reader = gevent.spawn(read_frames, source, 3, got)
    data = frames_bytes(OBJS[:3])
    for i in range(len(data)):
        peer.sendall(data[i:i + 1])
        settle(lambda: sock.reads == i + 1)
    reader.get(timeout=5)
    assert got == OBJS[:3]
    assert sock.empty == 0
    sock.close()
    peer.close()


def test_frames_larger_than_the_buffer_and_frames_around_them():
    sock, peer = counting_pair()
    buffer = read_buffer()
    big = {"type": "X", "text": "b" * (3 * len(buffer) + 17)}
    objs = [OBJS[1], big, OBJS[2], big, OBJS[3]]
    source, got = FrameSource(sock, buffer), []
    reader = gevent.spawn(read_frames, source, len(objs), got)
    peer.sendall(frames_bytes(objs))
    reader.get(timeout=5)
    assert got == objs
    sock.close()
    peer.close()


def test_two_connections_sharing_the_buffer_keep_their_own_partial_frames():
    (a, peer_a), (b, peer_b) = counting_pair(), counting_pair()
    buffer = read_buffer()
    source_a, source_b, got_a, got_b = FrameSource(a, buffer), FrameSource(b, buffer), [], []
    readers = [gevent.spawn(read_frames, source_a, len(OBJS), got_a),
               gevent.spawn(read_frames, source_b, len(OBJS), got_b)]
    data_a, data_b = frames_bytes(OBJS), frames_bytes(list(reversed(OBJS)))
    for i in range(0, max(len(data_a), len(data_b)), 7):  # each cut inside frames, the two reads interleaved
        peer_a.sendall(data_a[i:i + 7])
        settle(lambda: a.reads == i // 7 + 1)
        if data_b[i:i + 7]:
            peer_b.sendall(data_b[i:i + 7])
            settle(lambda: b.reads == i // 7 + 1)
    gevent.joinall(readers, timeout=5, raise_error=True)
    assert (got_a, got_b) == (OBJS, list(reversed(OBJS)))
    for sock in (a, b, peer_a, peer_b):
        sock.close()


def test_an_oversized_header_is_refused_at_once_after_the_frames_before_it():
    sock, peer = counting_pair()
    source = FrameSource(sock, read_buffer())
    peer.sendall(frames_bytes(OBJS[:2]) + HEADER.pack(MAX_FRAME + 1))  # and the peer stays, sending nothing more
    assert [source.read_frame(), source.read_frame()] == OBJS[:2]
    with gevent.Timeout(5):
        with pytest.raises(ProtocolError, match="invalid frame length"):
            source.read_frame()
    sock.close()
    peer.close()


@pytest.mark.parametrize("cut", [2, 9])
def test_a_peer_closing_inside_a_frame(cut):
    sock, peer = counting_pair()
    source = FrameSource(sock, read_buffer())
    frame = encode_frame(OBJS[5])
    peer.sendall(encode_frame(OBJS[1]) + frame[:cut])
    assert source.read_frame() == OBJS[1]
    peer.sendall(frame[cut:cut + 3])
    peer.close()
    with pytest.raises(ProtocolError, match="inside a frame"):
        source.read_frame()
    sock.close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


def tls_pair(certs):
    """A gevent TLS connection over a socket pair: the coordinator's side (timeout 0, as
    ``Output`` sets it) and the peer's."""
    ours, peer = gevent.socket.socketpair()
    server = gevent.ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(str(certs.server), str(certs.server_key))
    client = gevent.ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_verify_locations(str(certs.ca))
    ours = server.wrap_socket(ours, server_side=True, do_handshake_on_connect=False)
    peer = client.wrap_socket(peer, server_hostname="localhost", do_handshake_on_connect=False)
    gevent.joinall([gevent.spawn(ours.do_handshake), gevent.spawn(peer.do_handshake)], timeout=10, raise_error=True)
    ours.settimeout(0.0)
    return ours, peer


def test_tls_pipelined_frames_and_bytes_held_inside_the_tls_object(certs):
    ours, peer = tls_pair(certs)
    # A buffer smaller than a TLS record: after a read, the rest of the record is decrypted
    # bytes in the TLS object, and the socket itself has nothing more to read.
    source = FrameSource(ours, memoryview(bytearray(1000)))
    big = {"type": "X", "text": "t" * 12000}
    objs = OBJS + [big] + OBJS
    peer.sendall(frames_bytes(objs))
    with gevent.Timeout(5):
        assert [source.read_frame() for _ in objs] == objs
    data = encode_frame(big)
    for i in range(0, len(data), 5000):  # a frame in several records
        peer.sendall(data[i:i + 5000])
    peer.close()
    with gevent.Timeout(5):
        assert source.read_frame() == big
        assert source.read_frame() is None
    ours.close()
