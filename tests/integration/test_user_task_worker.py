"""A real ``jobmesh worker --tasks=...`` subprocess against a scripted coordinator in this process.

The scripted coordinator (a stdlib listening socket and a reader thread) gives the exact
control these tests need over TASK_ASSIGN, TASK_CANCEL and heartbeat timing; it records
when each HEARTBEAT arrives. The tasks module is ``tests/user_tasks_module.py``, copied to
``tmp_path`` as ``jm_user_tasks`` and found through the worker's working directory (or
PYTHONPATH). Each test proves one of the traps that running user code inside a
monkey-patched gevent process would fall into (docs/ARCHITECTURE.md, "User tasks").
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jobmesh.protocol.framing import FrameReader, encode_frame
from jobmesh.protocol.payloads import TASK_TYPES
from tests.support.cli import run_cli
from tests.support.processes import CoordinatorProc, alive, child_env
from tests.support.waiting import wait_until

MODULE_SOURCE = Path(__file__).resolve().parent.parent / "user_tasks_module.py"
USER_TYPES = sorted(["ADDUP", "BIG", "BOOM", "CHATTY", "COOP", "CPU", "DEAF", "EXIT3", "FLAKY", "GREET", "LISTY", "LOGS",
                     "NAP", "ORPHAN", "REPORTER", "SPIN", "STUBBORN", "TALLY", "THREADS", "WHOAMI"])


class Session:
    """One worker connection, seen from the coordinator's side."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.heartbeats: list[float] = []   # arrival times (time.monotonic)
        self.frames: queue.Queue = queue.Queue()
        self.seen: list[dict] = []           # every frame but heartbeats, in order
        self.reader = FrameReader(sock.recv)
        self.register = self.reader.read_frame()
        assert self.register and self.register["type"] == "WORKER_REGISTER", self.register
        self.send({"type": "WORKER_REGISTERED", "workerId": self.register["workerId"]})
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            while (frame := self.reader.read_frame()) is not None:
                if frame.get("type") == "HEARTBEAT":
                    self.heartbeats.append(time.monotonic())
                else:
                    self.seen.append(frame)
                    self.frames.put(frame)
        except Exception:
            pass

    def send(self, obj: dict) -> None:
        self.sock.sendall(encode_frame(obj))

    def assign(self, job: str, task_type: str, payload: dict, number: int = 1, attempt: str | None = None,
               **extra: object) -> str:
        attempt = attempt or "%s-a%d" % (job, number)
        self.send(dict({"type": "TASK_ASSIGN", "jobId": job, "attemptId": attempt, "attemptNumber": number,
                        "taskType": task_type, "payload": payload}, **extra))
        return attempt

    def cancel(self, job: str, attempt: str) -> None:
        self.send({"type": "TASK_CANCEL", "jobId": job, "attemptId": attempt})

    def result(self, timeout: float = 10.0) -> dict:
        try:
            frame = self.frames.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("no TASK_RESULT within %.1fs" % timeout) from None
        assert frame["type"] == "TASK_RESULT", frame
        return frame

    def results(self, n: int, timeout: float = 10.0) -> dict[str, dict]:
        """The next ``n`` results, by jobId."""
        deadline = time.monotonic() + timeout
        got = [self.result(max(0.01, deadline - time.monotonic())) for _ in range(n)]
        return {r["jobId"]: r for r in got}

    def results_for(self, job: str) -> list[dict]:
        return [f for f in list(self.seen) if f.get("type") == "TASK_RESULT" and f.get("jobId") == job]


class Worker:
    """The worker subprocess, its log (stderr) and its stdout, both files."""

    def __init__(self, tmp_path: Path, port: int, capacity: int, heartbeat_millis: int, via: str):
        self.out_path, self.err_path = tmp_path / "worker.out", tmp_path / "worker.err"
        env = child_env()
        cwd = tmp_path
        if via == "pythonpath":
            env["PYTHONPATH"] = str(tmp_path)
            cwd = Path(__file__).resolve().parent.parent.parent
        argv = [sys.executable, "-m", "jobmesh", "worker", "--coordinator=127.0.0.1:%d" % port, "--id=w-user",
                "--capacity=%d" % capacity, "--heartbeat-interval-millis=%d" % heartbeat_millis,
                "--tasks=jm_user_tasks", "--log-level=INFO"]
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=cwd)

    def log(self) -> str:
        return self.err_path.read_text(errors="replace")

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait_log(self, text: str, timeout: float = 10.0) -> str:
        return wait_until(lambda: text in self.log() and self.log(), timeout=timeout, message="%r in the log" % text)

    # terminate, wait, kill
    stop = CoordinatorProc.cleanup


