"""Coordinator: the impure shell around ``CoordinatorCore``.

Start order: recover from the store (inline, before any listener) → core greenlet →
sweep timer → listeners → the "listening" line. Stop order: core (commits its batch,
answers what it took, fails what is still queued) → listeners → database.

The core greenlet takes a batch of up to ``MAX_BATCH`` mailbox items (worker events
first), applies each with one clock read, schedules, and commits every changed row in
one SQLite transaction on a one-thread pool (group commit), and only then releases the
batch's replies and outbound frames. It starts no new batch while a commit is in flight,
so no client or worker ever observes a state that is not on disk, and memory is never
more than one batch ahead of disk. A failed commit stops the process: memory would be
ahead of disk, and recovery on the next start repairs it.

The sweep is armed by ``gevent.spawn_later``: the callback re-arms itself on a fixed
cadence and only posts a SWEEP marker; the sweep itself runs inside the core loop,
under the same try/except as every event, so an error can kill neither.
"""

from __future__ import annotations

import gc
import logging
import resource
import signal
import sqlite3
import time
from bisect import bisect_left
from collections import deque
from typing import Any, Callable

import gevent
import gevent.event
import gevent.pool
import gevent.server
from gevent.threadpool import ThreadPool

from jobmesh.config import CoordinatorConfig
from jobmesh.coordinator import events as ev
from jobmesh.coordinator.clock import now_millis, wall_millis
from jobmesh.coordinator.mailbox import Mailbox
from jobmesh.coordinator.core import CoordinatorCore
from jobmesh.coordinator.server import SHUTTING_DOWN, Servers
from jobmesh.coordinator.store import JobStore
from jobmesh.errors import ConfigError, ProtocolError
from jobmesh.protocol import messages as m
from jobmesh.protocol.framing import encode_frame

log = logging.getLogger(__name__)

MAX_BATCH = 512
BACKLOG = 4096
FD_MARGIN = 256
WORKER_FD_RESERVE = 512  # descriptors client connections may not take (new workers can always register)
EXIT_CORE_DIED = 70
EXIT_COMMIT_FAILED = 71


class CommitFailed(Exception):
    """A batch's commit failed: the core stops before releasing anything of that batch."""


class CollectorPolicy:
    """Keeps Python's cyclic collector from scanning the whole working set.

    Every active job is a tracked object, so under a growing queue each full collection
    walks hundreds of thousands of them: a pause of ~100 ms for every request in flight
    (docs/PERFORMANCE.md, the update at 8fe2c39). Every ``freeze_seconds`` the young
    generations are collected and everything that survives is moved to the permanent
    generation, which collections skip; reference counting still frees those objects
    when they are dropped. What it cannot free is a reference cycle that became garbage
    after being frozen, so every ``thaw_seconds`` the permanent generation is released
    and collected once.
    """

    def __init__(self, freeze_seconds: float = 1.0, thaw_seconds: float = 600.0) -> None:
        self.freeze_seconds = freeze_seconds
        self.thaw_seconds = thaw_seconds
        now = time.monotonic()
        self._next_freeze = now + freeze_seconds
        self._next_thaw = now + thaw_seconds

    def tick(self, now: float) -> None:
        if now >= self._next_thaw:
            self._next_thaw = now + self.thaw_seconds
            gc.unfreeze()
            gc.collect()
        if now >= self._next_freeze:
            self._next_freeze = now + self.freeze_seconds
            gc.collect(1)
            gc.freeze()


class Histogram:
    """Plain histogram bucket counts for the metrics port: no lock, O(log buckets) per
    observation. ``counts[i]`` counts values <= ``bounds[i]`` and > the bound before it;
    the last count is everything above the last bound (Prometheus's ``+Inf``)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


COMMIT_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


INTERNAL_ERROR = m.Error("internal coordinator error; see the coordinator log")


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


def raise_fd_limit() -> int:
    """Raise the soft open-files limit to the hard one; returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 65536)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, hard, exc)
    return soft


