"""The CLI as a subprocess: ``run_cli`` runs a command to completion; ``UpProc`` is
``jobmesh up`` (a coordinator and its workers) with its output in files."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from tests.support.processes import LISTENING, alive, child_env
from tests.support.waiting import wait_until


def run_cli(*args: str, coordinator: str | None = None, stdin: str | None = None,
            timeout: float = 20.0, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m jobmesh ARGS`` to completion; text stdout/stderr, never raises on rc.
    ``env``: variables to add to the environment."""
    argv = [sys.executable, "-m", "jobmesh"] + list(args)
    if coordinator is not None:
        argv.append("--coordinator=%s" % coordinator)
    extra = env or {}
    env = child_env()
    env.pop("GEVENT_MONITOR_THREAD_ENABLE", None)  # its warnings would muddy stderr checks
    env.update(extra)
    return subprocess.run(argv, input=stdin, stdin=None if stdin is not None else subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


class UpProc:
    """``jobmesh up`` as a subprocess (coordinator and workers), output to files."""

    def __init__(self, tmp_path, *extra: str, new_session: bool = False):
        self.out_path = tmp_path / "up.out"
        self.err_path = tmp_path / "up.err"
        args = [sys.executable, "-m", "jobmesh", "up", "--worker-port=0", "--client-port=0",
                "--db=%s" % (tmp_path / "up.db"), "--heartbeat-timeout-millis=1500",
                "--sweep-interval-millis=50", "--db-synchronous=NORMAL", *extra]
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(args, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=child_env(),
                                         start_new_session=new_session)
        self.seen_pids: set[int] = set()

    def log(self) -> str:
        return self.err_path.read_text(errors="replace")

    def listening(self):
        if self.proc.poll() is not None:
            raise AssertionError("up exited rc=%s\n%s" % (self.proc.returncode, self.log()))
        return LISTENING.search(self.out_path.read_text(errors="replace"))

    def worker_pids(self) -> dict[str, int]:
        """The latest pid of each worker slot."""
        pids = {wid: int(pid) for wid, pid in re.findall(r"worker started worker=(\S+) pid=(\d+)", self.log())}
        self.seen_pids.update(pids.values())
        return pids

    def coordinator_pid(self) -> int:
        pid = int(wait_until(lambda: re.search(r"coordinator_pid=(\d+)", self.log()), timeout=10)[1])
        self.seen_pids.add(pid)
        return pid

    def cleanup(self) -> None:
        self.worker_pids()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        for pid in self.seen_pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def assert_all_gone(up: UpProc) -> None:
    """No process ``up`` started (coordinator, workers, any seen so far) is left."""
    pids = set(up.worker_pids().values()) | {up.coordinator_pid()} | up.seen_pids
    left = [pid for pid in pids if alive(pid)]
    assert not left, "orphaned children %s" % left
