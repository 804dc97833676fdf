"""Real coordinator and worker processes (``python -m jobmesh ...``) on port 0, with
their output in files (an undrained pipe would freeze a child's hub); FAST_FLAGS, the
"listening" line, and ports for processes started later. The test process is never
monkey-patched: everything here uses the stdlib."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tests.support.waiting import wait_until


LISTENING = re.compile(
    r"jobmesh coordinator listening worker=(?P<w>\S+):(?P<wp>\d+) client=(?P<c>\S+):(?P<cp>\d+)"
    r"(?: periodic=(?P<p>\S+):(?P<pp>\d+))?"
    r"(?: metrics=(?P<m>\S+):(?P<mp>\d+))?"
)


# Small timings so tests run fast; every one can be overridden per test.
FAST_FLAGS = {
    "heartbeat-timeout-millis": 600,
    "sweep-interval-millis": 20,
    "retry-base-millis": 20,
    "retry-cap-millis": 200,
    "task-timeout-millis": 60000,
    "db-synchronous": "NORMAL",
}


def listening_addresses(m: re.Match) -> tuple:
    """``(worker, client, periodic, metrics)`` addresses of a LISTENING match, each a
    ``(host, port)`` or None for a port that is not open."""
    periodic = (m["p"], int(m["pp"])) if m["p"] else None
    metrics = (m["m"], int(m["mp"])) if m["m"] else None
    return (m["w"], int(m["wp"])), (m["c"], int(m["cp"])), periodic, metrics


_handed_out: set[int] = set()


def unused_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, for a process to open later.

    It is drawn from below the kernel's ephemeral range, so an outgoing connection (a
    coordinator's own link to PostgreSQL, say) can never be given it in the meantime, and
    never twice in one run."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    while True:
        port = rng.randrange(10000, max(low, 10001))
        if port in _handed_out:
            continue
        _handed_out.add(port)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


def closed_address() -> str:
    """``127.0.0.1:PORT`` where nothing listens: connecting is refused, as at a standby
    coordinator (it opens no job ports)."""
    return "127.0.0.1:%d" % unused_port()


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def child_env():
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("GEVENT_MONITOR_THREAD_ENABLE", "1")
    return env


class CoordinatorProc:
    """A real ``jobmesh coordinator`` subprocess on port 0 with a temp database."""

    ENTRY: tuple[str, ...] = ("-m", "jobmesh")  # what the interpreter runs

    def __init__(self, tmp_path: Path, db: Path | str | None = None, name: str = "coord", **flags):
        self.tmp_path = Path(tmp_path)
        # An SQLite file, or a PostgreSQL URL (kept as given).
        self.db: Path | str = (db if isinstance(db, str) and "://" in db else Path(db) if db
                               else self.tmp_path / "jobmesh.db")
        self.name = name
        self.flags = dict(FAST_FLAGS)
        if isinstance(self.db, str):  # SQLite's setting, refused with a PostgreSQL URL
            del self.flags["db-synchronous"]
        self.flags.update({k.replace("_", "-"): v for k, v in flags.items()})
        self.proc: subprocess.Popen | None = None
        self.worker_addr: tuple[str, int] | None = None
        self.client_addr: tuple[str, int] | None = None
        self.periodic_addr: tuple[str, int] | None = None
        self.metrics_addr: tuple[str, int] | None = None  # with metrics_port=0 (the HTTP port)
        self.open_files_limit: int | None = None  # RLIMIT_NOFILE (soft and hard) for the process, if set
        self._n = 0

    def start(self, timeout: float = 15.0, worker_port: int = 0, client_port: int = 0) -> "CoordinatorProc":
        self._n += 1
        self.out_path = self.tmp_path / ("%s-%d.out" % (self.name, self._n))
        self.err_path = self.tmp_path / ("%s-%d.err" % (self.name, self._n))
        args = [sys.executable, *self.ENTRY, "coordinator",
                "--worker-port=%d" % worker_port, "--client-port=%d" % client_port, "--db=%s" % self.db]
        args += ["--%s=%s" % (k, v) for k, v in self.flags.items() if v is not None]
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(args, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=child_env(),
                                         preexec_fn=self._limits if self.open_files_limit else None)
        m = wait_until(self._listening, timeout=timeout, message="coordinator listening line")
        self.worker_addr, self.client_addr, self.periodic_addr, self.metrics_addr = listening_addresses(m)
        return self

    def _limits(self) -> None:
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.open_files_limit, self.open_files_limit))

    def running(self) -> bool:
        """True while the process runs."""
        return self.proc is not None and self.proc.poll() is None

    def open_fds(self) -> int:
        """How many descriptors the coordinator process holds now."""
        return len(os.listdir("/proc/%d/fd" % self.proc.pid))

    def rss_mb(self) -> float:
        with open("/proc/%d/status" % self.proc.pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def _listening(self):
        if self.proc.poll() is not None:
            raise AssertionError("coordinator exited rc=%s\n%s" % (self.proc.returncode, self.stderr()))
        return LISTENING.search(self.out_path.read_text(errors="replace"))

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    @property
    def client_target(self) -> str:
        return "%s:%d" % self.client_addr

    @property
    def worker_target(self) -> str:
        return "%s:%d" % self.worker_addr

    @property
    def metrics_url(self) -> str:
        """``http://HOST:PORT`` of the metrics port (start with ``metrics_port=0``)."""
        assert self.metrics_addr is not None, "started without --metrics-port"
        return "http://%s:%d" % self.metrics_addr

    def terminate(self, timeout: float = 10.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise AssertionError("coordinator did not stop within %.0fs of SIGTERM" % timeout)

    def kill(self) -> None:
        """SIGKILL: a crash."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class WorkerProc:
    """A real ``jobmesh worker`` subprocess; stdout and stderr (its log) go to files."""

    _started = 0

    def __init__(self, tmp_path: Path, target: str, worker_id: str = "w-1", capacity: int = 2,
                 heartbeat_millis: int = 100, log_level: str = "DEBUG", tasks: str | None = None,
                 cwd: Path | None = None, extra: tuple[str, ...] = ()):
        self.tmp_path = Path(tmp_path)
        self.target = target
        self.worker_id = worker_id
        self.capacity = capacity
        self.heartbeat_millis = heartbeat_millis
        self.log_level = log_level
        self.tasks = tasks  # --tasks=MODULES, found from ``cwd``
        self.cwd = cwd
        self.extra = tuple(extra)  # more flags, e.g. ("--log-format=json",)
        self.proc: subprocess.Popen | None = None
        WorkerProc._started += 1  # two processes may share an id: each gets its own log
        self.name = "worker-%s-%d" % (worker_id, WorkerProc._started)
        self.err_path = self.tmp_path / (self.name + ".err")

    def start(self) -> "WorkerProc":
        args = [sys.executable, "-m", "jobmesh", "worker", "--coordinator=%s" % self.target,
                "--id=%s" % self.worker_id, "--capacity=%d" % self.capacity,
                "--heartbeat-interval-millis=%d" % self.heartbeat_millis, "--log-level=%s" % self.log_level]
        if self.tasks:
            args.append("--tasks=%s" % self.tasks)
        args.extend(self.extra)
        out_path = self.tmp_path / (self.name + ".out")
        with open(out_path, "ab") as out, open(self.err_path, "ab") as err:
            self.proc = subprocess.Popen(args, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=child_env(),
                                         cwd=self.cwd)
        return self

    def log(self) -> str:
        return self.err_path.read_text(errors="replace") if self.err_path.exists() else ""

    def count(self, text: str) -> int:
        """How often ``text`` occurs in the worker's log so far."""
        return self.log().count(text)

    def terminate(self, timeout: float = 10.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    # terminate, wait, kill: exactly what a coordinator needs at teardown
    cleanup = CoordinatorProc.cleanup


class WorkerProcs:
    """Real workers started by a test (``start(coord, ...)``), all stopped at teardown."""

    def __init__(self, tmp_path: Path):
        self.tmp_path = Path(tmp_path)
        self._all: list[WorkerProc] = []

    def start(self, coord, worker_id: str = "w-1", **kwargs) -> WorkerProc:
        w = WorkerProc(self.tmp_path, coord.worker_target, worker_id=worker_id, **kwargs)
        self._all.append(w)
        return w.start()

    def cleanup(self) -> None:
        for w in self._all:
            w.cleanup()
