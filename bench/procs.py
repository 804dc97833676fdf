"""Child processes of a bench run: the coordinator, worker processes, the echo server.

Each child's stdout and stderr go to files in the run directory (an undrained pipe would
fill and freeze the child's hub). Children are tracked by pid and stopped by pid:
SIGTERM, a bounded wait, then SIGKILL. ``RssSampler`` polls ``/proc/<pid>/status``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import gevent
from gevent import subprocess

REPO_ROOT = Path(__file__).resolve().parent.parent
LISTENING = re.compile(r"jobmesh coordinator listening worker=(\S+):(\d+) client=(\S+):(\d+)")
ECHO_LISTENING = re.compile(r"echo listening (\S+):(\d+)")


class ChildFailed(Exception):
    """A child exited or did not become ready in time; the message quotes its stderr."""


class Failed(Exception):
    """A measurement could not be made; the message says why."""


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + path if path else "")
    return env


def tail(path: Path, limit: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


class Child:
    """A subprocess with its output in ``<dir>/<name>.out`` and ``.err``."""

    def __init__(self, name: str, args: list[str], run_dir: Path) -> None:
        self.name = name
        self.args = args
        self.out_path = run_dir / (name + ".out")
        self.err_path = run_dir / (name + ".err")
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(args, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                         env=child_env(), cwd=str(REPO_ROOT))
        self.pid = self.proc.pid
        self.terminated = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_for_line(self, pattern: re.Pattern, timeout: float, poll: float = 0.05) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            match = pattern.search(tail(self.out_path, 1 << 20))
            if match:
                return match
            if not self.alive():
                raise ChildFailed("%s exited rc=%s before it was ready:\n%s"
                                  % (self.name, self.proc.returncode, tail(self.err_path)))
            if time.monotonic() > deadline:
                raise ChildFailed("%s not ready within %.0fs:\n%s" % (self.name, timeout, tail(self.err_path)))
            gevent.sleep(poll)

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """SIGTERM once: a second one could land after the child restored the default action."""
        if not self.terminated:
            self.terminated = True
            self.signal(signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL; returns the exit code."""
        self.terminate()
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            return self.proc.wait(timeout=5)


def stop_all(children: list[Child], timeout: float = 10.0) -> dict[str, int | None]:
    """Stop children in parallel (SIGTERM to all first); returns name -> exit code."""
    for child in children:
        child.terminate()
    codes: dict[str, int | None] = {}

    def one(child: Child) -> None:
        try:
            codes[child.name] = child.stop(timeout)
        except Exception:  # noqa: BLE001
            child.signal(signal.SIGKILL)
            codes[child.name] = None

    gevent.joinall([gevent.spawn(one, c) for c in children], timeout=timeout + 10)
    return codes


def start_coordinator(run_dir: Path, db: Path | str, synchronous: str | None, extra: list[str], timeout: float = 30.0,
                      poll: float = 0.05) -> tuple[Child, tuple[str, int], tuple[str, int]]:
    """``synchronous``: SQLite's --db-synchronous (None on PostgreSQL, which refuses it)."""
    args = [sys.executable, "-m", "jobmesh", "coordinator", "--bind=127.0.0.1", "--worker-port=0",
            "--client-port=0", "--db=%s" % db] + ([] if synchronous is None else ["--db-synchronous=%s" % synchronous])
    args += extra
    child = Child("coordinator", args, run_dir)
    try:
        match = child.wait_for_line(LISTENING, timeout, poll)
    except ChildFailed:
        child.stop(2)
        raise
    return child, (match.group(1), int(match.group(2))), (match.group(3), int(match.group(4)))


def start_worker(run_dir: Path, index: int, worker_addr: tuple[str, int], capacity: int,
                 extra: list[str]) -> Child:
    args = [sys.executable, "-m", "jobmesh", "worker", "--coordinator=%s:%d" % worker_addr,
            "--id=bench-w%d" % index, "--capacity=%d" % capacity, "--log-level=WARNING"] + list(extra)
    return Child("worker%d" % index, args, run_dir)


def start_echo(run_dir: Path, timeout: float = 15.0) -> tuple[Child, tuple[str, int]]:
    args = [sys.executable, "-m", "bench.echo_baseline", "--serve", "--port=0"]
    child = Child("echo", args, run_dir)
    try:
        match = child.wait_for_line(ECHO_LISTENING, timeout)
    except ChildFailed:
        child.stop(2)
        raise
    return child, (match.group(1), int(match.group(2)))


def read_status_kb(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of ``pid`` in KiB (empty if the process is gone)."""
    out = {}
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line[:5]] = int(line.split()[1])
    except (OSError, ValueError):
        pass
    return out


def cpu_seconds(pid: int, thread: int | None = None) -> float | None:
    """User + system CPU time of ``pid`` so far, in seconds (of its thread ``thread`` only,
    when given: the main thread's id is ``pid``)."""
    try:
        with open("/proc/%d/stat" % pid if thread is None else "/proc/%d/task/%d/stat" % (pid, thread)) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def run_seconds(pid: int, thread: int | None = None) -> float | None:
    """The time every live thread of ``pid`` (or its thread ``thread`` alone) has run on a
    CPU so far, in seconds, to the nanosecond (``/proc/<pid>/task/*/schedstat``), where
    ``cpu_seconds`` counts ticks and splits them between threads and the process apart, so
    over a short window a thread's ticks can exceed its process's."""
    total = 0
    try:
        tasks = os.listdir("/proc/%d/task" % pid) if thread is None else [str(thread)]
    except OSError:
        return None
    for task in tasks:
        try:
            with open("/proc/%d/task/%s/schedstat" % (pid, task)) as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total / 1e9


def machine_cpu_seconds() -> float | None:
    """CPU time all of the machine's CPUs have been busy so far (``/proc/stat``: user,
    nice, system, irq, softirq, steal), in seconds: with the processes' own times it
    tells whether the cores were all in use, by whom (other processes, or the kernel's
    loopback work, which no process is charged for)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None


class RssSampler:
    """Polls a pid's memory in a greenlet: ``peak_kb`` (max VmHWM seen) and ``last_kb``."""

    def __init__(self, pid: int | None, interval: float = 0.25) -> None:
        self.pid = pid
        self.interval = interval
        self.peak_kb: int | None = None
        self.last_kb: int | None = None
        self._g = gevent.spawn(self._run) if pid else None

    def sample(self) -> int | None:
        if not self.pid:
            return None
        st = read_status_kb(self.pid)
        if "VmRSS" in st:
            self.last_kb = st["VmRSS"]
            peak = max(st.get("VmHWM", 0), st["VmRSS"])
            self.peak_kb = peak if self.peak_kb is None else max(self.peak_kb, peak)
        return self.last_kb

    def _run(self) -> None:
        while True:
            self.sample()
            gevent.sleep(self.interval)

    def stop(self) -> None:
        if self._g is not None:
            self.sample()
            self._g.kill(block=False)


def stop_on_interrupt(program: str, started: list[Child], work_dir: Path, keep: bool) -> None:
    """Ctrl-C or SIGTERM in a bench: stop every child of ``started`` still running, by pid
    (SIGTERM; a load generator then stops its own children), remove ``work_dir`` unless
    ``keep``, and leave at once without a table (exit 130)."""
    sys.stderr.write("\n%s: interrupted, stopping the children\n" % program)
    stop_all([c for c in started if c.alive()], 10)
    if not keep:
        shutil.rmtree(work_dir, ignore_errors=True)
    os._exit(130)
