"""``ProcessPool`` driven directly from the (unpatched) test process, with real child processes.

gevent's own socket and subprocess work here without monkey-patching, like the agent in
``test_worker_agent.py``. The children import ``tests/user_tasks_module.py``, copied to
``tmp_path`` as ``jm_user_tasks`` and found through PYTHONPATH.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
from pathlib import Path

import gevent
import pytest

from jobmesh.worker.processes import ProcessPool
from tests.support.processes import alive
from tests.support.waiting import wait_until

MODULE_SOURCE = Path(__file__).resolve().parent.parent / "user_tasks_module.py"


def gevent_wait_until(predicate, timeout=10.0, message="condition"):
    """``wait_until`` for this process's hub: polls with ``gevent.sleep`` so greenlets run."""
    return wait_until(predicate, timeout=timeout, message=message, sleep=gevent.sleep)


@pytest.fixture
def make_pool(tmp_path):
    shutil.copy(MODULE_SOURCE, tmp_path / "jm_user_tasks.py")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    pools: list[ProcessPool] = []

    def make(capacity=1, modules=("jm_user_tasks",), **kwargs):
        pools.append(ProcessPool(modules, capacity, env=env, **kwargs))
        return pools[-1]

    yield make
    for pool in pools:
        pool.close()


def run(pool, task_type, payload=None, attempt=1, attempt_id="a-1"):
    return pool.run(task_type, "j-1", attempt_id, attempt, payload or {})


def test_a_child_runs_unpatched_and_is_reused(make_pool):
    pool = make_pool()
    ok, first, error = run(pool, "WHOAMI")
    assert (ok, error, first["gevent"]) == (True, None, False)
    assert run(pool, "GREET", {"name": "ada"}) == (True, {"greeting": "hello ada"}, None)
    assert run(pool, "WHOAMI")[1]["pid"] == first["pid"]
    assert (pool.started, len(pool), pool.idle) == (1, 1, 1)


def test_failures_name_what_happened_and_a_dead_child_is_replaced(make_pool, tmp_path):
    pool = make_pool()
    pid = run(pool, "WHOAMI")[1]["pid"]
    assert run(pool, "BOOM") == (False, None, "ValueError: bad name")
    assert run(pool, "LISTY") == (False, None, "task 'LISTY' returned list, not a dict (a JSON object)")
    assert run(pool, "WHOAMI")[1]["pid"] == pid  # failures in the function keep the child
    assert run(pool, "EXIT3") == (False, None, "task process exited with code 3")
    gevent_wait_until(lambda: not alive(pid), message="the exited child reaped")
    ok, again, _ = run(pool, "WHOAMI")
    assert ok and again["pid"] != pid
    assert (pool.started, len(pool)) == (2, 1)


def test_a_workflow_job_s_parents_reach_its_task_as_ctx_parents(make_pool):
    pool = make_pool()
    parents = {"left": {"sum": 2}, "right": {"sum": 3}}
    assert pool.run("ADDUP", "j-1", "a-1", 1, {"n": 1}, parents=parents) == (
        True, {"sum": 6, "parents": ["left", "right"]}, None)
    # a job without dependencies: ctx.parents is {}; a task without ctx runs as ever
    assert run(pool, "ADDUP", {"n": 1}) == (True, {"sum": 1, "parents": []}, None)
    assert pool.run("GREET", "j-2", "a-2", 1, {"name": "ada"}, parents=parents) == (
        True, {"greeting": "hello ada"}, None)


@pytest.mark.parametrize("size", [64 * 1024, 1024 * 1024, 2 * 1024 * 1024])
def test_a_result_over_the_limit_fails_the_attempt_in_the_limit_s_words(make_pool, size):
    pool = make_pool()
    ok, result, error = run(pool, "BIG", {"bytes": size})
    assert (ok, result) == (False, None)
    assert error == "result is %d bytes as JSON; a result may be at most 65536 bytes (64 KiB)" % (size + 8)
    assert run(pool, "BIG", {"bytes": 65536 - 8}) == (True, {"x": "y" * (65536 - 8)}, None)


def test_a_child_that_cannot_load_the_modules_fails_the_attempt(make_pool):
    pool = make_pool(modules=("jm_no_such_module",))
    ok, result, error = run(pool, "GREET", {"name": "x"})
    assert (ok, result) == (False, None)
    assert error == ("task process did not start: --tasks: no module named 'jm_no_such_module' "
                     "(looked in the current directory and PYTHONPATH)")
    assert len(pool) == 0


