"""Coordinator: the impure shell around ``CoordinatorCore``.

Start order: the database lock (``dblock``: one coordinator per database, before
anything touches the file) → open and recover from the store (inline, before any
listener) → core greenlet → sweep timer → listeners → the "listening" line. Stop order:
core (commits its batch, answers what it took, fails what is still queued) → listeners →
database → lock. With ``--drain-millis`` a stop signal first drains: no new assignment,
running attempts get up to that long to finish (a second signal stops at once).

The core greenlet takes a fair batch from the mailbox (``mailbox.py``: connections served
round-robin within a cost budget of ``MAX_BATCH``), applies each event with one clock read, schedules, and commits every changed row in
one store transaction, run off the hub by the store (group commit), and only then releases the
batch's replies and outbound frames. It starts no new batch while a commit is in flight,
so no client or worker ever observes a state that is not on disk, and memory is never
more than one batch ahead of disk.

A failed commit (disk full, database locked or read-only) acknowledges nothing of its
batch: the replies become ``ERROR storage unavailable: <reason>`` and its worker frames
are dropped. Memory is then ahead of disk, so it is thrown away: state is reloaded from
the database exactly as a restart would (a fresh core + ``recover``), and worker
connections are closed (their leases died with the discarded memory; they register
again). Until a write succeeds the core is paused (no assignments, no changes of its
own), reads are served, and writes are tried and answered with the same ERROR while
they fail; a probe write every ``STORAGE_PROBE_SECONDS`` notices when storage works
again. Nothing exits: a restart could do no better (docs/FAILURE_MODEL.md). That path
is written in ``outage.py``.

The sweep is armed by ``gevent.spawn_later``: the callback re-arms itself on a fixed
cadence and only posts a SWEEP marker; the sweep itself runs inside the core loop,
under the same try/except as every event, so an error can kill neither.

A WAIT_JOB the core cannot answer at once holds a ``Slot`` in its connection's reply
order: replies to later requests on that connection queue behind it (``Held``) and go
out, in order, once the core answers the wait (its job ended, or its time is up). A
timer armed for the earliest pending wait's deadline posts an EXPIRE marker, so a
timeout is answered within milliseconds of its time, not at the next sweep.
Connections with nothing pending take the unchanged path: one write per batch.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sqlite3
import time
from collections import deque
from typing import Any, Callable

import gevent
import gevent.event
import gevent.pool
import gevent.server

from jobmesh.config import CoordinatorConfig
from jobmesh.coordinator import events as ev
from jobmesh.coordinator.clock import core_millis, now_millis, wall_millis
from jobmesh.coordinator.connection import ReplyConnection
from jobmesh.coordinator.mailbox import Mailbox
from jobmesh.coordinator.outage import CommitFailed, StorageOutages, storage_error
from jobmesh.coordinator.core import CoordinatorCore
from jobmesh.coordinator.dblock import DatabaseInUse, DatabaseLock
from jobmesh.coordinator.figures import RuntimeFigures
from jobmesh.coordinator.housekeeping import (COMMIT_SECONDS_BUCKETS, SIZE_BUCKETS, CollectorPolicy, Histogram,
                                              raise_fd_limit)
from jobmesh.coordinator.periodic_port import PeriodicPort
from jobmesh.coordinator.server import SHUTTING_DOWN, Servers
from jobmesh.errors import ProtocolError
from jobmesh.protocol import messages as m
from jobmesh.protocol.framing import encode_frame
from jobmesh.store.base import Batch, Store, merge_batches
from jobmesh.store.sqlite import FAULT_FILE_ENV, SQLiteStore

log = logging.getLogger(__name__)

MAX_BATCH = 512
BACKLOG = 4096
FD_MARGIN = 256
WORKER_FD_RESERVE = 512  # descriptors client connections may not take (new workers can always register)
EXIT_CORE_DIED = 70
EXIT_COMMIT_FAILED = 71
DRAIN_POLL_SECONDS = 0.02
class CannotStart(Exception):
    """A start-up failure whose message is the whole story (one line, exit 1)."""


INTERNAL_ERROR = m.Error("internal coordinator error; see the coordinator log")


class Slot:
    """The place of a pending WAIT_JOB's reply in its connection's order; ``msg`` is set
    once the core answers it."""

    __slots__ = ("msg",)

    def __init__(self) -> None:
        self.msg: m.Message | None = None


class Held:
    """A connection's replies held behind pending waits: ``(reply or Slot, close)`` in
    request order, and how many of its Slots are not yet written (queued or still to be
    queued: a wait's Slot exists before its batch's replies are written)."""

    __slots__ = ("queue", "slots")

    def __init__(self) -> None:
        self.queue: deque = deque()
        self.slots = 0


def _by_conn(pairs: list) -> dict[Any, list]:
    """The items of ``(conn, item)`` pairs grouped by connection, each group in order."""
    groups: dict[Any, list] = {}
    for conn, item in pairs:
        group = groups.get(conn)
        if group is None:
            groups[conn] = [item]
        else:
            group.append(item)
    return groups


def _encode_reply(msg: m.Message) -> bytes:
    try:
        return encode_frame(msg.to_wire())
    except ProtocolError as exc:  # a bug upstream; answer rather than leave the client waiting
        log.error("could not encode a %s reply: %s", msg.TYPE, exc)
        return encode_frame(INTERNAL_ERROR.to_wire())


class Coordinator(StorageOutages):
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.mailbox = Mailbox()
        self.store: Store | None = None
        self.core: CoordinatorCore | None = None
        self.servers: list[gevent.server.StreamServer] = []
        self.handlers = Servers(self.mailbox.put, self.mailbox.put_urgent, config.idle_timeout_millis / 1000.0)
        self.periodic = PeriodicPort(self.mailbox.put, self.mailbox.put_urgent, self.handlers.connections,
                                     config.idle_timeout_millis / 1000.0, config.task_timeout_millis / 1000.0,
                                     config.periodic_keepalive_millis / 1000.0)
        self._core_greenlet: gevent.Greenlet | None = None
        self._sweep_timer: gevent.Greenlet | None = None
        self._next_sweep = 0.0
        self._sweep_pending = False
        # WAIT_JOB: replies held behind pending waits, per connection, and the timer for
        # the earliest wait deadline (core time), with the EXPIRE marker it posts.
        self._held: dict[Any, Held] = {}
        self._expire_timer: gevent.Greenlet | None = None
        self._expire_at: int | None = None
        self._expire_pending = False
        self._stopping = False
        self.stopped = gevent.event.Event()
        self.exit_code = 0  # what run_coordinator returns once stopped
        self.collector = CollectorPolicy()
        self.lock = DatabaseLock(config.db)
        self._dispatch: dict[type, Callable[[int, Any], Any]] = {}
        # Storage outage: its reason while writes fail (None: writes work), since when, how
        # many commits failed, recovery's rows not committed yet, and the probe in flight.
        self._outage: str | None = None
        self._outage_since = 0.0
        self._failed_commits = 0
        self._pending: Batch | None = None
        self._probe: Any = None
        self._next_probe = 0.0
        self._draining = False
        # Figures for the metrics port (jobmesh/coordinator/http.py), kept as plain numbers.
        self.ready = False  # recovered and listening (and not stopping)
        self.http: Any = None  # the metrics port, when --metrics-port is given
        self.commit_seconds = Histogram(COMMIT_SECONDS_BUCKETS)
        self.commit_rows = Histogram(SIZE_BUCKETS)  # job rows written per commit
        self.batch_events = Histogram(SIZE_BUCKETS)  # mailbox items per batch

    # ---- start --------------------------------------------------------------------

    def start(self) -> str:
        """Lock, recover, start the core and the listeners; returns the "listening" line.

        Raises ``DatabaseInUse`` or ``CannotStart`` (the message says it all),
        ``sqlite3.Error`` if the database cannot be opened, ``OSError`` if a port cannot.
        A database that opens but cannot be written (full, read-only, locked) starts
        degraded: reads are served, writes answer the storage ERROR until it works.
        """
        cfg = self.config
        fd_limit = raise_fd_limit()
        try:
            self.lock.acquire()  # before anything touches the database (recovery rewrites it)
        except DatabaseInUse:
            raise
        except OSError as exc:
            raise CannotStart("cannot open the database %s: cannot create its lock file %s: %s"
                              % (cfg.db, self.lock.path, exc.strerror or exc)) from None
        self.store = self._open_store()
        if self.store.migrated:
            log.info("migrated database %s: added columns %s", cfg.db, ", ".join(self.store.migrated))
        self.core = self._recovered_core()
        rows = self.core.take_dirty()
        if any(rows):
            try:
                self.store.write(rows)
            except Exception as exc:
                if not self.store.is_storage_fault(exc):
                    raise
                self._pending = rows  # recovery's decisions: committed with the first write that works
                self._storage_failed(self.store.fault_reason(exc), "at start", reload=False)
        self._dispatch = self._dispatch_table()
        gc.collect()
        gc.freeze()  # the recovered working set and everything imported: never scanned again
        self._core_greenlet = gevent.spawn(self._run_core)
        self._core_greenlet.link_exception(self._core_died)
        self._next_sweep = time.monotonic()
        self._arm_sweep()

        # A Pool caps handlers. Clients may not use the last WORKER_FD_RESERVE descriptors,
        # so however many clients connect (or idle), new workers can still register;
        # further clients wait in the accept backlog until a client connection ends.
        per_server = max(64, fd_limit - FD_MARGIN)
        worker_srv = gevent.server.StreamServer(
            (cfg.bind, cfg.worker_port), self.handlers.handle_worker, backlog=BACKLOG,
            spawn=gevent.pool.Pool(per_server),
        )
        client_srv = gevent.server.StreamServer(
            (cfg.bind, cfg.client_port), self.handlers.handle_client, backlog=BACKLOG,
            spawn=gevent.pool.Pool(max(32, per_server - WORKER_FD_RESERVE)),
        )
        servers = [worker_srv, client_srv]
        if cfg.periodic_port is not None:
            periodic_srv = gevent.server.StreamServer(
                (cfg.bind, cfg.periodic_port), self.periodic.handle, backlog=BACKLOG,
                spawn=gevent.pool.Pool(max(32, per_server - WORKER_FD_RESERVE)),
            )
            servers.append(periodic_srv)
        for srv in servers:
            srv.start()
            self.servers.append(srv)
        line = "jobmesh coordinator listening worker=%s:%d client=%s:%d" % (
            cfg.bind, worker_srv.server_port, cfg.bind, client_srv.server_port)
        if cfg.periodic_port is not None:
            line += " periodic=%s:%d" % (cfg.bind, periodic_srv.server_port)
        if cfg.metrics_port is not None:
            from jobmesh.coordinator.http import HttpPort  # imports prometheus_client: only when asked

            self.http = HttpPort(self, cfg.bind, cfg.metrics_port)
            self.servers.append(self.http.start())
            line += " metrics=%s:%d" % (cfg.bind, self.http.port)
        self.ready = True
        log.info("listening worker=%s:%d client=%s:%d fd_limit=%d", cfg.bind, worker_srv.server_port,
                 cfg.bind, client_srv.server_port, fd_limit)
        return line

    def _open_store(self) -> Store:
        # The fault file is a testing aid only (docs/FAILURE_MODEL.md, "Testing storage faults").
        return SQLiteStore(self.config.db, self.config.db_synchronous, os.environ.get(FAULT_FILE_ENV) or None)

    def _recovered_core(self) -> CoordinatorCore:
        """A fresh core with the database's state, after recovery (its rows not yet written)."""
        cfg = self.config
        assert self.store is not None
        core = CoordinatorCore(self.store, cfg)  # a CoordinatorConfig is a CoreConfig
        if self.core is not None:
            core.drift = self.core.drift  # a reload: keep the wall clock's known offset
        stats = core.recover(now_millis())
        core.draining = self._draining
        log.info(
            "recovered db=%s active=%d queued=%d scheduled=%d retry_wait=%d requeued=%d due_while_down=%d"
            " failed_on_restart=%d task_types=%d next_seq=%d",
            cfg.db, core.active_count, stats["queued"], stats["scheduled"], stats["retry_wait"],
            stats["requeued"], stats["due"], stats["failed"], len(core.known_types), core.next_seq,
        )
        return core

    def _core_died(self, greenlet: gevent.Greenlet) -> None:
        """The core is gone: nothing more can be applied or released. Stop the listeners
        and the database and make ``run_coordinator`` return non-zero, so that a listener
        never runs without a core (71: a commit failed in a way storage errors do not
        explain, or state could not be reloaded after one; the next start's recovery
        repairs it; 70: a bug)."""
        if isinstance(greenlet.exception, CommitFailed):
            self.exit_code = EXIT_COMMIT_FAILED
            log.critical("database commit failed; stopping so that recovery can repair state: %s",
                         greenlet.exception, exc_info=greenlet.exc_info)
        else:
            self.exit_code = EXIT_CORE_DIED
            log.critical("the core greenlet died; stopping the coordinator", exc_info=greenlet.exc_info)
        gevent.spawn(self.stop)

    # ---- sweep timer ----------------------------------------------------------------

    def _arm_sweep(self) -> None:
        interval = self.config.sweep_interval_millis / 1000.0
        now = time.monotonic()
        self._next_sweep += interval
        if self._next_sweep < now:  # skip missed periods rather than bunching up
            self._next_sweep = now + interval
        self._sweep_timer = gevent.spawn_later(self._next_sweep - now, self._sweep_tick)

    def _sweep_tick(self) -> None:
        if self._stopping:
            return
        self._arm_sweep()
        if not self._sweep_pending:
            self._sweep_pending = True
            self.mailbox.put_urgent(ev.SWEEP)

    # ---- the core loop -----------------------------------------------------------------

    def _dispatch_table(self) -> dict[type, Callable[[int, Any], Any]]:
        """Event class -> what the core does with it. Client requests answer with a reply."""
        core = self.core
        assert core is not None
        answers: dict[type, Callable[[int, Any], m.Message]] = {
            m.SubmitJob: core.submit_job,
            m.GetJobStatus: lambda now, r: core.get_job_status(now, r.job_id),
            m.ListJobs: core.list_jobs,
            m.ListWorkers: lambda now, r: core.list_workers(now),
            m.CancelJob: lambda now, r: core.cancel_job(now, r.job_id),
            m.GetJobEvents: lambda now, r: core.get_job_events(now, r.job_id),
            m.RetryJob: lambda now, r: core.retry_job(now, r.job_id),
            m.PurgeJobs: core.purge_jobs,
            m.GetStats: lambda now, _req: core.get_stats(now),
            ev.Refusal: lambda now, r: r.error,
        }
        wait = m.WaitJob  # the one request that needs its connection (its reply may come later)
        return {
            ev.Registered: lambda now, e: core.on_worker_registered(now, e.conn, e.msg),
            ev.Result: lambda now, e: core.on_task_result(now, e.conn, e.msg),
            ev.Disconnected: lambda now, e: core.on_worker_disconnected(now, e.conn),
            ev.PeriodicPacket: lambda now, e: core.on_periodic(now, e.conn, e.msg),
            ev.PeriodicClosed: lambda now, e: core.on_periodic_closed(now, e.conn),
            ev.Sweep: self._sweep,
            ev.Expire: self._expire,
            ev.ClientClosed: self._client_closed,
            ev.Request: lambda now, e: (answers[type(e.msg)](now, e.msg) if type(e.msg) is not wait
                                        else self._wait_job(now, e)),
        }

    # ---- WAIT_JOB: held replies and the expiry timer -------------------------------------

    def _wait_job(self, now: int, event: ev.Request) -> m.Message | Slot:
        """The reply to a WAIT_JOB, or a Slot that later replies on its connection wait behind."""
        assert self.core is not None
        slot = Slot()
        answer = self.core.wait_job(now, event.conn, slot, event.msg)
        if answer is not None:
            return answer
        held = self._held.get(event.conn)
        if held is None:
            held = self._held[event.conn] = Held()
        held.slots += 1
        return slot

    def _client_closed(self, now: int, event: ev.ClientClosed) -> None:
        """Its waits will never be read: forget them and what is held behind them."""
        assert self.core is not None
        self._held.pop(event.conn, None)
        self.core.on_client_closed(now, event.conn)

    def _expire(self, now: int, _event: ev.Expire) -> None:
        assert self.core is not None
        self._expire_pending = False
        self.core.expire_waits(now)

    def _arm_expiry(self) -> None:
        """Keep a timer armed for the earliest pending wait's deadline."""
        core = self.core
        if core is None or self._expire_pending or self._stopping:
            return
        due = core.next_wait_deadline()
        if due is None or (self._expire_at is not None and self._expire_at <= due):
            return
        if self._expire_timer is not None:
            self._expire_timer.kill(block=False)
        self._expire_at = due
        self._expire_timer = gevent.spawn_later(max(0.0, (due - now_millis()) / 1000.0), self._expire_tick)

    def _expire_tick(self) -> None:
        self._expire_timer = None
        self._expire_at = None
        if self._stopping or self._expire_pending:
            return
        self._expire_pending = True
        self.mailbox.put_urgent(ev.EXPIRE)

    def _release(self, conn: ReplyConnection, held: Held) -> None:
        """Write the longest ready prefix of a connection's held replies, in one write."""
        queue = held.queue
        data, count, close = b"", 0, False
        while queue:
            msg, closes = queue[0]
            if type(msg) is Slot:
                if msg.msg is None:
                    break
                held.slots -= 1
                msg = msg.msg
            queue.popleft()
            data += _encode_reply(msg)
            count += 1
            close = close or closes
        if count:
            conn.reply(data, count, close)
        if not queue and not held.slots:
            del self._held[conn]

    def _sweep(self, now: int, _event: ev.Sweep) -> None:
        assert self.core is not None
        self._sweep_pending = False
        # Liveness by arrival: each worker's handler stamps when its last frame arrived,
        # and one whose handler is paused (the core is behind on its events) is alive.
        for session in self.core.workers:
            conn = session.conn
            self.core.on_heartbeat(now if conn.paused else core_millis(conn.last_arrival), conn, session.worker_id)
        self.core.observe_wall(now, wall_millis())
        self.core.sweep(now)
        self.collector.tick(time.monotonic())

    def _run_core(self) -> None:
        """Take a batch, apply it, commit it, release it; until a STOP."""
        mailbox = self.mailbox
        unsent = None  # the replies of the last committed batch, not written yet
        while True:
            if unsent is not None and not len(mailbox):
                self._write_replies(unsent)
                unsent = None
            batch = mailbox.take(MAX_BATCH)
            self.batch_events.observe(len(batch))
            # self._dispatch: a storage failure replaces the core, and the table with it.
            replies, stop = self._apply_batch(batch, self._dispatch)
            unsent = self._commit_and_release(replies, unsent, stop)
            if stop:
                self._answer_waits(SHUTTING_DOWN)
                for item in mailbox.take_all():
                    self._fail(item)
                return
            self._arm_expiry()

    def _apply_batch(self, batch: list, dispatch: dict[type, Callable[[int, Any], Any]]) -> tuple[list, bool]:
        """Apply each event of a batch (one clock read each), then schedule.

        Returns the batch's replies and whether a STOP was in it (events after a STOP are
        refused, not applied). The replies are ``(conn, (reply, close after it))`` (the
        reply a ``Slot`` for a pending wait) and then ``(None, answers)``: the waits the
        core answered in this batch, ``(Waiter, reply)`` pairs.
        """
        core = self.core
        assert core is not None
        replies: list[tuple[Any, tuple[m.Message, bool]]] = []
        stop = False
        now = now_millis()
        for item in batch:
            kind = type(item)
            if kind is ev.Stop:
                stop = True
                continue
            if stop:
                self._fail(item)
                continue
            now = now_millis()
            try:
                answer = dispatch[kind](now, item)
                if kind is ev.Request:
                    replies.append((item.conn, (answer, type(item.msg) is ev.Refusal)))
            except Exception:
                log.exception("error while handling %s; continuing", kind.__name__)
                if kind is ev.Request:
                    replies.append((item.conn, (INTERNAL_ERROR, False)))
        try:
            core.after_batch(now)
        except Exception:
            log.exception("error while scheduling; continuing")
        if core.has_answers():
            replies.append((None, core.take_answers()))
        return replies, stop

    def _commit_and_release(self, replies: list, unsent: list | None, stop: bool) -> list | None:
        """Group commit: the whole batch in one transaction; its replies and frames go out
        only after it. One commit in flight at a time (measured: overlapping the next
        batch with the commit made batches smaller and submits slower; docs/PERFORMANCE.md).
        The previous batch's replies (``unsent``) are written while this commit runs.
        Returns the replies still to write (None if all are written).

        A commit that fails for a storage reason releases nothing of the batch: its replies
        become the storage ERROR, its frames are dropped, and state is reloaded
        (``_storage_failed``). Recovery rows not committed yet (``_pending``) go with the
        next batch that writes, or with the next batch at all once storage works."""
        core = self.core
        store = self.store
        assert core is not None and store is not None
        rows = core.take_dirty()
        outbound = core.take_outbound()
        pending = self._pending
        if pending is not None and (any(rows) or self._outage is None):
            rows = merge_batches(pending, rows)
        commit = store.commit(rows) if any(rows) else None
        started = time.perf_counter()
        if unsent is not None:
            self._write_replies(unsent)
        if commit is not None:
            failure = commit.get()
            if failure is not None and store.is_storage_fault(failure):
                reason = store.fault_reason(failure)
                answered = replies.pop()[1] if replies and replies[-1][0] is None else []
                self._storage_failed(reason, "commit", reload=not stop)
                error = storage_error(reason)
                # A pending wait stays pending (it writes nothing): see _carry_waits.
                replies = [(conn, (msg if closes or type(msg) is Slot else error, closes))
                           for conn, (msg, closes) in replies]
                self._carry_waits(core, answered, error, replies)
                outbound = []
            elif failure is not None:
                raise CommitFailed("%s: %s" % (type(failure).__name__, failure)) from failure
            else:
                self.commit_seconds.observe(time.perf_counter() - started)
                self.commit_rows.observe(len(rows[0]) + len(rows[1]))
                if pending is not None:
                    self._pending = None  # a commit with pending rows always merged them
                if self._outage is not None:
                    self._writes_resumed("a commit")
        elif self._outage is not None and not stop:
            self._check_probe()
        self._send_outbound(outbound)
        if stop or commit is None:
            self._write_replies(replies)  # nothing to overlap with
            if not stop:
                # The mailbox never blocks while it has items: let the hub run a whole loop
                # (I/O and timers too; sleep(0) only runs callbacks, so a stream of batches
                # without writes left the sweep timer and idle sockets unserved for seconds).
                gevent.idle()
            return None
        return replies

    # ---- storage outages --------------------------------------------------------------

    def _write_replies(self, replies: list) -> None:
        """Encode a batch's replies and write each connection's with one write, in order.

        A connection with a pending wait has its replies queued behind it (``_release``
        writes what is ready); the waits answered in the batch come last."""
        answered = replies.pop() if replies and replies[-1][0] is None else None
        held = self._held
        for conn, answers in _by_conn(replies).items():
            waiting = held.get(conn) if held else None
            if waiting is not None:
                waiting.queue.extend(answers)
                self._release(conn, waiting)
                continue
            data, close = b"", False
            for msg, closes in answers:
                data += _encode_reply(msg)
                close = close or closes
            conn.reply(data, len(answers), close)
        if answered is not None:
            for waiter, msg in answered[1]:
                slot = waiter.token
                if slot.msg is None:
                    slot.msg = msg
                waiting = held.get(waiter.conn)
                if waiting is not None:  # None: the client has gone
                    self._release(waiter.conn, waiting)

    def _answer_waits(self, msg: m.Message) -> None:
        """Answer every pending wait with ``msg`` now (stopping)."""
        core = self.core
        if core is not None and core.waiters:
            self._write_replies([(None, [(waiter, msg) for waiter in core.waiters.pending()])])

    @staticmethod
    def _send_outbound(outbound: list) -> None:
        """Worker frames of a committed batch: one write per worker connection, in order."""
        for conn, msgs in _by_conn(outbound).items():
            conn.send_many(msgs)

    @staticmethod
    def _fail(item: Any) -> None:
        """A client request the core will not apply (stopping): answer it and close."""
        if type(item) is ev.Request:
            item.conn.reply(encode_frame(SHUTTING_DOWN.to_wire()), 1, close=True)

    # ---- what the metrics port reads ----------------------------------------------------

    def figures(self) -> RuntimeFigures:
        """The runtime's own figures, read at scrape time (O(1); never touches job state)."""
        return RuntimeFigures(inbox_depth=len(self.mailbox), max_active_jobs=self.config.max_active_jobs,
                              connections=dict(self.handlers.connections), commit_seconds=self.commit_seconds,
                              commit_rows=self.commit_rows, batch_events=self.batch_events)

    # ---- stop -----------------------------------------------------------------------

    def on_stop_signal(self) -> None:
        """SIGTERM/SIGINT: drain first if ``--drain-millis`` > 0, else stop; a signal
        during the drain stops at once."""
        if self._stopping:
            return
        if self._draining:
            log.info("second stop signal: stopping now without waiting for running attempts")
            gevent.spawn(self.stop)
        elif self.config.drain_millis > 0:
            self._draining = True
            gevent.spawn(self.drain_and_stop)
        else:
            gevent.spawn(self.stop)

    def drain_and_stop(self) -> None:
        """Assign nothing more, wait until no attempt runs or ``drain_millis`` passed, stop.

        The listeners stay open meanwhile: results arrive, heartbeats keep sessions
        alive, clients are served (new jobs wait QUEUED for the next start). An attempt
        still running at the end stays RUNNING on disk and is requeued by recovery."""
        assert self.core is not None
        self._draining = True
        self.ready = False  # /readyz: 503 while stopping, and a drain is the start of a stop
        # A plain flag the core reads at its next scheduling pass; set between batches
        # (greenlets are cooperative), so no batch sees it change halfway.
        self.core.draining = True
        deadline = time.monotonic() + self.config.drain_millis / 1000.0
        log.info("draining: no new assignments; waiting up to %d ms for %d running attempts",
                 self.config.drain_millis, self.core.running_attempts)
        while not self._stopping:
            running = self.core.running_attempts
            if not running:
                log.info("drained: no attempt is running")
                break
            if time.monotonic() >= deadline:
                log.warning("drain time passed with %d attempts still running; the next start requeues them",
                            running)
                break
            gevent.sleep(DRAIN_POLL_SECONDS)
        self.stop()

    def stop(self) -> None:
        """Graceful stop; idempotent. Leaves the database exactly as a crash would."""
        if self._stopping:
            self.stopped.wait()
            return
        self._stopping = True
        self.ready = False
        log.info("stopping")
        if self.http is not None:
            self.http.stop_timers()
        if self._sweep_timer is not None:
            self._sweep_timer.kill(block=False)
        if self._core_greenlet is not None:
            self._core_greenlet.unlink(self._core_died)
            self.mailbox.put(ev.STOP)
            self._core_greenlet.join(10)
            self._core_greenlet.kill(block=False)
        for srv in self.servers:
            srv.close()  # stop accepting first
        for conn in list(self.handlers.worker_conns):
            conn.abort()
        for pconn in list(self.periodic.conns):
            pconn.abort()
        # Handlers get a moment to finish writing replies the core already released.
        gevent.joinall([gevent.spawn(srv.stop, 0.3) for srv in self.servers], timeout=5)
        if self._probe is not None:
            self._probe.wait(10)  # the DB thread must be done with the connections it closes
        if self.store is not None:
            self.store.close()
        self.lock.release()
        log.info("stopped")
        self.stopped.set()


def run_coordinator(config: CoordinatorConfig, announce: Callable[[str], None]) -> int:
    """``jobmesh coordinator``: run until SIGTERM/SIGINT; exit code 0 on a graceful stop.

    ``announce(line)`` publishes the listening line once every port is open (the CLI
    prints it on stdout)."""
    coordinator = Coordinator(config)
    try:
        line = coordinator.start()
    except (DatabaseInUse, CannotStart) as exc:
        log.error("%s", exc)
        return 1
    except sqlite3.Error as exc:
        log.error("cannot open the database %s: %s", config.db, exc)
        return 1
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT):
        gevent.signal_handler(sig, coordinator.on_stop_signal)
    announce(line)
    coordinator.stopped.wait()
    return coordinator.exit_code
