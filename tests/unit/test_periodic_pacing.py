"""A Periodic connection's ordered output: plain frames in one write, Paced frames each
on its own and spaced per msgid (aio-periodic keeps only the newest unread frame of a
msgid), everything in the order the core decided. A real gevent socket pair."""

from __future__ import annotations

import gevent
import gevent.socket

from jobmesh.coordinator.shell.clock import monotonic
from jobmesh.coordinator.ports import periodic as periodic_port
from jobmesh.coordinator.ports.periodic import PACE_SECONDS, PeriodicConn, local_answer
from jobmesh.periodic import codec as pc
from tests.support.waiting import wait_until


class Recording(PeriodicConn):
    """Notes when each write happens and what it carries."""

    __slots__ = ("writes",)

    def write(self, data: bytes, close: bool = False) -> None:
        self.writes.append((monotonic(), data))
        super().write(data, close)


def pair():
    a, b = gevent.socket.socketpair()
    conn = Recording(a, ("127.0.0.1", 1))
    conn.writes = []
    return conn, b, conn.writes


def read_all(sock, n: int) -> bytes:
    data = b""
    while len(data) < n:
        data += sock.recv(65536)
    return data


def test_plain_frames_go_out_in_one_write():
    conn, peer, writes = pair()
    frames = [pc.encode_success(1), pc.encode_pong(2)]
    conn.send_many(frames)
    assert [w[1] for w in writes] == [b"".join(frames)]
    assert read_all(peer, len(b"".join(frames))) == b"".join(frames)


class PausesNoted:
    """``gevent`` as the pacer sees it, noting how many writes were done when it paused."""

    def __init__(self, writes: list) -> None:
        self.writes = writes
        self.paused_before: list[int] = []  # index in ``writes`` of the frame each pause held back

    def sleep(self, seconds: float = 0) -> None:
        self.paused_before.append(len(self.writes))
        gevent.sleep(seconds)

    def __getattr__(self, name: str):
        return getattr(gevent, name)


def test_paced_frames_are_separate_spaced_per_msgid_and_keep_the_order(monkeypatch):
    conn, peer, writes = pair()
    pauses = PausesNoted(writes)
    monkeypatch.setattr(periodic_port, "gevent", pauses)
    ok = pc.Paced(8, pc.encode_success(8))
    chunks = [pc.Paced(8, pc.encode_data(8, b"c%d" % i)) for i in range(3)]
    result = pc.encode_data(7, b"end")
    other = pc.Paced(9, pc.encode_data(9, b"x"))
    conn.send_many([ok, chunks[0], other])
    conn.send_many([chunks[1], chunks[2], result])  # the plain frame waits behind the paced ones
    expected = [ok.frame, chunks[0].frame, other.frame, chunks[1].frame, chunks[2].frame, result]
    assert read_all(peer, sum(map(len, expected))) == b"".join(expected)
    # the pacer stops when its queue is empty
    wait_until(lambda: conn._pacer is None, timeout=5, message="the pacer done", sleep=gevent.sleep)
    assert [w[1] for w in writes] == expected
    times = [t for t, data in writes if data in {ok.frame} | {c.frame for c in chunks}]
    assert all(b - a >= PACE_SECONDS * 0.99 for a, b in zip(times, times[1:]))
    # another msgid does not wait for msgid 8's pause: the pacer never paused before it
    assert expected.index(other.frame) not in pauses.paused_before, pauses.paused_before


def test_a_close_after_paced_frames_comes_after_them():
    conn, peer, writes = pair()
    frames = [pc.Paced(8, pc.encode_data(8, b"a")), pc.Paced(8, pc.encode_data(8, pc.STREAM_EOF))]
    conn.send_many(frames + [None])
    data = b""
    while chunk := peer.recv(65536):
        data += chunk
    assert data == b"".join(f.frame for f in frames)


def test_local_answers():
    config = {b"timeout": 600, b"keepalive": 120}
    assert local_answer(pc.ConfigGet(1, b"timeout"), config) == pc.encode_config(1, 600)
    assert local_answer(pc.ConfigGet(2, b"assign-wait"), config) == pc.encode_config(2, 0)
    assert local_answer(pc.ConfigSet(3, b"timeout", 5), config) == pc.encode_success(3)
    assert local_answer(pc.Shutdown(4), config) == b""  # ignored: a Periodic client cannot stop jobmesh
    assert local_answer(pc.Sleep(5), config) == pc.encode_noop(5)
    assert local_answer(pc.SubmitJob(6, pc.Job(b"f", b"n")), config) is None  # the core's


def test_more_than_the_unsent_cap_waiting_to_be_paced_closes_the_connection(monkeypatch):
    monkeypatch.setattr(periodic_port, "MAX_UNSENT_BYTES", 10_000)
    conn, peer, writes = pair()
    chunk = pc.Paced(8, pc.encode_data(8, b"x" * 1000))
    conn.send_many([chunk] * 5)
    assert not conn.closed
    conn.send_many([chunk] * 6)  # a stream far faster than 200 chunks a second
    assert conn.closed
    wait_until(lambda: conn._pacer is None, timeout=5, message="the pacer stopped", sleep=gevent.sleep)


def test_frames_for_a_finished_connection_are_dropped():
    conn, peer, writes = pair()
    conn.send_many([pc.Paced(8, pc.encode_success(8))])
    conn.finish()  # the handler leaves before the pacer ran
    assert conn._paced is None and conn._pacer is None
    conn.send_many([pc.Paced(8, pc.encode_data(8, b"late"))] * 3)
    assert conn._paced is None and writes == []
