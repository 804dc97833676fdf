"""Hostile peers against a real coordinator, each with a well-behaved client measured
beside it (docs/FAILURE_MODEL.md, "Hostile and broken peers"): every one of its requests
is answered, none waits longer than a generous multiple of its latency measured before
the hostile peers arrived, nothing acknowledged is lost, healthy workers are not declared
dead, and the coordinator's descriptors come back after. Bounded in time; loopback only."""

from __future__ import annotations

import socket
import statistics
import threading
import time

import pytest

from jobmesh.protocol.framing import HEADER, encode_frame
from tests.support.connections import RawConn, read_until_closed
from tests.support.waiting import latency_limit, wait_until

BASELINE_REQUESTS = 50


class Probe:
    """A well-behaved client: one GET_JOB_STATUS at a time, each timed.

    Entering it measures the baseline (BASELINE_REQUESTS requests, one after another, with
    nothing hostile around yet), then starts a thread that keeps asking while the test's
    hostile peers run; ``check`` asserts every request was answered and none waited longer
    than ``limit()``.
    """

    def __init__(self, coord, job_id: str) -> None:
        self.conn = RawConn(coord.client_addr, timeout=30)
        self.job_id = job_id
        self.baseline: list[float] = []
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _ask(self) -> float:
        started = time.monotonic()
        reply = self.conn.request({"type": "GET_JOB_STATUS", "jobId": self.job_id})
        took = time.monotonic() - started
        assert reply is not None and reply.get("type") == "JOB_STATUS", reply
        return took

    def __enter__(self) -> "Probe":
        self.baseline = [self._ask() for _ in range(BASELINE_REQUESTS)]
        self._thread.start()
        self.await_replies(1)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)  # longer than the connection's timeout: the last request ends
        self.conn.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.latencies.append(self._ask())
            except Exception as exc:  # noqa: BLE001 - recorded and asserted on
                self.errors.append(repr(exc))
                return
            time.sleep(0.005)  # a client asking about every 5 ms, not a busy loop competing for the GIL

    def await_replies(self, n: int, timeout: float = 30.0) -> None:
        """Wait until ``n`` more requests are answered (the probe is being served now)."""
        target = len(self.latencies) + n
        wait_until(lambda: len(self.latencies) >= target or self.errors, timeout=timeout,
                   message="%d more probe replies" % n)
        assert not self.errors, self.errors[:3]

    def limit(self) -> float:
        return latency_limit(statistics.median(self.baseline))

    def check(self) -> None:
        worst = max(self.latencies, default=float("inf"))
        print("probe: baseline median %.2f ms; %d requests under load, median %.2f ms, max %.1f ms" % (
            statistics.median(self.baseline) * 1000, len(self.latencies),
            statistics.median(self.latencies) * 1000 if self.latencies else float("nan"), worst * 1000))
        assert not self.errors, self.errors[:3]
        assert not self._thread.is_alive(), "the probe's last request was never answered"
        assert self.latencies, "the probe was never answered under load"
        assert worst < self.limit(), "a probe request waited %.3f s; the limit is %.3f s (baseline median %.2f ms)" % (
            worst, self.limit(), statistics.median(self.baseline) * 1000)


def register(coord, worker_id: str, capacity: int = 1) -> RawConn:
    conn = RawConn(coord.worker_addr, timeout=10)
    conn.send({"type": "WORKER_REGISTER", "workerId": worker_id, "capacity": capacity})
    assert conn.recv()["type"] == "WORKER_REGISTERED"
    return conn


def flood(conn: RawConn, frame: bytes, seconds: float) -> tuple[int, bool]:
    """Send ``frame`` as fast as the socket takes it, for at most ``seconds``; returns
    (frames sent, whether the coordinator closed the connection)."""
    sent = 0
    deadline = time.monotonic() + seconds
    batch = frame * 64
    conn.sock.settimeout(2)
    try:
        while time.monotonic() < deadline:
            conn.sock.sendall(batch)
            sent += 64
    except OSError:
        return sent, True
    return sent, False


def closed_with_error(conn: RawConn, words: str) -> None:
    conn.sock.settimeout(5)
    seen = []
    try:
        while True:
            frame = conn.recv()
            if frame is None:
                break
            seen.append(frame)
    except OSError:
        pass
    assert any(f.get("type") == "ERROR" and words in f.get("message", "") for f in seen), seen[-3:]


@pytest.fixture
def job(coordinator, peers):
    return peers.client(coordinator).submit_ok("SLEEP", {"durationMillis": 1})


