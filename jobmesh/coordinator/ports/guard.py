"""The coordinator's side of tokens: the auth file in force, the connections each token
opened, the connections of each peer address that have not authenticated yet, and the
failed attempts of each address.

Only a coordinator with ``--auth-file`` has a ``Guard``; without one, no handler checks
anything (``Servers.guard`` is None), so the plain path costs what it always did.

* ``gate(handle, port)``: the handler of a port with tokens on. Each connection is
  admitted (``admit``) before anything is read from it: at most ``pending_limit``
  connections of one address (an IPv6 /64 counts as one) may be waiting for their TLS
  handshake and AUTH (or Periodic registration) at once, so strangers from one address
  cannot take the handler slots the coordinator keeps for workers and clients: a new
  one closes the oldest of them. Each has ``auth_timeout`` seconds from its accept to
  authenticate (``Ticket.done``), or it is closed.
* ``authenticate(token, host)`` looks the token up in the file in force
  (``jobmesh.auth.AuthFile``) and counts a failure against ``host``'s address (as
  ``admit`` counts it: an IPv6 /64 is one) at once, however the peer goes on.
  ``hold_back(host)`` then waits before the answer, AUTH_OK or ERROR alike, so a peer
  cannot tell a refusal by its timing and closing early gains nothing: after ``FREE_FAILURES`` failures from one address, its attempts are answered one at a
  time, each ``failure_delay(host)`` after the one before (doubling from
  ``FIRST_DELAY`` up to ``MAX_DELAY`` seconds). A success forgives only the failures
  made with its own token (say, before a reload added it); the others stay. At most
  ``MAX_PEERS`` addresses are remembered (the oldest forgotten first), each for
  ``FORGET_SECONDS`` after its last failure.
* ``attach(conn, identity)`` / ``detach(conn)``: the open connections of each token, so
  that ``reload`` (SIGHUP) can close those whose entry was removed or changed.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from typing import Any, Callable

import gevent

from jobmesh.auth import MAX_TOKEN_CHARS, AuthFile, AuthFileError, Identity, token_digest

log = logging.getLogger(__name__)

# The slow-down is against floods (log lines, CPU), not guessing: a token has 256 random
# bits. Its delay stays short enough for a client's ordinary reply timeout.
FREE_FAILURES = 20  # failures from one address before its attempts are slowed
FIRST_DELAY = 0.1  # seconds: the delay of the first slowed attempt, doubled for each next failure
MAX_DELAY = 2.0  # seconds: a slowed attempt waits at most this long after the one before
FORGET_SECONDS = 600.0  # an address with no failure for this long starts afresh
MAX_PEERS = 10_000  # addresses remembered at most
MAX_TOKENS_PER_PEER = 16  # the failed tokens of one address remembered at most (for forgiving)
AUTH_TIMEOUT_SECONDS = 10.0  # default of --auth-timeout-millis
MIN_PENDING = 4  # the per-address bound of connections not yet authenticated is never below this
PENDING_SHARE = 4  # ... and otherwise a quarter of the smallest port's handler slots


def pending_bound(slots: int) -> int:
    """Connections of one address that may wait to authenticate at once, when the
    smallest port serves ``slots`` connections: a quarter of them, so strangers need
    four addresses to fill a port (and each holds its slot for the auth timeout at most)."""
    return max(MIN_PENDING, slots // PENDING_SHARE)


def address_key(host: str) -> str:
    """The address a connection is counted under: an IPv4 address as it is, an IPv6 one by
    its /64 (one machine or site may hold the whole of it)."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return host


class _Record:
    """One address's failures: how many, when the last was, the failed tokens' digests
    (to forgive them on their own success), and when its next slowed answer may go."""

    __slots__ = ("count", "last", "by_token", "next_answer")

    def __init__(self, now: float) -> None:
        self.count = 0
        self.last = now
        self.by_token: dict[str, int] = {}
        self.next_answer = 0.0


