"""Test helpers: real coordinator processes, raw framed sockets, polling.

The test process is never monkey-patched: everything here uses the stdlib, and
coordinators and workers run as subprocesses (``python -m jobmesh ...``) whose output
goes to files (an undrained pipe would freeze a child's hub).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from jobmesh.protocol.framing import FrameReader, encode_frame

LISTENING = re.compile(
    r"jobmesh coordinator listening worker=(?P<w>\S+):(?P<wp>\d+) client=(?P<c>\S+):(?P<cp>\d+)"
    r"(?: periodic=(?P<p>\S+):(?P<pp>\d+))?"
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


def wait_until(predicate, timeout=10.0, interval=0.01, message="condition"):
    """Poll ``predicate`` until it returns a truthy value (returned) or fail after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("timed out after %.1fs waiting for %s" % (timeout, message))
        time.sleep(interval)


def child_env():
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("GEVENT_MONITOR_THREAD_ENABLE", "1")
    return env


class CoordinatorProc:
    """A real ``jobmesh coordinator`` subprocess on port 0 with a temp database."""

    def __init__(self, tmp_path: Path, db: Path | None = None, name: str = "coord", **flags):
        self.tmp_path = Path(tmp_path)
        self.db = Path(db) if db else self.tmp_path / "jobmesh.db"
        self.name = name
        self.flags = dict(FAST_FLAGS)
        self.flags.update({k.replace("_", "-"): v for k, v in flags.items()})
        self.proc: subprocess.Popen | None = None
        self.worker_addr: tuple[str, int] | None = None
        self.client_addr: tuple[str, int] | None = None
        self.periodic_addr: tuple[str, int] | None = None
        self._n = 0

    def start(self, timeout: float = 15.0, worker_port: int = 0, client_port: int = 0) -> "CoordinatorProc":
        self._n += 1
        self.out_path = self.tmp_path / ("%s-%d.out" % (self.name, self._n))
        self.err_path = self.tmp_path / ("%s-%d.err" % (self.name, self._n))
        args = [sys.executable, "-m", "jobmesh", "coordinator",
                "--worker-port=%d" % worker_port, "--client-port=%d" % client_port, "--db=%s" % self.db]
        args += ["--%s=%s" % (k, v) for k, v in self.flags.items() if v is not None]
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(args, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=child_env())
        m = wait_until(self._listening, timeout=timeout, message="coordinator listening line")
        self.worker_addr = (m["w"], int(m["wp"]))
        self.client_addr = (m["c"], int(m["cp"]))
        if m["p"]:
            self.periodic_addr = (m["p"], int(m["pp"]))
        return self

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


class RawConn:
    """A stdlib framed connection: send dicts or raw bytes, receive dicts."""

    def __init__(self, addr, timeout: float = 10.0):
        self.sock = socket.create_connection(addr, timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = FrameReader(self.sock.recv)

    def send(self, obj: dict) -> None:
        self.sock.sendall(encode_frame(obj))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self) -> dict | None:
        """The next frame, or None on a clean close."""
        return self.reader.read_frame()

    def request(self, obj: dict) -> dict:
        self.send(obj)
        reply = self.recv()
        if reply is None:
            raise AssertionError("connection closed instead of replying to %r" % (obj,))
        return reply

    def is_closed(self, timeout: float = 5.0) -> bool:
        """True if the peer closes the connection within ``timeout`` (frames before EOF are skipped)."""
        self.sock.settimeout(timeout)
        try:
            while True:
                if self.reader.read_frame() is None:
                    return True
        except (socket.timeout, TimeoutError):
            return False
        except (OSError, Exception):
            return True

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
