"""Scripted peers over stdlib sockets: ``ScriptedWorker`` speaks the worker protocol by
hand, ``Client`` makes client-port requests, ``Peers`` closes what a test made; and the
waits for workers to come and go."""

from __future__ import annotations

import queue
import socket
import threading

from jobmesh.protocol import messages
from tests.support.connections import RawConn
from tests.support.waiting import wait_until


class RegistrationRefused(AssertionError):
    """The coordinator answered WORKER_REGISTER with something other than WORKER_REGISTERED."""

    def __init__(self, reply):
        super().__init__("registration refused: %r" % (reply,))
        self.reply = reply


class ScriptedWorker:
    """A worker that speaks the worker protocol by hand over a stdlib socket.

    After ``register`` a reader thread records every TASK_ASSIGN and TASK_CANCEL (and any
    ERROR) and a heartbeat thread sends HEARTBEAT every ``heartbeat_millis`` until
    ``pause_heartbeats``/``stop_heartbeats`` (a hung worker keeps its socket open but goes
    quiet). Nothing executes: the test decides when to ``complete`` or ``fail`` an
    assignment. ``active``/``max_active`` count assignments not yet answered or cancelled,
    as the worker sees them (a result frees its slot before it is sent).
    All waits are bounded.
    """

    def __init__(self, addr, worker_id: str = "w-1", capacity: int = 1, heartbeat_millis: int = 100):
        self.addr = addr
        self.worker_id = worker_id
        self.capacity = capacity
        self.heartbeat_millis = heartbeat_millis
        self.conn = RawConn(addr)
        self._send_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self.assigns: list[dict] = []          # every TASK_ASSIGN, in arrival order
        self.cancels: list[dict] = []          # every TASK_CANCEL, in arrival order
        self.errors: list[dict] = []           # ERROR frames from the coordinator
        self.bad_frames: list[object] = []     # frames that are not legal coordinator->worker messages
        self._assign_q: queue.Queue = queue.Queue()
        self._cancel_q: queue.Queue = queue.Queue()
        self._open: dict[tuple[str, str], dict] = {}   # (jobId, attemptId) -> assign, not yet answered
        self.max_active = 0
        self.closed = threading.Event()       # the coordinator closed the connection (or we did)
        self._hb_running = threading.Event()  # set while heartbeats flow
        self._stopping = threading.Event()
        self._reader: threading.Thread | None = None
        self._heartbeater: threading.Thread | None = None
        self.heartbeats_sent = 0

    # -- lifecycle ---------------------------------------------------------------

    def register(self, worker_id: str | None = None, capacity: int | None = None,
                 heartbeats: bool = True, timeout: float = 5.0, task_types: list[str] | None = None,
                 extra: dict | None = None) -> dict:
        """Send WORKER_REGISTER (with ``taskTypes`` if given, and the fields of ``extra``);
        return WORKER_REGISTERED or raise ``RegistrationRefused``."""
        if worker_id is not None:
            self.worker_id = worker_id
        if capacity is not None:
            self.capacity = capacity
        frame = {"type": "WORKER_REGISTER", "workerId": self.worker_id, "capacity": self.capacity}
        if task_types is not None:
            frame["taskTypes"] = task_types
        frame.update(extra or {})
        self.send(frame)
        self.conn.sock.settimeout(timeout)
        try:
            reply = self.conn.recv()
        except Exception as exc:  # timeout, reset, bad frame
            raise RegistrationRefused("no reply: %r" % (exc,)) from exc
        if reply is None or reply.get("type") != "WORKER_REGISTERED":
            raise RegistrationRefused(reply)
        # Blocking reads from here on; close() shuts the socket down to wake the reader.
        self.conn.sock.settimeout(None)
        self._reader = threading.Thread(target=self._read_loop, name="scripted-%s-reader" % self.worker_id,
                                         daemon=True)
        self._reader.start()
        self._heartbeater = threading.Thread(target=self._heartbeat_loop,
                                              name="scripted-%s-heartbeat" % self.worker_id, daemon=True)
        self._heartbeater.start()
        if heartbeats:
            self._hb_running.set()
        return reply

    def close(self) -> None:
        """Stop both threads and close the socket (the coordinator sees a disconnect)."""
        self._stopping.set()
        self._hb_running.set()  # wake the heartbeat thread so it can exit
        try:
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.conn.close()
        for t in (self._reader, self._heartbeater):
            if t is not None and t is not threading.current_thread():
                t.join(5)
        self.closed.set()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- sending -----------------------------------------------------------------

    def send(self, obj: dict) -> None:
        with self._send_lock:
            self.conn.send(obj)

    def send_raw(self, data: bytes) -> None:
        with self._send_lock:
            self.conn.send_raw(data)

    def heartbeat(self) -> None:
        self.send({"type": "HEARTBEAT", "workerId": self.worker_id})
        self.heartbeats_sent += 1

    def pause_heartbeats(self) -> None:
        """Go quiet (a hung worker): the socket stays open, no HEARTBEAT is sent."""
        self._hb_running.clear()

    stop_heartbeats = pause_heartbeats

    def resume_heartbeats(self) -> None:
        self._hb_running.set()

    start_heartbeats = resume_heartbeats

    def _heartbeat_loop(self) -> None:
        period = self.heartbeat_millis / 1000.0
        while not self._stopping.is_set():
            self._hb_running.wait(1.0)
            if self._stopping.is_set():
                return
            if not self._hb_running.is_set():
                continue
            try:
                self.heartbeat()
            except OSError:
                return
            self._stopping.wait(period)

    def result(self, assign: dict, success: bool, result=None, error=None, **extra) -> None:
        """Send a TASK_RESULT echoing ``assign``'s lease (``extra`` overrides fields)."""
        with self._state_lock:
            self._open.pop((assign["jobId"], assign["attemptId"]), None)
        msg = {"type": "TASK_RESULT", "workerId": self.worker_id, "jobId": assign["jobId"],
               "attemptId": assign["attemptId"], "success": success, "result": result, "error": error}
        msg.update(extra)
        self.send(msg)

    def complete(self, assign: dict, result: dict | None = None) -> None:
        self.result(assign, True, result=result if result is not None else {"ok": True}, error=None)

    def fail(self, assign: dict, error: str = "scripted failure") -> None:
        self.result(assign, False, result=None, error=error)

    # -- receiving ---------------------------------------------------------------

    def _read_loop(self) -> None:
        try:
            while not self._stopping.is_set():
                frame = self.conn.recv()
                if frame is None:
                    return
                self._dispatch(frame)
        except Exception:
            return
        finally:
            self.closed.set()

    def _dispatch(self, frame: dict) -> None:
        try:
            messages.decode(frame, messages.TO_WORKER)
        except Exception:
            self.bad_frames.append(frame)
            return
        kind = frame["type"]
        if kind == "TASK_ASSIGN":
            with self._state_lock:
                self.assigns.append(frame)
                self._open[(frame["jobId"], frame["attemptId"])] = frame
                self.max_active = max(self.max_active, len(self._open))
            self._assign_q.put(frame)
        elif kind == "TASK_CANCEL":
            with self._state_lock:
                self.cancels.append(frame)
                self._open.pop((frame["jobId"], frame["attemptId"]), None)
            self._cancel_q.put(frame)
        elif kind == "ERROR":
            self.errors.append(frame)
        else:
            self.bad_frames.append(frame)

    @property
    def active(self) -> int:
        with self._state_lock:
            return len(self._open)

    def await_assign(self, timeout: float = 5.0) -> dict:
        """The next TASK_ASSIGN not yet taken; AssertionError after ``timeout``."""
        try:
            return self._assign_q.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("%s: no TASK_ASSIGN within %.1fs" % (self.worker_id, timeout)) from None

    def await_cancel(self, timeout: float = 5.0) -> dict:
        """The next TASK_CANCEL not yet taken; AssertionError after ``timeout``."""
        try:
            return self._cancel_q.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("%s: no TASK_CANCEL within %.1fs" % (self.worker_id, timeout)) from None

    def poll_assign(self, timeout: float) -> dict | None:
        """The next TASK_ASSIGN, or None if none arrives within ``timeout`` (for negative checks)."""
        try:
            return self._assign_q.get(timeout=timeout)
        except queue.Empty:
            return None

    def poll_cancel(self, timeout: float) -> dict | None:
        try:
            return self._cancel_q.get(timeout=timeout)
        except queue.Empty:
            return None

    def wait_closed(self, timeout: float = 5.0) -> bool:
        return self.closed.wait(timeout)