@pytest.fixture
def start_worker(tmp_path):
    """``start_worker(capacity=1, heartbeat_millis=200)`` -> (Worker, Session), registered."""
    shutil.copy(MODULE_SOURCE, tmp_path / "jm_user_tasks.py")
    listener = socket.create_server(("127.0.0.1", 0))
    started: list[tuple[Worker, Session]] = []

    def start(capacity: int = 1, heartbeat_millis: int = 200, via: str = "cwd"):
        worker = Worker(tmp_path, listener.getsockname()[1], capacity, heartbeat_millis, via)
        listener.settimeout(20)
        try:
            sock, _ = listener.accept()
        except socket.timeout:
            worker.stop()
            raise AssertionError("worker did not connect:\n%s" % worker.log()) from None
        sock.settimeout(None)
        started.append((worker, Session(sock)))
        return started[-1]

    yield start
    for worker, session in started:
        worker.stop()
        session.sock.close()
    listener.close()


# ---- registration and the plain path ---------------------------------------------------

@pytest.mark.parametrize("via", ["cwd", "pythonpath"])
def test_registration_declares_the_builtins_and_the_user_types(start_worker, via):
    worker, session = start_worker(capacity=2, via=via)
    assert session.register == {"type": "WORKER_REGISTER", "workerId": "w-user", "capacity": 2,
                                "taskTypes": list(TASK_TYPES) + USER_TYPES}
    session.assign("j1", "GREET", {"name": "ada"})
    assert session.result() == {"type": "TASK_RESULT", "workerId": "w-user", "jobId": "j1", "attemptId": "j1-a1",
                                "success": True, "result": {"greeting": "hello ada"}, "error": None}
    # The built-ins still run in the worker itself
    session.assign("j2", "WORD_COUNT", {"text": "two words"})
    assert session.result()["result"] == {"words": 2}
    # A workflow job's TASK_ASSIGN parents reach its task as ctx.parents
    session.assign("j3", "ADDUP", {"n": 1}, parents={"left": {"sum": 2}, "right": {"sum": 3}})
    assert session.result()["result"] == {"sum": 6, "parents": ["left", "right"]}
    assert "user task types worker=w-user modules=jm_user_tasks" in worker.log()


# ---- the traps -------------------------------------------------------------------------

def test_heartbeats_keep_their_cadence_during_a_cpu_bound_task(start_worker):
    # Given a worker heartbeating every 200 ms, its idle cadence measured first
    worker, session = start_worker(heartbeat_millis=200)
    wait_until(lambda: len(session.heartbeats) >= 6, timeout=10, message="heartbeats")
    idle = session.heartbeats[:]
    idle_gap = statistics.median(b - a for a, b in zip(idle, idle[1:]))
    # When a pure-Python function burns the CPU for 3 s
    assigned = time.monotonic()
    session.assign("j1", "CPU", {"seconds": 3.0})
    result = session.result(timeout=15)
    done = time.monotonic()
    # Then it completes, and from the assignment to the result no heartbeat came later than
    # a few idle periods (a blocked hub would leave one gap as long as the task)
    assert result["success"] is True and result["result"]["rounds"] > 0, result
    beats = [assigned] + [t for t in session.heartbeats if assigned < t < done] + [done]
    gaps = [b - a for a, b in zip(beats, beats[1:])]
    limit = max(1.0, 5 * idle_gap)
    assert max(gaps) < limit, "max heartbeat gap %.3fs, idle %.3fs" % (max(gaps), idle_gap)
    print("heartbeat gaps during a 3 s CPU task: n=%d max=%.0f ms mean=%.0f ms"
          % (len(gaps), max(gaps) * 1000, sum(gaps) / len(gaps) * 1000))


def test_time_sleep_in_tasks_sleeps_for_real_and_in_parallel(start_worker):
    worker, session = start_worker(capacity=2)
    session.assign("j0", "WHOAMI", {})  # warm one child; the second starts with the batch
    session.result()
    session.assign("j1", "NAP", {"seconds": 0.6})
    session.assign("j2", "NAP", {"seconds": 0.6})
    results = session.results(2, timeout=10)
    assert all(r["success"] and r["result"]["sleptSeconds"] >= 0.6 for r in results.values()), results
    # in parallel: each began before the other ended
    naps = [r["result"] for r in results.values()]
    assert max(n["began"] for n in naps) < min(n["ended"] for n in naps), naps


