"""The task child process: runs users' ``@task`` functions in a clean, unpatched interpreter.

Started by the worker (``jobmesh.worker.processes``) as::

    python -m jobmesh.worker.child --fd=N --tasks=MODULE[,MODULE...] [--log-level=L] [--log-format=F]

It never imports gevent: user code (``time.sleep``, ``logging``, threads, HTTP clients,
CPU loops) behaves exactly as in a plain script and cannot delay the worker's hub.

It talks to the worker over the socket ``N`` (one end of a ``socketpair``), in the
usual frames (``jobmesh.protocol.framing``); stdin is /dev/null. Its stdout and stderr
both go to the worker's stderr, the log stream: the user's ``print()`` and log lines show
up there, never on stdout (where ``jobmesh up`` relays the listening line), and cannot
corrupt the protocol. It logs as the worker does (``--log-level``, ``--log-format``); with
``json``, a relay thread turns whatever reaches fd 1 or 2 (``print``, a C library, a
subprocess) into one JSON object per line, and a task's traceback is one object too::

    worker -> child   {"op": "run", "taskType", "jobId", "attemptId", "attempt", "payload", "parents"?}
                      {"op": "cancel", "attemptId"}        sets that attempt's ctx.cancelled
    child -> worker   {"op": "ready", "pid", "taskTypes"}  once, after the modules loaded
                      {"op": "failed", "error"}            instead, then exit 1
                      {"op": "progress", "attemptId", "fraction", "message"}  ctx.progress, coalesced
                      {"op": "result", "attemptId", "success", "result", "error"}

Threads: a reader thread takes frames off the socket; "run" goes to the main thread
through a ``queue.Queue``, "cancel" sets the attempt's ``threading.Event``, and EOF (the
worker closed its end, or died) ends the process at once, whatever the main thread is
running: it SIGKILLs its own process group (itself and whatever the task started; the
worker made it the group's leader), so neither it nor a task's descendants outlive the
worker. The main thread runs one function at a time and sends its result. A relay
thread sends ``ctx.progress`` reports: only the latest of each attempt, at most once per
``PROGRESS_INTERVAL``, so a task that reports in a tight loop costs a lock and a dict
store per call, and the worker and the coordinator a few frames a second. A report the
relay has not sent when the function returns is dropped (the attempt is over).
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from typing import Any

from jobmesh.errors import ConfigError, ProtocolError
from jobmesh.logs import TEXT_FORMAT, JsonFormatter
from jobmesh.protocol.framing import FrameReader, encode_frame
from jobmesh.protocol.payloads import result_too_large
from jobmesh.worker.usertasks import TaskContext, load_modules, run_task

PROGRESS_INTERVAL = 0.2  # seconds between two progress frames of the task process, at least


class ProgressRelay:
    """The latest ``ctx.progress`` report of each attempt, sent by a thread of its own at
    most every ``interval`` seconds (the first one of a quiet spell at once)."""

    def __init__(self, send: Any, interval: float = PROGRESS_INTERVAL):
        self._send = send
        self._interval = interval
        self._ready = threading.Condition()
        self._latest: dict[str, tuple[float, str | None]] = {}

    def report(self, attempt_id: str, fraction: float, message: str | None) -> None:
        """``ctx.progress``'s sink; runs in the task's thread, never blocks on the socket."""
        with self._ready:
            if not self._latest:
                self._ready.notify()
            self._latest[attempt_id] = (fraction, message)

    def forget(self, attempt_id: str) -> None:
        """The attempt has ended: its unsent report is dropped."""
        with self._ready:
            self._latest.pop(attempt_id, None)

    def run(self) -> None:
        """The relay thread's body."""
        while True:
            with self._ready:
                while not self._latest:
                    self._ready.wait()
                latest, self._latest = self._latest, {}
            for attempt_id, (fraction, message) in latest.items():
                try:
                    data = encode_frame({"op": "progress", "attemptId": attempt_id, "fraction": fraction,
                                         "message": message})
                except ProtocolError:  # a message that does not encode (a lone surrogate): not sent
                    continue
                self._send(data)
            time.sleep(self._interval)