def flood_beside_a_probe(coord, job_id: str, worker_id: str, frame: dict, why: str, words: str) -> None:
    """A registered worker floods ``frame`` for 3 s beside a probe client: the flood is
    cut off with an ERROR containing ``words``, and the probe is served throughout."""
    hog = register(coord, worker_id)
    with Probe(coord, job_id) as probe:
        _, closed = flood(hog, encode_frame(frame), 3.0)
        probe.await_replies(10)  # served after the flood as well
    assert closed, why
    closed_with_error(hog, words)
    probe.check()
    hog.close()


def test_a_heartbeat_flood_is_cut_off_and_costs_clients_nothing(coordinator, job):
    flood_beside_a_probe(coordinator, job, "w-flood", {"type": "HEARTBEAT", "workerId": "w-flood"},
                         "the coordinator kept reading a heartbeat flood", "heartbeats in one second")


def test_forged_results_close_the_worker_and_cost_clients_nothing(coordinator, job):
    flood_beside_a_probe(coordinator, job, "w-forger",
                         {"type": "TASK_RESULT", "workerId": "w-forger", "jobId": "forged",
                          "attemptId": "forged.1", "success": True, "result": {}},
                         "the coordinator kept a worker sending results for leases it does not hold",
                         "leases this worker does not hold")


def hammered(probe: Probe, conns: list[RawConn], frame: bytes, per_round: int, served) -> Probe:
    """Each of ``conns`` sends ``frame`` ``per_round`` times and reads the replies, again and
    again for three seconds, beside ``probe``; a connection stops at a reply for which
    ``served(reply)`` is false. Returns the probe, to check."""
    stop = threading.Event()

    def hammer(conn: RawConn) -> None:
        while not stop.is_set():
            conn.send_raw(frame * per_round)
            for _ in range(per_round):
                if not served(conn.recv()):
                    return

    threads = [threading.Thread(target=hammer, args=(c,), daemon=True) for c in conns]
    with probe:
        for t in threads:
            t.start()
        time.sleep(3.0)  # how long the connections hammer: the load under test, not a synchronisation
        stop.set()
        for t in threads:
            t.join(30)
    return probe


def test_listing_clients_cannot_get_healthy_workers_declared_dead(coordinator_factory, peers):
    # Given a few thousand stored jobs and two healthy workers holding 16 running attempts
    coord = coordinator_factory(heartbeat_timeout_millis=1000)
    loader = RawConn(coord.client_addr, timeout=30)
    loader.send_raw(b"".join(encode_frame({"type": "SUBMIT_JOB", "taskType": "SLEEP",
                                           "payload": {"durationMillis": 1}}) for _ in range(3000)))
    for _ in range(3000):
        assert loader.recv()["type"] == "JOB_SUBMITTED"
    workers = [peers.worker(coord, "w-%d" % i, capacity=8, heartbeat_millis=100) for i in range(2)]
    running = [w.await_assign()["jobId"] for w in workers for _ in range(8)]
    probe_job = running[0]
    # When eight clients pipeline LIST_JOBS pages of 1000 for three seconds
    listers = [RawConn(coord.client_addr, timeout=30) for _ in range(8)]
    page = encode_frame({"type": "LIST_JOBS", "limit": 1000})
    probe = hammered(Probe(coord, probe_job), listers, page, 16, lambda reply: reply is not None)
    # Then no worker was presumed dead and every running attempt is still the first one
    assert "presumed dead" not in coord.stderr()
    client = peers.client(coord)
    for job_id in running:
        snap = client.status(job_id)
        assert (snap["state"], snap["attempts"]) == ("RUNNING", 1), snap
    assert sorted(w["workerId"] for w in client.workers()) == ["w-0", "w-1"]
    probe.check()
    for c in listers + [loader]:
        c.close()


def test_clients_that_never_read_cost_bounded_memory(coordinator_factory, peers):
    coord = coordinator_factory()
    client = peers.client(coord)
    job_id = client.submit_ok("WORD_COUNT", {"text": "x"})
    for _ in range(3):  # pages of about 260 KB
        for _ in range(300):
            client.submit_ok("WORD_COUNT", {"text": "y" * 800})
    before = coord.rss_mb()
    deaf = []
    page = encode_frame({"type": "LIST_JOBS", "limit": 1000})
    with Probe(coord, job_id) as probe:
        for _ in range(40):
            conn = RawConn(coord.client_addr, timeout=5)
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            conn.send_raw(page * 64)
            deaf.append(conn)
        time.sleep(3.0)  # how long the deaf clients are held: the load under test, not a synchronisation
        peak = coord.rss_mb()
    probe.check()
    print("RSS %.0f MB before, %.0f MB with 40 deaf clients" % (before, peak))
    assert peak - before < 300, "RSS grew from %.0f to %.0f MB" % (before, peak)
    for conn in deaf:
        conn.close()


