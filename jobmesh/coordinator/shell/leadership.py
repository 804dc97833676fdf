"""Leading on a shared store (PostgreSQL): the runtime's side of it.

Several coordinators may share one database; the store elects the leader (an advisory
lock on its writer session, then an epoch that fences every batch: ``Store.lead``) and
says when a failure means that this process no longer leads (``Store.leadership_lost``:
its writer session ended, the lock went to another, a batch's fence failed). Then the
coordinator commits nothing more, releases nothing of the batch that failed, and exits
75 (``exitcodes.EXIT_LEADERSHIP_LOST``); its supervisor starts it again and it stands by
(docs/SCALING.md). A failed statement on an intact session is a storage fault, not this:
the runtime's degraded mode (``outage.py``) handles it.

Two things here:

* ``LeadershipLost``, raised on the core greenlet (or at start) when a store call fails
  that way; the runtime turns it into the exit.
* ``KeepLeading``: while the leader commits nothing, a probe write now and then, where the
  store runs its commits (a fenced transaction). The store keeps its writer session busy
  on its own; the probe is how the runtime finds out that the leadership is gone when
  nothing is written: a leader that was frozen and thawed learns it at its next sweep,
  not at its next write.
"""

from __future__ import annotations

import time

from jobmesh.store.base import Outcome, Store

PROBES_PER_TIMEOUT = 4  # probe writes per session timeout while the leader writes nothing


class LeadershipLost(Exception):
    """This coordinator no longer leads: commit nothing more, release nothing, exit 75."""


def check(store: Store, exc: BaseException) -> None:
    """Raise ``LeadershipLost`` (from ``exc``) if ``exc`` means the leadership is gone."""
    if store.leadership_lost(exc):
        raise LeadershipLost("%s: %s" % (type(exc).__name__, " ".join(str(exc).split())[:300])) from exc


class KeepLeading:
    """Probe writes while the leader commits nothing: one at most every
    ``session_timeout_millis / PROBES_PER_TIMEOUT``, checked once done (never waited for)."""

    def __init__(self, session_timeout_millis: int) -> None:
        self.interval = session_timeout_millis / 1000.0 / PROBES_PER_TIMEOUT
        self.probe: Outcome | None = None
        self._next = time.monotonic() + self.interval

    def committed(self) -> None:
        """A batch committed: the session was busy, the fence held."""
        self._next = time.monotonic() + self.interval

    def tick(self, store: Store) -> None:
        """A batch that committed nothing: read a finished probe, or start one when due.

        Raises ``LeadershipLost`` when the probe found the leadership gone; a storage
        fault on an intact session is left to the next commit (the degraded mode)."""
        probe = self.probe
        if probe is not None:
            if not probe.ready():
                return
            self.probe = None
            failure = probe.get()
            if failure is not None:
                check(store, failure)
            self.committed()
        elif time.monotonic() >= self._next:
            self.probe = store.commit_probe()

    def wait(self, timeout: float) -> None:
        """Stopping: let a probe in flight finish before the store closes."""
        if self.probe is not None:
            self.probe.wait(timeout)