class Client:
    """Client-port requests over one ``RawConn``; each method returns the reply dict."""

    def __init__(self, addr, timeout: float = 10.0):
        self.conn = RawConn(addr, timeout=timeout)

    def request(self, obj: dict) -> dict:
        return self.conn.request(obj)

    def submit(self, task_type: str, payload: dict, max_attempts: int | None = None, **extra) -> dict:
        msg = {"type": "SUBMIT_JOB", "taskType": task_type, "payload": payload}
        if max_attempts is not None:
            msg["maxAttempts"] = max_attempts
        msg.update(extra)
        return self.request(msg)

    def submit_ok(self, task_type: str, payload: dict, max_attempts: int | None = None, **extra) -> str:
        """Submit and insist on JOB_SUBMITTED; returns the jobId."""
        reply = self.submit(task_type, payload, max_attempts, **extra)
        assert reply.get("type") == "JOB_SUBMITTED", reply
        assert isinstance(reply.get("jobId"), str) and reply["jobId"], reply
        return reply["jobId"]

    def status(self, job_id: str) -> dict:
        """The job snapshot (JOB_STATUS's ``job``); AssertionError on any other reply."""
        reply = self.request({"type": "GET_JOB_STATUS", "jobId": job_id})
        assert reply.get("type") == "JOB_STATUS", reply
        return reply["job"]

    def state(self, job_id: str) -> str:
        return self.status(job_id)["state"]

    def cancel(self, job_id: str) -> dict:
        return self.request({"type": "CANCEL_JOB", "jobId": job_id})

    def list_jobs(self, **fields) -> dict:
        return self.request(dict({"type": "LIST_JOBS"}, **fields))

    def workers(self) -> list[dict]:
        reply = self.request({"type": "LIST_WORKERS"})
        assert reply.get("type") == "WORKER_LIST", reply
        return reply["workers"]

    def wait_state(self, job_id: str, states, timeout: float = 5.0) -> dict:
        """Poll status until the job is in one of ``states``; returns the snapshot."""
        if isinstance(states, str):
            states = (states,)
        last = {}

        def check():
            last["job"] = self.status(job_id)
            return last["job"] if last["job"]["state"] in states else None

        try:
            return wait_until(check, timeout=timeout, interval=0.01, message="job %s in %s" % (job_id, states))
        except AssertionError as exc:
            raise AssertionError("%s; last snapshot %r" % (exc, last.get("job"))) from None

    def close(self) -> None:
        self.conn.close()


