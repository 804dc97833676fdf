"""The coordinator's side of tokens: the auth file in force, the connections each token
opened, and the failed attempts of each peer address.

Only a coordinator with ``--auth-file`` has a ``Guard``; without one, no handler checks
anything (``Servers.guard`` is None), so the plain path costs what it always did.

* ``authenticate(token, host)`` looks the token up in the file in force
  (``jobmesh.auth.AuthFile``) and counts a failure against ``host``. After
  ``FREE_FAILURES`` failures in a row from one address, each further failure waits
  ``failure_delay(host)`` before its ERROR is written (doubling from ``FIRST_DELAY`` up
  to ``MAX_DELAY`` seconds), so a peer that keeps failing costs little; a success from the address clears its record. At most
  ``MAX_PEERS`` addresses are remembered (the oldest forgotten first), each for
  ``FORGET_SECONDS`` after its last failure.
* ``attach(conn, identity)`` / ``detach(conn)``: the open connections of each token, so
  that ``reload`` (SIGHUP) can close those whose entry was removed or changed.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import gevent

from jobmesh.auth import AuthFile, AuthFileError, Identity

log = logging.getLogger(__name__)

# The slow-down is against floods (log lines, CPU), not guessing: a token has 256 random
# bits. Its delay stays short enough for a client's ordinary reply timeout.
FREE_FAILURES = 20  # failures in a row from one address before each further one is slowed
FIRST_DELAY = 0.1  # seconds: the delay of the first slowed failure, doubled for each next one
MAX_DELAY = 2.0  # seconds: a slowed failure waits at most this long
FORGET_SECONDS = 600.0  # an address with no failure for this long starts afresh
MAX_PEERS = 10_000  # addresses remembered at most


class Guard:
    """Authentication for one coordinator's ports (the worker, client and metrics ports)."""

    def __init__(self, auth_file: AuthFile) -> None:
        self.auth_file = auth_file
        self.failures = 0  # failed attempts since the process started (jobmesh_auth_failures_total)
        self._peers: dict[str, tuple[int, float]] = {}  # host -> (failures in a row, when the last was)
        self._conns: dict[Any, Identity] = {}  # open authenticated connections (each has ``abort()``)

    @classmethod
    def load(cls, path: str) -> Guard:
        """A guard over the file at ``path``; ``AuthFileError`` if it is not valid."""
        return cls(AuthFile.load(path))

    # ---- checking tokens ------------------------------------------------------------------

    def authenticate(self, token: Any, host: str) -> Identity | None:
        """The token's identity, or None (a failure counted against ``host``)."""
        identity = self.auth_file.authenticate(token)
        if identity is None:
            self.failed(host)
        else:
            self._peers.pop(host, None)
        return identity

    def failed(self, host: str) -> None:
        """Count a failed attempt (a wrong token, or no AUTH at all) from ``host``."""
        self.failures += 1
        now = time.monotonic()
        count, last = self._peers.pop(host, (0, now))
        if now - last > FORGET_SECONDS:
            count = 0
        self._peers[host] = (count + 1, now)  # re-inserted: the dict stays in order of last failure
        if len(self._peers) > MAX_PEERS:
            del self._peers[next(iter(self._peers))]

    def failure_delay(self, host: str) -> float:
        """Seconds to wait before answering ``host``'s latest failure (0 for the first few)."""
        count, _last = self._peers.get(host, (0, 0.0))
        if count <= FREE_FAILURES:
            return 0.0
        return min(MAX_DELAY, FIRST_DELAY * 2 ** min(count - FREE_FAILURES - 1, 16))

    def hold_back(self, host: str) -> None:
        """Wait ``failure_delay(host)`` in the calling greenlet, before a refusal goes out."""
        delay = self.failure_delay(host)
        if delay:
            gevent.sleep(delay)

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
