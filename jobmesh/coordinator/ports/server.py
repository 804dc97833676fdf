"""The worker and client ports: frames in, core events out; replies and frames back.

Connection handlers are blocking-style code running one greenlet per connection
(gevent ``StreamServer``). They decode frames and post events to the core's inbox; they
never touch core state. A framing or protocol violation gets an ERROR and closes that
one connection; nothing else is affected.

Handlers only read, each read one syscall once the socket is readable, taking every
whole frame it got (``connection.FrameSource``: pipelined frames cost one read). After
a batch's commit the core writes what the batch released itself: one non-blocking
write per connection (``connection.Output``), which the socket almost
always takes whole, so a request costs no reply handoff and no second wake-up of its
handler, and a TASK_ASSIGN leaves as soon as its commit is done. Bytes a full socket did
not take go to a flusher greenlet and later frames queue behind them, so the core never
blocks on a slow peer and frames never interleave on a socket.

With TLS (``Servers(tls=context)``), ``handler(port)`` puts the handshake in front of
each connection's handler, in its greenlet; the rest is the same code on the TLS socket
(``connection.FrameSource`` reading, ``Output`` writing through it).

Client connections are request/response, answered in request order: the handler posts
each request with its ``ClientConn`` and goes back to reading. A pending WAIT_JOB counts
as unanswered, and the runtime holds the replies that follow it until it is answered.
A connection that ends with requests unanswered posts ``ClientClosed``, so the core
forgets its waits.

With ``--auth-file`` (``guard`` set), the guard admits each connection before its TLS
handshake (bounding those of one address still waiting to authenticate) and closes it if
its handshake and AUTH take longer than ``--auth-timeout-millis`` (``guard.gate``). Each
port's first frame must be AUTH ``{token}``: the handler answers AUTH_OK ``{name, role}``,
or ERROR ``authentication failed`` / ``authentication required`` and closes (either answer
slowed, for an address that keeps failing: ``guard.py``). Then every request is checked against the token's role and task types
before it is posted (``jobmesh.auth``); a forbidden one is answered ERROR ``forbidden:
...`` in order, through the mailbox, and the connection stays open. Without a guard no
request is checked. It stops reading while
its connection has unsent bytes or ``MAX_PIPELINE`` unanswered requests, so a client
that pipelines without reading can grow neither the mailbox nor the coordinator's memory.
"""

from __future__ import annotations

import dataclasses
import logging
import select
import socket
import ssl
import time
from typing import Any, Callable

import gevent
import gevent.monkey

from jobmesh.coordinator.core import events as ev
from time import monotonic
from jobmesh.auth import WORKER, Identity
from jobmesh.coordinator.ports.connection import FrameSource, Output, nodelay, read_buffer, tls_accept
from jobmesh.coordinator.ports.guard import Guard, Ticket
from jobmesh.errors import ProtocolError
from jobmesh.protocol import messages as m
from jobmesh.protocol.framing import encode_frame
from jobmesh.protocol.payloads import TASK_NAME_RULE, TASK_TYPES, is_task_type_name
from jobmesh.tls import HANDSHAKE_SECONDS

log = logging.getLogger(__name__)

MAX_PIPELINE = 64  # unanswered requests per client connection before its handler stops reading
PEER_CHECK_SECONDS = 0.25  # while a client's handler is not reading, how often it checks that the peer is there
_PEER_GONE = select.POLLRDHUP | select.POLLHUP | select.POLLERR
_poll = gevent.monkey.get_original("select", "poll")  # a zero-timeout check: never blocks the hub
# While a worker's handler is not reading (the core is behind on it), how often a worker
# that asks for heartbeat answers gets one: well inside the shortest silence a worker
# waits before it leaves (1 s).
PAUSED_ACK_SECONDS = 0.25
MAX_HEARTBEATS_PER_SECOND = 50  # more from one worker is a flood: the connection is closed
IDLE_TIMEOUT_SECONDS = 120.0  # default: a client's first frame / a worker's registration must complete in this
DRAIN_SECONDS = 30.0  # at EOF, how long a client handler waits for its replies to go out

