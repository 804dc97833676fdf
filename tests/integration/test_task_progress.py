"""Progress from running tasks (CONTRACT.md "What a task can say and ask for"): a real
coordinator and a real ``jobmesh worker --tasks=jm_user_tasks``, shared by the module's
tests (each uses its own jobs), and scripted workers for what a real one never sends.

The tasks are ``REPORTER`` and ``SPIN`` in ``tests/user_tasks_module.py``.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from jobmesh.client import CoordinatorClient
from tests.support.cli import run_cli
from tests.support.peers import wait_registered
from tests.support.processes import CoordinatorProc, WorkerProc, child_env
from tests.support.waiting import wait_until

MODULE_SOURCE = Path(__file__).resolve().parent.parent / "user_tasks_module.py"


@pytest.fixture(scope="module")
def coord(tmp_path_factory):
    proc = CoordinatorProc(tmp_path_factory.mktemp("coord"), metrics_port=0)
    proc.start()
    yield proc
    proc.cleanup()


@pytest.fixture(scope="module")
def worker(coord, tmp_path_factory):
    """One real worker (two slots) running the tests' task module, for the whole module."""
    where = tmp_path_factory.mktemp("worker")
    shutil.copy(MODULE_SOURCE, where / "jm_user_tasks.py")
    proc = WorkerProc(where, coord.worker_target, worker_id="w-progress", capacity=2, tasks="jm_user_tasks",
                      cwd=where).start()
    with CoordinatorClient(*coord.client_addr, timeout=10) as client:
        wait_registered(client, ["w-progress"], timeout=20)
    yield proc
    proc.cleanup()


@pytest.fixture
def client(coord):
    with CoordinatorClient(*coord.client_addr, timeout=10) as c:
        yield c