class Peers:
    """Scripted workers and clients made by a test, all closed at teardown."""

    def __init__(self):
        self._all: list = []

    def worker(self, coord, worker_id: str = "w-1", capacity: int = 1, heartbeat_millis: int = 100,
               register: bool = True, task_types: list[str] | None = None) -> ScriptedWorker:
        w = ScriptedWorker(coord.worker_addr, worker_id=worker_id, capacity=capacity,
                           heartbeat_millis=heartbeat_millis)
        self._all.append(w)
        if register:
            w.register(task_types=task_types)
        return w

    def client(self, coord) -> Client:
        c = Client(coord.client_addr)
        self._all.append(c)
        return c

    def raw(self, addr) -> RawConn:
        r = RawConn(addr)
        self._all.append(r)
        return r

    def close_all(self) -> None:
        for p in reversed(self._all):
            try:
                p.close()
            except Exception:
                pass
        self._all.clear()


def wait_registered(client, worker_ids, timeout: float = 10.0) -> list[dict]:
    """Wait until every id in ``worker_ids`` is in the coordinator's live worker list."""
    wanted = set(worker_ids)

    def check():
        found = client.workers()
        return found if wanted <= {w["workerId"] for w in found} else None

    return wait_until(check, timeout=timeout, message="workers %s registered" % sorted(wanted))


def wait_no_worker(client, timeout: float = 10.0) -> None:
    """Wait until no worker is live: on a coordinator tests share, the workers of the tests
    before are gone."""
    wait_until(lambda: not client.workers(), timeout=timeout, message="the workers of earlier tests gone")