def test_idle_and_half_sent_connections_are_closed_and_their_descriptors_come_back(coordinator_factory, peers):
    coord = coordinator_factory(idle_timeout_millis=500)
    base = coord.open_fds()
    idle = [RawConn(coord.client_addr, timeout=5) for _ in range(200)]
    partial = [RawConn(coord.client_addr, timeout=5) for _ in range(50)]
    for conn in partial:
        conn.send_raw(HEADER.pack(100)[:3])  # 3 of 4 header bytes, then nothing
    unregistered = [RawConn(coord.worker_addr, timeout=5) for _ in range(50)]
    wait_until(lambda: coord.open_fds() >= base + 250, timeout=10, message="connections accepted")
    # After the idle timeout every one of them is closed by the coordinator
    for conn in idle + partial + unregistered:
        assert conn.recv() is None
    wait_until(lambda: coord.open_fds() <= base + 5, timeout=10, message="descriptors released")
    # and a client and a worker are served as usual
    assert peers.client(coord).submit("SLEEP", {"durationMillis": 1})["type"] == "JOB_SUBMITTED"
    peers.worker(coord, "w-after")
    for conn in idle + partial + unregistered:
        conn.close()


def test_workers_can_register_when_clients_hold_every_client_descriptor(tmp_path, peers):
    from tests.support.processes import CoordinatorProc
    coord = CoordinatorProc(tmp_path, name="few-fds")
    coord.open_files_limit = 1024  # clients get at most 1024 - 256 - 512 = 256 descriptors
    coord.start()
    try:
        held = [RawConn(coord.client_addr, timeout=5) for _ in range(400)]  # the rest wait in the backlog
        worker = peers.worker(coord, "w-reserved")  # registers through the reserve
        assert worker.conn.sock.fileno() > 0
        for conn in held:
            conn.close()
    finally:
        coord.cleanup()


def test_a_storage_stall_declares_no_worker_dead(coordinator_factory, peers):
    # Given two workers holding attempts and a heartbeat timeout of 2 s
    import sqlite3
    coord = coordinator_factory(heartbeat_timeout_millis=2000)
    client = peers.client(coord)
    workers = [peers.worker(coord, "w-%d" % i, capacity=2, heartbeat_millis=100) for i in range(2)]
    jobs = [client.submit_ok("SLEEP", {"durationMillis": 1}) for _ in range(4)]
    for w in workers:
        w.await_assign(), w.await_assign()
    # When the database stalls for 3 s (another connection holds its write lock; the next
    # commit waits, under SQLite's 5 s busy timeout) while a write is pending, and a
    # canary worker registers as it begins and never sends a heartbeat
    blocker = sqlite3.connect(str(coord.db), isolation_level=None, timeout=0)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        client.conn.send({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 1}})
        canary = RawConn(coord.worker_addr, timeout=10)
        canary.send({"type": "WORKER_REGISTER", "workerId": "w-canary", "capacity": 1})
        time.sleep(3.0)  # the stall under test, longer than the heartbeat timeout
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert client.conn.recv()["type"] == "JOB_SUBMITTED"
    # The sweep that finds the canary silent has judged the other workers too
    wait_until(lambda: "presumed dead worker=w-canary" in coord.stderr(), timeout=15,
               message="a sweep after the stall")
    canary.close()
    # Then no worker that kept sending heartbeats was presumed dead: they counted when they arrived
    assert "presumed dead worker=w-0" not in coord.stderr()
    assert "presumed dead worker=w-1" not in coord.stderr()
    for job_id in jobs:
        snap = client.status(job_id)
        assert (snap["state"], snap["attempts"]) == ("RUNNING", 1), snap


