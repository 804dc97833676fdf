"""Users' own task types end to end: a real coordinator, a real ``jobmesh worker --tasks=...``.

The tasks module is ``tests/user_tasks_module.py``, copied to ``tmp_path`` as
``jm_user_tasks`` (the worker runs there, so it finds it in its working directory).
These need the coordinator side of CONTRACT.md "Your own task types": accepting submits
of declared types and assigning them only to workers that declared them.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from jobmesh.client import CoordinatorClient
from jobmesh.protocol.payloads import TASK_TYPES
from tests.support.peers import wait_no_worker, wait_registered
from tests.support.processes import LISTENING, alive
from tests.support.waiting import wait_until
from tests.integration.test_cli_visibility import json_lines

MODULE_SOURCE = Path(__file__).resolve().parent.parent / "user_tasks_module.py"


WORKER_NUMBERS = itertools.count(1)


@pytest.fixture
def coordinator(shared_coordinator):
    """The module's tests share one coordinator: each test's workers are the only live ones
    while it runs (``start_user_worker`` waits for the previous test's to be gone), and each
    has an id of its own."""
    return shared_coordinator


@pytest.fixture
def client(coordinator):
    with CoordinatorClient(*coordinator.client_addr, timeout=10) as c:
        yield c


def start_user_worker(coordinator, client, worker_procs, tmp_path, worker_id="w-user", extra=()):
    """A registered real worker (capacity 1) running ``jm_user_tasks``, with ``extra`` flags,
    once no other worker is live; its id is ``worker_id`` and a number of its own."""
    wait_no_worker(client)
    worker_id = "%s-%d" % (worker_id, next(WORKER_NUMBERS))
    shutil.copy(MODULE_SOURCE, tmp_path / "jm_user_tasks.py")
    worker = worker_procs.start(coordinator, worker_id, capacity=1, tasks="jm_user_tasks", cwd=tmp_path,
                                extra=extra)
    wait_registered(client, [worker_id])
    return worker


@pytest.fixture
def user_worker(coordinator, client, worker_procs, tmp_path):
    return start_user_worker(coordinator, client, worker_procs, tmp_path)


def test_a_declared_custom_type_completes_with_the_functions_result(client, user_worker):
    # Given a worker that declared GREET (WORKER_LIST shows it beside the built-ins)
    listed = next(w for w in client.workers() if w["workerId"] == user_worker.worker_id)
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


# ---- task processes and what they start -------------------------------------------------

def _pid_in(path: Path, key: str = "pid") -> int:
    wait_until(path.exists, timeout=15, message="%s written" % path.name)
    return json.loads(path.read_text())[key]


def _kill(pids: list[int]) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_segfault_is_noticed_though_a_forked_descendant_holds_the_task_process_socket(client, user_worker,
                                                                                          tmp_path):
    # Given a task that forks a grandchild (it sleeps 60 s holding every fd of the task
    # process, the socket to the worker among them) and then segfaults
    job_id = client.submit("ORPHAN", {"dir": str(tmp_path), "seconds": 60, "signal": "SIGSEGV"}, max_attempts=1)
    grandchild = _pid_in(tmp_path / "grandchild")
    try:
        # Then the attempt fails at the task process's exit, not when the socket closes
        job = client.wait(job_id, timeout=15)
        assert (job["state"], job["error"]) == ("FAILED", "task process exited with code -11 (killed by SIGSEGV)"), job
        # And the grandchild went with its task process
        wait_until(lambda: not alive(grandchild), timeout=10, message="the grandchild killed")
        follow = client.wait(client.submit("GREET", {"name": "next"}), timeout=15)
        assert follow["state"] == "COMPLETED", follow
    finally:
        _kill([grandchild])


def test_what_a_task_forks_ends_with_the_worker(client, user_worker, tmp_path):
    # Given a task that forked a grandchild and returned (its task process waits idle)
    job = client.wait(client.submit("ORPHAN", {"dir": str(tmp_path), "seconds": 60}), timeout=15)
    assert job["state"] == "COMPLETED", job
    grandchild, task_process = _pid_in(tmp_path / "grandchild"), _pid_in(tmp_path / "grandchild", "parent")
    try:
        assert alive(grandchild)
        # When the worker is stopped
        assert user_worker.terminate() == 0
        # Then neither the task process nor its grandchild outlives it
        wait_until(lambda: not alive(grandchild) and not alive(task_process), timeout=10,
                   message="the task process and its grandchild gone")
    finally:
        _kill([grandchild, task_process])


def test_a_cancelled_task_that_ignores_sigterm_is_killed_after_the_grace(coordinator, client, worker_procs,
                                                                          tmp_path):
    # Given a worker whose cancelled tasks get 0.3 s, and a task that ignores both
    # ctx.cancelled and SIGTERM
    worker = start_user_worker(coordinator, client, worker_procs, tmp_path, "w-deaf", ("--cancel-grace-millis=300",))
    job_id = client.submit("DEAF", {"dir": str(tmp_path), "seconds": 60})
    pid = _pid_in(tmp_path / "started")
    try:
        # When the job is cancelled
        assert client.cancel(job_id)[0] is True
        # Then its process gets SIGTERM, and SIGKILL when that does not end it
        wait_until(lambda: not alive(pid), timeout=15, message="the deaf task killed")
        log = wait_until(lambda: "cancelled task's process ended pid=%d" % pid in worker.log() and worker.log(),
                         timeout=10, message="the end logged")
        assert "SIGTERM to its process group pid=%d job=%s" % (pid, job_id) in log
        assert "SIGKILL to its process group pid=%d job=%s" % (pid, job_id) in log
        assert "(killed by SIGKILL)" in log
        assert not (tmp_path / "finished").exists()
        follow = client.wait(client.submit("GREET", {"name": "next"}), timeout=15)
        assert follow["state"] == "COMPLETED", follow
    finally:
        _kill([pid])


# ---- task output ----------------------------------------------------------------------

def test_with_log_format_json_a_tasks_traceback_and_prints_are_json_objects(coordinator, client, worker_procs,
                                                                             tmp_path):
    worker = start_user_worker(coordinator, client, worker_procs, tmp_path, "w-json", ("--log-format=json",))
    # When a task raises, and another prints (on stdout and stderr)
    assert client.wait(client.submit("BOOM", {}, max_attempts=1), timeout=15)["state"] == "FAILED"
    assert client.wait(client.submit("CHATTY", {"lines": 3}), timeout=15)["state"] == "COMPLETED"
    wait_until(lambda: "chatty on stderr" in worker.log(), timeout=10, message="the task's output")
    assert worker.terminate() == 0
    # Then every line the worker wrote is one JSON object: the traceback inside one of them
    lines = json_lines(worker.log())
    raised = [o for o in lines if o["message"].startswith("task BOOM raised")]
    assert len(raised) == 1 and raised[0]["level"] == "WARNING", raised
    assert raised[0]["exc"].startswith("Traceback") and raised[0]["exc"].endswith("ValueError: bad name"), raised
    printed = {o["message"] for o in lines if o["logger"] == "jobmesh.task.output"}
    assert {'chatty line 2 {"type": "TASK_RESULT", "success": true}', "chatty on stderr"} <= printed, printed
    assert (tmp_path / (worker.name + ".out")).read_text() == ""


def test_task_prints_stay_off_ups_stdout(start_up, tmp_path, monkeypatch):
    shutil.copy(MODULE_SOURCE, tmp_path / "jm_user_tasks.py")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    up = start_up("--workers=1", "--capacity=1", "--tasks=jm_user_tasks")
    with CoordinatorClient(*up.client_addr, timeout=10) as c:
        wait_registered(c, ["local-1"], timeout=20)
        assert c.wait(c.submit("CHATTY", {"lines": 3}), timeout=20)["state"] == "COMPLETED"
    wait_until(lambda: "chatty on stderr" in up.log(), timeout=10, message="the task's output")
    # The output is on up's stderr, and its stdout holds the listening line alone
    assert "chatty line 2 " in up.log()
    stdout = up.out_path.read_text().splitlines()
    assert len(stdout) == 1 and LISTENING.match(stdout[0]), stdout
