"""The worker's side of user tasks: a pool of unpatched child processes (``jobmesh.worker.child``).

Why child processes at all: docs/ARCHITECTURE.md, "User tasks: unpatched child
processes". In short, under ``patch_all`` user threads become greenlets, real threads
plus ``logging`` deadlock, multiprocessing hangs, and a long call holding the GIL
starves the hub; a child interpreter has none of that and runs on another core.

- One child per busy slot, started lazily by the attempt greenlet that needs it and
  reused by later attempts; at most ``capacity`` children wait idle.
- An attempt greenlet (in ``InFlight``'s pool) calls ``ProcessPool.run``: it takes a
  child, sends "run" and waits for the result frame, cooperatively, handing the
  attempt's progress frames (already coalesced by the child) to its ``on_progress``.
- Each child leads its own process group, so whatever a task starts (a fork, a
  subprocess) is signalled with it. A small greenlet per child waits for its exit by pid
  (gevent's child watcher), not for EOF on its socket, which a forked descendant may hold
  open: at the exit it SIGKILLs the rest of the group and shuts our end down, so the
  attempt waiting on that socket fails at once.
- A child that dies mid-attempt (a segfault, ``os._exit``) fails that attempt with
  "task process exited with code N"; the next attempt starts a new child.
- Cancel: the attempt greenlet is killed as usual, so its slot frees at once. The child,
  which may still be running the function, is *detached*: a drain greenlet sends it
  "cancel" (setting ``ctx.cancelled``) and waits ``cancel_grace`` seconds for its late
  result, which it drops before giving the child back to the idle set (or ending it).
  A task that has not returned by then gets SIGTERM (its whole process group), and
  SIGKILL after another ``cancel_grace``. At most ``capacity`` detached children run at
  once: one more cancel SIGKILLs the oldest. Each step is logged with the pid.
- ``close`` ends every child: closing our end of its socket makes it kill its group and
  exit; whatever is still alive after a grace period is killed with its group.

Uses gevent's socket and subprocess explicitly, so it works patched or not (the tests
drive it from an unpatched process).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Any, Callable, Iterable

import gevent
from gevent import socket, subprocess
from gevent.pool import Group

from jobmesh.errors import ProtocolError
from jobmesh.protocol.framing import FrameReader, encode_frame

log = logging.getLogger(__name__)

# What an attempt does with its task's progress reports: (fraction, message).
OnProgress = Callable[[Any, Any], None]

START_TIMEOUT = 60.0      # importing the user's modules may be slow (think numpy, torch)
EXIT_WAIT = 5.0           # how long to wait for the exit code of a child whose socket closed
STOP_GRACE = 2.0          # after EOF, how long a child gets to exit before SIGKILL
CANCEL_GRACE = 5.0        # after a cancel, how long before SIGTERM, and then before SIGKILL


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
        self.killed = False     # SIGKILL was sent to the group
        self._buried = False    # the child has exited and the rest of its group was killed
        gevent.spawn(self._watch)

    @classmethod
    def start(cls, modules: Iterable[str], env: dict[str, str] | None = None, log_args: Iterable[str] = (),
              timeout: float = START_TIMEOUT) -> "TaskProcess":
        """Start a child and wait for it to load ``modules``; TaskProcessError if it cannot.

        ``log_args`` (``--log-level=...``, ``--log-format=...``) make it log as the worker does."""
        began = time.monotonic()
        ours, theirs = socket.socketpair()
        try:
            argv = [sys.executable, "-m", "jobmesh.worker.child", "--fd=%d" % theirs.fileno(),
                    "--tasks=%s" % ",".join(modules), *log_args]
            # process_group=0: the child leads a group of its own, see signal_group.
            proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
                                    process_group=0)
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

    def _watch(self) -> None:
        self.proc.wait()
        self._bury()

    def _bury(self) -> None:
        """Once the child has exited: kill what is left of its group (a forked descendant
        may hold its end of the socket) and shut our end down, so a reader sees EOF now."""
        if self._buried:
            return
        self._buried = True
        # The group outlives its leader while a member lives, so its id is not reused yet.
        _killpg(self.pid, signal.SIGKILL)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the child and everything it started (its process group)."""
        if self._buried:
            return  # the group is gone, and its id may be another's by now
        if signum == signal.SIGKILL:
            self.killed = True
        _killpg(self.pid, signum)

    def wait_exit(self, timeout: float) -> bool:
        """Whether the child exits within ``timeout`` seconds."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def send(self, obj: dict[str, Any]) -> None:
        self.sock.sendall(encode_frame(obj))

    def wait_result(self, attempt_id: str, on_progress: OnProgress | None = None) -> dict[str, Any]:
        """The result frame for ``attempt_id``; TaskProcessError if the child dies first.
        Its progress frames meanwhile go to ``on_progress``; any other frame (a late
        report of an earlier attempt) is skipped."""
        try:
            while True:
                frame = self.reader.read_frame()
                if frame is None:
                    break
                if frame.get("attemptId") != attempt_id:
                    continue
                op = frame.get("op")
                if op == "result":
                    return frame
                if op == "progress" and on_progress is not None:
                    on_progress(frame.get("fraction"), frame.get("message"))
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
        """Close our end (the child kills its group and exits on EOF); with ``wait``, give it
        ``timeout`` seconds first. Whatever of its group is left is killed."""
        try:
            self.sock.close()
        except OSError:
            pass
        if wait and not self.wait_exit(timeout):
            log.warning("task process did not exit, killing pid=%d", self.pid)
        if self.alive():
            self.signal_group(signal.SIGKILL)
        else:
            self._bury()


def _killpg(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except OSError:  # no such group any more
        pass


class ProcessPool:
    """Children for user task attempts: at most ``capacity`` idle, one per running attempt."""

    def __init__(self, modules: Iterable[str], capacity: int, env: dict[str, str] | None = None,
                 cancel_grace: float = CANCEL_GRACE, log_args: Iterable[str] = ()):
        self.modules = tuple(modules)
        self.capacity = capacity
        self.cancel_grace = cancel_grace
        self._env = env
        self._log_args = tuple(log_args)  # the child logs as the worker does: --log-level, --log-format
        self._idle: list[TaskProcess] = []
        self._live: set[TaskProcess] = set()
        self._drains = Group()
        self._detached: dict[TaskProcess, str] = {}  # oldest first: "job=... attempt=..."
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
        return len(self._detached)

    def run(self, task_type: str, job_id: str, attempt_id: str, attempt: int, payload: dict[str, Any],
            on_progress: OnProgress | None = None, parents: dict[str, Any] | None = None
            ) -> tuple[bool, dict[str, Any] | None, str | None]:
        """Run one attempt in a child: ``(success, result, error)``; its progress reports
        go to ``on_progress`` as they arrive. ``parents``: a workflow job's dependencies'
        results by ref (TASK_ASSIGN's), the task's ``ctx.parents``.

        Blocks the calling greenlet until the result arrives. Killing that greenlet
        (cancel, session end) detaches the child, see the module docstring.
        """
        try:
            run = {"op": "run", "taskType": task_type, "jobId": job_id, "attemptId": attempt_id,
                   "attempt": attempt, "payload": payload}
            if parents is not None:
                run["parents"] = parents
            request = encode_frame(run)
        except ProtocolError as exc:  # a payload (and parents' results) at the very frame limit
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
            reply = child.wait_result(attempt_id, on_progress)
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
        child = TaskProcess.start(self.modules, self._env, self._log_args)
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
        running = [c for c in self._detached if not c.killed]
        if len(running) >= self.capacity:
            oldest = running[0]
            log.warning("%d cancelled tasks still running, at most %d (the capacity): SIGKILL to the oldest's "
                        "process group pid=%d %s", len(running), self.capacity, oldest.pid, self._detached[oldest])
            oldest.signal_group(signal.SIGKILL)
        self._detached[child] = "job=%s attempt=%s" % (job_id, attempt_id)
        self._drains.spawn(self._drain, child, job_id, attempt_id)

    def _drain(self, child: TaskProcess, job_id: str, attempt_id: str) -> None:
        try:
            self._drain_child(child, job_id, attempt_id)
        finally:
            self._detached.pop(child, None)

    def _drain_child(self, child: TaskProcess, job_id: str, attempt_id: str) -> None:
        began = time.monotonic()
        grace = self.cancel_grace
        try:
            child.send({"op": "cancel", "attemptId": attempt_id})
        except OSError:
            pass
        log.info("cancelled task still running in pid %d, now an extra process until it returns (SIGTERM in %.1fs); "
                 "its result will be dropped job=%s attempt=%s", child.pid, grace, job_id, attempt_id)
        returned = False
        try:
            with gevent.Timeout(grace, False):
                child.wait_result(attempt_id)
                returned = True
        except TaskProcessError as exc:
            log.info("cancelled task's process ended pid=%d job=%s attempt=%s: %s", child.pid, job_id, attempt_id, exc)
            self._discard(child)
            return
        if returned:
            log.info("cancelled task returned in pid %d after %d ms; its result was dropped job=%s attempt=%s",
                     child.pid, (time.monotonic() - began) * 1000, job_id, attempt_id)
            self._release(child)
            return
        log.warning("cancelled task did not return within %.1fs: SIGTERM to its process group pid=%d job=%s attempt=%s",
                    grace, child.pid, job_id, attempt_id)
        child.signal_group(signal.SIGTERM)
        if not child.wait_exit(grace):
            log.warning("cancelled task still running %.1fs after SIGTERM: SIGKILL to its process group pid=%d "
                        "job=%s attempt=%s", grace, child.pid, job_id, attempt_id)
            child.signal_group(signal.SIGKILL)
        log.info("cancelled task's process ended pid=%d job=%s attempt=%s: %s", child.pid, job_id, attempt_id,
                 child.exit_description())
        self._discard(child)