MAX_TASK_TYPES = 1024  # task types one worker may declare
MAX_CAPACITY = 1024  # the largest capacity a worker may register with

SHUTTING_DOWN = m.Error("coordinator is shutting down")
AUTH_REQUIRED = "authentication required"
AUTH_FAILED = "authentication failed"
AUTH_TWICE = "AUTH comes once, as a connection's first frame"
AUTH_FLUSH_SECONDS = 2.0  # how long a refused connection's ERROR may take to go out before it closes


def forbidden(identity: Identity, msg: m.Message) -> str | None:
    """Why ``identity`` may not send ``msg`` (the ERROR's text), or None if it may."""
    if not identity.may(msg.TYPE):
        return "forbidden: token %s (role %s) may not send %s" % (m.quote(identity.name), identity.role, msg.TYPE)
    if identity.task_types is None:
        return None
    if isinstance(msg, m.SubmitJob):
        names: list[Any] = [msg.task_type]
    elif isinstance(msg, m.SubmitWorkflow):  # every job's type (a malformed job is the core's to refuse)
        names = list(dict.fromkeys(job["taskType"] for job in msg.jobs
                                   if isinstance(job, dict) and isinstance(job.get("taskType"), str)))
    elif isinstance(msg, m.WorkerRegister):
        names = list(TASK_TYPES) if msg.task_types is None else msg.task_types
    elif isinstance(msg, m.SchedulePut):  # its fires submit that type (a malformed body is the core's to refuse)
        task_type = msg.schedule.get("taskType")
        names = [task_type] if isinstance(task_type, str) else []
    elif isinstance(msg, m.LimitPut):  # a limit holds back that type's jobs
        task_type = msg.limit.get("taskType")
        names = [task_type] if isinstance(task_type, str) else []
    elif isinstance(msg, (m.LimitDelete, m.TypePause, m.TypeResume)):
        names = [msg.task_type]
    else:
        return None
    refused = [name for name in names if not identity.may_use_type(name)]
    if not refused:
        return None
    verb = ("declare" if isinstance(msg, m.WorkerRegister) else
            "submit" if isinstance(msg, (m.SubmitJob, m.SchedulePut, m.SubmitWorkflow)) else "limit")
    return "forbidden: token %s may not %s task type %s (its taskTypes: %s)" % (
        m.quote(identity.name), verb, m.quote(refused[0]), ", ".join(identity.task_types) or "none")


def check_task_types(msg: m.WorkerRegister) -> None:
    """A malformed ``taskTypes`` is a protocol violation (the connection closes)."""
    names = msg.task_types
    if names is None:
        return
    if len(names) > MAX_TASK_TYPES:
        raise ProtocolError("WORKER_REGISTER declares %d task types; at most %d" % (len(names), MAX_TASK_TYPES))
    for name in names:
        if not is_task_type_name(name):
            shown = m.quote(name) if isinstance(name, str) else "a %s" % type(name).__name__
            raise ProtocolError("WORKER_REGISTER taskTypes holds %s; a task type is %s" % (shown, TASK_NAME_RULE))


def check_running(msg: m.WorkerRegister) -> None:
    """A malformed ``running`` (not a list of ``{jobId, attemptId}`` strings, or more
    entries than a worker can run) is a protocol violation (the connection closes)."""
    running = msg.running
    if running is None:
        return
    if len(running) > MAX_CAPACITY:
        raise ProtocolError("WORKER_REGISTER names %d running attempts; at most %d" % (len(running), MAX_CAPACITY))
    for item in running:
        if not (isinstance(item, dict) and isinstance(item.get("jobId"), str)
                and isinstance(item.get("attemptId"), str)):
            raise ProtocolError("WORKER_REGISTER running holds %s; each item is an object with string fields "
                                "jobId and attemptId" % m.quote(item))


