"""The worker process: connect, register, read assignments, heartbeat, reconnect.

One connection at a time (a *session*), with three greenlets of its own besides the
task pool:

- the reader (the agent's greenlet): TASK_ASSIGN starts an attempt in the pool,
  TASK_CANCEL stops the attempt holding exactly that lease, ERROR is logged;
- the heartbeat greenlet: HEARTBEAT every ``heartbeat_interval_millis``, whatever the
  tasks do (CPU-heavy built-in tasks yield, see ``tasks.prime_count``; user tasks run in
  child processes, see ``processes``);
- the writer: the only greenlet that writes to the socket, draining the session's
  outbox (all queued frames in one ``sendall``), so frames from several greenlets never interleave.

A user task's progress reports (``ctx.progress``, coalesced by its task process) become
TASK_PROGRESS frames in the live session's outbox, ahead of the attempt's result; without
a live session they are dropped (progress is not held like a result).

When the connection ends, for whatever reason, the agent reconnects with capped
exponential backoff, registering under the same id. A refused registration (typically:
the coordinator still holds our previous session) is retried the same way. Given several
coordinator addresses (a leader and its standbys), each round tries them in turn, from
the one after the address of the last session: a refused or silent address (a standby
opens no job ports) moves on to the next at once, or after ``connect_timeout_millis``;
the backoff comes between whole rounds.

Its running attempts are kept meanwhile, for up to ``keep_running_millis``: they run on,
and the results of those that finish are held. Registering again, the agent names every
attempt it still runs or holds a result of (WORKER_REGISTER ``running``) and then sends
the held results. A coordinator that restarted with a lease grace keeps the leases it
still holds for a worker; every other one it answers with TASK_CANCEL, which stops that
attempt here (a held result it was sent is stale there, and dropped). A coordinator
that stayed up and saw the connection end has already given those leases up, so it
keeps none. Without a registration within ``keep_running_millis`` (checked between
connection attempts) the kept attempts are stopped and their results dropped, as they
are at once with 0.

A result written to a coordinator is not yet applied: one that froze or died may never
read it. So a worker that keeps attempts (``keep_running_millis`` > 0) and has somewhere
else to go (several addresses: where it also asks for HEARTBEAT_ACKs and leaves a
frozen coordinator) asks for RESULT_ACKs at registration, and where the coordinator
agrees (WORKER_REGISTERED ``resultAcks``) it holds each result it sent until an
acknowledgement or a TASK_CANCEL names it. At the next registration the results still
held are named and sent again like any other held result: the coordinator that follows
(restarted, or a standby that took over) applies them to the leases it kept, and
re-runs nothing that had finished. A worker with one address sends the frames it always
sent.

This module uses gevent's socket explicitly, so it works whether or not the process is
monkey-patched; it patches nothing.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any, Callable, TypeVar

import gevent
import gevent.ssl
from gevent import socket
from gevent.queue import Queue

from jobmesh.addresses import Address, AllFailed, first_reachable, joined
from jobmesh.auth import read_token, warn_if_exposed
from jobmesh.config import WorkerConfig
from jobmesh.errors import ConfigError, PayloadError, ProtocolError
from jobmesh.exitcodes import EXIT_FAILED, EXIT_OK
from jobmesh.protocol.framing import FrameReader, encode_frame
from jobmesh.protocol.payloads import TASK_TYPES
from jobmesh.protocol.messages import (
    NO_AUTH,
    WRONG_PORT_REFUSALS,
    TO_WORKER,
    Auth,
    AuthOk,
    Error,
    Heartbeat,
    HeartbeatAck,
    Message,
    ResultAck,
    TaskAssign,
    TaskCancel,
    TaskProgress,
    TaskResult,
    WorkerRegister,
    WorkerRegistered,
    decode,
)
from jobmesh.worker import tasks
from jobmesh.worker.processes import ProcessPool
from jobmesh.tls import client_context, secure
from jobmesh.worker.running import Attempt, InFlight, Key
from jobmesh.worker.usertasks import declared_defaults, load_modules

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)

REGISTER_TIMEOUT = 10.0
BACKOFF_INITIAL = 0.1
BACKOFF_CAP = 5.0
# While attempts are kept, retry at least this often: a restarted coordinator keeps their
# leases only for its grace (by default its heartbeat timeout).
KEEPING_BACKOFF_CAP = 0.5
# Unacknowledged data (our heartbeats) fails the connection after this long, so a silent
# network partition is noticed even though the coordinator never writes unprompted.
MIN_USER_TIMEOUT_MILLIS = 10_000
MIN_SILENCE_MILLIS = 1_000


class RegistrationRefused(Exception):
    """The coordinator answered WORKER_REGISTER with ERROR (e.g. the id is still in use)."""


class ConnectionLost(Exception):
    """The connection ended; the message says how."""


class WrongPort(Exception):
    """The address is a client or metrics port, or its coordinator takes no tokens and we
    hold one: retrying cannot help."""

    def __init__(self, address: Address, message: str):
        super().__init__(message)
        self.address = address


class WorkerAgent:
    """Run ``run()`` in a greenlet; kill that greenlet, then ``close()``, to stop the worker.

    With ``cfg.task_modules`` the constructor imports them (``ConfigError`` if it cannot)
    and the worker declares their task types besides the built-ins.
    """

    def __init__(self, cfg: WorkerConfig, pause: Callable[[], Any] = gevent.idle):
        self.cfg = cfg
        self.worker_id = cfg.worker_id
        self.addresses = cfg.coordinators
        self._next = 0  # the index of the address the next connection tries first
        self.connect_timeout = cfg.connect_timeout_millis / 1000.0
        # gevent's SSLContext: the handshake and every read yield, patched process or not.
        self.tls = client_context(cfg.tls, gevent.ssl.SSLContext) if cfg.tls is not None else None
        self.in_flight = InFlight(cfg.capacity)
        self._pause = pause
        # Results of attempts not yet written to a coordinator, by lease: held while
        # disconnected, taken by the session's writer while connected.
        self.results: dict[Key, bytes] = {}
        # Results written in this session and not yet acknowledged, by attempt id (with
        # their lease): only while the coordinator sends RESULT_ACKs (``_acked``).
        self.unacked: dict[str, tuple[Key, bytes]] = {}
        self._acked = False  # the live session's coordinator acknowledges results
        # Where there is somewhere else to go, as for HEARTBEAT_ACKs, and results are kept.
        self._asks_acks = len(self.addresses) > 1 and cfg.keep_running_millis > 0
        self._outbox: Queue | None = None  # the live session's outbox; None between sessions
        self._kept_since: float | None = None  # when the attempts kept across a lost connection were left
        self.registrations = 0
        self.token = cfg.token  # presented in AUTH; SIGHUP reads cfg.token_file again (``reload_token``)
        self.wrong_port: str | None = None  # set when the coordinator says this is its client or metrics port,
        # or that it takes no tokens
        self.user_task_types: frozenset[str] = frozenset()
        self.processes: ProcessPool | None = None
        # None (absent on the wire) means the five built-ins.
        self.task_types: list[str] | None = None
        self.task_defaults: dict[str, Any] | None = None  # the user task types' @task options
        if cfg.task_modules:
            self.user_task_types = frozenset(load_modules(cfg.task_modules))
            self.task_defaults = declared_defaults(self.user_task_types) or None
            self.processes = ProcessPool(cfg.task_modules, cfg.capacity, cancel_grace=cfg.cancel_grace_millis / 1000.0,
                                         log_args=("--log-level=%s" % cfg.log_level, "--log-format=%s" % cfg.log_format))
            self.task_types = list(TASK_TYPES) + sorted(self.user_task_types)
            log.info("user task types worker=%s modules=%s types=%s", self.worker_id,
                     ",".join(cfg.task_modules), ",".join(sorted(self.user_task_types)) or "(none)")

    def close(self) -> None:
        """End the task processes; call once ``run``'s greenlet is dead."""
        if self.processes is not None:
            self.processes.close()

    def reload_token(self) -> None:
        """SIGHUP: read the token file again; the next connection presents what it holds
        (the live one goes on with the token it opened with, until the coordinator closes
        it: a removed token's connections are closed at its SIGHUP). A file that cannot be
        read, or a token from ``JOBMESH_TOKEN``, keeps the token in force."""
        path = self.cfg.token_file
        if path is None:
            log.info("SIGHUP: worker=%s has no token file to read again", self.worker_id)
            return
        try:
            token = read_token(path)
        except ConfigError as exc:
            log.error("SIGHUP: kept the token in force worker=%s: %s", self.worker_id, exc)
            return
        warn_if_exposed(path, "the token file")
        changed = token != self.token
        self.token = token
        log.info("SIGHUP: read the token file %s again worker=%s: %s", path, self.worker_id,
                 "a new token, presented from the next connection on" if changed else "the same token")

    # ---- connection lifecycle ---------------------------------------------------------

    def run(self) -> None:
        """Connect, register and serve until killed; returns on its own only when the
        coordinator says this is its client or metrics port (``wrong_port`` tells why).
        Whatever ends it stops the attempts still running."""
        try:
            self._run()
        finally:
            self._abandon("the worker is stopping")

    def _run(self) -> None:
        delay = BACKOFF_INITIAL
        while True:
            self._give_up_kept()
            try:
                index, (sock, reader) = first_reachable(self.addresses, self._next, self._connect_and_register,
                                                        (OSError, ProtocolError, ConnectionLost, RegistrationRefused))
            except WrongPort as exc:
                # Pointed at the wrong port, or holding a token for a coordinator that takes
                # none: retrying cannot help.
                log.error("cannot register worker=%s at %s: %s", self.worker_id, exc.address, exc)
                self.wrong_port = str(exc)
                return
            except AllFailed as exc:
                refused = any(isinstance(e, RegistrationRefused) for _, e in exc.failures)
                log.log(logging.WARNING if refused else logging.INFO,
                        "%s worker=%s coordinator=%s reason=%r retry_in=%.1fs",
                        "registration refused" if refused else "cannot register", self.worker_id,
                        joined(self.addresses), str(exc), delay)
            else:
                # A reconnection starts with the next address: when this coordinator goes
                # away, a standby is the likelier one to take over.
                self._next = (index + 1) % len(self.addresses)
                delay = BACKOFF_INITIAL
                reason = self._serve(sock, reader)
                log.info("connection lost worker=%s coordinator=%s reason=%r reconnecting_in=%.1fs",
                         self.worker_id, self.addresses[index], reason, delay)
                self._keep_running()
            gevent.sleep(self._retry_delay(delay))
            delay = min(delay * 2, BACKOFF_CAP if self._kept_since is None else KEEPING_BACKOFF_CAP)

    # ---- attempts kept across a lost connection ----------------------------------------

    def kept(self) -> list[Key]:
        """The leases of the attempts still running here or holding a result, oldest first."""
        return list(dict.fromkeys(self.in_flight.leases() + list(self.results)
                                  + [key for key, _frame in self.unacked.values()]))

    def _keep_running(self) -> None:
        """The session ended: keep its attempts for ``keep_running_millis`` (or stop them now)."""
        if not self.kept():
            return
        if self.cfg.keep_running_millis <= 0:
            self._abandon("the connection ended")
            return
        self._kept_since = time.monotonic()
        log.info("keeping attempts while reconnecting worker=%s running=%d results=%d for_millis=%d",
                 self.worker_id, len(self.in_flight), len(self.results), self.cfg.keep_running_millis)

    def _retry_delay(self, delay: float) -> float:
        """The backoff, cut short when the kept attempts are due to be given up."""
        if self._kept_since is None:
            return delay
        left = self._kept_since + self.cfg.keep_running_millis / 1000.0 - time.monotonic()
        return max(0.0, min(delay, left))

    def _give_up_kept(self) -> None:
        """Stop the kept attempts once ``keep_running_millis`` passed without a registration."""
        since = self._kept_since
        if since is not None and (time.monotonic() - since) * 1000 >= self.cfg.keep_running_millis:
            self._abandon("no registration within %d ms" % self.cfg.keep_running_millis)

    def _abandon(self, why: str) -> None:
        """Stop every attempt and drop every unsent result (their leases are gone)."""
        self._kept_since = None
        abandoned = self.in_flight.abandon_all()
        dropped = len(self.results) + len(self.unacked)
        self.results.clear()
        self.unacked.clear()
        if abandoned or dropped:
            log.info("abandoned in-flight attempts worker=%s count=%d results_dropped=%d: %s",
                     self.worker_id, abandoned, dropped, why)

    def _deliver(self, attempt: Attempt, frame: bytes | None) -> None:
        """An attempt finished (``frame``: its TASK_RESULT; None if it was cancelled): sent
        by the live session's writer, or held until the next registration."""
        if frame is None:
            return
        self.results[attempt.key] = frame
        if self._outbox is not None:
            self._outbox.put(b"")  # wakes the writer, which takes the results

    def _connect_and_register(self, address: Address) -> tuple[socket.socket, FrameReader]:
        """Connect to ``address`` and register there; ``WrongPort`` if it is no worker port
        of ours (the others make the caller try the next address)."""
        sock = socket.create_connection((address.host, address.port), timeout=self.connect_timeout)
        try:
            # The handshake and the registration get longer; with somewhere else to go, no
            # longer than a silence (a frozen coordinator's kernel still accepts connections).
            sock.settimeout(REGISTER_TIMEOUT if len(self.addresses) == 1
                            else min(REGISTER_TIMEOUT, silence_limit(self.cfg.heartbeat_interval_millis) / 1000.0))
            sock = secure(sock, self.tls, address.host)
            _tune(sock, self.cfg.heartbeat_interval_millis)
            log.info("connected worker=%s coordinator=%s", self.worker_id, address)
            # The same reader serves the session: an assignment may share the reply's packet.
            reader = FrameReader(sock.recv)
            if self.token is not None:  # a coordinator with --auth-file: AUTH first
                ok = self._ask(sock, reader, Auth(self.token).to_wire(), AuthOk)
                log.info("authenticated worker=%s token=%s role=%s", self.worker_id, ok.name, ok.role)
            kept = self.kept()
            running = [{"jobId": job_id, "attemptId": attempt_id} for job_id, attempt_id in kept] or None
            # Absent means none: the frame a worker keeping nothing always sent.
            frame = WorkerRegister(self.worker_id, self.cfg.capacity, self.task_types, running,
                                   result_acks=self._asks_acks, task_defaults=self.task_defaults).to_wire()
            registered = self._ask(sock, reader, frame, WorkerRegistered)
            sock.settimeout(None)
        except RegistrationRefused as exc:
            sock.close()
            if str(exc).startswith(WRONG_PORT_REFUSALS) or str(exc) == NO_AUTH:
                raise WrongPort(address, str(exc)) from None
            raise
        except BaseException:
            sock.close()
            raise
        self.registrations += 1
        self._kept_since = None
        self._acked = registered.result_acks
        log.info("registered worker=%s capacity=%d heartbeat_millis=%d kept=%d",
                 self.worker_id, self.cfg.capacity, self.cfg.heartbeat_interval_millis, len(kept))
        return sock, reader

    @staticmethod
    def _ask(sock: socket.socket, reader: FrameReader, frame: dict[str, Any], expect: type[M]) -> M:
        """Send ``frame`` and read the answer, which must be ``expect``; an ERROR is a
        ``RegistrationRefused`` (a refused AUTH or WORKER_REGISTER)."""
        sock.sendall(encode_frame(frame))
        obj = reader.read_frame()
        if obj is None:
            raise ConnectionLost("closed before answering %s" % frame["type"])
        reply = decode(obj, TO_WORKER)
        if isinstance(reply, Error):
            raise RegistrationRefused(reply.message)
        if not isinstance(reply, expect):
            raise ProtocolError("expected %s, got %s" % (expect.TYPE, reply.TYPE))
        return reply

    def _serve(self, sock: socket.socket, reader: FrameReader) -> str:
        """Run one session until the connection ends; returns why it ended."""
        outbox: Queue = Queue()
        self._outbox = outbox
        if self.results:  # held while disconnected: they follow the registration
            outbox.put(b"")
        hearing = Hearing()
        writer = gevent.spawn(self._write_loop, sock, outbox)
        heart = gevent.spawn(self._heartbeat_loop, outbox, sock, hearing)
        try:
            return self._read_loop(reader, outbox, hearing)
        except ProtocolError as exc:
            log.warning("bad frame from coordinator worker=%s error=%r", self.worker_id, str(exc))
            return "protocol error: %s" % exc
        except OSError as exc:
            return str(exc) or type(exc).__name__
        finally:
            self._outbox = None
            gevent.killall([heart, writer])
            sock.close()
            # Not acknowledged: maybe never applied. Held, to be named and sent again.
            for key, frame in self.unacked.values():
                self.results[key] = frame
            self.unacked.clear()

    # ---- session greenlets ------------------------------------------------------------

    def _read_loop(self, reader: FrameReader, outbox: Queue, hearing: "Hearing") -> str:
        while True:
            obj = reader.read_frame()
            if obj is None:
                return hearing.why_ended or "coordinator closed the connection"
            hearing.heard()
            msg = decode(obj, TO_WORKER)
            if isinstance(msg, HeartbeatAck):
                if not hearing.answers:
                    hearing.answers = True
                    log.info("coordinator answers heartbeats worker=%s: its silence will count from now on",
                             self.worker_id)
            elif isinstance(msg, ResultAck):
                unacked = self.unacked
                for attempt_id in msg.attempt_ids:
                    if isinstance(attempt_id, str):
                        unacked.pop(attempt_id, None)
            elif isinstance(msg, TaskAssign):
                self._on_assign(msg, outbox)
            elif isinstance(msg, TaskCancel):
                self._on_cancel(msg)
            elif isinstance(msg, Error):
                log.warning("coordinator error worker=%s message=%r", self.worker_id, msg.message)
            else:
                log.warning("unexpected message worker=%s type=%s", self.worker_id, msg.TYPE)

    def _write_loop(self, sock: socket.socket, outbox: Queue) -> None:
        """Write the outbox's frames and the results waiting in ``results``. Results whose
        write did not complete (the connection failed, or the session ended) go back to
        ``results``, to be named at the next registration; written ones wait in
        ``unacked`` for their RESULT_ACK when the coordinator sends them."""
        sending: dict[Key, bytes] = {}
        try:
            for frame in outbox:
                # Whatever else is already queued goes out in the same write.
                while outbox.qsize():
                    frame += outbox.get_nowait()
                if self.results:
                    sending, self.results = self.results, {}
                    frame += b"".join(sending.values())
                    if self._acked:  # before the write: its acknowledgement may come before sendall returns
                        unacked = self.unacked
                        for key, result in sending.items():
                            unacked[key[1]] = (key, result)
                sock.sendall(frame)
                sending = {}
        except OSError as exc:
            log.info("send failed worker=%s error=%r", self.worker_id, str(exc))
            # Wake the reader: shutdown makes its recv return EOF.
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        finally:
            if sending:
                sending.update(self.results)
                self.results = sending

    def _heartbeat_loop(self, outbox: Queue, sock: socket.socket, hearing: "Hearing") -> None:
        # Answers are asked for only where there is somewhere else to go: a worker with one
        # address sends the HEARTBEAT it always sent.
        wire = Heartbeat(self.worker_id, ack=len(self.addresses) > 1).to_wire()
        if not wire["ack"]:
            del wire["ack"]
        frame = encode_frame(wire)
        interval = self.cfg.heartbeat_interval_millis / 1000.0
        silence = silence_limit(self.cfg.heartbeat_interval_millis) / 1000.0
        next_beat = time.monotonic()
        while True:
            quiet = hearing.quiet_for()
            if hearing.answers and quiet > silence:
                # Its kernel still takes our bytes, yet the process has not answered a
                # heartbeat: frozen (SIGSTOP, a paused VM). Move on to the next address.
                hearing.why_ended = "coordinator silent for %.1f s" % quiet
                log.warning("coordinator silent for %.1f s worker=%s: leaving the connection", quiet, self.worker_id)
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # the reader sees EOF
                except OSError:
                    pass
                return
            # A fixed cadence: one late beat does not push the following ones back, but
            # after a long stall the cadence restarts instead of sending a burst.
            next_beat += interval
            delay = next_beat - time.monotonic()
            if delay < 0:
                next_beat -= delay
                delay = 0.0
            gevent.sleep(delay)
            outbox.put(frame)
            log.debug("heartbeat worker=%s", self.worker_id)

    # ---- assignments ------------------------------------------------------------------

    def _on_assign(self, msg: TaskAssign, outbox: Queue) -> None:
        key = (msg.job_id, msg.attempt_id)
        if key in self.in_flight:
            log.warning("duplicate assignment ignored job=%s attempt=%s", *key)
            return
        attempt = self.in_flight.start(msg.job_id, msg.attempt_id, lambda a: self._run_attempt(msg, a),
                                       self._deliver)
        if attempt is None:
            log.warning("assignment over capacity job=%s attempt=%s capacity=%d",
                        msg.job_id, msg.attempt_id, self.cfg.capacity)
            outbox.put(self._result(msg, None, "worker at capacity (%d running)" % len(self.in_flight)))
            return
        log.debug("task started job=%s attempt=%s number=%d type=%s",
                  msg.job_id, msg.attempt_id, msg.attempt_number, msg.task_type)

    def _on_cancel(self, msg: TaskCancel) -> None:
        if self.in_flight.cancel(msg.job_id, msg.attempt_id):
            log.info("task cancelled job=%s attempt=%s", msg.job_id, msg.attempt_id)
        elif (self.results.pop((msg.job_id, msg.attempt_id), None) is not None
              or self.unacked.pop(msg.attempt_id, None) is not None):
            log.info("result dropped job=%s attempt=%s: the coordinator did not keep the lease",
                     msg.job_id, msg.attempt_id)
        else:
            log.debug("cancel for no running attempt job=%s attempt=%s", msg.job_id, msg.attempt_id)

    def _run_attempt(self, msg: TaskAssign, attempt: Attempt) -> bytes | None:
        """The attempt greenlet's body: the TASK_RESULT frame to send, or None if cancelled."""
        started = time.monotonic()
        result, error = None, None
        if msg.task_type in self.user_task_types and self.processes is not None:
            # Runs in a child process; this greenlet only waits (killing it detaches the child).
            success, result, error = self.processes.run(msg.task_type, msg.job_id, msg.attempt_id,
                                                        msg.attempt_number, msg.payload,
                                                        lambda fraction, text: self._progress(msg, fraction, text),
                                                        msg.parents)
            if not success:
                result, error = None, error or "task failed"
            log.debug("user task finished job=%s attempt=%s success=%s millis=%d", msg.job_id, msg.attempt_id,
                      success, (time.monotonic() - started) * 1000)
            return self._result(msg, result, error)
        if msg.task_type not in TASK_TYPES:
            return self._result(msg, None, "unknown task type %r: this worker runs %s"
                                % (msg.task_type, ", ".join(self.task_types or TASK_TYPES)))
        try:
            result = tasks.execute(msg.task_type, msg.payload, msg.attempt_number,
                                   attempt.cancel_event, self._pause)
        except tasks.TaskCancelled:
            return None
        except PayloadError as exc:
            error = "invalid payload: %s" % exc
        except tasks.TaskFailed as exc:
            error = str(exc)
        except Exception as exc:  # a bug in a task body must not take the worker down
            log.exception("task crashed job=%s attempt=%s", msg.job_id, msg.attempt_id)
            error = "worker error: %s: %s" % (type(exc).__name__, exc)
        log.debug("task finished job=%s attempt=%s success=%s millis=%d", msg.job_id, msg.attempt_id,
                  error is None, (time.monotonic() - started) * 1000)
        return self._result(msg, result, error)

    def _progress(self, msg: TaskAssign, fraction: Any, message: Any) -> None:
        """A progress report of ``msg``'s attempt: a TASK_PROGRESS for the live session, if
        there is one. A report that is not one (its task process checked it) is dropped."""
        outbox = self._outbox
        if outbox is None:
            return
        report = TaskProgress(self.worker_id, msg.job_id, msg.attempt_id, fraction, message)
        try:
            report.check_types()
            frame = encode_frame(report.to_wire())
        except (TypeError, ProtocolError):
            log.debug("progress not sendable job=%s attempt=%s", msg.job_id, msg.attempt_id)
            return
        outbox.put(frame)

    def _result(self, msg: TaskAssign, result: dict[str, Any] | None = None, error: str | None = None) -> bytes:
        """The TASK_RESULT frame echoing ``msg``'s lease."""
        try:
            return encode_frame(TaskResult(self.worker_id, msg.job_id, msg.attempt_id, error is None,
                                           result, error).to_wire())
        except ProtocolError as exc:  # a result too big for one frame fails the attempt instead
            return encode_frame(TaskResult(self.worker_id, msg.job_id, msg.attempt_id, False, None,
                                           "result not sendable: %s" % exc).to_wire())


