"""The core greenlet: batches, group commit, release, and storage outages.

It takes a fair batch from the mailbox (``mailbox.py``: connections served round-robin
within a cost budget of ``MAX_BATCH``), has the core apply it (``CoordinatorCore.apply_batch``:
each event with one clock read, then the end of the batch), commits every changed row in
one store transaction, run off the hub by the store (group commit), and only then
releases the batch's replies and outbound frames (``replies.py``). It starts no new batch
while a commit is in flight, so no client or worker ever observes a state that is not on
disk, and memory is never more than one batch ahead of disk.

A failed commit (disk full, database locked or read-only) acknowledges nothing of its
batch: the replies become ``ERROR storage unavailable: <reason>`` and its worker frames
are dropped. Memory is then ahead of disk, so it is thrown away: state is reloaded from
the database exactly as a restart would (a fresh core + ``recover``), and worker
connections are closed (their leases died with the discarded memory; they register
again). Until storage works the core is paused (``core.refusal``: no assignments, no
changes of its own, every event that would write refused before it is applied), reads
are served, and no write is tried, so an outage costs one reload however many writes
come; a probe write every ``STORAGE_PROBE_SECONDS`` notices when storage works again
(``outage.py``). Nothing exits: a restart could do no better (docs/FAILURE_MODEL.md).

On a shared store a store call that fails because this process no longer leads
(``leadership.py``) ends the loop: nothing more is committed or released, exit 75.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import gevent

from jobmesh.coordinator.core import events as ev
from jobmesh.coordinator.core.face import Applied, CoordinatorCore, Slot, Waiter
from jobmesh.coordinator.ports.server import SHUTTING_DOWN
from jobmesh.coordinator.shell.clock import core_millis, now_millis, wall_millis
from jobmesh.coordinator.shell.housekeeping import COMMIT_SECONDS_BUCKETS, SIZE_BUCKETS, CollectorPolicy, Histogram
from jobmesh.coordinator.shell.leadership import KeepLeading
from jobmesh.coordinator.shell.mailbox import Mailbox
from jobmesh.coordinator.shell.marker import Marker
from jobmesh.coordinator.shell.outage import CommitFailed, StorageOutage, storage_error
from jobmesh.coordinator.shell.replies import Replies, refuse, send_outbound
from jobmesh.coordinator.core.peers import OutboundConnection
from jobmesh.protocol import messages as m
from jobmesh.exitcodes import EXIT_COMMIT_FAILED, EXIT_CORE_DIED, EXIT_LEADERSHIP_LOST
from jobmesh.store.base import LeadershipLost, StorageFault, Store, first_line

log = logging.getLogger("jobmesh.coordinator.shell.runtime")  # one logger for the runtime's lines

MAX_BATCH = 512
DRAIN_POLL_SECONDS = 0.02
FIRE_TICK_MILLIS = 10  # recurring schedules fire at most this often (in batches), at their time


class BatchFigures:
    """The loop's figures for the metrics port, plain histograms: commit times, job rows
    per commit, mailbox items per batch (zero until the loop runs)."""

    def __init__(self) -> None:
        self.commit_seconds = Histogram(COMMIT_SECONDS_BUCKETS)
        self.commit_rows = Histogram(SIZE_BUCKETS)
        self.batch_events = Histogram(SIZE_BUCKETS)


def arrival(conn: OutboundConnection) -> int:
    """Liveness by arrival: a worker connection's handler stamps when its last frame
    arrived; one whose handler is paused (the core is behind on its events) is alive now."""
    return now_millis() if conn.paused else core_millis(conn.last_arrival)


class CoreLoop:
    """The core and its store from recovery on: the core greenlet and what it releases.

    ``recover(store, old)`` builds a recovered core
    (a reload after a failed commit); ``drop_sessions()`` closes every worker and Periodic
    connection (their sessions die with the memory a reload throws away)."""

    def __init__(self, store: Store, core: CoordinatorCore, mailbox: Mailbox, marker: Marker,
                 keep_leading: KeepLeading | None, figures: BatchFigures,
                 recover: Callable[[Store, CoordinatorCore | None], CoordinatorCore],
                 drop_sessions: Callable[[], None]) -> None:
        self.store = store
        self.core = core
        self.mailbox = mailbox
        self.marker = marker
        self.keep_leading = keep_leading
        self._recover = recover
        self._drop_sessions = drop_sessions
        self.replies = Replies()
        self.outage = StorageOutage()
        self.collector = CollectorPolicy()
        self._sweep = ev.Sweep(arrival, wall_millis)  # what the sweep timer posts
        self.figures = figures
        self._greenlet: gevent.Greenlet | None = None
        self._ended: Callable[[int], None] = lambda code: None

    @property
    def storage_available(self) -> bool:
        """False during a storage outage (writes fail)."""
        return not self.outage.active

    def write_recovery(self) -> None:
        """Commit recovery's rows (and the schedules file's) before any job port opens. A
        database that cannot be written starts degraded: the rows wait for the first
        write that works, and writes answer the storage ERROR until then."""
        rows = self.core.take_dirty()
        if not any(rows):
            return
        try:
            self.store.write(rows)
        except StorageFault as exc:
            reason = exc.reason
            self.outage.keep(rows)  # recovery's decisions: committed with the first write that works
            self.outage.failed(reason, "at start")
            self.core.refusal = storage_error(reason)

    def start(self, ended: Callable[[int], None], sweep_seconds: float) -> None:
        """Start the core greenlet: take a batch, apply it, commit it, release it, until a
        STOP (``stop``); and the sweep's timer, every ``sweep_seconds``. ``ended(code)`` is
        told if the greenlet ends on its own, and nothing more is committed or released
        then: 75, the leadership of a shared store was lost; 71, a commit failed in a way
        storage errors do not explain, or state could not be reloaded after one (the next
        start's recovery repairs it); 70, a bug."""
        self._ended = ended
        self._greenlet = gevent.spawn(self._run)
        self._greenlet.link_exception(self._died)
        self.marker.every(self._sweep, sweep_seconds)

    def _run(self) -> None:
        try:
            self._loop()
        except LeadershipLost as exc:  # nothing of the batch that found it was released
            log.error("leadership lost: another coordinator may lead now; nothing more is committed or answered,"
                      " exiting %d (%s)", EXIT_LEADERSHIP_LOST, exc)
            self._ended(EXIT_LEADERSHIP_LOST)

    def _died(self, greenlet: gevent.Greenlet) -> None:
        if isinstance(greenlet.exception, CommitFailed):
            log.critical("database commit failed; stopping so that recovery can repair state: %s",
                         greenlet.exception, exc_info=greenlet.exc_info)
            self._ended(EXIT_COMMIT_FAILED)
        else:
            log.critical("the core greenlet died; stopping the coordinator", exc_info=greenlet.exc_info)
            self._ended(EXIT_CORE_DIED)

    def stop(self) -> None:
        """STOP: the core commits its batch, answers what it took and fails what is still
        queued (waited for up to 10 s)."""
        greenlet = self._greenlet
        if greenlet is not None:
            greenlet.unlink(self._died)
            self.mailbox.put(ev.STOP)
            greenlet.join(10)
            greenlet.kill(block=False)

    def _loop(self) -> None:
        mailbox, marker = self.mailbox, self.marker
        unsent: Applied | None = None  # the replies of the last committed batch, not written yet
        while True:
            if unsent is not None and not len(mailbox):
                self.replies.write(unsent)
                unsent = None
            batch = mailbox.take(MAX_BATCH)
            if marker.taken():
                self.collector.tick(time.monotonic())
            self.figures.batch_events.observe(len(batch))
            applied = self._apply(batch)
            unsent = self._commit_and_release(applied, unsent)
            if applied.stop:
                self.replies.answer([(waiter, SHUTTING_DOWN) for waiter in self.core.pending_waits()])
                for event in mailbox.take_all():
                    refuse(event)
                return
            core = self.core  # a failed commit replaced it
            deadlines = core.next_deadlines()
            marker.arm(ev.EXPIRE, deadlines.waits)
            if deadlines.fires is not None:
                marker.arm(ev.FIRE, max(deadlines.fires, now_millis() + FIRE_TICK_MILLIS))
            marker.arm(ev.TOKENS_DUE, deadlines.tokens)
            for read in core.take_new_reads():  # none on SQLite: its reads answer at once
                read.then(self._read_done)

    def _read_done(self) -> None:
        """A store read a held request waits for finished: wake the core."""
        self.marker.post(ev.READS_DONE)

    def _apply(self, batch: list[ev.Event]) -> Applied:
        """The core applies the batch; events after a STOP are refused, not applied."""
        applied = self.core.apply_batch(batch, now_millis)  # raises LeadershipLost: a read found it gone
        for event in applied.unapplied:
            refuse(event)
        return applied

    def _commit_and_release(self, applied: Applied, unsent: Applied | None) -> Applied | None:
        """Group commit: the whole batch in one transaction; its replies and frames go out
        only after it. One commit in flight at a time (measured: overlapping the next
        batch with the commit made batches smaller and submits slower; docs/PERFORMANCE.md).
        The previous batch's replies (``unsent``) are written while this commit runs.
        Returns the replies still to write (None if all are written).

        A commit that fails for a storage reason releases nothing of the batch
        (``_refuse_batch``). Recovery rows not committed yet (the outage's ``pending``) go
        with the next batch that writes, or with the next batch at all once storage works."""
        core, store, outage, stop = self.core, self.store, self.outage, applied.stop
        rows = outage.with_pending(core.take_dirty())
        outbound = core.take_outbound()
        commit = store.commit(rows) if any(rows) else None
        started = time.perf_counter()
        if unsent is not None:
            self.replies.write(unsent)
        if commit is not None:
            failure = commit.get()
            if isinstance(failure, LeadershipLost):
                raise failure  # nothing of this batch is released
            if isinstance(failure, StorageFault):
                self._refuse_batch(applied, failure.reason)
                outbound = []
            elif failure is not None:
                raise CommitFailed("%s: %s" % (type(failure).__name__, failure)) from failure
            else:
                self.figures.commit_seconds.observe(time.perf_counter() - started)
                self.figures.commit_rows.observe(len(rows.inserts) + len(rows.updates))
                if self.keep_leading is not None:
                    self.keep_leading.committed()
                if outage.committed(rows):
                    core.refusal = None
        elif outage.active and not stop:
            core.refusal = None if outage.check_probe(store) else storage_error(outage.reason or "")
        elif self.keep_leading is not None and not stop:
            self.keep_leading.tick(store)
        send_outbound(outbound)
        if stop or commit is None:
            self.replies.write(applied)  # nothing to overlap with
            if not stop:
                # The mailbox never blocks while it has items: let the hub run a whole loop
                # (I/O and timers too; sleep(0) only runs callbacks, so a stream of batches
                # without writes left the sweep timer and idle sockets unserved for seconds).
                gevent.idle()
            return None
        return applied

    # ---- storage outages --------------------------------------------------------------

    def _refuse_batch(self, applied: Applied, reason: str) -> None:
        """A batch whose commit failed for a storage reason: its replies become the storage
        ERROR (a protocol refusal keeps its own; a pending wait stays pending: it wrote
        nothing), and state is reloaded (``_reload``). The waits the old core answered in
        that batch were answered by changes that are not durable, so they, and every wait
        still pending, wait again on the reloaded core (an ended job answers them at once);
        without a reload (stopping) they get the storage ERROR."""
        old = self.core
        self.outage.failed(reason, "commit")
        if not applied.stop:
            self._reload()
        error = storage_error(reason)
        self.core.refusal = error
        applied.replies = [(conn, (msg if closes or type(msg) is Slot else error, closes))
                           for conn, (msg, closes) in applied.replies]
        # A held request applied again in this batch answered like any reply of it.
        resumed: list[tuple[Waiter, m.Message]] = [(waiter, error) for waiter, _ in applied.waits if not waiter.job_id]
        waits = [waiter for waiter, _ in applied.waits if waiter.job_id]
        if self.core is old:
            applied.waits = resumed + [(waiter, error) for waiter in waits]
        else:
            applied.waits = resumed + self.core.adopt_from(old, now_millis(), waits)

    def _reload(self) -> None:
        """Replace the core with the database's state, as a restart would (``recover``).

        Worker connections are closed: the discarded memory held their sessions and
        leases; they register again. Recovery's own rows are kept to commit later."""
        self._drop_sessions()
        old = self.core
        try:
            # Reopened: a connection opened on a read-only file stays read-only (a shared
            # store's writer holds the leadership: it reloads through it).
            self.store.reopen()
        except StorageFault as exc:
            log.warning("could not reopen the database, reloading through the open connections: %s",
                        first_line(exc.__cause__ or exc))
        try:
            core = self._recover(self.store, old)
        except StorageFault as exc:
            raise CommitFailed("could not reload state from the database after a failed commit: %s" % exc) from exc
        rows = core.take_dirty()
        self.outage.keep(rows)
        core.take_outbound()
        self.core = core

    # ---- stop -----------------------------------------------------------------------

    def drain(self, millis: int, stopping: Callable[[], bool]) -> None:
        """Assign nothing more; return once no attempt runs, ``millis`` passed, or
        ``stopping()`` (an attempt still running then stays RUNNING on disk and is
        requeued by the next start's recovery)."""
        # A plain flag the core reads at its next scheduling pass; set between batches
        # (greenlets are cooperative), so no batch sees it change halfway.
        self.core.draining = True
        deadline = time.monotonic() + millis / 1000.0
        log.info("draining: no new assignments; waiting up to %d ms for %d running attempts",
                 millis, self.core.running_attempts)
        while not stopping():
            running = self.core.running_attempts
            if not running:
                log.info("drained: no attempt is running")
                break
            if time.monotonic() >= deadline:
                log.warning("drain time passed with %d attempts still running; the next start requeues them",
                            running)
                break
            gevent.sleep(DRAIN_POLL_SECONDS)

    def close(self) -> None:
        """After the core stopped and the ports closed: wait for the probe and the
        keepalive in flight, then close the store."""
        self.outage.wait(10)  # the DB thread must be done with the connections it closes
        if self.keep_leading is not None:
            self.keep_leading.wait(10)
        self.store.close()