def test_cancel_detaches_the_child_sets_ctx_cancelled_and_reuses_the_child(make_pool, tmp_path):
    pool = make_pool()
    pid = run(pool, "WHOAMI")[1]["pid"]
    # Given a cooperative task running
    attempt = gevent.spawn(run, pool, "COOP", {"dir": str(tmp_path)}, 2, "a-2")
    gevent_wait_until((tmp_path / "started").exists, message="COOP started")
    # When its greenlet is killed (what TASK_CANCEL does), it dies at once: it does not
    # wait for the function, which would see nothing for 30 s without the cancel that only
    # a detached child is sent
    attempt.kill(block=True, timeout=10)
    assert attempt.dead and isinstance(attempt.value, gevent.GreenletExit), attempt.value
    # Then the function sees ctx.cancelled, ends, and the child goes back to the idle set
    gevent_wait_until((tmp_path / "finished").exists, timeout=5, message="COOP finished")
    seen = json.loads((tmp_path / "finished").read_text())
    assert seen == {"cancelled": True, "jobId": "j-1", "attempt": 2, "attemptId": "a-2"}
    gevent_wait_until(lambda: pool.detached == 0 and pool.idle == 1, message="child back in the idle set")
    assert run(pool, "WHOAMI")[1]["pid"] == pid


def test_a_task_ignoring_cancel_runs_on_as_an_extra_process(make_pool, tmp_path):
    pool = make_pool(capacity=1)
    attempt = gevent.spawn(run, pool, "STUBBORN", {"dir": str(tmp_path), "seconds": 60, "untilReleased": True})
    gevent_wait_until((tmp_path / "started").exists, message="STUBBORN started")
    attempt.kill(block=True, timeout=10)
    assert attempt.dead
    # The next attempt does not wait for it: it runs in a new child while the stubborn
    # task, held until released, still runs in the old one
    ok, me, _ = run(pool, "WHOAMI", attempt_id="a-3")
    assert ok
    assert (len(pool), pool.detached) == (2, 1)
    assert not (tmp_path / "finished").exists()
    # Once it returns, its result is dropped and, the idle set being full, its child ends
    (tmp_path / "release").touch()
    gevent_wait_until(lambda: pool.detached == 0, message="the stubborn task returned")
    assert json.loads((tmp_path / "finished").read_text()) == {"cancelledSet": True}
    assert (len(pool), pool.idle) == (1, 1)
    assert run(pool, "WHOAMI")[1]["pid"] == me["pid"]


def test_close_ends_idle_and_detached_children(make_pool, tmp_path, caplog):
    pool = make_pool(capacity=2)
    attempt = gevent.spawn(run, pool, "STUBBORN", {"dir": str(tmp_path), "seconds": 30})
    gevent_wait_until((tmp_path / "started").exists, message="STUBBORN started")
    attempt.kill(block=True, timeout=10)
    idle_pid = run(pool, "WHOAMI")[1]["pid"]
    assert (len(pool), pool.idle, pool.detached) == (2, 1, 1)
    pids = pool.pids()
    assert idle_pid in pids
    with caplog.at_level(logging.WARNING, logger="jobmesh.worker.processes"):
        pool.close()
    # Both exited on their own when their socket closed, the busy one too, and close
    # reaped them: none had to be killed, and the 30 s task never finished
    assert len(pool) == 0
    assert [pid for pid in pids if alive(pid)] == []
    assert "did not exit, killing" not in caplog.text
    assert not (tmp_path / "finished").exists()


def test_a_dead_child_fails_its_attempt_though_a_forked_descendant_holds_its_socket(make_pool, tmp_path):
    pool = make_pool()
    # Given a task that forks a grandchild (it sleeps 60 s holding the socket) and segfaults
    attempt = gevent.spawn(run, pool, "ORPHAN", {"dir": str(tmp_path), "seconds": 60, "signal": "SIGSEGV"})
    gevent_wait_until((tmp_path / "grandchild").exists, timeout=15, message="the grandchild forked")
    grandchild = json.loads((tmp_path / "grandchild").read_text())["pid"]
    try:
        # Then the attempt fails when the child exits, and the grandchild goes with it
        assert attempt.get(timeout=15) == (False, None, "task process exited with code -11 (killed by SIGSEGV)")
        gevent_wait_until(lambda: not alive(grandchild), message="the grandchild killed")
    finally:
        attempt.kill()
        if alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)


def test_cancelled_tasks_beyond_capacity_kill_the_oldest(make_pool, tmp_path, caplog):
    # Given a capacity-1 pool whose cancelled tasks would get a minute to return
    pool = make_pool(capacity=1, cancel_grace=60.0)
    pids = []
    try:
        for n in (1, 2):
            marks = tmp_path / str(n)
            marks.mkdir()
            attempt = gevent.spawn(run, pool, "DEAF", {"dir": str(marks), "seconds": 60}, attempt_id="a-%d" % n)
            gevent_wait_until((marks / "started").exists, timeout=15, message="DEAF %d started" % n)
            pids.append(json.loads((marks / "started").read_text())["pid"])
            with caplog.at_level(logging.INFO, logger="jobmesh.worker.processes"):
                attempt.kill(block=True, timeout=10)
                # When a second one is cancelled while the first still runs
                if n == 2:
                    # Then the oldest is killed at once, and the newest runs on in its grace
                    gevent_wait_until(lambda: not alive(pids[0]), timeout=10, message="the oldest killed")
                    gevent_wait_until(lambda: pool.detached == 1, message="the oldest reaped")
        assert alive(pids[1])
        assert ("1 cancelled tasks still running, at most 1 (the capacity): SIGKILL to the oldest's process group "
                "pid=%d job=j-1 attempt=a-1" % pids[0]) in caplog.text
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
