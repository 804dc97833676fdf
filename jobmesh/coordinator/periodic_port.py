"""The Periodic port: Periodic frames in, core events out; frames back (docs/PERIODIC.md).

One blocking-style greenlet per connection, like the JSON ports' handlers
(``server.py``): it reads, decodes with the pure codec (``jobmesh.periodic.codec``) and
posts ``PeriodicPacket`` events; it never touches core state. The core answers with
codec frames through its ``outbound`` list, written after the batch's commit on the
connection's one ordered ``Output``.

The handshake is answered here (the connection id must be the first frame out), and so
are the requests that need no state: PING, SLEEP, UNKNOWN, CONFIG_GET/SET, the commands
of this slice's "not supported yet" list (docs/PERIODIC.md), JOB_ASSIGNED (no reply) and
stray server commands (ignored). Everything else goes to the core.

A bad magic, a bad CRC, an oversized frame, an undecodable body or a handshake other
than client (1) or worker (2) closes that connection only, without a reply (periodicd
sends none either).
"""

from __future__ import annotations

import logging
import random
from typing import Any, Callable

import gevent

from jobmesh.coordinator import events as ev
from jobmesh.coordinator.clock import monotonic
from jobmesh.coordinator.server import MAX_WORKER_BACKLOG, WRITER_JOIN_SECONDS, Output, Servers, _nodelay
from jobmesh.errors import ProtocolError
from jobmesh.periodic import codec as pc

log = logging.getLogger(__name__)

RECV_BYTES = 65536
_random = random.Random()

# Requests the core applies; the rest are answered by the handler.
CORE_REQUESTS = (pc.SubmitJob, pc.Status, pc.DropFunc, pc.RemoveJob, pc.CanDo, pc.CantDo, pc.Broadcast,
                 pc.GrabJob, pc.WorkDone, pc.WorkFail, pc.SchedLater, pc.JobUnassigned)


def local_answer(msg: Any) -> bytes | None:
    """The frame answering a request that needs no core state (b"" = no reply)."""
    kind = type(msg)
    if kind is pc.Ping:
        return pc.encode_pong(msg.msgid)
    if kind is pc.Sleep:
        return pc.encode_noop(msg.msgid)
    if kind is pc.Unknown or kind is pc.Dump or kind is pc.Load:
        return pc.encode_unknown(msg.msgid)  # DUMP/LOAD: not supported yet
    if kind is pc.ConfigGet:
        return pc.encode_config(msg.msgid, 0)
    if kind is pc.ConfigSet or kind is pc.WorkData or kind is pc.Release:
        return pc.encode_success(msg.msgid)
    if kind is pc.RunJob or kind is pc.RecvData:
        return pc.encode_no_worker(msg.msgid)  # not supported yet: aio-periodic raises "no worker"
    if kind is pc.Acquire:
        return pc.encode_acquired(msg.msgid, True)  # locks not enforced yet: always granted
    if kind is pc.Shutdown or kind is pc.JobAssigned or kind is pc.StrayCommand:
        return b""
    return None


class PeriodicConn(Output):
    """One Periodic connection: the core writes codec frames (bytes) to it, in order."""

    __slots__ = ("addr", "kind")

    def __init__(self, sock: Any, addr: Any) -> None:
        super().__init__(sock)
        self.addr = addr
        self.kind = 0  # 1 client, 2 worker, after the handshake

    def __repr__(self) -> str:
        return "<PeriodicConn %s %s:%s>" % (self.kind, *self.addr[:2])

    def send_many(self, msgs: list) -> None:
        """Frames in order with one write; a None among them closes after what precedes it."""
        close = None in msgs
        if close:
            msgs = msgs[: msgs.index(None)]
        self.write(b"".join(msgs), close)

    def finish(self) -> None:
        try:
            self.flushed(WRITER_JOIN_SECONDS)
        finally:
            self.release()


class PeriodicPort:
    """The Periodic port's handler; ``post`` feeds the core (clients), ``post_urgent`` (workers)."""

    def __init__(self, post: Callable[[Any], None], post_urgent: Callable[[Any], None], servers: Servers,
                 idle_timeout: float) -> None:
        self.post = post
        self.post_urgent = post_urgent
        self.servers = servers  # shares its connection counts (metrics)
        self.idle_timeout = idle_timeout
        self.conns: set[PeriodicConn] = set()
        servers.connections.setdefault("periodic", 0)

    def handle(self, sock: Any, addr: Any) -> None:
        _nodelay(sock)
        conn = PeriodicConn(sock, addr)
        self.conns.add(conn)
        self.servers.connections["periodic"] += 1
        decoder = pc.PacketDecoder()
        posted = False
        try:
            timer = gevent.Timeout(self.idle_timeout)
            timer.start()
            try:
                body = self._next(sock, decoder)
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
            conn.kind = int(pc.decode_handshake(body))
            conn.write(pc.encode_handshake_reply(_random.getrandbits(32)))
            post = self.post_urgent if conn.kind == pc.ConnType.WORKER else self.post
            while True:
                if len(conn.inbox) >= MAX_WORKER_BACKLOG:
                    conn.paused = True  # the core is behind on us: stop reading
                    conn._wait_for(lambda: len(conn.inbox) < MAX_WORKER_BACKLOG)
                    conn.paused = False
                body = self._next(sock, decoder)
                if body is None:
                    return
                conn.last_arrival = monotonic()
                msg = pc.decode_request(body)
                if isinstance(msg, CORE_REQUESTS):
                    post(ev.PeriodicPacket(conn, msg))
                    posted = True
                    continue
                answer = local_answer(msg)
                if answer is None:
                    raise ProtocolError("unexpected periodic request %s" % type(msg).__name__)
                if answer:
                    conn.write(answer)
        except ProtocolError as exc:
            log.warning("closing periodic connection peer=%s:%s: %s", addr[0], addr[1], exc)
        except OSError as exc:
            log.info("periodic connection error peer=%s:%s: %s", addr[0], addr[1], exc)
        finally:
            if posted:
                self.post_urgent(ev.PeriodicClosed(conn)) if conn.kind == pc.ConnType.WORKER else \
                    self.post(ev.PeriodicClosed(conn))
            conn.finish()
            self.conns.discard(conn)
            self.servers.connections["periodic"] -= 1

    @staticmethod
    def _next(sock: Any, decoder: pc.PacketDecoder) -> bytes | None:
        """The next checked frame body; None at EOF."""
        while True:
            body = decoder.next_packet()
            if body is not None:
                return body
            data = sock.recv(RECV_BYTES)
            if not data:
                return None
            decoder.feed(data)
