"""Users' own task types end to end: a real coordinator, a real ``jobmesh worker --tasks=...``.

The tasks module is ``tests/user_tasks_module.py``, copied to ``tmp_path`` as
``jm_user_tasks`` (the worker runs there, so it finds it in its working directory).
These need the coordinator side of CONTRACT.md "Your own task types": accepting submits
of declared types and assigning them only to workers that declared them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from jobmesh.client import CoordinatorClient
from jobmesh.protocol.payloads import TASK_TYPES
from tests.helpers import wait_registered, wait_until

MODULE_SOURCE = Path(__file__).resolve().parent.parent / "user_tasks_module.py"


@pytest.fixture
def client(coordinator):
    with CoordinatorClient(*coordinator.client_addr, timeout=10) as c:
        yield c


@pytest.fixture
def user_worker(coordinator, client, worker_procs, tmp_path):
    """A registered real worker (capacity 1) running ``jm_user_tasks``."""
    shutil.copy(MODULE_SOURCE, tmp_path / "jm_user_tasks.py")
    worker = worker_procs.start(coordinator, "w-user", capacity=1, tasks="jm_user_tasks", cwd=tmp_path)
    wait_registered(client, ["w-user"])
    return worker


def test_a_declared_custom_type_completes_with_the_functions_result(client, user_worker):
    # Given a worker that declared GREET (WORKER_LIST shows it beside the built-ins)
    listed = next(w for w in client.workers() if w["workerId"] == "w-user")
    assert set(TASK_TYPES) | {"GREET", "COOP", "FLAKY"} <= set(listed["taskTypes"]), listed
    # When a GREET job is submitted
    job = client.wait(client.submit("GREET", {"name": "ada"}), timeout=15)
    # Then it completes with exactly what the function returned
    assert (job["state"], job["result"], job["attempts"]) == ("COMPLETED", {"greeting": "hello ada"}, 1), job


def test_a_raising_custom_task_fails_after_its_retries_with_the_error(client, user_worker):
    job = client.wait(client.submit("BOOM", {}, max_attempts=2), timeout=15)
    assert (job["state"], job["attempts"], job["error"]) == ("FAILED", 2, "ValueError: bad name"), job


def test_ctx_attempt_counts_the_retries(client, user_worker):
    job = client.wait(client.submit("FLAKY", {"okFromAttempt": 2}, max_attempts=3), timeout=15)
    assert (job["state"], job["attempts"], job["result"]) == ("COMPLETED", 2, {"attempt": 2}), job


def test_cancelling_a_running_custom_task(client, user_worker, tmp_path):
    # Given a cooperative task running on the only slot
    job_id = client.submit("COOP", {"dir": str(tmp_path)})
    wait_until((tmp_path / "started").exists, timeout=15, message="COOP started")
    # When the job is cancelled
    cancelled, job = client.cancel(job_id)
    assert cancelled and job["state"] == "CANCELLED", job
    # Then the function sees ctx.cancelled and ends; its result is dropped
    wait_until((tmp_path / "finished").exists, timeout=5, message="COOP saw the cancel")
    assert json.loads((tmp_path / "finished").read_text())["cancelled"] is True
    wait_until(lambda: user_worker.count("its result was dropped job=%s" % job_id), timeout=10,
               message="the worker dropped the late result")
    assert client.status(job_id)["state"] == "CANCELLED"
    # And the slot is free for the next job
    follow = client.wait(client.submit("GREET", {"name": "next"}), timeout=15)
    assert follow["state"] == "COMPLETED", follow


def test_a_cpu_bound_task_never_gets_its_worker_declared_dead(coordinator_factory, worker_procs, tmp_path):
    # Given a coordinator that presumes a worker dead after 1 s without a heartbeat
    coord = coordinator_factory(heartbeat_timeout_millis=1000)
    shutil.copy(MODULE_SOURCE, tmp_path / "jm_user_tasks.py")
    worker = worker_procs.start(coord, "w-cpu", capacity=2, heartbeat_millis=200, tasks="jm_user_tasks",
                                cwd=tmp_path)
    with CoordinatorClient(*coord.client_addr, timeout=10) as client:
        wait_registered(client, ["w-cpu"])
        # When two pure-Python CPU loops of 3 s each run at once (both cores busy)
        jobs = [client.submit("CPU", {"seconds": 3}, max_attempts=1) for _ in range(2)]
        done = [client.wait(j, timeout=30) for j in jobs]
    # Then both complete on their first attempt: the worker was never presumed dead
    assert [(j["state"], j["attempts"]) for j in done] == [("COMPLETED", 1)] * 2, done
    assert all(j["result"]["rounds"] > 0 for j in done)
    assert "presumed dead" not in coord.stderr()
    assert worker.count("registered worker=w-cpu") == 1  # one session all along


def test_every_result_over_64_kib_fails_in_the_same_words(client, user_worker, coordinator, peers):
    limit = "a result may be at most 65536 bytes (64 KiB)"
    # Given results just over the limit and far over a frame, from a task process
    for size in (65536, 2 * 1024 * 1024):
        job = client.wait(client.submit("BIG", {"bytes": size}, max_attempts=1), timeout=30)
        assert job["state"] == "FAILED", job
        assert job["error"] == "result is %d bytes as JSON; %s" % (size + 8, limit)
    # and one over it from a worker that does not check, refused by the coordinator
    worker = peers.worker(coordinator, "w-unchecked", capacity=1, task_types=["BIG"])
    assert user_worker.terminate() == 0
    job_id = client.submit("BIG", {"bytes": 1}, max_attempts=1)
    assign = worker.await_assign(timeout=20)
    worker.complete(assign, {"x": "y" * 70_000})
    job = client.wait(job_id, timeout=15)
    assert (job["state"], job["error"]) == ("FAILED", "result is 70008 bytes as JSON; " + limit)


def test_a_non_dict_result_and_a_dying_task_process_fail_the_attempt(client, user_worker):
    listy = client.wait(client.submit("LISTY", {}, max_attempts=1), timeout=15)
    assert listy["state"] == "FAILED" and "not a dict" in listy["error"], listy
    died = client.wait(client.submit("EXIT3", {}, max_attempts=1), timeout=15)
    assert died["state"] == "FAILED" and "exited with code 3" in died["error"], died
    # The worker survives both and runs the next job in a fresh task process
    after = client.wait(client.submit("GREET", {"name": "still here"}), timeout=15)
    assert after["result"] == {"greeting": "hello still here"}, after
