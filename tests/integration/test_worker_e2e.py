"""Real workers (``python -m jobmesh worker`` subprocesses) against a real coordinator.

Results are checked against values computed here independently (hashlib, a regex word
split, known prime counts). Workers heartbeat every 100 ms and log at DEBUG to a file,
which some tests read to see what the worker itself did.
"""

from __future__ import annotations

import hashlib
import re
import time
from datetime import datetime

import pytest

from jobmesh.client import CoordinatorClient
from tests.support.peers import wait_no_worker, wait_registered
from tests.support.waiting import wait_until


@pytest.fixture
def coordinator(shared_coordinator):
    """The coordinator the module's tests share: each test's workers are the only live ones
    while it runs, and no test leaves a job for the next one's workers. A test that needs
    other flags or a restart has one of its own."""
    with CoordinatorClient(*shared_coordinator.client_addr) as client:
        wait_no_worker(client)
    return shared_coordinator


@pytest.fixture
def client(coordinator):
    with CoordinatorClient(*coordinator.client_addr, timeout=10) as c:
        yield c


def wait_state(client, job_id, states, timeout=10.0):
    return wait_until(lambda: (lambda j: j if j["state"] in states else None)(client.status(job_id)),
                      timeout=timeout, message="job %s in %s" % (job_id, states))