def test_heavy_logging_from_threads_in_concurrent_tasks_does_not_deadlock(start_worker, tmp_path):
    # gevent#1698: under patch_all, real threads + logging deadlock on the patched RLock
    worker, session = start_worker(capacity=3)
    files = [tmp_path / ("log-%d.txt" % k) for k in range(3)]
    for k, path in enumerate(files):
        session.assign("j%d" % k, "LOGS", {"file": str(path), "lines": 5000})
    results = session.results(3, timeout=40)
    assert all(r["success"] and r["result"] == {"lines": 20000} for r in results.values()), results
    for path in files:
        assert len(path.read_text().splitlines()) == 20000


def test_a_task_that_starts_threads_gets_real_os_threads(start_worker):
    # Patched threading would turn them into greenlets on one OS thread (one native id)
    worker, session = start_worker()
    session.assign("j1", "THREADS", {"n": 4})
    assert session.result()["result"] == {"distinctNativeIds": 4, "threads": 4, "gevent": False}


def test_print_in_a_task_does_not_break_the_protocol(start_worker):
    worker, session = start_worker()
    session.assign("j1", "CHATTY", {"lines": 300})
    assert session.result()["result"] == {"printed": 300}
    session.assign("j2", "GREET", {"name": "bob"})
    assert session.result()["result"] == {"greeting": "hello bob"}
    # The output went to the worker's stderr, the log, both streams of it: stdout stays clean
    wait_until(lambda: "chatty line 299 " in worker.log(), timeout=5, message="printed lines")
    assert "chatty on stderr" in worker.log()
    assert worker.stdout() == ""


# ---- cancel --------------------------------------------------------------------------

def test_cancel_sets_ctx_cancelled_and_a_cooperative_task_ends(start_worker, tmp_path):
    worker, session = start_worker()
    attempt = session.assign("j1", "COOP", {"dir": str(tmp_path)}, number=2)
    wait_until((tmp_path / "started").exists, timeout=10, message="COOP started")
    session.cancel("j1", attempt)
    wait_until((tmp_path / "finished").exists, timeout=3, message="COOP saw the cancel")
    assert json.loads((tmp_path / "finished").read_text()) == {
        "cancelled": True, "jobId": "j1", "attempt": 2, "attemptId": attempt}
    worker.wait_log("its result was dropped job=j1 attempt=%s" % attempt)
    # The slot is free, and the cancelled attempt never reported
    session.assign("j2", "GREET", {"name": "c"})
    assert session.result()["jobId"] == "j2"
    assert session.results_for("j1") == []


def test_a_task_ignoring_cancel_frees_its_slot_at_once_and_its_result_never_arrives(start_worker, tmp_path):
    # Given a capacity-1 worker running a task that ignores ctx.cancelled for 2 s
    worker, session = start_worker(capacity=1)
    attempt = session.assign("j1", "STUBBORN", {"dir": str(tmp_path), "seconds": 2.0})
    wait_until((tmp_path / "started").exists, timeout=10, message="STUBBORN started")
    # When it is cancelled and a new assignment follows at once
    session.cancel("j1", attempt)
    session.assign("j2", "GREET", {"name": "next"})
    # Then the new one starts and finishes while the cancelled one still runs
    result = session.result(timeout=5)
    assert (result["jobId"], result["success"]) == ("j2", True), result
    assert not (tmp_path / "finished").exists()
    log = worker.wait_log("cancelled task still running in pid ")
    assert "an extra process" in log
    # And the cancelled one's late result is dropped, never sent
    worker.wait_log("its result was dropped job=j1 attempt=%s" % attempt, timeout=10)
    assert json.loads((tmp_path / "finished").read_text()) == {"cancelledSet": True}
    session.assign("j3", "GREET", {"name": "after"})
    assert session.result()["jobId"] == "j3"
    assert session.results_for("j1") == []


# ---- failures ------------------------------------------------------------------------

