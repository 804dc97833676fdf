"""Coordinator: the impure shell around ``CoordinatorCore``.

Start order: open the store → on SQLite lead at once (``Store.lead``: the file lock, one
coordinator per file, taken or refused) → the metrics port → on a shared store lead
(this process stands by, serving only the metrics port, until it gets the leadership) →
recover from the store (inline, before any job port) → core greenlet → sweep timer → job
ports → the "listening" line. Stop order: core (commits its batch, answers what it took,
fails what is still queued) → listeners → database (and its lock). With
``--drain-millis`` a stop signal first drains: no new assignment, running attempts get
up to that long to finish (a second signal stops at once).

On a shared store a store call that fails because this process no longer leads
(``LeadershipLost``, ``leadership.py``) ends it: nothing more is committed or released,
exit 75.

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
again). Until storage works the core is paused (``core.refusal``: no assignments, no
changes of its own, every event that would write refused before it is applied), reads
are served, and no write is tried, so an outage costs one reload however many writes
come; a probe write every ``STORAGE_PROBE_SECONDS`` notices when storage works again.
Nothing exits: a restart could do no better (docs/FAILURE_MODEL.md). That path is
written in ``outage.py``.

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
import signal
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

import gevent
import gevent.event
import gevent.pool
import gevent.server
import gevent.ssl

from jobmesh.addresses import Address
from jobmesh.config import CoordinatorConfig, is_loopback
from jobmesh.coordinator.core import events as ev
from jobmesh.coordinator.shell.clock import core_millis, now_millis, wall_millis
from jobmesh.coordinator.core.peers import ReplyConnection
from jobmesh.coordinator.shell.mailbox import Mailbox
from jobmesh.coordinator.shell.outage import CommitFailed, StorageOutage, storage_error
from jobmesh.coordinator.core.face import INTERNAL_ERROR, SCHEDULES_NOT_APPLIED, CoordinatorCore
from jobmesh.coordinator.core.figures import RuntimeFigures
from jobmesh.auth import warn_if_exposed
from jobmesh.coordinator.ports.guard import Guard, pending_bound
from jobmesh.coordinator.shell.housekeeping import (COMMIT_SECONDS_BUCKETS, SIZE_BUCKETS, CollectorPolicy, Histogram,
                                              raise_fd_limit)
from jobmesh.coordinator.shell.leadership import KeepLeading
from jobmesh.coordinator.ports.periodic import PeriodicPort
from jobmesh.coordinator.ports.server import SHUTTING_DOWN, Servers
from jobmesh.coordinator.core.waiters import Slot, Waiter
from jobmesh.coordinator.shell import schedule_file
from jobmesh.errors import ConfigError, ProtocolError
from jobmesh.exitcodes import EXIT_COMMIT_FAILED, EXIT_CORE_DIED, EXIT_LEADERSHIP_LOST, EXIT_USAGE
from jobmesh.protocol import messages as m
from jobmesh.protocol.framing import encode_frame
from jobmesh.store.base import CannotLead, LeadershipLost, StorageFault, Store, first_line, outcome_of
from jobmesh.store.opening import CannotOpen, open_store, shown
from jobmesh.tls import server_context

if TYPE_CHECKING:
    from jobmesh.coordinator.ports.http import HttpPort
    from jobmesh.periodic.rsa import ServerKeys

log = logging.getLogger(__name__)

MAX_BATCH = 512
BACKLOG = 4096
FD_MARGIN = 256
WORKER_FD_RESERVE = 512  # descriptors client connections may not take (new workers can always register)
DRAIN_POLL_SECONDS = 0.02
FIRE_TICK_MILLIS = 10  # recurring schedules fire at most this often (in batches), at their time
STANDING_BY = "jobmesh coordinator standing by"  # on stdout while another coordinator leads (CONTRACT.md)
RECONNECT_INITIAL = 0.5  # a standby whose session ended connects again after this, doubling
RECONNECT_CAP = 5.0


class CannotStart(Exception):
    """A start-up failure whose message is the whole story (one line, exit 1)."""

class MarkerTimer:
    """A timer for the earliest instant (core time) it is armed for, which then posts
    ``marker`` to the mailbox; at most one marker is pending (``taken`` when the core
    applies it). The WAIT_JOB deadlines and the schedules' fire times each have one."""

    def __init__(self, post: Callable[[Any], None], marker: ev.Event) -> None:
        self.post = post
        self.marker = marker
        self.pending = False
        self.stopped = False
        self._at: int | None = None
        self._timer: gevent.Greenlet | None = None

    def arm(self, at: int) -> None:
        if self.pending or self.stopped or (self._at is not None and self._at <= at):
            return
        if self._timer is not None:
            self._timer.kill(block=False)
        self._at = at
        self._timer = gevent.spawn_later(max(0.0, (at - now_millis()) / 1000.0), self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._at = None
        if self.stopped or self.pending:
            return
        self.pending = True
        self.post(self.marker)

    def taken(self, _event: ev.Event) -> None:
        self.pending = False

    def stop(self) -> None:
        self.stopped = True
        if self._timer is not None:
            self._timer.kill(block=False)


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


class Answers:
    """A batch's replies: ``(conn, (reply or Slot, close after it))`` in order, and the
    waits the core answered in it, ``(Waiter, reply)``, written after them."""

    __slots__ = ("replies", "waits")

    def __init__(self, replies: list[tuple[ReplyConnection, tuple[m.Message | Slot, bool]]],
                 waits: list[tuple[Waiter, m.Message]]) -> None:
        self.replies = replies
        self.waits = waits


class Coordinator:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.mailbox = Mailbox()
        self.store: Store | None = None
        self.core: CoordinatorCore | None = None
        self.servers: list[gevent.server.StreamServer] = []
        # TLS on the worker, client and metrics ports; the certificate files are read here, once.
        self.tls = (server_context(config.tls_cert, config.tls_key, config.tls_client_ca, gevent.ssl.SSLContext)
                    if config.tls_cert and config.tls_key else None)
        self.handlers = Servers(self.mailbox.put, self.mailbox.put_urgent, config.idle_timeout_millis / 1000.0,
                                self.tls, config.tls_handshake_timeout_millis / 1000.0)
        # Tokens (--auth-file): AuthFileError, a ConfigError, if the file is not valid.
        self.guard = (Guard.load(config.auth_file, config.auth_timeout_millis / 1000.0)
                      if config.auth_file is not None else None)
        self.handlers.guard = self.guard
        self.periodic = PeriodicPort(self.mailbox.put, self.mailbox.put_urgent, self.handlers.connections,
                                     config.idle_timeout_millis / 1000.0, config.task_timeout_millis / 1000.0,
                                     config.periodic_keepalive_millis / 1000.0, self._periodic_sizes,
                                     keys=periodic_keys(config))
        self.periodic.guard = self.guard  # types 3 and 4 carry a token
        self._core_greenlet: gevent.Greenlet | None = None
        self._sweep_timer: gevent.Greenlet | None = None
        self._next_sweep = 0.0
        self._sweep_pending = False
        # WAIT_JOB: replies held behind pending waits, per connection, and the timer for
        # the earliest wait deadline (core time), with the EXPIRE marker it posts.
        self._held: dict[Any, Held] = {}
        self.expiry = MarkerTimer(self.mailbox.put_urgent, ev.EXPIRE)
        # Recurring schedules: the timer for the earliest next fire time (core time) and
        # the FIRE marker it posts, so fires do not wait for the sweep.
        self.fires = MarkerTimer(self.mailbox.put_urgent, ev.FIRE)
        # Rate limits: the timer for the earliest token due (core time) and the marker it posts.
        self.tokens = MarkerTimer(self.mailbox.put_urgent, ev.TOKENS_DUE)
        self._stopping = False
        self.stopped = gevent.event.Event()
        self.exit_code = 0  # what run_coordinator returns once stopped
        self.collector = CollectorPolicy()
        self.leading = False  # this process leads its store (at once on SQLite; a standby until then)
        self.keep_leading: KeepLeading | None = None  # on a shared store, once leading
        self.outage = StorageOutage()
        # What the runtime itself does before the core applies an event of that kind.
        self._before: dict[type, Callable[[Any], None]] = {
            ev.Sweep: self._before_sweep, ev.Expire: self.expiry.taken, ev.ClientClosed: self._before_client_closed,
            ev.ReadsDone: self._before_reads_done, ev.Fire: self.fires.taken, ev.TokensDue: self.tokens.taken,
        }
        self._reads_pending = False  # a READS_DONE marker is in the mailbox
        self._draining = False
        # Figures for the metrics port (jobmesh/coordinator/http.py), kept as plain numbers.
        self.ready = False  # recovered and listening (and not stopping)
        self.http: HttpPort | None = None  # the metrics port, when --metrics-port is given
        self.commit_seconds = Histogram(COMMIT_SECONDS_BUCKETS)
        self.commit_rows = Histogram(SIZE_BUCKETS)  # job rows written per commit
        self.batch_events = Histogram(SIZE_BUCKETS)  # mailbox items per batch

    # ---- start --------------------------------------------------------------------

    def start(self, standing_by: Callable[[], None] = lambda: None) -> str | None:
        """Lock, lead, recover, start the core and the listeners; returns the "listening"
        line, or None if a stop signal came while standing by.

        On a shared store another coordinator may lead: ``standing_by()`` is called once
        (the CLI prints ``STANDING_BY``) and this waits, serving only the metrics port,
        until the store makes this process the leader.

        Raises ``CannotLead`` (``DatabaseInUse``), ``CannotStart`` or ``CannotOpen`` (the
        message says it all), ``StorageFault`` if recovery cannot read the store,
        ``OSError`` if a port cannot, ``LeadershipLost`` if the leadership was lost before
        recovery was written.
        A database that opens but cannot be written (full, read-only, locked) starts
        degraded: reads are served, writes answer the storage ERROR until it works.
        """
        cfg = self.config
        fd_limit = raise_fd_limit()
        self.store = self._open_store()
        if not self.store.shared:  # its file lock: a second coordinator stops before any port opens
            self.store.lead(standing_by)
            self.leading = True
        if cfg.metrics_port is not None:  # /healthz and /readyz answer while standing by and recovering
            from jobmesh.coordinator.ports.http import HttpPort  # imports prometheus_client: only when asked

            self.http = HttpPort(self, cfg.bind, cfg.metrics_port, self.guard, self.tls, cfg.tls_handshake_timeout_millis / 1000.0)
            self.servers.append(self.http.start())
        if not self._lead(standing_by):
            self._stop_standing_by()
            return None
        if self.store.migrated:
            log.info("migrated database %s: added columns %s", shown(cfg.db), ", ".join(self.store.migrated))
        self.core = self._recovered_core()
        if cfg.schedules_file is not None:  # its schedules commit with recovery's rows
            problem = self.core.apply_schedules_file(now_millis(), schedule_file.read(cfg.schedules_file))
            if problem is not None:
                raise ConfigError("--schedules: %s: %s" % (cfg.schedules_file, problem))
        rows = self.core.take_dirty()
        if any(rows):
            try:
                self.store.write(rows)
            except StorageFault as exc:
                self.outage.pending = rows  # recovery's decisions: committed with the first write that works
                self._storage_failed(exc.reason, "at start", reload=False)
        gc.collect()
        gc.freeze()  # the recovered working set and everything imported: never scanned again
        self._core_greenlet = gevent.spawn(self._run_core)
        self._core_greenlet.link_exception(self._core_died)
        self._next_sweep = time.monotonic()
        self._arm_sweep()

        # A Pool caps handlers. Clients may not use the last WORKER_FD_RESERVE descriptors,
        # so however many clients connect (or idle), new workers can still register;
        # further clients wait in the accept backlog until a client connection ends.
        # With tokens, the connections of one address that have not authenticated yet
        # take at most a quarter of the client port's slots (guard.py).
        per_server = max(64, fd_limit - FD_MARGIN)
        per_client_server = max(32, per_server - WORKER_FD_RESERVE)
        if self.guard is not None:
            self.guard.pending_limit = pending_bound(per_client_server)
        worker_srv = gevent.server.StreamServer(
            (cfg.bind, cfg.worker_port), self.handlers.handler("worker"), backlog=BACKLOG,
            spawn=gevent.pool.Pool(per_server),
        )
        client_srv = gevent.server.StreamServer(
            (cfg.bind, cfg.client_port), self.handlers.handler("client"), backlog=BACKLOG,
            spawn=gevent.pool.Pool(per_client_server),
        )
        servers = [worker_srv, client_srv]
        if cfg.periodic_port is not None:
            periodic_srv = gevent.server.StreamServer(
                (cfg.bind, cfg.periodic_port),
                self.periodic.handle if self.guard is None else self.guard.gate(self.periodic.handle, "periodic"),
                backlog=BACKLOG, spawn=gevent.pool.Pool(per_client_server),
            )
            servers.append(periodic_srv)
        for srv in servers:
            srv.start()
            self.servers.append(srv)
        line = "jobmesh coordinator listening worker=%s client=%s" % (
            Address(cfg.bind, worker_srv.server_port), Address(cfg.bind, client_srv.server_port))
        if cfg.periodic_port is not None:
            line += " periodic=%s" % Address(cfg.bind, periodic_srv.server_port)
        if self.http is not None:
            line += " metrics=%s" % Address(cfg.bind, self.http.port)
        self.ready = True
        log.info("listening worker=%s:%d client=%s:%d fd_limit=%d tls=%s", cfg.bind, worker_srv.server_port,
                 cfg.bind, client_srv.server_port, fd_limit,
                 "off" if self.tls is None else "on" if cfg.tls_client_ca is None else "on,client-certificates")
        self._warn_about_auth()
        return line

    def _warn_about_auth(self) -> None:
        cfg = self.config
        for path, what in ((cfg.auth_file, "the auth file"), (cfg.tls_key, "the --tls-key file"),
                           (cfg.periodic_key, "the --periodic-key file")):
            warn_if_exposed(path, what)
        remote = not is_loopback(cfg.bind)
        if self.guard is None:
            if remote:
                log.warning("--insecure: bind=%s is reachable from other machines and no token is asked for: "
                            "anyone who can connect can submit, cancel and read every job", cfg.bind)
            return
        log.info("tokens on: auth file %s holds %d tokens", cfg.auth_file, len(self.guard.auth_file))
        if not len(self.guard.auth_file):
            log.warning("auth file %s holds no token: every connection will be refused (jobmesh token new)",
                        cfg.auth_file)
        if remote and not cfg.tls_cert:
            log.warning("tokens travel in plaintext: bind=%s is reachable from other machines without TLS; "
                        "anyone on the network path can read them (docs/SECURITY.md)", cfg.bind)
        elif remote and cfg.periodic_port is not None and cfg.periodic_key is None:
            log.warning("Periodic tokens travel in plaintext: bind=%s is reachable from other machines and TLS "
                        "covers the worker, client and metrics ports only; give --periodic-key for the Periodic "
                        "port's handshake (docs/PERIODIC.md)", cfg.bind)

    def on_hangup(self) -> None:
        """SIGHUP: read the files given by flags again: the auth file (the connections of
        removed tokens close), the Periodic port's authorized keys (the connections of
        removed keys close) and the schedules file."""
        if self.guard is not None:
            self.guard.reload()
        self.periodic.reload_keys()
        self.reload_schedules()

    def _lead(self, standing_by: Callable[[], None]) -> bool:
        """Return once this process leads its store (at once on SQLite); False if a stop
        signal came first. A standby whose database session ends (the server restarted,
        the network) connects again and stands by again, however long that takes."""
        store = self.store
        assert store is not None
        if not store.shared:  # led since start()
            return True
        told = False

        def standby() -> None:
            nonlocal told
            log.info("standing by: another coordinator leads this database; taking over when its session ends")
            if not told:
                told = True
                standing_by()

        stop = gevent.event.Event()
        handlers = [gevent.signal_handler(sig, stop.set) for sig in (signal.SIGTERM, signal.SIGINT)]
        handlers.append(gevent.signal_handler(signal.SIGHUP, log.info, "SIGHUP while standing by: the files given"
                                              " by flags are read when this coordinator leads"))
        delay = RECONNECT_INITIAL
        try:
            while True:
                leading = gevent.spawn(outcome_of, store.lead, standby)
                gevent.wait([leading, stop], count=1)
                if not leading.ready():
                    leading.kill()
                    return False
                exc = leading.value
                if exc is None:
                    if stop.is_set():  # the signal came as the leadership did: stop all the same
                        return False
                    break
                if not isinstance(exc, (LeadershipLost, StorageFault)):
                    raise exc
                log.warning("lost the database session while standing by (%s); connecting again in %.1f s",
                            exc.reason, delay)
                store.close()
                store = self._reconnect(stop, delay)
                if store is None:
                    return False
                delay = min(RECONNECT_CAP, delay * 2)
        finally:
            for handler in handlers:
                handler.cancel()
        self.leading = True
        self.keep_leading = KeepLeading(self.config.db_session_timeout_millis)
        log.info("leading the database: recovering, then opening the job ports")
        return True

    def _reconnect(self, stop: gevent.event.Event, delay: float) -> Store | None:
        """Open the store again after ``delay`` (doubling while it fails); None if ``stop`` came first."""
        while not stop.wait(delay):
            try:
                self.store = self._open_store()
                return self.store
            except CannotOpen as exc:
                log.warning("%s; trying again", exc)
            delay = min(RECONNECT_CAP, delay * 2)
        return None

    def _stop_standing_by(self) -> None:
        """A stop signal while standing by: close the metrics port and the store."""
        log.info("stopping while standing by")
        self._stopping = True
        if self.http is not None:
            self.http.stop_timers()
        for srv in self.servers:
            srv.stop(timeout=1)
        if self.store is not None:
            self.store.close()
        log.info("stopped")
        self.stopped.set()

    def _open_store(self) -> Store:
        """The store --db names; raises ``CannotOpen``."""
        cfg = self.config
        return open_store(cfg.db, cfg.db_synchronous, cfg.db_session_timeout_millis)

    def _recovered_core(self) -> CoordinatorCore:
        """A fresh core with the database's state, after recovery (its rows not yet written)."""
        cfg = self.config
        assert self.store is not None
        core = CoordinatorCore(self.store, cfg)  # a CoordinatorConfig is a CoreConfig
        if self.core is not None:
            core.table.drift = self.core.table.drift  # a reload: keep the wall clock's known offset
        stats = core.recover(now_millis())
        core.draining = self._draining
        log.info(
            "recovered db=%s active=%d queued=%d scheduled=%d retry_wait=%d requeued=%d due_while_down=%d"
            " failed_on_restart=%d damaged=%d task_types=%d next_seq=%d schedules=%d",
            shown(cfg.db), core.active_count, stats["queued"], stats["scheduled"], stats["retry_wait"],
            stats["requeued"], stats["due"], stats["failed"], stats["damaged"], len(core.table.known_types),
            core.table.next_seq, len(core.schedules.by_name),
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

    # ---- what the runtime does before the core applies an event ------------------------

    def _periodic_sizes(self) -> tuple[int, int]:
        """(live Periodic jobs, funcs): what a DUMP or a STATUS costs the core (O(funcs))."""
        core = self.core
        return core.periodic.sizes() if core is not None else (0, 0)

    def _before_sweep(self, _event: ev.Sweep) -> None:
        """Liveness by arrival: each worker's handler stamps when its last frame arrived,
        and one whose handler is paused (the core is behind on its events) is alive now;
        and the wall clock's offset."""
        core = self.core
        assert core is not None
        self._sweep_pending = False
        now = now_millis()
        core.observe_arrivals(now, {s.conn: now if s.conn.paused else core_millis(s.conn.last_arrival)
                                    for s in core.json.workers})
        core.observe_wall(now, wall_millis())
        self.collector.tick(time.monotonic())

    def _arm_fire(self) -> None:
        """Keep a timer armed for the earliest fire time of a recurring schedule (none
        without schedules: one heap peek per batch), at most every FIRE_TICK_MILLIS, so
        thousands of schedules make batches of fires, not a wake-up each."""
        core = self.core
        # Paused (storage) or held back (admission full): the sweep catches up once it can.
        if core is None or core.refusal is not None or core.schedules.behind:
            return
        due = core.schedules.next_due()
        if due is not None:
            self.fires.arm(max(due - core.table.drift, now_millis() + FIRE_TICK_MILLIS))

    def _arm_tokens(self) -> None:
        """Keep a timer armed for the earliest token a rate-limited type or key waits for
        (none without rate limits: one heap peek per batch)."""
        core = self.core
        due = None if core is None else core.limits.next_wake()
        if due is not None:
            self.tokens.arm(due)

    def _before_reads_done(self, _event: ev.ReadsDone) -> None:
        self._reads_pending = False

    def _read_done(self) -> None:
        """A store read a held request waits for finished: wake the core (one marker at a time)."""
        if not self._reads_pending and not self._stopping:
            self._reads_pending = True
            self.mailbox.put_urgent(ev.READS_DONE)

    def _before_client_closed(self, event: ev.ClientClosed) -> None:
        """Its waits will never be read: forget what is held behind them (the core forgets the waits)."""
        self._held.pop(event.conn, None)

    # ---- WAIT_JOB: held replies and the expiry timer -------------------------------------

    def _hold(self, conn: ReplyConnection) -> None:
        """A WAIT_JOB on ``conn`` got a Slot: its later replies wait behind it."""
        held = self._held.get(conn)
        if held is None:
            held = self._held[conn] = Held()
        held.slots += 1

    def _arm_expiry(self) -> None:
        """Keep a timer armed for the earliest pending wait's deadline."""
        core = self.core
        due = None if core is None else core.requests.next_wait_deadline()
        if due is not None:
            self.expiry.arm(due)

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
        conn.held_back(len(queue))
        if not queue and not held.slots:
            del self._held[conn]

    def _run_core(self) -> None:
        """Take a batch, apply it, commit it, release it; until a STOP, or until the
        leadership of a shared store is lost (then the process stops, exit 75)."""
        try:
            self._core_loop()
        except LeadershipLost as exc:  # nothing of the batch that found it was released
            self.exit_code = EXIT_LEADERSHIP_LOST
            log.error("leadership lost: another coordinator may lead now; nothing more is committed or answered,"
                      " exiting %d (%s)", EXIT_LEADERSHIP_LOST, exc)
            self.ready = False
            gevent.spawn(self.stop)

    def _core_loop(self) -> None:
        mailbox = self.mailbox
        unsent: Answers | None = None  # the replies of the last committed batch, not written yet
        while True:
            if unsent is not None and not len(mailbox):
                self._write_replies(unsent)
                unsent = None
            batch = mailbox.take(MAX_BATCH)
            self.batch_events.observe(len(batch))
            answers, stop = self._apply_batch(batch)
            unsent = self._commit_and_release(answers, unsent, stop)
            if stop:
                self._answer_waits(SHUTTING_DOWN)
                for item in mailbox.take_all():
                    self._fail(item)
                return
            self._arm_expiry()
            self._arm_fire()
            self._arm_tokens()
            core = self.core
            if core is not None:
                for read in core.take_new_reads():  # none on SQLite: its reads answer at once
                    read.then(self._read_done)

    def _apply_batch(self, batch: list) -> tuple[Answers, bool]:
        """Apply each event of a batch (one clock read each), then the core's end of batch.

        Returns the batch's answers and whether a STOP was in it (events after a STOP are
        refused, not applied)."""
        core, store = self.core, self.store  # a storage failure replaces the core, between batches
        assert core is not None and store is not None
        replies: list[tuple[ReplyConnection, tuple[m.Message | Slot, bool]]] = []
        stop = False
        now = now_millis()
        before = self._before
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
                hook = before.get(kind)
                if hook is not None:
                    hook(item)
                answer = core.apply(item, now)
                if kind is ev.Request:
                    assert answer is not None
                    if type(answer) is Slot:
                        self._hold(item.conn)
                    replies.append((item.conn, (answer, type(item.msg) is ev.Refusal)))
            except LeadershipLost:
                raise  # a read that found the leadership gone
            except Exception:
                log.exception("error while handling %s; continuing", kind.__name__)
                if kind is ev.Request:
                    replies.append((item.conn, (INTERNAL_ERROR, False)))
        try:
            waits = core.end_batch(now)
        except Exception:
            log.exception("error while scheduling; continuing")
            waits = core.requests.take_answers()
        return Answers(replies, waits), stop

    def _commit_and_release(self, answers: Answers, unsent: Answers | None, stop: bool) -> Answers | None:
        """Group commit: the whole batch in one transaction; its replies and frames go out
        only after it. One commit in flight at a time (measured: overlapping the next
        batch with the commit made batches smaller and submits slower; docs/PERFORMANCE.md).
        The previous batch's replies (``unsent``) are written while this commit runs.
        Returns the replies still to write (None if all are written).

        A commit that fails for a storage reason releases nothing of the batch
        (``_refuse_batch``). Recovery rows not committed yet (the outage's ``pending``) go
        with the next batch that writes, or with the next batch at all once storage works."""
        core, store = self.core, self.store
        assert core is not None and store is not None
        outage = self.outage
        rows = outage.with_pending(core.take_dirty())
        outbound = core.take_outbound()
        commit = store.commit(rows) if any(rows) else None
        started = time.perf_counter()
        if unsent is not None:
            self._write_replies(unsent)
        if commit is not None:
            failure = commit.get()
            if isinstance(failure, LeadershipLost):
                raise failure  # nothing of this batch is released
            if isinstance(failure, StorageFault):
                answers = self._refuse_batch(core, answers, failure.reason, stop)
                outbound = []
            elif failure is not None:
                raise CommitFailed("%s: %s" % (type(failure).__name__, failure)) from failure
            else:
                self.commit_seconds.observe(time.perf_counter() - started)
                self.commit_rows.observe(len(rows.inserts) + len(rows.updates))
                if self.keep_leading is not None:
                    self.keep_leading.committed()
                if outage.committed(rows):
                    core.refusal = None
        elif outage.active and not stop:
            core.refusal = None if outage.check_probe(store) else storage_error(outage.reason or "")
        elif self.keep_leading is not None and not stop:
            self.keep_leading.tick(store)
        self._send_outbound(outbound)
        if stop or commit is None:
            self._write_replies(answers)  # nothing to overlap with
            if not stop:
                # The mailbox never blocks while it has items: let the hub run a whole loop
                # (I/O and timers too; sleep(0) only runs callbacks, so a stream of batches
                # without writes left the sweep timer and idle sockets unserved for seconds).
                gevent.idle()
            return None
        return answers

    # ---- storage outages --------------------------------------------------------------

    def _refuse_batch(self, old: CoordinatorCore, answers: Answers, reason: str, stop: bool) -> Answers:
        """A batch whose commit failed for a storage reason: its replies become the storage
        ERROR (a protocol refusal keeps its own; a pending wait stays pending: it wrote
        nothing), and state is reloaded (``_storage_failed``). The waits the old core
        answered in that batch were answered by changes that are not durable, so they, and
        every wait still pending, wait again on the reloaded core (an ended job answers
        them at once); without a reload (stopping) they get the storage ERROR."""
        self._storage_failed(reason, "commit", reload=not stop)
        error = storage_error(reason)
        replies = [(conn, (msg if closes or type(msg) is Slot else error, closes))
                   for conn, (msg, closes) in answers.replies]
        core = self.core
        assert core is not None
        # A held request applied again in this batch answered like any reply of it.
        resumed: list[tuple[Waiter, m.Message]] = [(waiter, error) for waiter, _ in answers.waits if not waiter.job_id]
        waits = [waiter for waiter, _ in answers.waits if waiter.job_id]
        if core is old:
            return Answers(replies, resumed + [(waiter, error) for waiter in waits])
        core.requests.adopt_waiters(now_millis(), old.requests.waiters.pending() + waits)
        return Answers(replies, resumed + core.requests.take_answers())

    def _storage_failed(self, reason: str, where: str, reload: bool = True) -> None:
        """A write failed for a storage reason: pause (from now on writes are refused
        unapplied), and unless stopping, throw memory away and reload state from the
        database: the one reload of the outage."""
        self.outage.failed(reason, where)
        if reload:
            self._reload()
        assert self.core is not None
        self.core.refusal = storage_error(reason)

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
            self.store.reopen()
        except StorageFault as exc:
            log.warning("could not reopen the database, reloading through the open connections: cannot open the"
                        " database %s: %s", shown(self.config.db), first_line(exc.__cause__ or exc))
        try:
            core = self._recovered_core()
        except StorageFault as exc:
            raise CommitFailed("could not reload state from the database after a failed commit: %s" % exc) from exc
        core.carry_over(old)
        rows = core.take_dirty()
        self.outage.pending = rows if any(rows) else None
        core.take_outbound()
        self.core = core

    # ---- writing replies --------------------------------------------------------------

    def _write_replies(self, answers: Answers) -> None:
        """Encode a batch's replies and write each connection's with one write, in order.

        A connection with a pending wait has its replies queued behind it (``_release``
        writes what is ready); the waits answered in the batch come last."""
        held = self._held
        for conn, replies in _by_conn(answers.replies).items():
            waiting = held.get(conn) if held else None
            if waiting is not None:
                waiting.queue.extend(replies)
                self._release(conn, waiting)
                continue
            data, close = b"", False
            for msg, closes in replies:
                data += _encode_reply(msg)
                close = close or closes
            conn.reply(data, len(replies), close)
        for waiter, msg in answers.waits:
            slot = waiter.token
            if slot.msg is None:
                slot.msg = msg
            waiting = held.get(waiter.conn)
            if waiting is not None:  # None: the client has gone
                self._release(waiter.conn, waiting)

    def _answer_waits(self, msg: m.Message) -> None:
        """Answer every pending wait with ``msg`` now (stopping)."""
        core = self.core
        if core is not None:
            waiting = core.requests.waiters.pending() + core.held_requests()
            if waiting:
                self._write_replies(Answers([], [(waiter, msg) for waiter in waiting]))

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
                              commit_rows=self.commit_rows, batch_events=self.batch_events,
                              auth_failures=self.guard.failures if self.guard is not None else 0,
                              storage_available=0 if self.outage.active else 1, leading=int(self.leading))

    # ---- the schedules file --------------------------------------------------------------

    def reload_schedules(self) -> None:
        """SIGHUP: read the --schedules file again and hand it to the core; a file that does
        not parse is logged and changes nothing (so does one the core refuses)."""
        path = self.config.schedules_file
        if path is None:
            log.info("SIGHUP: no --schedules file to read")
            return
        try:
            definitions = schedule_file.read(path)
        except ConfigError as exc:
            log.error(SCHEDULES_NOT_APPLIED, exc)
            return
        log.info("SIGHUP: applying the schedules file %s (%d schedules)", path, len(definitions))
        self.mailbox.put_urgent(ev.SchedulesFile(definitions))

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
        self.expiry.stop()
        self.fires.stop()
        self.tokens.stop()
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
        if self.outage.probe is not None:
            self.outage.probe.wait(10)  # the DB thread must be done with the connections it closes
        if self.keep_leading is not None:
            self.keep_leading.wait(10)
        if self.store is not None:
            self.store.close()
        log.info("stopped")
        self.stopped.set()


def periodic_keys(config: CoordinatorConfig) -> ServerKeys | None:
    """The Periodic RSA handshake's keys, or None when off;
    ``ConfigError`` when a key file is bad or the ``cryptography`` package is missing."""
    if config.periodic_key is None or config.periodic_authorized_keys is None:
        return None
    try:
        from jobmesh.periodic.rsa import ServerKeys  # imports cryptography: only when asked
    except ImportError as exc:
        raise ConfigError("--periodic-key needs the cryptography package (pip install 'jobmesh[periodic-rsa]'): %s"
                          % exc) from None
    return ServerKeys.load(config.periodic_key, config.periodic_authorized_keys)


def run_coordinator(config: CoordinatorConfig, announce: Callable[[str], None]) -> int:
    """``jobmesh coordinator``: run until SIGTERM/SIGINT; exit code 0 on a graceful stop.

    ``announce(line)`` publishes the listening line once every port is open, and on a
    shared store ``STANDING_BY`` while another coordinator leads (the CLI prints them on
    stdout). 75 when the leadership was lost."""
    coordinator = Coordinator(config)
    try:
        line = coordinator.start(lambda: announce(STANDING_BY))
    except LeadershipLost as exc:
        log.error("leadership lost while recovering: exiting %d (%s)", EXIT_LEADERSHIP_LOST, exc)
        return EXIT_LEADERSHIP_LOST
    except (CannotLead, CannotStart, CannotOpen) as exc:
        log.error("%s", exc)
        return 1
    except ConfigError as exc:  # the --schedules file: a usage error, as a bad flag is
        log.error("%s", exc)
        if coordinator.store is not None:
            coordinator.store.close()  # and its lock
        return EXIT_USAGE
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 1
    except StorageFault as exc:  # recovery's reads failed: the database's fault
        log.error("cannot open the database %s: %s", shown(config.db), first_line(exc.__cause__ or exc))
        return 1
    if line is None:  # stopped while standing by
        return 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        gevent.signal_handler(sig, coordinator.on_stop_signal)
    gevent.signal_handler(signal.SIGHUP, coordinator.on_hangup)
    announce(line)
    coordinator.stopped.wait()
    return coordinator.exit_code