def counter(coord, name: str) -> float:
    """One unlabelled counter of the coordinator's /metrics."""
    with urllib.request.urlopen(coord.metrics_url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    found = re.search(r"^%s (\S+)$" % re.escape(name), text, re.MULTILINE)
    assert found, "%s not in /metrics" % name
    return float(found.group(1))


def shown(client, job_id: str, message: str) -> dict:
    """The job's snapshot once its progress says ``message``."""
    return wait_until(lambda: (lambda job: job if (job.get("progress") or {}).get("message") == message else None)(
        client.status(job_id)), timeout=15, message="progress %r shown" % message)


def test_progress_shows_while_running_and_a_new_attempt_and_the_end_clear_it(coord, worker, client, tmp_path):
    # Given a task whose first attempt reports progress and then fails
    job_id = client.submit("REPORTER", {"dir": str(tmp_path)}, max_attempts=2)
    wait_until((tmp_path / "started-1").exists, timeout=15, message="attempt 1 started")
    assert client.status(job_id)["progress"] is None  # running, nothing reported yet
    (tmp_path / "report-1").write_text(json.dumps({"fraction": 0.42, "message": "compressing chunk 7",
                                                   "fail": True}))
    # Then the running job's snapshot carries it
    job = shown(client, job_id, "compressing chunk 7")
    assert job["state"] == "RUNNING" and job["progress"]["fraction"] == 0.42, job
    assert abs(job["progress"]["atMillis"] - job["updatedAtMillis"]) < 600_000, job  # wall-clock millis
    # And `jobmesh status` shows it as a percentage and the message
    status = run_cli("status", job_id, coordinator=coord.client_target)
    assert status.returncode == 0 and "\nprogress  42% compressing chunk 7\n" in status.stdout, status
    # When the attempt fails, the second attempt starts without it
    (tmp_path / "end-1").write_text("")
    wait_until((tmp_path / "started-2").exists, timeout=15, message="attempt 2 started")
    job = wait_until(lambda: (lambda j: j if j["state"] == "RUNNING" else None)(client.status(job_id)), timeout=15,
                     message="attempt 2 running")
    assert (job["attempts"], job["progress"]) == (2, None), job
    (tmp_path / "report-2").write_text(json.dumps({"fraction": 1, "message": "second"}))
    assert shown(client, job_id, "second")["progress"]["fraction"] == 1
    # And the finished job has none
    (tmp_path / "end-2").write_text("")
    done = client.wait(job_id, timeout=15)
    assert (done["state"], done["progress"]) == ("COMPLETED", None), done
    assert "\nprogress " not in run_cli("status", job_id, coordinator=coord.client_target).stdout


def test_a_task_reporting_in_a_tight_loop_sends_the_coordinator_few_frames(coord, worker, client):
    frames = counter(coord, "jobmesh_progress_reports_total") + counter(coord, "jobmesh_progress_dropped_total")
    calls = 50_000
    job = client.wait(client.submit("SPIN", {"calls": calls}, max_attempts=1), timeout=60)
    assert job["state"] == "COMPLETED" and job["result"]["calls"] == calls, job
    # The task process sent the latest report a few times a second, not every call; the
    # coordinator kept what it got (the worker sent it ahead of the result)
    sent = counter(coord, "jobmesh_progress_reports_total") + counter(coord, "jobmesh_progress_dropped_total") - frames
    assert 1 <= sent <= calls // 100, (sent, job["result"])


def test_progress_of_another_lease_or_out_of_bounds_is_dropped_and_the_connection_stays(coord, client, peers):
    # Given a scripted worker running a job of its own type
    scripted = peers.worker(coord, "w-raw-progress", capacity=1, task_types=["RAW_PROGRESS"])
    job_id = client.submit("RAW_PROGRESS", {}, max_attempts=1)
    assign = scripted.await_assign(timeout=10)

    def report(fraction, message=None, **extra):
        scripted.send(dict({"type": "TASK_PROGRESS", "workerId": scripted.worker_id, "jobId": job_id,
                            "attemptId": assign["attemptId"], "fraction": fraction, "message": message}, **extra))

    report(0.5, "kept")
    shown(client, job_id, "kept")
    dropped = counter(coord, "jobmesh_progress_dropped_total")
    # When it reports for another attempt, for another job, out of 0..1, or with a long message
    report(0.6, "stale", attemptId=job_id + ".2")
    report(0.6, "other job", jobId="no-such-job")
    report(1.01, "over")
    report(-0.01, "under")
    report(0.6, "x" * 1001)
    wait_until(lambda: counter(coord, "jobmesh_progress_dropped_total") >= dropped + 5, timeout=10,
               message="five reports dropped")
    # Then the job shows what it showed, and the connection is still open and in use
    assert client.status(job_id)["progress"]["message"] == "kept"
    report(0.75, "y" * 1000)
    shown(client, job_id, "y" * 1000)
    scripted.complete(assign, {"ok": True})
    assert client.wait(job_id, timeout=10)["state"] == "COMPLETED"
    assert not scripted.closed.is_set() and scripted.errors == [], scripted.errors


def read_pty(fd: int, until: bytes | None, timeout: float = 15.0) -> bytes:
    """What a terminal shows: read ``fd`` (a pty's master end) until ``until`` has appeared,
    or (None) until the other end is closed."""
    out = b""
    deadline = time.monotonic() + timeout
    while until is None or until not in out:
        left = deadline - time.monotonic()
        assert left > 0, "timed out waiting for %r on the terminal; it shows %r" % (until, out)
        if not select.select([fd], [], [], left)[0]:
            continue
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: every process holding the other end has exited
            chunk = b""
        if not chunk:
            assert until is None, "the terminal closed before %r appeared; it showed %r" % (until, out)
            break
        out += chunk
    return out


def test_wait_shows_the_progress_on_a_terminal_only(coord, worker, client, tmp_path):
    # Given a running job that reported progress
    job_id = client.submit("REPORTER", {"dir": str(tmp_path)}, max_attempts=1)
    wait_until((tmp_path / "started-1").exists, timeout=15, message="attempt 1 started")
    (tmp_path / "report-1").write_text(json.dumps({"fraction": 0.5, "message": "halfway there"}))
    shown(client, job_id, "halfway there")
    # When `jobmesh wait` runs with a terminal as its stdout
    master, slave = pty.openpty()
    env = child_env()
    env.pop("GEVENT_MONITOR_THREAD_ENABLE", None)
    proc = subprocess.Popen([sys.executable, "-m", "jobmesh", "wait", job_id, "--coordinator=" + coord.client_target],
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=subprocess.PIPE, env=env)
    os.close(slave)
    try:
        # Then the terminal shows a line with the job's progress, redrawn in place
        before = read_pty(master, b"job %s RUNNING 50%% halfway there" % job_id.encode())
        (tmp_path / "end-1").write_text("")
        assert proc.wait(timeout=15) == 0, proc.stderr.read()
        after = read_pty(master, None)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    # and erases it before the final snapshot
    shown_text = (before + after).decode()
    assert "\r\x1b[K" in before.decode() and "\r\x1b[Kjob       %s\r\n" % job_id in shown_text, shown_text
    assert "state     COMPLETED" in shown_text
    # And into a pipe there is no such line
    piped = run_cli("wait", job_id, coordinator=coord.client_target)
    assert piped.returncode == 0 and "\r" not in piped.stdout and "\x1b" not in piped.stdout, piped