def test_every_task_type_end_to_end(coordinator, client, worker_procs):
    # Given one real worker with room for everything at once
    worker_procs.start(coordinator, "w-all", capacity=8)
    wait_registered(client, ["w-all"])
    text = "The  quick\tbrown\nfox — jumps\u2003over ✓ the lazy dog  "

    # When one job of every kind is submitted
    jobs = {
        "sleep": client.submit("SLEEP", {"durationMillis": 50}),
        "words": client.submit("WORD_COUNT", {"text": text}),
        "sha": client.submit("SHA256", {"text": text}),
        "primes": client.submit("PRIME_COUNT", {"limit": 1_000_000}),
        "primes_small": client.submit("PRIME_COUNT", {"limit": 2}),
        "fail_then_ok": client.submit("FAIL", {"failUntilAttempt": 2}, max_attempts=3),
        "fail_never": client.submit("FAIL", {"failUntilAttempt": 0}),
        "fail_out": client.submit("FAIL", {"failUntilAttempt": 5}, max_attempts=2),
    }
    done = {name: client.wait(job_id, timeout=15) for name, job_id in jobs.items()}

    # Then each result is exactly the independently computed one
    def ok(name, result, attempts=1):
        job = done[name]
        assert (job["state"], job["result"], job["attempts"]) == ("COMPLETED", result, attempts), job

    ok("sleep", {"sleptMillis": 50})
    ok("words", {"words": len(re.findall(r"\S+", text))})
    ok("sha", {"sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()})
    ok("primes", {"primes": 78498})
    ok("primes_small", {"primes": 1})
    ok("fail_then_ok", {"attempt": 2}, attempts=2)
    assert done["fail_then_ok"]["error"] == "attempt 1 failed on purpose (failUntilAttempt=2)"
    ok("fail_never", {"attempt": 1})
    failed = done["fail_out"]
    assert failed["state"] == "FAILED" and failed["attempts"] == 2, failed
    assert failed["error"] == "attempt 2 failed on purpose (failUntilAttempt=5)"


def test_heartbeats_flow_while_cpu_tasks_fill_every_slot(coordinator_factory, tmp_path, worker_procs):
    # Given a coordinator that declares a worker dead after 1.5 s of silence
    coord = coordinator_factory(heartbeat_timeout_millis=1500)
    with CoordinatorClient(*coord.client_addr) as client:
        worker = worker_procs.start(coord, "w-cpu", capacity=4)
        wait_registered(client, ["w-cpu"])

        # When twice its capacity of the largest PRIME_COUNT run back to back (every slot
        # busy, then busy again as each first job ends)
        job_ids = [client.submit("PRIME_COUNT", {"limit": 50_000_000}) for _ in range(8)]

        # Then the worker stays listed the whole time, and every job completes on attempt 1
        seen_running = False
        deadline = time.monotonic() + 30
        while True:
            assert "w-cpu" in {w["workerId"] for w in client.workers()}, "worker declared dead"
            states = [client.status(j)["state"] for j in job_ids]
            seen_running |= "RUNNING" in states
            if all(s == "COMPLETED" for s in states):
                break
            assert time.monotonic() < deadline, states
            time.sleep(0.05)
        assert seen_running
        for job_id in job_ids:
            job = client.status(job_id)
            assert (job["result"], job["attempts"]) == ({"primes": 3001134}, 1), job
        assert worker.count("registered worker=w-cpu") == 1
        assert worker.count("connection lost") == 0
        # and, seen from the worker, heartbeats went out all along: no two of them (every
        # 100 ms) as far apart as the heartbeat timeout
        beats = [datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
                 for line in worker.log().splitlines() if "heartbeat worker=w-cpu" in line]
        gaps = [(b - a).total_seconds() for a, b in zip(beats, beats[1:])]
        assert gaps and max(gaps) < 1.5, max(gaps, default=None)


def _cancel_while_running(client, task_type, payload, attempts=5):
    """Submit and cancel once RUNNING; returns the job id.

    A PRIME_COUNT may finish before the cancel lands; try again a few times.
    """
    for _ in range(attempts):
        job_id = client.submit(task_type, payload)
        wait_state(client, job_id, ("RUNNING", "COMPLETED"))
        cancelled, job = client.cancel(job_id)
        if cancelled:
            assert job["state"] == "CANCELLED", job
            return job_id
    pytest.fail("%s always finished before the cancel landed" % task_type)


@pytest.mark.parametrize("task_type,payload", [
    ("SLEEP", {"durationMillis": 600_000}),
    ("PRIME_COUNT", {"limit": 50_000_000}),
])
def test_cancel_stops_the_running_task_and_frees_its_slot(coordinator, client, worker_procs, task_type, payload):
    # Given a worker with a single slot
    worker = worker_procs.start(coordinator, "w-one", capacity=1)
    wait_registered(client, ["w-one"])

    # When its running task is cancelled
    job_id = _cancel_while_running(client, task_type, payload)

    # Then the worker stops it within a second, reporting nothing for it
    wait_until(lambda: worker.count("task cancelled job=%s" % job_id), timeout=1.0,
               message="worker stopped the task")
    # ... and the freed slot runs the next job at once
    follow = client.submit("SHA256", {"text": "next"})
    job = client.wait(follow, timeout=5)
    assert job["state"] == "COMPLETED" and job["workerId"] is None
    assert worker.count("task finished job=%s" % job_id) == 0
    assert client.status(job_id)["state"] == "CANCELLED"


def test_worker_reconnects_after_coordinator_restart(coordinator_factory, worker_procs):
    coordinator = coordinator_factory()  # of its own: it is stopped and started again
    # Given a worker attached to a coordinator that has run a job
    worker = worker_procs.start(coordinator, "w-back", capacity=2)
    worker_port, client_port = coordinator.worker_addr[1], coordinator.client_addr[1]
    with CoordinatorClient(*coordinator.client_addr) as client:
        wait_registered(client, ["w-back"])
        first = client.submit("SHA256", {"text": "before"})
        assert client.wait(first, timeout=10)["state"] == "COMPLETED"

    # When the coordinator stops and a new one starts on the same ports and database
    assert coordinator.terminate() == 0
    wait_until(lambda: worker.count("connection lost"), timeout=5, message="worker noticed the loss")
    coordinator.start(worker_port=worker_port, client_port=client_port)

    # Then the worker registers again under the same id and runs new work
    with CoordinatorClient(*coordinator.client_addr) as client:
        wait_registered(client, ["w-back"], timeout=15)
        assert client.status(first)["state"] == "COMPLETED"
        second = client.submit("SHA256", {"text": "after"})
        job = client.wait(second, timeout=10)
        assert job["result"] == {"sha256": hashlib.sha256(b"after").hexdigest()}
    assert worker.count("registered worker=w-back") == 2
    assert worker.proc.poll() is None


def test_worker_stops_cleanly_on_sigterm_and_its_job_is_retried(coordinator, client, worker_procs):
    # Given a worker running a long task
    worker = worker_procs.start(coordinator, "w-term", capacity=1)
    wait_registered(client, ["w-term"])
    job_id = client.submit("SLEEP", {"durationMillis": 600_000}, max_attempts=3)
    wait_state(client, job_id, ("RUNNING",))

    # When it is told to stop
    assert worker.terminate(timeout=5) == 0

    # Then it exits 0 without waiting for its 10-minute task, and the coordinator takes the job back
    job = wait_state(client, job_id, ("QUEUED", "RETRY_WAIT"))
    assert job["attempts"] == 1
    assert "worker stopped worker=w-term" in worker.log()
    assert client.cancel(job_id)[0] is True  # (not left for the next test's workers)


def test_duplicate_worker_id_is_refused_then_takes_over(coordinator, client, worker_procs):
    # Given a live worker w-dup
    first = worker_procs.start(coordinator, "w-dup", capacity=1)
    wait_registered(client, ["w-dup"])

    # When a second process registers under the same id, it is refused and keeps retrying
    second = worker_procs.start(coordinator, "w-dup", capacity=1)
    wait_until(lambda: second.count("registration refused worker=w-dup") >= 2, timeout=5,
               message="second worker refused twice")
    assert [w["workerId"] for w in client.workers()] == ["w-dup"]
    assert second.proc.poll() is None

    # Then once the first one leaves, the second registers and runs work
    assert first.terminate() == 0
    wait_until(lambda: second.count("registered worker=w-dup"), timeout=10, message="second registered")
    job = client.wait(client.submit("WORD_COUNT", {"text": "still works"}), timeout=10)
    assert job["result"] == {"words": 2}


def test_deadline_expiry_cancels_the_task_on_the_real_worker(coordinator_factory, worker_procs):
    # Given a coordinator whose attempts may run 300 ms
    coord = coordinator_factory(task_timeout_millis=300)
    with CoordinatorClient(*coord.client_addr) as client:
        worker = worker_procs.start(coord, "w-slow", capacity=1)
        wait_registered(client, ["w-slow"])

        # When a task overruns on its last attempt
        job_id = client.submit("SLEEP", {"durationMillis": 600_000}, max_attempts=1)
        job = client.wait(job_id, timeout=10)

        # Then the job fails with the deadline error and the worker stopped the task
        assert job["state"] == "FAILED" and "deadline" in job["error"], job
        wait_until(lambda: worker.count("task cancelled job=%s" % job_id), timeout=2, message="task stopped")
        assert client.wait(client.submit("SLEEP", {"durationMillis": 1}), timeout=5)["state"] == "COMPLETED"