class Hearing:
    """What one session has heard from its coordinator: when the last frame came, and
    whether it answers heartbeats at all (an older coordinator does not, and is then
    never judged by its silence)."""

    __slots__ = ("last", "answers", "why_ended")

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.answers = False
        self.why_ended: str | None = None

    def heard(self) -> None:
        self.last = time.monotonic()

    def quiet_for(self) -> float:
        return time.monotonic() - self.last


def silence_limit(heartbeat_interval_millis: int) -> int:
    """Milliseconds without a frame from a coordinator that answers heartbeats after which
    it is taken to be frozen: three missed answers, as a coordinator judges a worker by
    three missed heartbeats under its default timeout."""
    return max(MIN_SILENCE_MILLIS, 3 * heartbeat_interval_millis)


def _tune(sock: socket.socket, heartbeat_interval_millis: int) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)
    if user_timeout is not None:  # Linux
        millis = max(MIN_USER_TIMEOUT_MILLIS, 5 * heartbeat_interval_millis)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, user_timeout, millis)
        except OSError:
            pass


def run_worker(cfg: WorkerConfig) -> int:
    """Run a worker until SIGTERM/SIGINT (exit 0); 1 if it was pointed at the client port
    or the agent dies of a bug."""
    agent = WorkerAgent(cfg)
    main = gevent.spawn(agent.run)
    stopping: list[int] = []

    def stop(signum: int) -> None:
        if not stopping:
            stopping.append(signum)
            log.info("stopping worker=%s signal=%s", cfg.worker_id, signal.Signals(signum).name)
            main.kill(block=False)

    handlers = [gevent.signal_handler(s, stop, s) for s in (signal.SIGTERM, signal.SIGINT)]
    handlers.append(gevent.signal_handler(signal.SIGHUP, agent.reload_token))
    warn_if_exposed(cfg.token_file, "the token file")
    warn_if_exposed(cfg.tls.key if cfg.tls is not None else None, "the --tls-key file")
    try:
        main.join()
    finally:
        for handler in handlers:
            handler.cancel()
        agent.close()
    if agent.wrong_port is not None:
        return EXIT_FAILED  # logged with the right port to use
    if not main.successful():
        log.error("worker crashed worker=%s", cfg.worker_id, exc_info=main.exc_info)
        return EXIT_FAILED
    log.info("worker stopped worker=%s", cfg.worker_id)
    return EXIT_OK