def test_failures_are_reported_and_the_worker_survives_a_dying_child(start_worker):
    worker, session = start_worker()
    cases = [
        ("BOOM", "ValueError: bad name"),
        ("LISTY", "task 'LISTY' returned list, not a dict (a JSON object)"),
        ("EXIT3", "task process exited with code 3"),
        ("NO_SUCH_TYPE", "unknown task type 'NO_SUCH_TYPE': this worker runs SLEEP, WORD_COUNT"),
    ]
    for n, (task_type, error) in enumerate(cases):
        session.assign("j%d" % n, task_type, {})
        result = session.result()
        assert (result["jobId"], result["success"], result["result"]) == ("j%d" % n, False, None), result
        assert result["error"].startswith(error), result
    session.assign("j9", "GREET", {"name": "still here"})
    assert session.result()["result"] == {"greeting": "hello still here"}
    assert worker.proc.poll() is None
    assert "Traceback" in worker.log() and "ValueError: bad name" in worker.log()  # the child's, for the user


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_task_processes_end_with_their_worker(start_worker, tmp_path, how):
    worker, session = start_worker(capacity=2)
    session.assign("j1", "STUBBORN", {"dir": str(tmp_path), "seconds": 60})
    wait_until((tmp_path / "started").exists, timeout=10, message="STUBBORN started")
    session.assign("j2", "ORPHAN", {"dir": str(tmp_path), "seconds": 60})  # forks a grandchild that stays
    grandchild = session.result()["result"]["grandchild"]
    idle = json.loads((tmp_path / "grandchild").read_text())["parent"]
    try:
        if how == "SIGTERM":
            worker.proc.terminate()
            assert worker.proc.wait(10) == 0
        else:
            worker.proc.kill()
            worker.proc.wait(10)
        # Idle or busy, each child sees EOF on its socket and exits, and what a task forked
        # goes with it
        busy = json.loads((tmp_path / "started").read_text())["pid"]
        assert busy != idle
        wait_until(lambda: not alive(idle) and not alive(busy) and not alive(grandchild), timeout=5,
                   message="both children and the grandchild gone")
        assert not (tmp_path / "finished").exists()
    finally:
        if alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)


# ---- start-up errors ------------------------------------------------------------------

@pytest.mark.parametrize("command", ["worker", "up"])
@pytest.mark.parametrize("source, message", [
    (None, "no module named 'jm_missing'"),
    ("import jm_no_such_dependency\n", "failed to import: ModuleNotFoundError"),
    ("from jobmesh.worker import task\n@task('GREET')\ndef again(p):\n    return {}\n", "defined twice"),
    ("from jobmesh.worker import task\n@task('no spaces allowed')\ndef f(p):\n    return {}\n", "is invalid"),
    ("import os\n", "module 'jm_bad' defines no tasks: a task module registers at least one function with @task"),
])
def test_a_bad_tasks_module_is_one_line_and_exit_2(tmp_path, command, source, message):
    shutil.copy(MODULE_SOURCE, tmp_path / "jm_user_tasks.py")
    modules = "jm_user_tasks,jm_missing"
    if source is not None:
        (tmp_path / "jm_bad.py").write_text(source)
        modules = "jm_user_tasks,jm_bad"
    extra = ["--worker-port=0", "--client-port=0", "--db=%s" % (tmp_path / "up.db")] if command == "up" else []
    argv = [sys.executable, "-m", "jobmesh", command, "--tasks=%s" % modules] + extra
    env = child_env()
    env.pop("GEVENT_MONITOR_THREAD_ENABLE", None)  # its psutil warning would be a second line
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=tmp_path, stdin=subprocess.DEVNULL,
                          env=env)
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("jobmesh %s: --tasks" % command), lines
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "up.db").exists()


def test_a_module_without_tasks_is_refused(tmp_path):
    proc = run_cli("worker", "--tasks=os")
    assert proc.returncode == 2, proc
    assert proc.stderr.strip() == ("jobmesh worker: --tasks: module 'os' defines no tasks: a task module registers "
                                   "at least one function with @task(\"NAME\") (from jobmesh.worker import task)")


def test_tasks_flag_syntax_is_checked(tmp_path):
    proc = run_cli("worker", "--tasks=my-tasks")
    assert proc.returncode == 2 and "--tasks must be MODULE[,MODULE...]" in proc.stderr, proc


def test_up_passes_tasks_to_its_workers(tmp_path):
    shutil.copy(MODULE_SOURCE, tmp_path / "jm_user_tasks.py")
    err_path = tmp_path / "up.err"
    argv = [sys.executable, "-m", "jobmesh", "up", "--workers=2", "--capacity=1", "--tasks=jm_user_tasks",
            "--worker-port=0", "--client-port=0", "--db=%s" % (tmp_path / "up.db")]
    with open(tmp_path / "up.out", "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=tmp_path, env=child_env())
    try:
        for n in (1, 2):
            wait_until(lambda n=n: "user task types worker=local-%d modules=jm_user_tasks types=ADDUP,BIG,BOOM" % n
                       in err_path.read_text(errors="replace"), timeout=20, message="worker local-%d's task types" % n)
        wait_until(lambda: all("jobmesh.worker.agent: registered worker=local-%d " % n in err_path.read_text()
                               for n in (1, 2)), timeout=20, message="both workers registered")
    finally:
        proc.terminate()
        assert proc.wait(15) == 0