def _encode(msgs: list[m.Message], worker_id: str | None) -> bytes:
    frames = []
    for msg in msgs:
        try:
            frames.append(encode_frame(msg.to_wire()))
        except ProtocolError as exc:  # a bug upstream; never let it wedge the session
            log.error("dropped an unencodable %s for worker=%s: %s", msg.TYPE, worker_id, exc)
    return b"".join(frames)


class WorkerConn(Output):
    """One worker connection: the core sends it TASK_ASSIGN, TASK_CANCEL and ERROR frames."""

    __slots__ = ("addr", "worker_id")

    def __init__(self, sock: socket.socket, addr: tuple[Any, ...]) -> None:
        super().__init__(sock)
        self.addr = addr
        self.worker_id: str | None = None

    def __repr__(self) -> str:
        return "<WorkerConn %s %s:%s>" % (self.worker_id, *self.addr[:2])

    def send(self, msg: m.Message | None) -> None:
        """Send one message; None closes the connection once what came before it is sent."""
        self.send_many([msg])

    def send_many(self, msgs: list[Any]) -> None:
        """Send messages in order with one write; a None among them closes after what precedes it."""
        close = None in msgs
        if close:
            msgs = msgs[: msgs.index(None)]
        self.write(_encode(msgs, self.worker_id), close)


class ClientConn(Output):
    """A client connection as the core sees it: a destination for replies, in request order."""

    __slots__ = ("inflight", "blocked", "peer_gone")

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self.inflight = 0  # requests posted to the core and not answered yet
        self.blocked = 0  # of those, the ones waiting for a pending WAIT_JOB (the runtime says)
        self.peer_gone = False  # the peer closed while the handler was not reading

    def reply(self, data: bytes, count: int, close: bool = False) -> None:
        """Write ``count`` replies' bytes without blocking; called by the core only."""
        self.inflight -= count
        self.write(data, close)

    def held_back(self, count: int) -> None:
        self.blocked = count
        self.wake()

    def wait_for_room(self) -> None:
        """Block the reader while the client is too far ahead of its replies; meanwhile
        notice the peer going away (``peer_gone``), since nothing reads its socket."""
        if self.inflight >= MAX_PIPELINE or self.unsent:  # rare: checked per request
            while not self.wait_until(lambda: self.inflight < MAX_PIPELINE and not self.unsent, PEER_CHECK_SECONDS):
                if self._peer_closed():
                    self.peer_gone = True
                    return

    def _peer_closed(self) -> bool:
        poller = _poll()
        poller.register(self.fileno, _PEER_GONE)
        try:
            return any(events & _PEER_GONE for _fd, events in poller.poll(0))
        except OSError:
            return True

    def drain(self, timeout: float) -> bool:
        """At the end: wait until every posted request is answered and written, but for
        those held behind a pending WAIT_JOB (the peer has gone: nobody reads them); False
        on timeout."""
        return self.wait_until(lambda: self.inflight <= self.blocked and not self.unsent, timeout)


