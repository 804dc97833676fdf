"""Storage outages: what the coordinator does when a write fails for a storage reason.

``StorageOutages`` is a mixin of the runtime's ``Coordinator`` (runtime.py), which calls
it from its commit path; it uses the runtime's store, core and connections.
A failed commit acknowledges nothing of its batch; memory, now ahead of disk, is thrown
away and state reloaded from the database as a restart would (``_reload``); worker and
Periodic connections are closed (their sessions died with that memory) and register
again. Until a write succeeds the core is paused, reads are served, writes are answered
``storage unavailable``, and a probe write every ``STORAGE_PROBE_SECONDS`` notices when
storage works again (docs/FAILURE_MODEL.md, "Storage faults").
"""

from __future__ import annotations

import logging
import time

from jobmesh.coordinator.clock import now_millis
from jobmesh.coordinator.core import CoordinatorCore
from jobmesh.protocol import messages as m

log = logging.getLogger("jobmesh.coordinator.runtime")  # one logger for the runtime's lines

STORAGE_PROBE_SECONDS = 1.0  # while storage fails, how often a probe write checks it again


class CommitFailed(Exception):
    """A commit failed in a way the coordinator cannot serve through (not a storage error,
    or the state could not even be reloaded): the core stops, nothing of the batch is released."""


def storage_error(reason: str) -> m.Error:
    return m.Error("storage unavailable: %s" % reason)


class StorageOutages:
    """The runtime's storage-outage path; see the module docstring."""

    def _carry_waits(self, old: CoordinatorCore, answered: list, error: m.Error, replies: list) -> None:
        """After a failed commit: the waits the old core answered in that batch were
        answered by changes that are not durable, so they, and every wait still pending,
        wait again on the reloaded core (an ended job answers them at once). Without a
        reload (stopping) the answered ones get the storage ERROR."""
        core = self.core
        assert core is not None
        if core is old:
            if answered:
                replies.append((None, [(waiter, error) for waiter, _ in answered]))
            return
        core.adopt_waiters(now_millis(), old.waiters.pending() + [waiter for waiter, _ in answered])
        if core.has_answers():
            replies.append((None, core.take_answers()))

    def _storage_failed(self, reason: str, where: str, reload: bool = True) -> None:
        """A write failed for a storage reason: log (once per outage), pause, and unless
        stopping, throw memory away and reload state from the database."""
        self._failed_commits += 1
        if self._outage is None:
            self._outage_since = time.monotonic()
            self._failed_commits = 1
            log.error("storage unavailable (%s): %s; nothing of the failed write is acknowledged, writes answer"
                      " 'storage unavailable' and resume by themselves once storage works", where, reason)
        else:
            log.debug("storage still unavailable (%s): %s", where, reason)
        self._outage = reason
        self._next_probe = time.monotonic() + STORAGE_PROBE_SECONDS
        self._probe = None
        if reload:
            self._reload()
        assert self.core is not None
        self.core.paused = True

    def _reload(self) -> None:
        """Replace the core with the database's state, as a restart would (``recover``).

        Worker connections are closed: the discarded memory held their sessions and
        leases; they register again. Recovery's own rows are kept to commit later."""
        for conn in list(self.handlers.worker_conns):
            conn.abort()
        for pconn in list(self.periodic.conns):  # Periodic sessions too: they reconnect
            pconn.abort()
        old = self.core
        assert old is not None and self.store is not None
        try:
            # Reopened: a connection opened on a read-only file stays read-only.
            store = self._open_store()
        except Exception as exc:
            if not self.store.is_storage_fault(exc):
                raise
            log.warning("could not reopen the database, reloading through the open connections: %s", exc)
        else:
            self.store.close()
            self.store = store
        try:
            core = self._recovered_core()
        except Exception as exc:
            if not self.store.is_storage_fault(exc):
                raise
            raise CommitFailed("could not reload state from the database after a failed commit: %s" % exc) from exc
        core.stats.add(old.stats)  # counters count since the process started
        for state, value in old.finished_counts.items():
            core.finished_counts[state] += value
        rows = core.take_dirty()
        self._pending = rows if any(rows) else None
        core.take_outbound()
        core.paused = True
        self.core = core
        self._dispatch = self._dispatch_table()

    def _check_probe(self) -> None:
        """While storage fails and no batch writes: a probe write now and then, off the hub."""
        assert self.store is not None
        now = time.monotonic()
        probe = self._probe
        if probe is not None:
            if not probe.ready():
                return
            self._probe = None
            failure = probe.get()
            if failure is None:
                self._writes_resumed("a probe write")
            else:
                self._outage = self.store.fault_reason(failure)
                self._next_probe = now + STORAGE_PROBE_SECONDS
            return
        if now >= self._next_probe:
            self._probe = self.store.commit_probe()

    def _writes_resumed(self, how: str) -> None:
        assert self.core is not None
        log.warning("storage works again (%s succeeded): writes resumed after %.1f s and %d failed writes",
                    how, time.monotonic() - self._outage_since, self._failed_commits)
        self._outage = None
        self._probe = None
        self.core.paused = False