class Coordinator:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.mailbox = Mailbox()
        self.store: JobStore | None = None
        self.core: CoordinatorCore | None = None
        self.dbpool: ThreadPool | None = None
        self.servers: list[gevent.server.StreamServer] = []
        self.handlers = Servers(self.mailbox.put, self.mailbox.put_urgent, config.idle_timeout_millis / 1000.0)
        self._core_greenlet: gevent.Greenlet | None = None
        self._sweep_timer: gevent.Greenlet | None = None
        self._next_sweep = 0.0
        self._sweep_pending = False
        self._stopping = False
        self.stopped = gevent.event.Event()
        self.exit_code = 0  # what run_coordinator returns once stopped
        self.collector = CollectorPolicy()
        # Figures for the metrics port (jobmesh/coordinator/http.py), kept as plain numbers.
        self.ready = False  # recovered and listening (and not stopping)
        self.http: Any = None  # the metrics port, when --metrics-port is given
        self.commit_seconds = Histogram(COMMIT_SECONDS_BUCKETS)
        self.commit_rows = Histogram(SIZE_BUCKETS)  # job rows written per commit
        self.batch_events = Histogram(SIZE_BUCKETS)  # mailbox items per batch

    # ---- start --------------------------------------------------------------------

    def start(self) -> str:
        """Recover, start the core and the listeners; returns the "listening" line."""
        cfg = self.config
        fd_limit = raise_fd_limit()
        self.store = JobStore(cfg.db, cfg.db_synchronous)
        if self.store.migrated:
            log.info("migrated database %s: added columns %s", cfg.db, ", ".join(self.store.migrated))
        self.core = CoordinatorCore(self.store, cfg)  # a CoordinatorConfig is a CoreConfig
        stats = self.core.recover(now_millis())
        self.store.write(*self.core.take_dirty())
        log.info(
            "recovered db=%s active=%d queued=%d scheduled=%d retry_wait=%d requeued=%d due_while_down=%d"
            " failed_on_restart=%d task_types=%d next_seq=%d",
            cfg.db, self.core.active_count, stats["queued"], stats["scheduled"], stats["retry_wait"],
            stats["requeued"], stats["due"], stats["failed"], len(self.core.known_types), self.core.next_seq,
        )
        gc.collect()
        gc.freeze()  # the recovered working set and everything imported: never scanned again
        self.dbpool = ThreadPool(1)
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
        for srv in (worker_srv, client_srv):
            srv.start()
            self.servers.append(srv)
        line = "jobmesh coordinator listening worker=%s:%d client=%s:%d" % (
            cfg.bind, worker_srv.server_port, cfg.bind, client_srv.server_port)
        if cfg.metrics_port is not None:
            from jobmesh.coordinator.http import HttpPort  # imports prometheus_client: only when asked

            self.http = HttpPort(self, cfg.bind, cfg.metrics_port)
            self.servers.append(self.http.start())
            line += " metrics=%s:%d" % (cfg.bind, self.http.port)
        self.ready = True
        log.info("listening worker=%s:%d client=%s:%d fd_limit=%d", cfg.bind, worker_srv.server_port,
                 cfg.bind, client_srv.server_port, fd_limit)
        return line

    def _core_died(self, greenlet: gevent.Greenlet) -> None:
        """The core is gone: nothing more can be applied or released. Stop the listeners
        and the database and make ``run_coordinator`` return non-zero, so that a listener
        never runs without a core (71: a commit failed, memory is ahead of disk and the
        next start's recovery repairs it; 70: a bug)."""
        if isinstance(greenlet.exception, CommitFailed):
            self.exit_code = EXIT_COMMIT_FAILED
            log.critical("database commit failed; stopping so that recovery can repair state: %s",
                         greenlet.exception)
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
            ev.Refusal: lambda now, r: r.error,
        }
        return {
            ev.Registered: lambda now, e: core.on_worker_registered(now, e.conn, e.msg),
            ev.Result: lambda now, e: core.on_task_result(now, e.conn, e.msg),
            ev.Disconnected: lambda now, e: core.on_worker_disconnected(now, e.conn),
            ev.Sweep: self._sweep,
            ev.Request: lambda now, e: answers[type(e.msg)](now, e.msg),
        }

    def _sweep(self, now: int, _event: ev.Sweep) -> None:
        assert self.core is not None
        self._sweep_pending = False
        # Liveness by arrival: each worker's handler stamps when its last frame arrived,
        # and one whose handler is paused (the core is behind on its events) is alive.
        for session in self.core.workers:
            conn = session.conn
            self.core.on_heartbeat(now if conn.paused else conn.last_arrival, conn, session.worker_id)
        self.core.observe_wall(now, wall_millis())
        self.core.sweep(now)
        self.collector.tick(time.monotonic())

    def _run_core(self) -> None:
        """Take a batch, apply it, commit it, release it; until a STOP."""
        mailbox = self.mailbox
        dispatch = self._dispatch_table()
        unsent = None  # the replies of the last committed batch, not written yet
        while True:
            if unsent is not None and not len(mailbox):
                self._write_replies(unsent)
                unsent = None
            batch = mailbox.take(MAX_BATCH)
            self.batch_events.observe(len(batch))
            replies, stop = self._apply_batch(batch, dispatch)
            unsent = self._commit_and_release(replies, unsent, stop)
            if stop:
                for item in mailbox.take_all():
                    self._fail(item)
                return

    def _apply_batch(self, batch: list, dispatch: dict[type, Callable[[int, Any], Any]]) -> tuple[list, bool]:
        """Apply each event of a batch (one clock read each), then schedule.

        Returns the batch's replies as ``(conn, (reply, close after it))`` and whether a
        STOP was in it (events after a STOP are refused, not applied).
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
        return replies, stop

    def _commit_and_release(self, replies: list, unsent: list | None, stop: bool) -> list | None:
        """Group commit: the whole batch in one transaction; its replies and frames go out
        only after it. One commit in flight at a time (measured: overlapping the next
        batch with the commit made batches smaller and submits slower; docs/PERFORMANCE.md).
        The previous batch's replies (``unsent``) are written while this commit runs.
        Returns the replies still to write (None if all are written)."""
        core = self.core
        assert core is not None and self.dbpool is not None and self.store is not None
        rows = core.take_dirty()
        outbound = core.take_outbound()
        commit = self.dbpool.spawn(self.store.write, *rows) if any(rows) else None
        started = time.perf_counter()
        if unsent is not None:
            self._write_replies(unsent)
        if commit is not None:
            try:
                commit.get()
            except Exception as exc:
                raise CommitFailed("%s: %s" % (type(exc).__name__, exc)) from exc
            self.commit_seconds.observe(time.perf_counter() - started)
            self.commit_rows.observe(len(rows[0]) + len(rows[1]))
        self._send_outbound(outbound)
        if stop or commit is None:
            self._write_replies(replies)  # nothing to overlap with
            if not stop:
                gevent.sleep(0)  # the mailbox never blocks while it has items: let handlers run
            return None
        return replies

    @staticmethod
    def _write_replies(replies: list) -> None:
        """Encode a batch's replies and write each connection's with one write, in order."""
        for conn, answers in _by_conn(replies).items():
            data, close = b"", False
            for msg, closes in answers:
                data += _encode_reply(msg)
                close = close or closes
            conn.reply(data, len(answers), close)

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

    def figures(self) -> dict[str, Any]:
        """The runtime's own figures, read at scrape time (O(1); never touches job state)."""
        return {
            "inbox_depth": len(self.mailbox),
            "max_active_jobs": self.config.max_active_jobs,
            "connections": dict(self.handlers.connections),
            "commit_seconds": self.commit_seconds,
            "commit_rows": self.commit_rows,
            "batch_events": self.batch_events,
        }

    # ---- stop -----------------------------------------------------------------------

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
        # Handlers get a moment to finish writing replies the core already released.
        gevent.joinall([gevent.spawn(srv.stop, 0.3) for srv in self.servers], timeout=5)
        if self.dbpool is not None:
            self.dbpool.kill()
        if self.store is not None:
            self.store.close()
        log.info("stopped")
        self.stopped.set()


def run_coordinator(config: CoordinatorConfig, announce: Callable[[str], None]) -> int:
    """``jobmesh coordinator``: run until SIGTERM/SIGINT; exit code 0 on a graceful stop.

    ``announce(line)`` publishes the listening line once every port is open (the CLI
    prints it on stdout)."""
    if config.periodic_port is not None:
        raise ConfigError("--periodic-port: the Periodic protocol port is not available in this version")
    coordinator = Coordinator(config)
    try:
        line = coordinator.start()
    except sqlite3.Error as exc:
        log.error("cannot open the database %s: %s", config.db, exc)
        return 1
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT):
        gevent.signal_handler(sig, lambda: gevent.spawn(coordinator.stop))
    announce(line)
    coordinator.stopped.wait()
    return coordinator.exit_code
