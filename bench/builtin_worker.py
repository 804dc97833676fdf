"""Scripted workers inside the load generator (``--worker-impl=builtin``).

Each is one greenlet pair on one worker-port connection: WORKER_REGISTER, a HEARTBEAT
every second, and a TASK_RESULT for every TASK_ASSIGN. They execute nothing: SLEEP
waits its duration (a timer, no CPU), every other task succeeds at once with a dummy
result. One writer greenlet per connection sends whatever is queued (results, heartbeats)
in one write. This
measures the coordinator alone, without the cost of real worker processes.

``executions`` counts results sent per jobId, so the report can show jobs executed
more than once (legal under at-least-once delivery, but only after a lost attempt).
``assigned_at`` holds the ``perf_counter`` time of every TASK_ASSIGN read, in order
(``bench/scaling.py`` derives assignments/s from it).

They connect through ``bench.conns.dial`` (TLS when the load generator's clients use
it) and, given a ``token`` (a worker token), send AUTH before WORKER_REGISTER.

``task_types`` (optional, one list per worker) is sent as WORKER_REGISTER ``taskTypes``;
without it the field is absent (the built-ins). ``assigned_by_type`` counts assignments
per task type, and an assignment of a type the worker did not declare counts as the
error ``misrouted``.
"""

from __future__ import annotations

import time
from collections import Counter

import gevent
import gevent.event
from gevent.queue import Queue

from bench.conns import authenticate, dial
from jobmesh.protocol.framing import FrameReader, encode_frame

HEARTBEAT_SECONDS = 1.0


class BuiltinWorkers:
    def __init__(self, addr: tuple[str, int], count: int, capacity: int,
                 task_types: list[list[str]] | None = None, token: str | None = None) -> None:
        self.addr = addr
        self.token = token
        self.count = count
        self.capacity = capacity
        self.task_types = task_types
        self.assigned_by_type: Counter = Counter()
        self.executions: Counter = Counter()
        self.cancels = 0
        self.assigned_at: list[float] = []
        self.errors: Counter = Counter()
        self._greenlets: list[gevent.Greenlet] = []
        self._socks: list = []

    def start(self, timeout: float = 15.0) -> None:
        """Connect and register every worker; raises if any is refused or times out."""
        ready = [gevent.event.Event() for _ in range(self.count)]
        for i in range(self.count):
            types = self.task_types[i] if self.task_types is not None else None
            self._greenlets.append(gevent.spawn(self._run, "bench-builtin-%d" % i, ready[i], types))
        for i, ev in enumerate(ready):
            if not ev.wait(timeout):
                raise RuntimeError("builtin worker %d did not register within %.0fs (%s)"
                                   % (i, timeout, dict(self.errors)))

    def _run(self, worker_id: str, ready, types: list[str] | None = None) -> None:
        helpers: list[gevent.Greenlet] = []
        try:
            sock = dial(self.addr, timeout=10)
            self._socks.append(sock)
            reader = FrameReader(sock.recv)
            if self.token is not None:
                authenticate(sock, reader, self.token)
            register = {"type": "WORKER_REGISTER", "workerId": worker_id, "capacity": self.capacity}
            if types is not None:
                register["taskTypes"] = types
            sock.sendall(encode_frame(register))
            reply = reader.read_frame()
            if not reply or reply.get("type") != "WORKER_REGISTERED":
                self.errors["register_refused"] += 1
                return
            sock.settimeout(None)
            ready.set()
            outbox: Queue = Queue()
            helpers.append(gevent.spawn(self._write, sock, outbox))
            helpers.append(gevent.spawn(self._heartbeat, outbox, worker_id))
            self._greenlets.extend(helpers)
            self._serve(reader, outbox, worker_id, None if types is None else frozenset(types))
        except Exception as exc:  # noqa: BLE001 - reported, never raised into the hub
            self.errors["worker_" + type(exc).__name__] += 1
        finally:
            gevent.killall(helpers, block=False)

    @staticmethod
    def _write(sock, outbox: Queue) -> None:
        """The connection's only writer: everything queued so far goes out in one write."""
        try:
            while True:
                frames = [outbox.get()]
                while not outbox.empty():
                    frames.append(outbox.get_nowait())
                sock.sendall(b"".join(frames))
        except OSError:
            return  # the reader sees the same failure and ends the session

    @staticmethod
    def _heartbeat(outbox: Queue, worker_id: str) -> None:
        frame = encode_frame({"type": "HEARTBEAT", "workerId": worker_id})
        while True:
            gevent.sleep(HEARTBEAT_SECONDS)
            outbox.put(frame)

    def _serve(self, reader: FrameReader, outbox: Queue, worker_id: str, declared: frozenset | None) -> None:
        while True:
            msg = reader.read_frame()
            if msg is None:
                return
            kind = msg.get("type")
            if kind == "TASK_ASSIGN":
                self.assigned_at.append(time.perf_counter())
                if declared is not None:
                    task_type = msg.get("taskType")
                    self.assigned_by_type[task_type] += 1
                    if task_type not in declared:
                        self.errors["misrouted"] += 1
                payload = msg.get("payload") or {}
                delay = payload.get("durationMillis", 0) if msg.get("taskType") == "SLEEP" else 0
                if delay > 0:
                    gevent.spawn_later(delay / 1000.0, lambda a=msg: outbox.put(self._encode(worker_id, a)))
                else:
                    outbox.put(self._encode(worker_id, msg))
            elif kind == "TASK_CANCEL":
                self.cancels += 1
            elif kind == "ERROR":
                self.errors["worker_error_frame"] += 1

    def _encode(self, worker_id: str, assign: dict) -> bytes:
        self.executions[assign["jobId"]] += 1
        if assign.get("taskType") == "SLEEP":
            result = {"sleptMillis": (assign.get("payload") or {}).get("durationMillis", 0)}
        else:
            result = {"builtin": True}
        return encode_frame({"type": "TASK_RESULT", "workerId": worker_id, "jobId": assign["jobId"],
                             "attemptId": assign["attemptId"], "success": True, "result": result,
                             "error": None})

    def stop(self) -> None:
        gevent.killall(self._greenlets, block=True, timeout=2)
        for sock in self._socks:
            try:
                sock.close()
            except OSError:
                pass
