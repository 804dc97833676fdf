"""The Periodic port: Periodic frames in, core events out; frames back (docs/PERIODIC.md).

One blocking-style greenlet per connection, like the JSON ports' handlers
(``server.py``): it reads, decodes with the pure codec (``jobmesh.periodic.codec``) and
posts ``PeriodicPacket`` events; it never touches core state. The core answers with
codec frames through its ``outbound`` list, written after the batch's commit on the
connection's one ordered ``connection.Output``.

The handshake is answered here (the connection id must be the first frame out), and so
are the requests that need no state: PING, SLEEP, UNKNOWN, CONFIG_GET/SET, SHUTDOWN
(ignored), JOB_ASSIGNED (no reply) and stray server commands (ignored). A client
connection (handshake type 1) that sends a worker command gets NO_WORKER and the
command is ignored (periodicd's role check). Everything else goes to the core.

Frames the core marks ``Paced`` (a RECV_DATA's SUCCESS, chunks and EOF) are written one
by one: each after everything before it has left, and at least ``PACE_SECONDS`` after
the previous frame of its msgid, because aio-periodic keeps only the newest unread frame
of a msgid. Later frames of the connection queue behind them, so the order the core
decided holds; more than ``MAX_UNSENT_BYTES`` waiting there closes the connection, as
unsent bytes do. The handshake must come within ``--idle-timeout-millis``; after it, a
connection that sends nothing for ``--periodic-keepalive-millis`` is closed (aio-periodic
pings every 10 s when it has nothing else to say).

A bad magic, a bad CRC, an oversized frame, an undecodable body or a handshake other
than client (1 or 3) or worker (2 or 4) closes that connection only, without a reply
(periodicd sends none either).

Security, both off unless configured (docs/PERIODIC.md, "Keys and tokens"): with
``--periodic-key`` every connection starts with Periodic's RSA handshake
(``jobmesh.periodic.rsa``), in the handshake's time limit; in RSA or AES mode the
connection is a ``SealedPeriodicConn``, whose reads are opened and writes sealed. With
``--auth-file`` (``guard``), types 3 and 4 carry a token's name and text: a worker token
for 4, a client or admin token for 3 (a reader token may only PING and STATUS); a wrong
one, or a plain 1 or 2, is closed without a reply, whether or not the RSA handshake came
first: as aio-periodic speaks it, the handshake shows the coordinator to the peer but
proves nothing about the peer (anyone who holds the two public keys completes it). The
handshakes and the registration must be done within ``--auth-timeout-millis``
(``guard.gate``). A token's ``taskTypes`` limit the funcs its client submits (each job
of a LOAD), runs, removes or drops, and its worker declares. A refused command gets
NO_WORKER, as periodicd answers it.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Iterable

import gevent

from jobmesh.coordinator.core import events as ev
from time import monotonic
from jobmesh.coordinator.ports.connection import (MAX_UNSENT_BYTES, WRITER_JOIN_SECONDS, Output, Receiver, nodelay,
                                                   read_buffer)
from jobmesh.auth import READER, WORKER
from jobmesh.errors import ConfigError, ProtocolError
from jobmesh.periodic import codec as pc

if TYPE_CHECKING:
    from jobmesh.auth import Identity
    from jobmesh.coordinator.ports.guard import Guard, Ticket
    from jobmesh.periodic.rsa import OpenedDecoder, ServerKeys

    Decoder = pc.PacketDecoder | OpenedDecoder

log = logging.getLogger(__name__)

RECV_BYTES = 65536
PACE_SECONDS = 0.005  # between two frames of one msgid that the core marked Paced
_random = random.Random()

# Requests the core applies; the rest are answered by the handler.
CORE_REQUESTS = (pc.SubmitJob, pc.RunJob, pc.RecvData, pc.Status, pc.DropFunc, pc.RemoveJob, pc.Dump, pc.Load,
                 pc.CanDo, pc.CantDo, pc.Broadcast, pc.GrabJob, pc.WorkDone, pc.WorkFail, pc.SchedLater,
                 pc.WorkData, pc.JobUnassigned, pc.Acquire, pc.Release)
# Commands only a worker connection may send (periodicd's role check, PERIODIC.md 7.16).
WORKER_COMMANDS = (pc.GrabJob, pc.SchedLater, pc.WorkDone, pc.WorkFail, pc.CanDo, pc.CantDo, pc.Sleep,
                   pc.Broadcast, pc.Acquire, pc.Release, pc.WorkData, pc.JobAssigned, pc.JobUnassigned)
# What each kind of connection may not send (it gets NO_WORKER): a client no worker
# command, a reader token's client anything but PING and STATUS.
REFUSED_TO_CLIENT = frozenset(WORKER_COMMANDS)
REFUSED_TO_READER = frozenset(pc.REQUESTS.values()) - {pc.Ping, pc.Status}
REFUSED_TO_WORKER: frozenset[type] = frozenset()
# The funcs a command names, where a token's taskTypes limit it (periodicd's per-func
# lists): a client's jobs (a LOAD's every job) and funcs, a worker's declarations.
CLIENT_FUNCS: dict[type, Callable[[Any], Iterable[bytes]]] = {
    pc.SubmitJob: lambda msg: (msg.job.func,), pc.RunJob: lambda msg: (msg.job.func,),
    pc.RecvData: lambda msg: (msg.job.func,), pc.RemoveJob: lambda msg: (msg.handle.func,),
    pc.DropFunc: lambda msg: (msg.func,), pc.Load: lambda msg: [job.func for job in msg.jobs]}
WORKER_FUNCS: dict[type, Callable[[Any], Iterable[bytes]]] = {
    pc.CanDo: lambda msg: (msg.func,), pc.Broadcast: lambda msg: (msg.func,)}


def local_answer(msg: Any, config: dict[bytes, int]) -> bytes | None:
    """The frame answering a request that needs no core state (b"" = no reply).
    ``config``: what CONFIG_GET reports (anything else reads 0; CONFIG_SET changes nothing)."""
    kind = type(msg)
    if kind is pc.Ping:
        return pc.encode_pong(msg.msgid)
    if kind is pc.Sleep:
        return pc.encode_noop(msg.msgid)
    if kind is pc.Unknown:
        return pc.encode_unknown(msg.msgid)
    if kind is pc.ConfigGet:
        return pc.encode_config(msg.msgid, config.get(msg.key, 0))
    if kind is pc.ConfigSet:
        return pc.encode_success(msg.msgid)
    if kind is pc.Shutdown or kind is pc.JobAssigned or kind is pc.StrayCommand:
        return b""
    return None


class PeriodicConn(Output):
    """One Periodic connection: the core writes codec frames (bytes) to it, in order."""

    __slots__ = ("addr", "kind", "identity", "_paced", "_paced_bytes", "_pacer", "_last_paced")

    def __init__(self, sock: Any, addr: Any) -> None:
        super().__init__(sock)
        self.addr = addr
        self.kind = 0  # 1 client, 2 worker, after the handshake
        self.identity: Identity | None = None  # the token it registered with (types 3 and 4)
        self._paced: deque[Any] | None = None  # frames waiting for the pacer, in order (None: close)
        self._paced_bytes = 0
        self._pacer: gevent.Greenlet | None = None
        self._last_paced: dict[int, float] = {}  # msgid -> when its last Paced frame went out

    def __repr__(self) -> str:
        return "<PeriodicConn %s %s:%s>" % (self.kind, *self.addr[:2])

    def send_many(self, msgs: list[Any]) -> None:
        """Frames in order; a None among them closes after what precedes it. Plain frames
        go out with one write; from the first Paced frame on, everything goes through
        the pacer, in order."""
        if self.closed:
            return
        if self._paced is None and not any(type(msg) is pc.Paced for msg in msgs):
            close = None in msgs
            if close:
                msgs = msgs[: msgs.index(None)]
            self.write(b"".join(msgs), close)
            return
        if self._paced is None:
            self._paced = deque()
            self._paced_bytes = 0
            self._pacer = gevent.spawn(self._pace)
        self._paced.extend(msgs)
        self._paced_bytes += sum(len(msg.frame) if type(msg) is pc.Paced else len(msg or b"") for msg in msgs)
        if self._paced_bytes > MAX_UNSENT_BYTES:  # a stream far faster than its reader: as unsent bytes
            log.warning("closing periodic connection peer=%s:%s: %d bytes wait to be paced out (limit %d)",
                        self.addr[0], self.addr[1], self._paced_bytes, MAX_UNSENT_BYTES)
            self.abort()

    def _pace(self) -> None:
        paced = self._paced
        assert paced is not None
        try:
            while paced and not self.closed:
                item = paced.popleft()
                if item is None:
                    self.write(b"", True)
                    return
                if type(item) is not pc.Paced:
                    self._paced_bytes -= len(item)
                    self.write(item)
                    continue
                self._paced_bytes -= len(item.frame)
                self.flushed(WRITER_JOIN_SECONDS)
                last = self._last_paced.get(item.msgid)
                if last is not None and monotonic() - last < PACE_SECONDS:
                    gevent.sleep(last + PACE_SECONDS - monotonic())
                self.write(item.frame)
                now = monotonic()
                self._last_paced[item.msgid] = now
                if len(self._last_paced) > 256:
                    self._last_paced = {k: t for k, t in self._last_paced.items() if now - t < PACE_SECONDS}
        finally:
            self._paced = None
            self._pacer = None

    def release(self) -> None:
        """The handler is leaving: stop pacing too (see ``Output.release``)."""
        if self._pacer is not None:
            self._pacer.kill(block=False)
        self._paced = self._pacer = None
        super().release()


class SealedPeriodicConn(PeriodicConn):
    """A connection that passed the RSA handshake: in RSA or AES mode (``seal`` set once
    the handshake is over) every write is sealed for the peer first, so frames written
    by the handler, the runtime and the pacer all go through the session, in order.
    ``fingerprint`` names the authorized key it used (b"" until the handshake is over)."""

    __slots__ = ("seal", "fingerprint")

    def __init__(self, sock: Any, addr: Any) -> None:
        super().__init__(sock, addr)
        self.seal: Callable[[bytes], bytes] | None = None
        self.fingerprint = b""

    def write(self, data: bytes, close: bool = False) -> None:
        if data and self.seal is not None:
            data = self.seal(data)
        super().write(data, close)


class PeriodicPort:
    """The Periodic port's handler; ``post`` feeds the core (clients), ``post_urgent`` (workers).

    ``keys``: the RSA handshake's keys (None: no handshake); ``guard``: the tokens of
    types 3 and 4 are checked with it (set with ``--auth-file``; None: no tokens)."""

    def __init__(self, post: Callable[[Any], None], post_urgent: Callable[[Any], None], connections: dict[str, int],
                 idle_timeout: float, task_timeout: float = 0.0, keepalive: float = 120.0,
                 cost: Callable[[type], int] = lambda kind: 1, keys: ServerKeys | None = None) -> None:
        self.keys = keys
        self.guard: Guard | None = None
        self.post = post
        self.cost = cost  # the core's price of a request by its kind (a DUMP or a STATUS by what it walks)
        self.post_urgent = post_urgent
        self.connections = connections  # open connections per port, shared with the JSON ports (metrics)
        self.idle_timeout = idle_timeout  # for the handshake
        self.keepalive = keepalive  # after it (0: never)
        self.conns: set[PeriodicConn] = set()
        self._reaper: gevent.Greenlet | None = None
        self._buffer = read_buffer()  # what every handler's reads go into (``_next``)
        # CONFIG_GET: the settings that mean the same here as in periodicd (seconds).
        self.config = {b"timeout": int(task_timeout), b"keepalive": int(keepalive)}
        connections.setdefault("periodic", 0)

    def cost_of(self, msg: Any) -> int:
        """A request's share of a core batch (mailbox.py): 1, but a DUMP, a STATUS or a LOAD
        by the jobs or funcs it walks, as a LIST_JOBS page costs by its rows, so one
        client's large DUMPs cannot crowd the other connections out of the core's batches."""
        kind = type(msg)
        if kind is pc.Load:
            return 1 + len(msg.jobs) // ev.LIST_ROWS_PER_COST
        if kind is pc.Dump or kind is pc.Status:
            return self.cost(kind)
        return 1

    def _reap(self) -> None:
        """Close connections silent for longer than the keepalive since their handshake
        (checked every quarter of it, at most every 10 s); stops when none is left. A
        connection whose reader is paused (the core is behind on it) is not silent."""
        every = min(max(self.keepalive / 4, 0.05), 10.0)
        while self.conns:
            gevent.sleep(every)
            limit = monotonic() - self.keepalive
            for conn in list(self.conns):
                if conn.kind and not conn.paused and conn.last_arrival < limit and not conn.closed:
                    log.info("closing an idle periodic connection peer=%s:%s: nothing received for %.1f s",
                             conn.addr[0], conn.addr[1], self.keepalive)
                    conn.abort()
        self._reaper = None

    def reload_keys(self) -> None:
        """SIGHUP: read ``--periodic-authorized-keys`` again. New handshakes use the keys
        read; the connections that passed the handshake with a key no longer there are
        closed (as a removed token's are). Keys that do not load are logged, and the keys
        in force kept."""
        keys = self.keys
        if keys is None:
            return
        try:
            keys.reload_authorized()
        except ConfigError as exc:
            log.error("kept the Periodic authorized keys in force: %s", exc)
            return
        gone = [conn for conn in self.conns if isinstance(conn, SealedPeriodicConn) and conn.fingerprint
                and conn.fingerprint not in keys.authorized]
        for conn in gone:
            conn.abort()
        log.info("reloaded periodic authorized keys %s: keys=%d closed_connections=%d", keys.authorized_path,
                 len(keys.authorized), len(gone))

    def _admit(self, reg: pc.Registration, conn: PeriodicConn) -> frozenset[type] | None:
        """What the registered connection may not send, or None: close it without a reply
        (after the guard's delay, for an address that keeps failing)."""
        worker = reg.kind == pc.ConnType.WORKER
        guard = self.guard
        if guard is None:  # no tokens: types 3 and 4 are a client and a worker, as periodicd takes them
            return REFUSED_TO_WORKER if worker else REFUSED_TO_CLIENT
        host = str(conn.addr[0])
        if reg.token is None:  # the RSA handshake, if any, vouches only for the coordinator
            log.warning("closing periodic connection peer=%s:%s: tokens are on, and a registration without one "
                        "(type 1 or 2) is refused, after the RSA handshake too", *conn.addr[:2])
            guard.failed(host)
            identity = None
        else:
            identity = guard.authenticate(reg.token.decode("utf-8", "replace"), host)
            if identity is None or identity.name.encode() != reg.name:
                if identity is not None:
                    guard.failed(host)
                log.warning("closing periodic connection peer=%s:%s: wrong token name or token", *conn.addr[:2])
                identity = None
        guard.hold_back(host)  # a success waits as a refusal does, for an address that keeps failing
        if identity is None:
            return None
        if worker != (identity.role == WORKER):  # only a worker token registers a worker, and only as one
            log.warning("closing periodic connection peer=%s:%s: token %s of role %s may not register as a %s",
                        conn.addr[0], conn.addr[1], identity.name, identity.role, "worker" if worker else "client")
            return None
        conn.identity = identity
        guard.attach(conn, identity)  # a reload that removes the token closes the connection
        if worker:
            return REFUSED_TO_WORKER
        return REFUSED_TO_READER if identity.role == READER else REFUSED_TO_CLIENT

    def _secure(self, sock: Any, conn: PeriodicConn, decoder: pc.PacketDecoder) -> Decoder | None:
        """Periodic's RSA handshake, in the handshake's time limit; the decoder the
        connection's frames are then read with (None: the peer left or failed it)."""
        from jobmesh.periodic import rsa  # imports cryptography: only with --periodic-key

        assert self.keys is not None and isinstance(conn, SealedPeriodicConn)
        handshake = rsa.Handshake(self.keys)
        while handshake.session is None:
            data = sock.recv(RECV_BYTES)
            if not data:
                return None
            reply = handshake.feed(data)
            if reply:
                sock.sendall(reply)
        if handshake.peer_fingerprint not in self.keys.authorized:  # removed by a reload meanwhile
            log.warning("closing periodic connection peer=%s:%s: its key is no longer authorized", *conn.addr[:2])
            return None
        conn.fingerprint = handshake.peer_fingerprint
        session = handshake.session
        if session.mode is rsa.Mode.PLAIN:
            decoder.feed(handshake.rest)
            return decoder
        conn.seal = session.seal
        opened = rsa.OpenedDecoder(session, decoder)
        opened.feed(handshake.rest)
        return opened

    def handle(self, sock: Any, addr: Any, ticket: Ticket | None = None) -> None:
        """One connection; with tokens (``guard.gate``), ``ticket`` is done once it registers."""
        nodelay(sock)
        conn = PeriodicConn(sock, addr) if self.keys is None else SealedPeriodicConn(sock, addr)
        self.conns.add(conn)
        if self._reaper is None and self.keepalive > 0:
            self._reaper = gevent.spawn(self._reap)
        self.connections["periodic"] += 1
        decoder: Decoder = pc.PacketDecoder()
        receiver = Receiver(sock)
        posted = False
        try:
            timer = gevent.Timeout(self.idle_timeout)
            timer.start()
            try:
                if self.keys is not None:
                    secured = self._secure(sock, conn, pc.PacketDecoder())
                    if secured is None:
                        return
                    decoder = secured
                body = self._next(receiver, decoder)
            except gevent.Timeout as exc:
                if exc is not timer:
                    raise
                log.info("closing an idle periodic connection peer=%s:%s: no handshake within %.0f s",
                         addr[0], addr[1], self.idle_timeout)
                return
            finally:
                timer.close()
            if body is None:
                return
            registration = pc.decode_handshake(body)
            refused = self._admit(registration, conn)
            if refused is None:
                return
            if ticket is not None:
                ticket.done()
            conn.kind = int(registration.kind)
            conn.write(pc.encode_handshake_reply(_random.getrandbits(32)))
            conn.last_arrival = monotonic()
            worker = conn.kind == pc.ConnType.WORKER
            post = self.post_urgent if worker else self.post
            identity = conn.identity
            submitted_by = identity.name if identity is not None else None  # what the jobs it makes name
            limited = None  # the commands naming a func, for a token that lists its taskTypes
            if identity is not None and identity.task_types is not None:
                limited = WORKER_FUNCS if worker else CLIENT_FUNCS
            while True:
                conn.wait_for_core()  # stops reading while the core is behind on us
                body = self._next(receiver, decoder)
                if body is None:
                    return
                conn.last_arrival = monotonic()
                msg = pc.decode_request(body)
                if refused and type(msg) in refused:
                    conn.write(pc.encode_no_worker(msg.msgid))  # e.g. a client may not act as a worker
                    continue
                if limited is not None and type(msg) in limited:
                    assert identity is not None
                    func = next((func for func in limited[type(msg)](msg)
                                 if not identity.may_use_type(func.decode("utf-8", "replace"))), None)
                    if func is not None:
                        log.info("refused periodic %s of func %r: token %s does not list it",
                                 type(msg).__name__, func, identity.name)
                        conn.write(pc.encode_no_worker(msg.msgid))
                        continue
                if isinstance(msg, CORE_REQUESTS):
                    post(ev.PeriodicPacket(conn, msg, self.cost_of(msg), submitted_by))
                    posted = True
                    continue
                answer = local_answer(msg, self.config)
                if answer is None:
                    raise ProtocolError("unexpected periodic request %s" % type(msg).__name__)
                if answer:
                    conn.write(answer)
        except ProtocolError as exc:
            log.warning("closing periodic connection peer=%s:%s: %s", addr[0], addr[1], exc)
        except OSError as exc:
            log.info("periodic connection error peer=%s:%s: %s", addr[0], addr[1], exc)
        finally:
            if ticket is not None:
                ticket.done()  # no auth timeout in the middle of what follows
            if posted:
                self.post_urgent(ev.PeriodicClosed(conn)) if conn.kind == pc.ConnType.WORKER else \
                    self.post(ev.PeriodicClosed(conn))
            if conn.identity is not None and self.guard is not None:
                self.guard.detach(conn)
            conn.finish()
            self.conns.discard(conn)
            self.connections["periodic"] -= 1

    def _next(self, receiver: Receiver, decoder: Decoder) -> bytes | None:
        """The next checked frame body; None at EOF. One read takes what the socket holds,
        in the port's shared buffer, and the decoder copies it out at once."""
        buffer = self._buffer
        while True:
            body = decoder.next_packet()
            if body is not None:
                return body
            n = receiver.read_into(buffer)
            if not n:
                return None
            decoder.feed(buffer[:n])
