"""Leading on a shared store (PostgreSQL): the runtime's side of it.

Several coordinators may share one database; the store elects the leader (an advisory
lock on its writer session, then an epoch that fences every batch: ``Store.lead``) and
raises ``store.base.LeadershipLost`` when this process no longer leads (its writer
session ended, the lock went to another, a batch's fence failed). Then the coordinator
commits nothing more, releases nothing of the batch that failed, and exits 75
(``exitcodes.EXIT_LEADERSHIP_LOST``); its supervisor starts it again and it stands by
(docs/SCALING.md). A failed statement on an intact session is a ``StorageFault``, not
this: the runtime's degraded mode (``outage.py``) handles it.

``KeepLeading``: while the leader commits nothing, a probe write now and then, where the
store runs its commits (a fenced transaction). The store keeps its writer session busy
on its own; the probe is how the runtime finds out that the leadership is gone when
nothing is written: a leader that was frozen and thawed learns it at its next sweep,
not at its next write.
"""

from __future__ import annotations

import time

from jobmesh.store.base import LeadershipLost, Outcome, Store

PROBES_PER_TIMEOUT = 4  # probe writes per session timeout while the leader writes nothing


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
            if isinstance(failure, LeadershipLost):
                raise failure
            self.committed()
        elif time.monotonic() >= self._next:
            self.probe = store.commit_probe()

    def wait(self, timeout: float) -> None:
        """Stopping: let a probe in flight finish before the store closes."""
        if self.probe is not None:
            self.probe.wait(timeout)