def test_strangers_that_never_authenticate_cannot_take_the_slots_of_workers_and_clients(tmp_path):
    # Given a coordinator with tokens whose descriptor limit leaves 64 worker and 32 client slots
    from jobmesh import auth
    from tests.support.processes import CoordinatorProc
    path = str(tmp_path / "auth.toml")
    tokens = {role: auth.new_token(path, role, role) for role in ("worker", "client")}
    coord = CoordinatorProc(tmp_path, name="strangers", auth_file=path, auth_timeout_millis=4000, periodic_port=0)
    coord.open_files_limit = 300
    coord.start()
    silent = []
    try:
        # When strangers on one address open more silent connections than either port has slots
        for addr in [coord.worker_addr] * 80 + [coord.client_addr] * 40:
            silent.append(RawConn(addr, timeout=30))
        # a worker still registers
        worker = RawConn(coord.worker_addr, timeout=30)
        silent.append(worker)
        assert worker.request({"type": "AUTH", "token": tokens["worker"]})["type"] == "AUTH_OK"
        reply = worker.request({"type": "WORKER_REGISTER", "workerId": "w-past-strangers", "capacity": 1})
        assert reply["type"] == "WORKER_REGISTERED", reply
        # and a client still submits
        client = RawConn(coord.client_addr, timeout=30)
        silent.append(client)
        assert client.request({"type": "AUTH", "token": tokens["client"]})["type"] == "AUTH_OK"
        reply = client.request({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 1}})
        assert reply["type"] == "JOB_SUBMITTED", reply
        # and every silent connection is closed: the oldest ones to make room for newer ones
        # of their address, the others once --auth-timeout-millis passed
        periodic = RawConn(coord.periodic_addr, timeout=30)
        silent.append(periodic)
        for conn in silent[:-3]:
            assert conn.recv() is None
        assert "not authenticated within 4.0 s" in coord.stderr()
        # on the Periodic port too
        assert periodic.recv() is None
        wait_until(lambda: "periodic connection peer=127.0.0.1:%d: not authenticated within 4.0 s"
                   % periodic.sock.getsockname()[1] in coord.stderr(), message="the auth timeout logged")
        # while the authenticated ones stay open
        assert client.request({"type": "GET_STATS"})["type"] == "STATS"
    finally:
        for conn in silent:
            conn.close()
        coord.cleanup()


def test_readers_of_a_10000_job_workflow_and_a_wait_flood_cost_others_little(coordinator, peers):
    # Given a workflow of 10,000 jobs (a fan-out waiting on its root: no worker runs SLEEP here)
    client = peers.client(coordinator)
    sleep = {"taskType": "SLEEP", "payload": {"durationMillis": 1}}
    submitted = client.request({"type": "SUBMIT_WORKFLOW", "jobs": [dict(sleep, ref="root")] + [
        dict(sleep, ref="leaf-%05d" % i, dependsOn=["root"]) for i in range(9_999)]})
    assert submitted["type"] == "WORKFLOW_SUBMITTED", submitted
    workflow_id = submitted["workflowId"]
    status = encode_frame({"type": "WORKFLOW_STATUS", "workflowId": workflow_id})
    # When four clients ask for its status for three seconds, two at a time (a page is near 1 MiB),
    # and another pipelines 500 WAIT_WORKFLOWs
    readers = [RawConn(coordinator.client_addr, timeout=30) for _ in range(4)]
    waiter = RawConn(coordinator.client_addr, timeout=30)
    waits = 500
    waiter.send_raw(encode_frame({"type": "WAIT_WORKFLOW", "workflowId": workflow_id,
                                  "timeoutMillis": 3_600_000}) * waits)
    pages: list[int] = []

    def served(reply) -> bool:
        if reply is None or reply.get("type") != "WORKFLOW":
            return False
        pages.append(len(reply["jobs"]))
        return True

    probe = hammered(Probe(coordinator, submitted["jobIds"]["root"]), readers, status, 2, served)
    # Then the others were served throughout, each reader got whole pages
    probe.check()
    assert pages and all(0 < n < 10_000 for n in pages), pages[:5]
    # and once the workflow ends, the waits are answered with the ended workflow, until the
    # waiter, which does not read, holds more unsent replies than a connection may: it alone is closed
    assert client.request({"type": "WORKFLOW_CANCEL", "workflowId": workflow_id})["state"] == "CANCELLED"
    answered, closed = read_until_closed(waiter, timeout=30)
    assert closed and len(answered) < waits, len(answered)
    assert answered and {(r["type"], r["state"]) for r in answered} == {("WORKFLOW", "CANCELLED")}, answered[-1:]
    assert client.status(submitted["jobIds"]["root"])["state"] == "CANCELLED"
    for c in readers + [waiter]:
        c.close()