class Ticket:
    """A connection admitted by ``Guard.admit`` that has not authenticated yet: counted
    against its address until ``done()`` (authenticated, or the connection ended); its
    ``timer`` fires in the connection's greenlet after the auth timeout."""

    __slots__ = ("guard", "key", "sock", "timer")

    def __init__(self, guard: Guard, key: str, sock: Any, timeout: float) -> None:
        self.guard = guard
        self.key = key
        self.sock = sock  # the accepted socket, shut down if the ticket is evicted
        self.timer: gevent.Timeout | None = gevent.Timeout(timeout)
        self.timer.start()

    def done(self) -> None:
        """Authenticated (or ended): no longer counted, and no timeout. Idempotent."""
        timer = self.timer
        if timer is None:
            return
        self.timer = None
        timer.close()
        self.guard.settled(self)

    def evict(self) -> None:
        """Make room for a newer connection of the address: shut this one down (its
        handler then ends)."""
        self.done()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class Guard:
    """Authentication for one coordinator's ports (the worker, client, Periodic and metrics ports)."""

    def __init__(self, auth_file: AuthFile, auth_timeout: float = AUTH_TIMEOUT_SECONDS) -> None:
        self.auth_file = auth_file
        self.auth_timeout = auth_timeout  # seconds from accept to AUTH (or Periodic registration) done
        self.pending_limit = pending_bound(32)  # set by the runtime from its ports' handler slots
        self.failures = 0  # failed attempts since the process started (jobmesh_auth_failures_total)
        self._peers: dict[str, _Record] = {}  # address key -> its failures, in order of the last failure
        # address key -> its connections not yet authenticated, oldest first (dicts as ordered sets)
        self._pending: dict[str, dict[Ticket, None]] = {}
        self._crowded: set[str] = set()  # address keys told about since they last had none waiting
        self._conns: dict[Any, Identity] = {}  # open authenticated connections (each has ``abort()``)

    @classmethod
    def load(cls, path: str, auth_timeout: float = AUTH_TIMEOUT_SECONDS) -> Guard:
        """A guard over the file at ``path``; ``AuthFileError`` if it is not valid."""
        return cls(AuthFile.load(path), auth_timeout)

    # ---- connections not yet authenticated --------------------------------------------------

    def admit(self, sock: Any, host: str, port: str) -> Ticket:
        """A ticket for a new connection from ``host``. When ``pending_limit`` connections of
        its address wait to authenticate already, the oldest of them is closed to make
        room: strangers from one address then only push out each other, while a peer that
        authenticates promptly gets through."""
        key = address_key(host)
        waiting = self._pending.setdefault(key, {})
        if len(waiting) >= self.pending_limit:
            oldest = next(iter(waiting))
            # Once per crowding (until none of the address waits), not once per connection of a flood.
            level = logging.DEBUG if key in self._crowded else logging.WARNING
            self._crowded.add(key)
            log.log(level, "closing the oldest connection of %s waiting to authenticate, for a new one on the %s "
                    "port: %d of its connections wait already", key, port, self.pending_limit)
            oldest.evict()
            waiting = self._pending.setdefault(key, {})
        ticket = Ticket(self, key, sock, self.auth_timeout)
        waiting[ticket] = None
        return ticket

    def settled(self, ticket: Ticket) -> None:
        waiting = self._pending.get(ticket.key)
        if waiting is not None:
            waiting.pop(ticket, None)
            if not waiting:
                del self._pending[ticket.key]
                self._crowded.discard(ticket.key)

    def gate(self, handle: Callable[[Any, Any, Ticket], None], port: str) -> Callable[[Any, Any], None]:
        """``handle(sock, addr, ticket)`` as a StreamServer handler: admitted first, and
        closed when the ticket's timer fires before the handler called ``ticket.done()``."""

        def gated(sock: Any, addr: Any) -> None:
            ticket = self.admit(sock, str(addr[0]), port)
            timer = ticket.timer
            try:
                handle(sock, addr, ticket)
            except gevent.Timeout as exc:
                if exc is not timer:
                    raise
                log.info("closing a %s connection peer=%s:%s: not authenticated within %.1f s (--auth-timeout-millis)",
                         port, addr[0], addr[1], self.auth_timeout)
            finally:
                ticket.done()

        return gated

    # ---- checking tokens ------------------------------------------------------------------

    def authenticate(self, token: Any, host: str) -> Identity | None:
        """The token's identity, or None (a failure counted against ``host``). A success
        forgives the failures ``host`` made with this same token, and only those."""
        identity = self.auth_file.authenticate(token)
        if identity is None:
            self.failed(host, token)
            return identity
        key = address_key(host)
        record = self._peers.get(key)
        if record is not None:
            forgiven = record.by_token.pop(identity.digest, 0)
            if forgiven:
                record.count -= forgiven
                if record.count <= 0:
                    del self._peers[key]
        return identity

    def failed(self, host: str, token: Any = None) -> None:
        """Count a failed attempt (a wrong ``token``, or no AUTH at all) from ``host``."""
        self.failures += 1
        now = time.monotonic()
        key = address_key(host)
        record = self._peers.pop(key, None)
        if record is None or now - record.last > FORGET_SECONDS:
            record = _Record(now)
        record.count += 1
        record.last = now
        if isinstance(token, str) and token:
            digest = token_digest(token[:MAX_TOKEN_CHARS])
            if digest in record.by_token or len(record.by_token) < MAX_TOKENS_PER_PEER:
                record.by_token[digest] = record.by_token.get(digest, 0) + 1
        self._peers[key] = record  # re-inserted: the dict stays in order of last failure
        if len(self._peers) > MAX_PEERS:
            del self._peers[next(iter(self._peers))]

    def failure_delay(self, host: str) -> float:
        """Seconds between two answers to ``host`` (0 for the first few failures)."""
        record = self._peers.get(address_key(host))
        if record is None or record.count <= FREE_FAILURES or time.monotonic() - record.last > FORGET_SECONDS:
            return 0.0
        return min(MAX_DELAY, FIRST_DELAY * 2 ** min(record.count - FREE_FAILURES - 1, 16))

    def hold_back(self, host: str) -> float:
        """Wait in the calling greenlet before an attempt's answer (a success's too) goes
        out: for an address that keeps failing, ``failure_delay`` after the answer before
        it, so its attempts are answered one at a time however many it opens at once.
        Returns the seconds waited."""
        delay = self.failure_delay(host)
        if not delay:
            return 0.0
        record = self._peers[address_key(host)]
        now = time.monotonic()
        record.next_answer = max(now, record.next_answer) + delay
        wait = record.next_answer - now
        gevent.sleep(wait)
        return wait

    # ---- connections and reloads ------------------------------------------------------------

    def attach(self, conn: Any, identity: Identity) -> None:
        self._conns[conn] = identity

    def detach(self, conn: Any) -> None:
        self._conns.pop(conn, None)

    def still_valid(self, identity: Identity) -> bool:
        """Whether ``identity``'s entry is unchanged in the file in force."""
        return self.auth_file.still_valid(identity)

    def reload(self) -> bool:
        """Read the auth file again (SIGHUP). A file that is no longer valid is logged and
        the one in force kept; otherwise the connections of removed or changed tokens are
        closed. Returns whether the new file was taken."""
        path = self.auth_file.path
        try:
            fresh = AuthFile.load(path)
        except AuthFileError as exc:
            log.error("kept the tokens in force: %s", exc)
            return False
        self.auth_file = fresh
        gone = [(conn, identity) for conn, identity in self._conns.items() if not fresh.still_valid(identity)]
        for conn, identity in gone:
            self._conns.pop(conn, None)
            conn.abort()
        log.info("reloaded auth file %s: tokens=%d closed_connections=%d%s", path, len(fresh), len(gone),
                 "".join(" closed=%s" % name for name in sorted({identity.name for _c, identity in gone})))
        return True
