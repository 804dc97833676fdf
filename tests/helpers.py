"""Test helpers: real coordinator processes, raw framed sockets, polling.

The test process is never monkey-patched: everything here uses the stdlib, and
coordinators and workers run as subprocesses (``python -m jobmesh ...``) whose output
goes to files (an undrained pipe would freeze a child's hub).
"""

from __future__ import annotations

import itertools
import os
import random
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


def wait_until(predicate, timeout=10.0, interval=0.01, message="condition", sleep=time.sleep):
    """Poll ``predicate`` until it returns a truthy value (returned) or fail after timeout.

    ``sleep`` pauses between polls: ``gevent.sleep`` in a test that runs greenlets in its
    own process, so they get to run while it waits.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("timed out after %.1fs waiting for %s" % (timeout, message))
        sleep(interval)


# A request beside hostile peers may take this many times its baseline (the same request,
# measured in the same test before they arrived), or LATENCY_FLOOR seconds if that is
# longer: on loopback a baseline is a fraction of a millisecond, and a machine that runs
# the test slowly is slow for both. A peer that blocks the others costs them seconds, or
# their whole timeout.
LATENCY_FACTOR = 100
LATENCY_FLOOR = 1.0


def timed(fn):
    """``(fn(), seconds it took)``."""
    started = time.monotonic()
    value = fn()
    return value, time.monotonic() - started


def baseline(fn, n: int = 10) -> float:
    """The median of ``n`` timed calls of ``fn``, in seconds."""
    return sorted(timed(fn)[1] for _ in range(n))[n // 2]


def latency_limit(base: float) -> float:
    return max(LATENCY_FLOOR, LATENCY_FACTOR * base)


def assert_prompt(seconds: float, base: float, what: str = "the request") -> None:
    """Fail if ``seconds`` is over ``latency_limit(base)``."""
    limit = latency_limit(base)
    assert seconds < limit, "%s took %.3f s: over %.3f s (baseline %.2f ms)" % (what, seconds, limit, base * 1000)


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
        self.worker_addr = (m["w"], int(m["wp"]))
        self.client_addr = (m["c"], int(m["cp"]))
        if m["p"]:
            self.periodic_addr = (m["p"], int(m["pp"]))
        if m["m"]:
            self.metrics_addr = (m["m"], int(m["mp"]))
        return self

    def _limits(self) -> None:
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.open_files_limit, self.open_files_limit))

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


_strangers = itertools.count(1)


def stranger() -> str:
    """A loopback address of its own (127.0.X.Y, never 127.0.0.1) to connect from, so the
    failed attempts a test makes from it slow no other test's connections."""
    n = next(_strangers)
    return "127.0.%d.%d" % (1 + n // 250 % 250, 2 + n % 250)


class RawConn:
    """A stdlib framed connection: send dicts or raw bytes, receive dicts."""

    def __init__(self, addr, timeout: float = 10.0, source: str | None = None):
        """``source``: the local address to connect from (another loopback address, e.g.
        ``stranger()``, counts as another peer address for the coordinator's guard)."""
        self.sock = socket.create_connection(addr, timeout=timeout, source_address=(source, 0) if source else None)
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


# ---- scripted peers (added for the black-box suite) ---------------------------------

import queue as _queue  # noqa: E402
import threading as _threading  # noqa: E402

from jobmesh.protocol import messages as _messages  # noqa: E402


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
        self._send_lock = _threading.Lock()
        self._state_lock = _threading.Lock()
        self.assigns: list[dict] = []          # every TASK_ASSIGN, in arrival order
        self.cancels: list[dict] = []          # every TASK_CANCEL, in arrival order
        self.errors: list[dict] = []           # ERROR frames from the coordinator
        self.bad_frames: list[object] = []     # frames that are not legal coordinator->worker messages
        self._assign_q: _queue.Queue = _queue.Queue()
        self._cancel_q: _queue.Queue = _queue.Queue()
        self._open: dict[tuple[str, str], dict] = {}   # (jobId, attemptId) -> assign, not yet answered
        self.max_active = 0
        self.closed = _threading.Event()       # the coordinator closed the connection (or we did)
        self._hb_running = _threading.Event()  # set while heartbeats flow
        self._stopping = _threading.Event()
        self._reader: _threading.Thread | None = None
        self._heartbeater: _threading.Thread | None = None
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
        self._reader = _threading.Thread(target=self._read_loop, name="scripted-%s-reader" % self.worker_id,
                                         daemon=True)
        self._reader.start()
        self._heartbeater = _threading.Thread(target=self._heartbeat_loop,
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
            if t is not None and t is not _threading.current_thread():
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
            _messages.decode(frame, _messages.TO_WORKER)
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
        except _queue.Empty:
            raise AssertionError("%s: no TASK_ASSIGN within %.1fs" % (self.worker_id, timeout)) from None

    def await_cancel(self, timeout: float = 5.0) -> dict:
        """The next TASK_CANCEL not yet taken; AssertionError after ``timeout``."""
        try:
            return self._cancel_q.get(timeout=timeout)
        except _queue.Empty:
            raise AssertionError("%s: no TASK_CANCEL within %.1fs" % (self.worker_id, timeout)) from None

    def poll_assign(self, timeout: float) -> dict | None:
        """The next TASK_ASSIGN, or None if none arrives within ``timeout`` (for negative checks)."""
        try:
            return self._assign_q.get(timeout=timeout)
        except _queue.Empty:
            return None

    def poll_cancel(self, timeout: float) -> dict | None:
        try:
            return self._cancel_q.get(timeout=timeout)
        except _queue.Empty:
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


def read_until_closed(conn: RawConn, timeout: float = 5.0):
    """Collect frames until the peer closes; returns ``(frames, closed)``.

    A reset or a malformed frame counts as closed; ``closed`` is False if the
    connection is still open after ``timeout``.
    """
    frames: list[dict] = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return frames, False
        conn.sock.settimeout(left)
        try:
            frame = conn.reader.read_frame()
        except (socket.timeout, TimeoutError):
            return frames, False
        except Exception:
            return frames, True
        if frame is None:
            return frames, True
        frames.append(frame)


def assert_stays(predicate, duration: float, interval: float = 0.02, message: str = "condition"):
    """Fail if ``predicate`` is ever falsy during ``duration`` seconds (a bounded negative check)."""
    deadline = time.monotonic() + duration
    while True:
        value = predicate()
        if not value:
            raise AssertionError("%s stopped holding" % message)
        if time.monotonic() > deadline:
            return value
        time.sleep(interval)


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


# ---- a scripted coordinator for client unit tests ------------------------------------

CLOSE = "close"   # a ScriptedServer step: close the connection without a reply
HANG = "hang"     # a ScriptedServer step: never answer


class Delayed:
    """A ScriptedServer step that answers only after ``seconds``."""

    def __init__(self, seconds: float, step):
        self.seconds = seconds
        self.step = step


class ScriptedServer:
    """Accepts connections one after another and plays ``steps`` across them in order.

    ``port``: listen there (default: a free one); ``dies``: stop listening once the steps
    are played (connecting is refused then, as at a dead coordinator). Each step answers
    one request: a dict is sent as a frame, ``CLOSE`` closes the
    connection without a reply, ``HANG`` never answers, ``bytes`` are sent raw, and
    ``Delayed(seconds, step)`` plays ``step`` after a pause (a coordinator holding a WAIT_JOB).
    ``requests`` and ``connections`` record what arrived (stdlib threads, no patching).
    """

    def __init__(self, steps, port: int = 0, dies: bool = False):
        self.steps = list(steps)
        self.dies = dies
        self.requests: list[dict] = []
        self.connections = 0
        self.listener = socket.create_server(("127.0.0.1", port))
        self.listener.settimeout(0.05)  # before the thread starts: close() may come first
        self.port = self.listener.getsockname()[1]
        self._release = _threading.Event()
        self._thread = _threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while self.steps and not self._release.is_set():
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conn.settimeout(None)
            self.connections += 1
            with conn:
                reader = FrameReader(conn.recv)
                while self.steps:
                    try:
                        request = reader.read_frame()
                    except OSError:
                        break
                    if request is None:
                        break
                    self.requests.append(request)
                    step = self.steps.pop(0)
                    if self.dies and not self.steps:
                        self.listener.close()  # before this connection ends: the client sees the death whole
                    if step == CLOSE:
                        break
                    if isinstance(step, Delayed):
                        if self._release.wait(step.seconds):
                            break
                        step = step.step
                    if step == HANG:
                        self._release.wait(10)
                        break
                    conn.sendall(step if isinstance(step, bytes) else encode_frame(step))
        if self.dies:
            self.listener.close()

    def close(self):
        self._release.set()
        self.listener.close()
        self._thread.join(5)


# ---- real worker processes and the CLI as a subprocess ------------------------------

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