class Child:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.runs: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()
        self._write = threading.Lock()  # progress frames (relay thread) and results (main thread)
        self._contexts: dict[str, TaskContext] = {}
        self.progress = ProgressRelay(self.send_bytes)

    def send(self, obj: dict[str, Any]) -> None:
        self.send_bytes(encode_frame(obj))

    def send_bytes(self, data: bytes) -> None:
        try:
            with self._write:
                self.sock.sendall(data)
        except OSError:
            end()  # the worker is gone

    def read_loop(self) -> None:
        """The reader thread's body; ends the process when the worker's end closes."""
        reader = FrameReader(self.sock.recv)
        try:
            while True:
                frame = reader.read_frame()
                if frame is None:
                    break
                op = frame.get("op")
                if op == "run":
                    parents = frame.get("parents")
                    ctx = TaskContext(str(frame["jobId"]), int(frame["attempt"]), str(frame["attemptId"]),
                                      sink=self.progress.report, parents=parents if isinstance(parents, dict) else {})
                    with self._lock:
                        self._contexts[ctx.attempt_id] = ctx
                    self.runs.put((frame, ctx))
                elif op == "cancel":
                    with self._lock:
                        running = self._contexts.get(str(frame.get("attemptId")))
                    if running is not None:
                        running.cancelled.set()
        except (OSError, ProtocolError, KeyError, TypeError, ValueError):
            pass
        end()

    def serve(self) -> None:
        """The main thread: run each requested attempt and send its result, forever."""
        while True:
            frame, ctx = self.runs.get()
            payload = frame.get("payload")
            success, result, error = run_task(str(frame["taskType"]), payload if isinstance(payload, dict) else {}, ctx)
            too_large = result_too_large(result) if success else None
            if too_large is not None:  # fails here, in the same words as in the worker and the coordinator
                success, result, error = False, None, too_large
            with self._lock:
                self._contexts.pop(ctx.attempt_id, None)
            self.progress.forget(ctx.attempt_id)
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            reply = {"op": "result", "attemptId": ctx.attempt_id, "success": success, "result": result,
                     "error": error}
            try:
                data = encode_frame(reply)
            except ProtocolError as exc:  # too big for one frame, or not valid Unicode
                data = encode_frame({"op": "result", "attemptId": ctx.attempt_id, "success": False,
                                     "result": None, "error": "task result not sendable: %s" % exc})
            self.send_bytes(data)


def end() -> None:
    """Exit now, and take whatever the task started along (our group, when we lead it)."""
    if os.getpgrp() == os.getpid():
        os.killpg(0, signal.SIGKILL)  # ourselves included
    os._exit(0)


def setup_output(level: str, log_format: str) -> None:
    """Log to stderr as the worker does; stdout goes to stderr too (see the module docstring)."""
    os.dup2(2, 1)
    handler: logging.Handler
    if log_format == "json":
        log_fd = os.dup(2)
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        log_stream = os.fdopen(log_fd, "w", buffering=1, encoding="utf-8", errors="replace")
        handler = logging.StreamHandler(log_stream)
        handler.setFormatter(JsonFormatter())
        threading.Thread(target=_relay_output, args=(read_fd,), name="jobmesh-child-output", daemon=True).start()
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=getattr(logging, level, logging.INFO), handlers=[handler])
    for std in (sys.stdout, sys.stderr):
        try:
            std.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        except (AttributeError, ValueError):
            pass


def _relay_output(read_fd: int) -> None:
    """The json mode's relay thread: each line written to fd 1 or 2 becomes one log object."""
    output = logging.getLogger("jobmesh.task.output")
    output.setLevel(logging.INFO)  # a task's own output is shown whatever --log-level says
    with os.fdopen(read_fd, "r", encoding="utf-8", errors="replace") as lines:
        for line in lines:
            line = line.rstrip("\n")
            if line.strip():
                output.info("%s", line)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jobmesh.worker.child")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--tasks", default="")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", default="text")
    args = parser.parse_args(argv)
    # The worker decides when we stop (EOF on the socket); a Ctrl-C must not interrupt a
    # task mid-way (we lead a process group of our own, but a signal may still reach us).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_output(args.log_level, args.log_format)
    sock = socket.socket(fileno=args.fd)
    sock.set_inheritable(False)
    sock.setblocking(True)  # the worker's end is a gevent socket: the fd arrives non-blocking
    child = Child(sock)
    threading.Thread(target=child.read_loop, name="jobmesh-child-reader", daemon=True).start()
    threading.Thread(target=child.progress.run, name="jobmesh-child-progress", daemon=True).start()
    try:
        names = sorted(load_modules([m for m in args.tasks.split(",") if m]))
    except ConfigError as exc:
        child.send({"op": "failed", "error": str(exc)})
        os._exit(1)
    child.send({"op": "ready", "pid": os.getpid(), "taskTypes": names})
    child.serve()


if __name__ == "__main__":
    main()
