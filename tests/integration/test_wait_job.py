"""WAIT_JOB against a real coordinator: answered at the job's end or at its timeout, replies
in request order on one connection, other connections not held up; ``jobmesh wait``.

Spec: CONTRACT.md "Waiting without polling"; docs/PROTOCOL.md "WAIT_JOB".
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time

import pytest

from jobmesh.client import CoordinatorClient
from jobmesh.client.api import WaitTimeout
from tests.support.cli import run_cli
from tests.support.processes import child_env
from tests.support.waiting import assert_prompt, baseline, timed, wait_until

SLEEP = {"durationMillis": 10}
_serial = itertools.count(1)


@pytest.fixture
def coordinator(shared_coordinator):
    """The coordinator the module's tests share: no worker here declares the built-ins, so a
    SLEEP job stays queued; a test with a worker gives it a task type of its own
    (``own_worker``)."""
    return shared_coordinator


def own_worker(peers, coordinator):
    """A scripted worker that alone declares a task type no other test uses: ``(worker, type)``."""
    task_type = "WAIT-%d" % next(_serial)
    return peers.worker(coordinator, "w-" + task_type, task_types=[task_type]), task_type


def wait_job(job_id: str, timeout: int) -> dict:
    return {"type": "WAIT_JOB", "jobId": job_id, "timeoutMillis": timeout}


def status(job_id: str) -> dict:
    return {"type": "GET_JOB_STATUS", "jobId": job_id}


def test_wait_is_answered_when_the_job_completes(coordinator, peers):
    client = peers.client(coordinator)
    worker, task_type = own_worker(peers, coordinator)
    job_id = client.submit_ok(task_type, SLEEP)
    assign = worker.await_assign()
    raw = peers.raw(coordinator.client_addr)
    raw.send(wait_job(job_id, 60_000))
    raw.sock.settimeout(0.3)
    with pytest.raises(OSError):  # nothing yet: the job is running
        raw.recv()
    raw.sock.settimeout(10)
    worker.complete(assign, {"sleptMillis": 10})
    reply = raw.recv()
    assert reply["type"] == "JOB_STATUS" and reply["job"]["state"] == "COMPLETED"
    assert reply["job"]["result"] == {"sleptMillis": 10}


def test_a_request_after_a_wait_is_answered_after_it(coordinator, peers):
    # Given a queued job (no worker) and, pipelined on one connection, a WAIT_JOB for it
    # followed by a GET_JOB_STATUS and a SUBMIT_JOB
    client = peers.client(coordinator)
    before = {j["jobId"] for j in client.list_jobs(limit=1000)["jobs"]}
    job_id = client.submit_ok("SLEEP", SLEEP)
    raw = peers.raw(coordinator.client_addr)
    raw.send(wait_job(job_id, 60_000))
    raw.send(status(job_id))
    raw.send({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": SLEEP})
    # The requests after the wait are applied (the submit creates its job) ...
    wait_until(lambda: len({j["jobId"] for j in client.list_jobs(limit=1000)["jobs"]} - before) == 2,
               message="the pipelined submit applied")
    # ... but their replies wait for the wait's reply, which comes when the job ends.
    raw.sock.settimeout(0.3)
    with pytest.raises(OSError):
        raw.recv()
    raw.sock.settimeout(10)
    assert client.cancel(job_id)["cancelled"] is True
    first, second, third = raw.recv(), raw.recv(), raw.recv()
    assert first["type"] == "JOB_STATUS" and first["job"]["state"] == "CANCELLED"
    # The status was applied when it arrived, before the cancel; only its reply waited.
    assert second["type"] == "JOB_STATUS" and second["job"]["state"] == "QUEUED"
    assert third["type"] == "JOB_SUBMITTED"


def test_other_connections_are_not_held_up(coordinator, peers):
    client = peers.client(coordinator)
    job_id = client.submit_ok("SLEEP", SLEEP)
    other = peers.client(coordinator)
    base_status = baseline(lambda: other.status(job_id))
    base_submit = baseline(lambda: other.submit_ok("SLEEP", SLEEP))
    raw = peers.raw(coordinator.client_addr)
    raw.send(wait_job(job_id, 60_000))
    # While a minute-long wait is pending, another connection is answered as promptly as before
    for _ in range(20):
        snapshot, elapsed = timed(lambda: other.status(job_id))
        assert snapshot["state"] == "QUEUED"
        assert_prompt(elapsed, base_status, "a status beside a pending wait")
    _, elapsed = timed(lambda: other.submit_ok("SLEEP", SLEEP))
    assert_prompt(elapsed, base_submit, "a submit beside a pending wait")
    client.cancel(job_id)
    assert raw.recv()["job"]["state"] == "CANCELLED"


def test_a_timeout_is_answered_on_time_with_the_snapshot(coordinator_factory, peers):
    # A slow sweep: the wait's own timer must answer it, not the sweep.
    coordinator = coordinator_factory(sweep_interval_millis=5000)
    client = peers.client(coordinator)
    job_id = client.submit_ok("SLEEP", SLEEP)
    raw = peers.raw(coordinator.client_addr)
    base = baseline(lambda: raw.request(status(job_id)))
    started = time.monotonic()
    reply = raw.request(wait_job(job_id, 200))
    took = time.monotonic() - started
    assert reply["type"] == "JOB_STATUS" and reply["job"]["state"] == "QUEUED"
    assert reply["job"]["waitingReason"] == "NO_WORKER"
    # not before its time, and long before the next sweep (5 s)
    assert took >= 0.19, took
    assert_prompt(took - 0.2, base, "the answer after the wait's 200 ms")
    # Several waits with different timeouts on several connections each come on time.
    conns = [peers.raw(coordinator.client_addr) for _ in range(3)]
    started = time.monotonic()
    for i, conn in enumerate(conns):
        conn.send(wait_job(job_id, 100 * (3 - i)))
    took = [None] * 3

    def read(i):
        conns[i].recv()
        took[i] = time.monotonic() - started

    threads = [threading.Thread(target=read, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for i, seconds in enumerate(took):
        assert seconds is not None and seconds >= 0.1 * (3 - i) - 0.01, took
        assert_prompt(seconds - 0.1 * (3 - i), base, "the answer after a wait of %d ms" % (100 * (3 - i)))


def test_timeout_zero_unknown_job_and_bad_timeouts(coordinator, peers):
    client = peers.client(coordinator)
    job_id = client.submit_ok("SLEEP", SLEEP)
    raw = peers.raw(coordinator.client_addr)
    reply = raw.request(wait_job(job_id, 0))
    assert reply["type"] == "JOB_STATUS" and reply["job"]["state"] == "QUEUED"
    reply = raw.request(wait_job("no-such-job", 1000))
    assert reply["type"] == "ERROR" and "unknown job" in reply["message"]
    for bad in (-1, 3_600_001):
        reply = raw.request(wait_job(job_id, bad))
        assert reply["type"] == "ERROR" and "timeoutMillis" in reply["message"]
    assert raw.request(status(job_id))["type"] == "JOB_STATUS"  # still open


def test_a_finished_job_is_answered_at_once(coordinator, peers):
    client = peers.client(coordinator)
    job_id = client.submit_ok("SLEEP", SLEEP)
    client.cancel(job_id)
    raw = peers.raw(coordinator.client_addr)
    base = baseline(lambda: raw.request(status(job_id)))
    reply, took = timed(lambda: raw.request(wait_job(job_id, 60_000)))
    assert reply["job"]["state"] == "CANCELLED"
    assert_prompt(took, base, "a wait for a finished job")


def test_a_client_that_leaves_while_waiting_costs_nothing(coordinator_factory, peers):
    coordinator = coordinator_factory()  # of its own: GET_STATS counts the whole coordinator's waits
    client = peers.client(coordinator)
    job_id = client.submit_ok("SLEEP", SLEEP)

    def waits() -> int:
        return client.request({"type": "GET_STATS"})["waits"]

    for _ in range(5):
        raw = peers.raw(coordinator.client_addr)
        raw.send(wait_job(job_id, 60_000))
        raw.send(status(job_id))
        wait_until(lambda: waits() == 1, message="the wait held")
        raw.close()
        wait_until(lambda: waits() == 0, message="the closed client's wait dropped")
    # The coordinator goes on serving, and answers a later wait when the job ends.
    raw = peers.raw(coordinator.client_addr)
    raw.send(wait_job(job_id, 60_000))
    client.cancel(job_id)
    assert raw.recv()["job"]["state"] == "CANCELLED"


def test_the_library_wait_returns_when_the_job_ends(coordinator, peers):
    worker, task_type = own_worker(peers, coordinator)
    with CoordinatorClient(*coordinator.client_addr, timeout=1.0) as client:
        job_id = client.submit(task_type, SLEEP)
        assign = worker.await_assign()
        threading.Timer(1.5, worker.complete, args=(assign, {"sleptMillis": 10})).start()
        started = time.monotonic()
        job = client.wait(job_id, timeout=10)  # longer than the client's 1 s reply timeout
        assert job["state"] == "COMPLETED" and time.monotonic() - started > 1.4
        with pytest.raises(WaitTimeout) as info:
            client.wait(client.submit(task_type, SLEEP), timeout=0.2)
        assert info.value.job["state"] in ("QUEUED", "RUNNING")


def test_jobmesh_wait_exit_codes(coordinator, peers):
    worker, task_type = own_worker(peers, coordinator)
    client = peers.client(coordinator)
    job_id = client.submit_ok(task_type, SLEEP)
    assign = worker.await_assign()
    # Times out: exit 4 with the snapshot as it stood.
    result = run_cli("wait", job_id, "--timeout-millis=300", "--json", coordinator=coordinator.client_target)
    assert result.returncode == 4, result.stderr
    assert json.loads(result.stdout)["state"] == "RUNNING"
    # Completes while the command waits: exit 0.
    threading.Timer(0.5, worker.complete, args=(assign, {"sleptMillis": 10})).start()
    result = run_cli("wait", job_id, "--json", coordinator=coordinator.client_target)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["state"] == "COMPLETED"


@pytest.mark.parametrize("pending", [63, 64])  # 64: the handler has stopped reading
def test_a_client_that_closes_with_pending_waits_is_cleaned_up_at_once(coordinator_factory, peers, pending):
    coordinator = coordinator_factory()
    client = peers.client(coordinator)
    job_id = client.submit_ok("SLEEP", SLEEP)  # no worker: it never ends on its own

    def waits() -> int:
        return client.request({"type": "GET_STATS"})["waits"]

    fds = coordinator.open_fds()
    raws = []
    for _ in range(3):
        raw = peers.raw(coordinator.client_addr)
        for _ in range(pending):
            raw.send(wait_job(job_id, 3_600_000))
        raws.append(raw)
    wait_until(lambda: waits() == 3 * pending, message="every wait held")
    for raw in raws:
        raw.close()
    # The waits (their answers have nowhere to go) and the connections go at once, not
    # when the waits time out (an hour) or a drain gives up (30 s).
    wait_until(lambda: waits() == 0, timeout=10, message="the waits of the closed clients dropped")
    wait_until(lambda: coordinator.open_fds() <= fds, timeout=10, message="their descriptors closed")
    # and a later client is served as usual
    raw = peers.raw(coordinator.client_addr)
    raw.send(wait_job(job_id, 60_000))
    client.cancel(job_id)
    assert raw.recv()["job"]["state"] == "CANCELLED"


def test_waits_ride_through_a_restart_of_their_coordinator(coordinator_factory, peers):
    # Given two queued jobs (no worker yet), one submitted by `submit --wait` with its key
    coordinator = coordinator_factory()
    client = peers.client(coordinator)
    job_id = client.submit_ok("SLEEP", SLEEP)
    argv = [sys.executable, "-m", "jobmesh", "--json", "--coordinator=%s" % coordinator.client_target]
    env = child_env()
    env.pop("GEVENT_MONITOR_THREAD_ENABLE", None)
    cli = [subprocess.Popen(argv[:3] + command + argv[3:], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, env=env)
           for command in (["wait", job_id], ["submit", "SLEEP", json.dumps(SLEEP), "--wait",
                                              "--idempotency-key=ride-1"])]
    # ... and waits pending on it: the CLI's two and the library's
    ended: list = []

    def library_wait() -> None:
        try:
            with CoordinatorClient(*coordinator.client_addr, timeout=10) as waiter:
                ended.append(waiter.wait(job_id, timeout=60))
        except Exception as exc:  # what escaped, for the assertion below
            ended.append(exc)

    thread = threading.Thread(target=library_wait)
    thread.start()
    try:
        wait_until(lambda: client.request({"type": "GET_STATS"})["waits"] == 3, timeout=30, message="three waits held")
        # When the coordinator is killed and comes back on the same ports and database
        ports = {"worker_port": coordinator.worker_addr[1], "client_port": coordinator.client_addr[1]}
        coordinator.kill()
        coordinator.start(**ports)
        # ... and a worker runs the two jobs
        worker = peers.worker(coordinator, capacity=2)
        for _ in range(2):
            worker.complete(worker.await_assign(timeout=30), {"sleptMillis": 10})
        # Then every wait returns the job's end: the waits were sent again once it was back
        thread.join(60)
        assert len(ended) == 1 and isinstance(ended[0], dict) and ended[0]["state"] == "COMPLETED", ended
        for proc in cli:
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
            assert json.loads(out)["state"] == "COMPLETED" and err == ""
    finally:
        for proc in cli:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        thread.join(60)
