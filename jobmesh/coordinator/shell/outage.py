"""Storage outages: the state of the coordinator while writes fail for a storage reason.

A failed commit acknowledges nothing of its batch; memory, now ahead of disk, is thrown
away and state reloaded from the database as a restart would (the runtime's ``_reload``);
worker and Periodic connections are closed (their sessions died with that memory) and
register again. That is the one reload of an outage: until a probe write (one every
``STORAGE_PROBE_SECONDS``) succeeds, the core is paused, reads are served, and writes
are answered ``storage unavailable`` without being applied or tried
(docs/FAILURE_MODEL.md, "Storage faults").

``StorageOutage`` is the runtime's record of that: whether writes fail and why, since
when, how many failed, recovery's rows not committed yet, and the probe in flight. It
logs the outage's start and end once each and runs the probes through the store.
"""

from __future__ import annotations

import logging
import time

from jobmesh.protocol import messages as m
from jobmesh.store.base import Batch, LeadershipLost, Outcome, StorageFault, Store, first_line, merge_batches

log = logging.getLogger("jobmesh.coordinator.shell.runtime")  # one logger for the runtime's lines

STORAGE_PROBE_SECONDS = 1.0  # while storage fails, how often a probe write checks it again


class CommitFailed(Exception):
    """A commit failed in a way the coordinator cannot serve through (not a storage error,
    or the state could not even be reloaded): the core stops, nothing of the batch is released."""


def storage_error(reason: str) -> m.Error:
    return m.Error("storage unavailable: %s" % reason)


class StorageOutage:
    def __init__(self) -> None:
        self.reason: str | None = None  # why writes fail; None: they work
        self.since = 0.0
        self.failures = 0  # failed commits and probes in this outage
        self.pending: Batch | None = None  # recovery's rows, committed with the first write that works
        self.probe: Outcome | None = None
        self._next_probe = 0.0

    @property
    def active(self) -> bool:
        return self.reason is not None

    def failed(self, reason: str, where: str) -> None:
        """A write failed for a storage reason: log once per outage."""
        self.failures += 1
        if self.reason is None:
            self.since = time.monotonic()
            self.failures = 1
            log.error("storage unavailable (%s): %s; nothing of the failed write is acknowledged, writes answer"
                      " 'storage unavailable' and resume by themselves once storage works", where, reason)
        else:
            log.debug("storage still unavailable (%s): %s", where, reason)
        self.reason = reason
        self._next_probe = time.monotonic() + STORAGE_PROBE_SECONDS
        self.probe = None

    def keep(self, rows: Batch) -> None:
        """Recovery's rows (at start or after a reload), to commit with the first write that
        works; none if it changed nothing."""
        self.pending = rows if any(rows) else None

    def wait(self, timeout: float) -> None:
        """Wait for the probe in flight, if any (the store's thread must be done with it)."""
        if self.probe is not None:
            self.probe.wait(timeout)

    def with_pending(self, rows: Batch) -> Batch:
        """The rows to commit now: recovery's pending rows go with a batch that writes, or
        with any batch once storage works."""
        if self.pending is not None and (any(rows) or self.reason is None):
            return merge_batches(self.pending, rows)
        return rows

    def committed(self, rows: Batch) -> bool:
        """A commit of ``rows`` succeeded (it merged the pending rows, if any); True if that
        ended an outage."""
        self.pending = None
        if self.reason is None:
            return False
        self._resumed("a commit")
        return True

    def check_probe(self, store: Store) -> bool:
        """While storage fails and no batch writes: a probe write now and then, off the hub.
        True once one succeeded (the outage is over). Raises ``LeadershipLost`` when a
        probe found that this process no longer leads (a shared store)."""
        now = time.monotonic()
        probe = self.probe
        if probe is not None:
            if not probe.ready():
                return False
            self.probe = None
            failure = probe.get()
            if failure is None:
                self._resumed("a probe write")
                return True
            if isinstance(failure, LeadershipLost):
                raise failure
            self.reason = failure.reason if isinstance(failure, StorageFault) else first_line(failure)
            self.failures += 1
            self._next_probe = now + STORAGE_PROBE_SECONDS
            return False
        if now >= self._next_probe:
            self.probe = store.commit_probe()
        return False

    def _resumed(self, how: str) -> None:
        log.warning("storage works again (%s succeeded): writes resumed after %.1f s and %d failed writes",
                    how, time.monotonic() - self.since, self.failures)
        self.reason = None
        self.probe = None
