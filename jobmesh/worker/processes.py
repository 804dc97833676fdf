"""The worker's side of user tasks: a pool of unpatched child processes (``jobmesh.worker.child``).

Why child processes at all: docs/ARCHITECTURE.md, "User tasks: unpatched child
processes". In short, under ``patch_all`` user threads become greenlets, real threads
plus ``logging`` deadlock, multiprocessing hangs, and a long call holding the GIL
starves the hub; a child interpreter has none of that and runs on another core.

- One child per busy slot, started lazily by the attempt greenlet that needs it and
  reused by later attempts; at most ``capacity`` children wait idle.
- An attempt greenlet (in ``InFlight``'s pool) calls ``ProcessPool.run``: it takes a
  child, sends "run" and waits for the result frame, cooperatively.
- A child that dies mid-attempt (a segfault, ``os._exit``) fails that attempt with
  "task process exited with code N"; the next attempt starts a new child.
- Cancel: the attempt greenlet is killed as usual, so its slot frees at once. The child,
  which may still be running the function, is *detached*: a small greenlet sends it
  "cancel" (setting ``ctx.cancelled``), waits for its late result, drops it, and gives
  the child back to the idle set (or ends it). Until then the child is an extra process
  beyond ``capacity``; both moments are logged at INFO.
- ``close`` ends every child: closing our end of its socket makes it ``os._exit(0)``;
  whatever is still alive after a grace period is killed.

Uses gevent's socket and subprocess explicitly, so it works patched or not (the tests
drive it from an unpatched process).
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from typing import Any, Iterable

from gevent import socket, subprocess
from gevent.pool import Group

from jobmesh.errors import ProtocolError
from jobmesh.protocol.framing import FrameReader, encode_frame

log = logging.getLogger(__name__)

START_TIMEOUT = 60.0      # importing the user's modules may be slow (think numpy, torch)
EXIT_WAIT = 5.0           # how long to wait for the exit code of a child whose socket closed
STOP_GRACE = 2.0          # after EOF, how long a child gets to exit before SIGKILL


class TaskProcessError(Exception):
    """A child could not start, or died; ``str(exc)`` is the attempt's error."""