class Servers:
    """Handlers for both ports; ``post(item)`` feeds the core, ``ask(req)`` waits for its reply."""

    def __init__(self, post: Callable[[Any], None], post_urgent: Callable[[Any], None],
                 idle_timeout: float = IDLE_TIMEOUT_SECONDS, tls: ssl.SSLContext | None = None,
                 handshake_timeout: float = HANDSHAKE_SECONDS) -> None:
        self.post = post  # client requests
        self.post_worker = post_urgent  # worker events go first (they free capacity)
        self.idle_timeout = idle_timeout
        self.tls = tls  # with a context, both ports speak TLS
        self.handshake_timeout = handshake_timeout
        self.worker_conns: set[WorkerConn] = set()
        self.connections = {"worker": 0, "client": 0}  # open connections per port (metrics)
        self.guard: Guard | None = None  # set with --auth-file: AUTH first, then every request checked
        self._buffer = read_buffer()  # what every handler's reads go into (``FrameSource``)

    def handler(self, port: str) -> Callable[[Any, tuple[Any, ...]], None]:
        """The StreamServer handler of the ``worker`` or ``client`` port: with TLS, the
        handshake comes first, in the connection's greenlet (``tls_accept``); with tokens,
        the guard admits the connection before that and bounds the time to AUTH."""
        handle: Callable[..., None] = self.handle_worker if port == "worker" else self.handle_client
        context = self.tls
        if context is not None:
            plain = handle

            def handle(sock: Any, addr: tuple[Any, ...], ticket: Ticket | None = None) -> None:
                tls_sock = tls_accept(context, sock, addr, self.handshake_timeout, port)
                if tls_sock is not None:
                    try:
                        plain(tls_sock, addr, ticket)
                    finally:
                        tls_sock.close()

        if self.guard is None:
            return handle
        return self.guard.gate(handle, port)

    def _first_frame(self, reader: FrameSource, what: str, addr: Any) -> dict[str, Any] | None:
        """The first frame, which must complete within the idle timeout (so connections
        that send nothing, or part of a frame, cannot hold descriptors forever)."""
        timer = gevent.Timeout(self.idle_timeout)
        timer.start()
        try:
            return reader.read_frame()
        except gevent.Timeout as exc:
            if exc is not timer:
                raise
            log.info("closing an idle %s connection peer=%s:%s: no complete frame within %.0f s",
                     what, addr[0], addr[1], self.idle_timeout)
            return None
        finally:
            timer.close()

    def _authenticate(self, conn: Output, obj: dict[str, Any], addr: Any, port: str, ticket: Ticket | None) -> Identity | None:
        """The first frame of a connection when tokens are on: AUTH with a known token is
        answered AUTH_OK and gives its identity; anything else is answered ERROR and the
        connection closes. Either answer waits the guard's delay, for an address that
        keeps failing (the failure is counted before it, however the peer goes on)."""
        guard = self.guard
        assert guard is not None
        host = str(addr[0])
        identity = None
        if obj.get("type") != m.Auth.TYPE:
            guard.failed(host)
            reason = AUTH_REQUIRED
        else:
            identity = guard.authenticate(obj.get("token"), host)
            reason = AUTH_FAILED
        delay = guard.hold_back(host)
        if identity is not None:
            if ticket is not None:
                ticket.done()
            conn.write(encode_frame(m.AuthOk(identity.name, identity.role).to_wire()))
            guard.attach(conn, identity)
            log.debug("authenticated peer=%s:%s port=%s token=%s role=%s", host, addr[1], port, identity.name,
                      identity.role)
            return identity
        log.log(logging.DEBUG if delay else logging.WARNING, "refused peer=%s:%s port=%s: %s%s", host, addr[1], port,
                reason, " (after %.2f s: this address keeps failing)" % delay if delay else "")
        conn.write(encode_frame(m.Error(reason).to_wire()), close=True)
        conn.flushed(AUTH_FLUSH_SECONDS)
        return None

    # ---- worker port ---------------------------------------------------------------

    def handle_worker(self, sock: socket.socket, addr: tuple[Any, ...], ticket: Ticket | None = None) -> None:
        nodelay(sock)
        conn = WorkerConn(sock, addr)
        self.worker_conns.add(conn)
        self.connections["worker"] += 1
        reader = FrameSource(sock, self._buffer)
        registered = False
        window_start, beats = time.monotonic(), 0
        try:
            obj = self._first_frame(reader, "worker", addr)
            if obj is None:
                return
            if self.guard is not None:
                register = self._register_with_token(conn, reader, obj, addr, ticket)
                if register is None:
                    return
            else:
                first = m.decode(obj, m.WORKER_PORT_REQUESTS)
                if not isinstance(first, m.WorkerRegister):
                    raise ProtocolError("the first message on the worker port must be WORKER_REGISTER, got %s"
                                        % first.TYPE)
                check_task_types(first)
                register = first
            check_running(register)
            conn.worker_id = register.worker_id
            self.post_worker(ev.Registered(conn, register))
            registered = True
            acks = False  # the worker asks for HEARTBEAT_ACKs (it has other coordinators to go to)
            while True:
                # Stops reading while the core is behind on us. Its heartbeats then go unread,
                # so a worker that asks for answers gets one now and then meanwhile: it would
                # take a silence for a frozen coordinator and leave (with its running work).
                while not conn.wait_for_core(timeout=PAUSED_ACK_SECONDS if acks else None):
                    conn.send(m.HeartbeatAck(conn.worker_id))
                obj = reader.read_frame()
                if obj is None:
                    return
                conn.last_arrival = monotonic()
                msg = m.decode(obj, m.WORKER_PORT_REQUESTS)
                if not isinstance(msg, (m.TaskResult, m.Heartbeat, m.TaskProgress)):  # the port's one other request
                    raise ProtocolError("WORKER_REGISTER sent twice on one connection")
                assert isinstance(msg, (m.TaskResult, m.Heartbeat, m.TaskProgress)), "the rest of WORKER_PORT_REQUESTS"
                if msg.worker_id != conn.worker_id:
                    raise ProtocolError(
                        "%s workerId %s does not match this session's %s"
                        % (msg.TYPE, m.quote(msg.worker_id), m.quote(conn.worker_id))
                    )
                if isinstance(msg, m.TaskResult):
                    self.post_worker(ev.Result(conn, msg))
                elif isinstance(msg, m.TaskProgress):  # the core keeps it or drops it: never the connection
                    self.post_worker(ev.Progress(conn, msg))
                else:  # a HEARTBEAT: its arrival is what it says (stamped above), and maybe "answer me"
                    if msg.ack:
                        acks = True
                        conn.send(m.HeartbeatAck(msg.worker_id))
                    beats += 1
                    if beats > MAX_HEARTBEATS_PER_SECOND:
                        if time.monotonic() - window_start < 1.0:
                            raise ProtocolError("more than %d heartbeats in one second; a worker sends one "
                                                "every few seconds" % MAX_HEARTBEATS_PER_SECOND)
                        window_start, beats = time.monotonic(), 0
        except ProtocolError as exc:
            reason = self._violation(exc)
            log.warning("protocol violation on worker port peer=%s:%s worker=%s: %s", addr[0], addr[1], conn.worker_id,
                        reason)
            conn.send(m.Error(reason))
        except OSError as exc:
            if not conn.closed:  # closed here: the coordinator is stopping, nothing went wrong
                log.info("worker connection error peer=%s:%s worker=%s: %s", addr[0], addr[1], conn.worker_id, exc)
        finally:
            if ticket is not None:
                ticket.done()  # no auth timeout in the middle of what follows
            if registered:
                self.post_worker(ev.Disconnected(conn))
            if self.guard is not None:
                self.guard.detach(conn)
            conn.finish()
            self.worker_conns.discard(conn)
            self.connections["worker"] -= 1

    def _register_with_token(self, conn: WorkerConn, reader: FrameSource, obj: dict[str, Any], addr: Any,
                             ticket: Ticket | None) -> m.WorkerRegister | None:
        """AUTH, then the WORKER_REGISTER a worker token may make: what a request the token
        may not make gets (``forbidden``, the connection open) until then. None: the
        connection ended (refused, idle, or closed by the peer)."""
        identity = self._authenticate(conn, obj, addr, "worker", ticket)
        if identity is None:
            return None
        while True:
            frame = self._first_frame(reader, "worker", addr)
            if frame is None:
                return None
            msg = m.decode(frame, m.WORKER_PORT_REQUESTS)
            if identity.role == WORKER and not isinstance(msg, m.WorkerRegister):
                raise ProtocolError("the first message on the worker port after AUTH must be WORKER_REGISTER, got %s"
                                    % msg.TYPE)
            if isinstance(msg, m.WorkerRegister):
                check_task_types(msg)
            reason = forbidden(identity, msg)
            if reason is None:
                assert isinstance(msg, m.WorkerRegister)
                return msg
            log.warning("forbidden peer=%s:%s port=worker: %s", addr[0], addr[1], reason)
            conn.send(m.Error(reason))

    # ---- client port ----------------------------------------------------------------

    def handle_client(self, sock: socket.socket, addr: tuple[Any, ...], ticket: Ticket | None = None) -> None:
        nodelay(sock)
        conn = ClientConn(sock)
        self.connections["client"] += 1
        reader = FrameSource(sock, self._buffer)
        first = True
        identity: Identity | None = None
        try:
            if self.guard is not None:
                obj = self._first_frame(reader, "client", addr)
                if obj is None:
                    return
                identity = self._authenticate(conn, obj, addr, "client", ticket)
                if identity is None:
                    return
                first = False
            while not conn.closed:
                if first:
                    obj = self._first_frame(reader, "client", addr)
                    first = False
                else:
                    obj = reader.read_frame()
                if obj is None:
                    if not conn.drain(DRAIN_SECONDS):
                        log.warning("client peer=%s:%s closed with %d replies still unwritten after %.0f s",
                                    addr[0], addr[1], conn.inflight, DRAIN_SECONDS)
                    return
                req = m.decode(obj, m.CLIENT_PORT_REQUESTS)
                conn.inflight += 1
                if identity is None:
                    self.post(ev.Request(conn, req))
                else:
                    self.post(ev.Request(conn, self._checked(identity, req, addr)))
                conn.wait_for_room()
                if conn.peer_gone:
                    conn.drain(DRAIN_SECONDS)
                    return
        except ProtocolError as exc:
            reason = self._violation(exc)
            log.warning("protocol violation on client port peer=%s:%s: %s", addr[0], addr[1], reason)
            # Answered in order, after the replies to what came before; then the connection closes.
            conn.inflight += 1
            self.post(ev.Request(conn, ev.Refusal(reason)))
            conn.drain(DRAIN_SECONDS)
        except OSError:
            pass
        finally:
            if ticket is not None:
                ticket.done()  # no auth timeout in the middle of what follows
            if identity is not None:
                assert self.guard is not None
                self.guard.detach(conn)
            conn.release()
            if conn.inflight > 0:  # pending WAIT_JOBs (or a drain that timed out): tell the core
                self.post(ev.ClientClosed(conn))
            self.connections["client"] -= 1

    def _violation(self, exc: ProtocolError) -> str:
        """A protocol violation's ERROR text; with tokens on, a second AUTH is named as such
        (the codec's refusal of AUTH is for a coordinator without tokens)."""
        if self.guard is not None and str(exc) == m.NO_AUTH:
            return AUTH_TWICE
        return str(exc)

    @staticmethod
    def _checked(identity: Identity, req: m.Message, addr: Any) -> m.Message | ev.Forbidden:
        """The request as the core gets it from this token: refused (``ev.Forbidden``), or
        a submit, retry or trigger that carries the token's name (``submittedBy``)."""
        reason = forbidden(identity, req)
        if reason is not None:
            log.info("forbidden peer=%s:%s port=client: %s", addr[0], addr[1], reason)
            return ev.Forbidden(reason)
        if isinstance(req, (m.RetryJob, m.ScheduleTrigger)):  # the core knows the type they make
            return dataclasses.replace(req, submitted_by=identity.name, task_types=identity.task_types)
        if isinstance(req, (m.SubmitJob, m.SubmitWorkflow)):
            return dataclasses.replace(req, submitted_by=identity.name)
        return req
