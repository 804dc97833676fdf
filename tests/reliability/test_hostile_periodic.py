"""Hostile peers on the Periodic port, each beside a well-behaved JSON client measured
while it runs (docs/FAILURE_MODEL.md, "Periodic peers"): every one of its requests is
answered within a generous multiple of its latency before the flood, a Periodic bystander is served after, and the coordinator keeps running. Loopback only,
a few seconds each."""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable

import pytest

from jobmesh.periodic import codec as pc
from tests.integration.periodic_support import RawPeriodic
from tests.reliability.test_hostile_peers import Probe

FLOOD_SECONDS = 3.0


@pytest.fixture
def coord(coordinator_factory):
    return coordinator_factory(periodic_port=0)


@pytest.fixture
def probe_job(coord, peers):
    return peers.client(coord).submit_ok("SLEEP", {"durationMillis": 1}, delayMillis=10 ** 9)


def flood(conn: RawPeriodic, frames: Callable[[], bytes], seconds: float) -> tuple[int, bool]:
    """Send batches from ``frames()`` without reading, for at most ``seconds``; returns
    (batches sent, whether the coordinator closed the connection)."""
    sent = 0
    deadline = time.monotonic() + seconds
    conn.sock.settimeout(1.0)
    try:
        while time.monotonic() < deadline:
            try:
                conn.sock.sendall(frames())
            except socket.timeout:
                continue  # it stopped reading us: keep trying until the time is up
            sent += 1
    except OSError:
        return sent, True
    return sent, False


def still_fine(coord) -> None:
    assert coord.proc.poll() is None, coord.stderr()[-3000:]
    bystander = RawPeriodic(coord.periodic_addr)
    assert bystander.ping()
    bystander.status()  # a well-formed STATUS comes back
    bystander.close()


def flood_beside_a_probe(coord, probe_job: str, hog: RawPeriodic, batch: Callable[[], bytes]) -> None:
    """``hog`` floods ``batch()`` for FLOOD_SECONDS beside a probe client, which must be
    served throughout; the coordinator is fine after."""
    with Probe(coord, probe_job) as probe:
        flood(hog, batch, FLOOD_SECONDS)
        probe.await_replies(10)  # served after the flood as well
    probe.check()
    still_fine(coord)
    hog.close()


def test_a_periodic_client_pipelining_submits_and_status_without_reading(coord, probe_job):
    hog = RawPeriodic(coord.periodic_addr)
    names = iter(range(10 ** 9))

    def batch() -> bytes:
        frames = [pc.encode_request(pc.SubmitJob(n, pc.Job(b"hog", b"n%d" % n, b"x" * 100)))
                  for n in (next(names) for _ in range(32))]
        return b"".join(frames) + pc.encode_request(pc.Status(0))

    flood_beside_a_probe(coord, probe_job, hog, batch)


def test_a_periodic_worker_flooding_stale_outcomes_and_tokens(coord, probe_job):
    hog = RawPeriodic(coord.periodic_addr, pc.ConnType.WORKER)
    hog.request(pc.CanDo(1, b"hogf"))
    msgids = iter(range(2, 10 ** 9))

    def batch() -> bytes:
        return b"".join(pc.encode_request(pc.WorkDone(next(msgids), pc.Handle(b"hogf", b"nobody"), b"r"))
                        + pc.encode_request(pc.GrabJob(next(msgids))) for _ in range(32))

    flood_beside_a_probe(coord, probe_job, hog, batch)


def test_a_stream_to_a_client_that_never_reads_is_bounded(coord, probe_job):
    # Given a worker running a job that a RUN_JOB + RECV_DATA client waits for, and the
    # client never reads its socket
    worker = RawPeriodic(coord.periodic_addr, pc.ConnType.WORKER)
    worker.request(pc.CanDo(1, b"st"))
    worker.send(pc.GrabJob(2))
    client = RawPeriodic(coord.periodic_addr)
    client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.send(pc.RunJob(1, pc.Job(b"st", b"s", b"", 0, 0, 60)))
    client.send(pc.RecvData(2, pc.Job(b"st", b"s")))
    replies = [worker.reply(), worker.reply()]  # SUCCESS for the GRAB_JOB, then JOB_ASSIGN
    assert any(isinstance(r, pc.JobAssign) for r in replies), replies
    chunk = pc.encode_request(pc.WorkData(3, pc.Handle(b"st", b"s"), b"c" * 60_000))
    stop = threading.Event()

    def drain_worker() -> None:  # the worker reads its SUCCESS replies
        worker.sock.settimeout(0.5)
        while not stop.is_set():
            try:
                if not worker.sock.recv(65536):
                    return
            except socket.timeout:
                continue
            except OSError:
                return

    reader = threading.Thread(target=drain_worker, daemon=True)
    reader.start()
    # When the worker streams chunks far faster than 200 a second
    with Probe(coord, probe_job) as probe:
        flood(worker, lambda: chunk * 8, FLOOD_SECONDS)
        probe.await_replies(10)  # served after the flood as well
    stop.set()
    reader.join(5)
    # Then the client connection is closed at the unsent cap, and nobody else suffers
    assert client.closed_within(10), "a client holding megabytes of paced frames was kept"
    assert "wait to be paced out" in coord.stderr()
    probe.check()
    still_fine(coord)
    worker.close()