class TaskProcess:
    """One child process and our end of its socket. Use ``TaskProcess.start``."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket, start_millis: float):
        self.proc = proc
        self.pid = proc.pid
        self.sock = sock
        self.reader = FrameReader(sock.recv)
        self.start_millis = start_millis
        self.attempts = 0

    @classmethod
    def start(cls, modules: Iterable[str], env: dict[str, str] | None = None,
              timeout: float = START_TIMEOUT) -> "TaskProcess":
        """Start a child and wait for it to load ``modules``; TaskProcessError if it cannot."""
        began = time.monotonic()
        ours, theirs = socket.socketpair()
        try:
            argv = [sys.executable, "-m", "jobmesh.worker.child", "--fd=%d" % theirs.fileno(),
                    "--tasks=%s" % ",".join(modules)]
            proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        child = cls(proc, ours, 0.0)
        try:
            ours.settimeout(timeout)
            try:
                hello = child.reader.read_frame()
            except (OSError, ProtocolError) as exc:  # socket.timeout is an OSError
                raise TaskProcessError("task process did not start: %s" % (str(exc) or type(exc).__name__)) from None
            ours.settimeout(None)
            if hello is None:
                raise TaskProcessError("task process did not start: %s" % child.exit_description())
            if hello.get("op") != "ready":
                raise TaskProcessError("task process did not start: %s" % hello.get("error", hello))
        except BaseException:
            child.end(wait=False)
            raise
        child.start_millis = (time.monotonic() - began) * 1000
        log.debug("task process started pid=%d millis=%.0f", child.pid, child.start_millis)
        return child

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, obj: dict[str, Any]) -> None:
        self.sock.sendall(encode_frame(obj))

    def wait_result(self, attempt_id: str) -> dict[str, Any]:
        """The result frame for ``attempt_id``; TaskProcessError if the child dies first."""
        try:
            while True:
                frame = self.reader.read_frame()
                if frame is None:
                    break
                if frame.get("op") == "result" and frame.get("attemptId") == attempt_id:
                    return frame
        except (OSError, ProtocolError):
            pass
        raise TaskProcessError(self.exit_description())

    def exit_description(self) -> str:
        """How the child ended (waits a little for its exit code; kills it if it lingers)."""
        try:
            rc = self.proc.wait(timeout=EXIT_WAIT)
        except subprocess.TimeoutExpired:
            self.end(wait=False)
            return "task process pid %d closed its connection and was killed" % self.pid
        if rc < 0:
            try:
                name = signal.Signals(-rc).name
            except ValueError:
                name = "signal %d" % -rc
            return "task process exited with code %d (killed by %s)" % (rc, name)
        return "task process exited with code %d" % rc

    def end(self, wait: bool = True, timeout: float = STOP_GRACE) -> None:
        """Close our end (the child exits on EOF); with ``wait``, SIGKILL it if it lingers."""
        try:
            self.sock.close()
        except OSError:
            pass
        if not wait:
            if self.alive():
                _kill(self.proc)
            return
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("task process did not exit, killing pid=%d", self.pid)
            _kill(self.proc)


def _kill(proc: subprocess.Popen) -> None:
    try:
        proc.kill()
    except OSError:
        pass


class ProcessPool:
    """Children for user task attempts: at most ``capacity`` idle, one per running attempt."""

    def __init__(self, modules: Iterable[str], capacity: int, env: dict[str, str] | None = None):
        self.modules = tuple(modules)
        self.capacity = capacity
        self._env = env
        self._idle: list[TaskProcess] = []
        self._live: set[TaskProcess] = set()
        self._drains = Group()
        self._closed = False
        self.started = 0             # children started so far

    def __len__(self) -> int:
        """Live children: busy, idle and detached."""
        return len(self._live)

    def pids(self) -> list[int]:
        """The process ids of the live children."""
        return sorted(child.pid for child in self._live)

    @property
    def idle(self) -> int:
        return len(self._idle)

    @property
    def detached(self) -> int:
        """Children still running a cancelled attempt."""
        return len(self._drains)

    def run(self, task_type: str, job_id: str, attempt_id: str, attempt: int,
            payload: dict[str, Any]) -> tuple[bool, dict[str, Any] | None, str | None]:
        """Run one attempt in a child: ``(success, result, error)``.

        Blocks the calling greenlet until the result arrives. Killing that greenlet
        (cancel, session end) detaches the child, see the module docstring.
        """
        try:
            request = encode_frame({"op": "run", "taskType": task_type, "jobId": job_id,
                                    "attemptId": attempt_id, "attempt": attempt, "payload": payload})
        except ProtocolError as exc:  # a payload at the very frame limit
            return False, None, "payload not sendable to the task process: %s" % exc
        try:
            child = self._acquire()
        except TaskProcessError as exc:
            return False, None, str(exc)
        try:
            child.sock.sendall(request)
        except OSError:  # the child is gone
            error = child.exit_description()
            self._discard(child)
            return False, None, error
        except BaseException:  # killed mid-send: the child's stream cannot be trusted
            self._discard(child)
            raise
        child.attempts += 1
        try:
            reply = child.wait_result(attempt_id)
        except TaskProcessError as exc:
            self._discard(child)
            log.warning("task process died job=%s attempt=%s pid=%d: %s", job_id, attempt_id, child.pid, exc)
            return False, None, str(exc)
        except BaseException:  # GreenletExit: the attempt was cancelled or abandoned
            self._detach(child, job_id, attempt_id)
            raise
        self._release(child)
        return bool(reply.get("success")), reply.get("result"), reply.get("error")

    def close(self) -> None:
        """End every child (idle, busy or detached) and stop the drain greenlets."""
        self._closed = True
        self._drains.kill(block=True, timeout=STOP_GRACE)
        children = list(self._live)
        self._live.clear()
        self._idle.clear()
        for child in children:  # EOF for all of them first, so they exit in parallel
            try:
                child.sock.close()
            except OSError:
                pass
        deadline = time.monotonic() + STOP_GRACE
        for child in children:
            child.end(timeout=max(0.0, deadline - time.monotonic()))
        if children:
            log.info("task processes ended count=%d", len(children))

    # ---- children in and out -----------------------------------------------------------

    def _acquire(self) -> TaskProcess:
        while self._idle:
            child = self._idle.pop()
            if child.alive():
                return child
            self._discard(child)
        child = TaskProcess.start(self.modules, self._env)
        self.started += 1
        if self._closed:  # the worker stopped while this child started
            child.end(wait=False)
            raise TaskProcessError("worker is stopping")
        self._live.add(child)
        return child

    def _release(self, child: TaskProcess) -> None:
        if not self._closed and child in self._live and len(self._idle) < self.capacity and child.alive():
            self._idle.append(child)
        else:
            self._discard(child)

    def _discard(self, child: TaskProcess) -> None:
        self._live.discard(child)
        if child in self._idle:
            self._idle.remove(child)
        child.end(wait=False)

    def _detach(self, child: TaskProcess, job_id: str, attempt_id: str) -> None:
        """Hand a child whose attempt was cancelled to a drain greenlet; never blocks."""
        if self._closed:
            self._discard(child)
            return
        self._drains.spawn(self._drain, child, job_id, attempt_id)

    def _drain(self, child: TaskProcess, job_id: str, attempt_id: str) -> None:
        began = time.monotonic()
        try:
            child.send({"op": "cancel", "attemptId": attempt_id})
        except OSError:
            pass
        log.info("cancelled task still running in pid %d, now an extra process until it returns; "
                 "its result will be dropped job=%s attempt=%s", child.pid, job_id, attempt_id)
        try:
            child.wait_result(attempt_id)
        except TaskProcessError as exc:
            log.info("cancelled task's process ended pid=%d job=%s attempt=%s: %s", child.pid, job_id, attempt_id, exc)
            self._discard(child)
            return
        log.info("cancelled task returned in pid %d after %d ms; its result was dropped job=%s attempt=%s",
                 child.pid, (time.monotonic() - began) * 1000, job_id, attempt_id)
        self._release(child)
