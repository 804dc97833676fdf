"""Coordinator: the impure shell around ``CoordinatorCore``, a façade over its parts.

* ``startup.py``: the store (on SQLite its file lock), leading or standing by, recovery, the
  job ports and the "listening" line;
* ``loop.py``: the core greenlet: batches, group commit, storage outages;
* ``replies.py``: replies in request order after the commit, held behind pending waits;
* ``marker.py``: the sweep, WAIT_JOB expiry, schedule fire, rate-limit and read-done
  markers that wake the core, at most one of each pending.

Stop order: core (commits its batch, answers what it took, fails what is still queued)
→ listeners → database (and its lock). With ``--drain-millis`` a stop signal first drains: no
new assignment, running attempts get up to that long to finish (a second signal stops
at once).
"""

from __future__ import annotations

import gc
import logging
import signal
from typing import TYPE_CHECKING, Callable

import gevent
import gevent.event
import gevent.server
import gevent.ssl

from jobmesh.config import CoordinatorConfig
from jobmesh.coordinator.core.face import CoordinatorCore
from jobmesh.coordinator.core.figures import RuntimeFigures
from jobmesh.coordinator.ports.guard import Guard
from jobmesh.coordinator.ports.periodic import PeriodicPort
from jobmesh.coordinator.ports.server import Servers
from jobmesh.coordinator.shell import schedule_file, startup
from jobmesh.coordinator.shell.housekeeping import raise_fd_limit
from jobmesh.coordinator.shell.leadership import KeepLeading
from jobmesh.coordinator.shell.loop import BatchFigures, CoreLoop
from jobmesh.coordinator.shell.mailbox import Mailbox
from jobmesh.coordinator.shell.marker import Marker
from jobmesh.coordinator.shell.startup import CannotStart
from jobmesh.errors import ConfigError
from jobmesh.exitcodes import EXIT_FAILED, EXIT_LEADERSHIP_LOST, EXIT_OK, EXIT_USAGE
from jobmesh.store.base import CannotLead, LeadershipLost, StorageFault, Store, first_line
from jobmesh.store.opening import CannotOpen, shown
from jobmesh.tls import server_context

if TYPE_CHECKING:
    from jobmesh.coordinator.ports.http import HttpPort

log = logging.getLogger(__name__)

STANDING_BY = "jobmesh coordinator standing by"  # on stdout while another coordinator leads (CONTRACT.md)


class Coordinator:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.mailbox = Mailbox()
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
                                     config.periodic_keepalive_millis / 1000.0, self._periodic_cost,
                                     keys=startup.periodic_keys(config))
        self.periodic.guard = self.guard  # types 3 and 4 carry a token
        self.marker = Marker(self.mailbox.put_urgent)
        self._store: Store | None = None  # until recovery; then the loop's
        self.loop: CoreLoop | None = None  # from recovery on
        self.servers: list[gevent.server.StreamServer] = []
        self.http: HttpPort | None = None  # the metrics port, when --metrics-port is given
        self.leading = False  # this process leads its store (at once on SQLite; a standby until then)
        self.keep_leading: KeepLeading | None = None  # on a shared store, once leading
        self.batch_figures = BatchFigures()
        self._stopping = False
        self._draining = False
        self.stopped = gevent.event.Event()
        self.exit_code = 0  # what run_coordinator returns once stopped
        self.ready = False  # recovered and listening (and not stopping): /readyz

    @property
    def store(self) -> Store | None:
        return self.loop.store if self.loop is not None else self._store

    @property
    def core(self) -> CoordinatorCore | None:
        """The core (a reload after a failed commit replaces it); None until recovered."""
        return self.loop.core if self.loop is not None else None

    # ---- start --------------------------------------------------------------------

    def start(self, standing_by: Callable[[], None] = lambda: None) -> str | None:
        """Lock, lead, recover, start the core and the listeners (``startup.py``); returns
        the "listening" line, or None if a stop signal came while standing by.

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
        self._store = startup.store_of(cfg)
        if not self._store.shared:  # its file lock: a second coordinator stops before any port opens
            self._store.lead(standing_by)
        if cfg.metrics_port is not None:  # /healthz and /readyz answer while standing by and recovering
            from jobmesh.coordinator.ports.http import HttpPort  # imports prometheus_client: only when asked

            self.http = HttpPort(self, cfg.bind, cfg.metrics_port, self.guard, self.tls,
                                 cfg.tls_handshake_timeout_millis / 1000.0)
            self.servers.append(self.http.start())
        self._store, self.leading = startup.lead(self._store, cfg, standing_by)
        if not self.leading:
            self._stop_standing_by()
            return None
        store = self._store
        if store.shared:
            self.keep_leading = KeepLeading(cfg.db_session_timeout_millis)
        if store.migrated:
            log.info("migrated database %s: added columns %s", shown(cfg.db), ", ".join(store.migrated))
        core = startup.first_core(cfg, store)
        self.loop = CoreLoop(store, core, self.mailbox, self.marker, self.keep_leading, self.batch_figures,
                             lambda store, old: startup.recovered_core(cfg, store, old, self._draining),
                             self._drop_sessions)
        self.loop.write_recovery()
        gc.collect()
        gc.freeze()  # the recovered working set and everything imported: never scanned again
        self.loop.start(self._ended, cfg.sweep_interval_millis / 1000.0)
        ports = startup.open_ports(cfg, fd_limit, self.handlers, self.periodic, self.guard, self.servers)
        line = startup.listening_line(cfg, ports, self.http.port if self.http is not None else None, fd_limit,
                                      self.tls is not None)
        self.ready = True
        startup.warn_about_auth(cfg, self.guard)
        return line

    def on_hangup(self) -> None:
        """SIGHUP: read the files given by flags again: the auth file (the connections of
        removed tokens close), the Periodic port's authorized keys (the connections of
        removed keys close) and the schedules file."""
        if self.guard is not None:
            self.guard.reload()
        self.periodic.reload_keys()
        schedule_file.reload(self.config.schedules_file, self.mailbox.put_urgent)

    def _stop_standing_by(self) -> None:
        """A stop signal while standing by: close the metrics port and the store."""
        log.info("stopping while standing by")
        self._stopping = True
        if self.http is not None:
            self.http.stop_timers()
        for srv in self.servers:
            srv.stop(timeout=1)
        if self._store is not None:
            self._store.close()
        log.info("stopped")
        self.stopped.set()

    def _drop_sessions(self) -> None:
        """Close every worker and Periodic connection (a reload): they register again."""
        for conn in list(self.handlers.worker_conns):
            conn.abort()
        for pconn in list(self.periodic.conns):
            pconn.abort()

    def _ended(self, code: int) -> None:
        """The core greenlet ended on its own (``CoreLoop.start``): stop with ``code``, so
        that a listener never runs without a core."""
        self.exit_code = code
        self.ready = False
        gevent.spawn(self.stop)

    def _periodic_cost(self, kind: type) -> int:
        """What a Periodic request of ``kind`` costs the core's batch (``periodic_cost``)."""
        core = self.core
        return core.periodic_cost(kind) if core is not None else 1

    # ---- what the metrics port reads ----------------------------------------------------

    def figures(self) -> RuntimeFigures:
        """The runtime's own figures, read at scrape time (O(1); never touches job state)."""
        batches = self.batch_figures
        return RuntimeFigures(inbox_depth=len(self.mailbox), max_active_jobs=self.config.max_active_jobs,
                              connections=dict(self.handlers.connections), commit_seconds=batches.commit_seconds,
                              commit_rows=batches.commit_rows, batch_events=batches.batch_events,
                              auth_failures=self.guard.failures if self.guard is not None else 0,
                              storage_available=int(self.loop is None or self.loop.storage_available),
                              leading=int(self.leading))

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
        assert self.loop is not None
        self._draining = True
        self.ready = False  # /readyz: 503 while stopping, and a drain is the start of a stop
        self.loop.drain(self.config.drain_millis, lambda: self._stopping)
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
        self.marker.stop()
        if self.loop is not None:
            self.loop.stop()
        for srv in self.servers:
            srv.close()  # stop accepting first
        self._drop_sessions()
        # Handlers get a moment to finish writing replies the core already released.
        gevent.joinall([gevent.spawn(srv.stop, 0.3) for srv in self.servers], timeout=5)
        if self.loop is not None:
            self.loop.close()  # the store, once the probe or keepalive in flight is done
        elif self._store is not None:
            self._store.close()
        log.info("stopped")
        self.stopped.set()


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
        return EXIT_FAILED
    except ConfigError as exc:  # the --schedules file: a usage error, as a bad flag is
        log.error("%s", exc)
        if coordinator.store is not None:
            coordinator.store.close()  # and its lock
        return EXIT_USAGE
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return EXIT_FAILED
    except StorageFault as exc:  # recovery's reads failed: the database's fault
        log.error("cannot open the database %s: %s", shown(config.db), first_line(exc.__cause__ or exc))
        return EXIT_FAILED
    if line is None:  # stopped while standing by
        return EXIT_OK
    for sig in (signal.SIGTERM, signal.SIGINT):
        gevent.signal_handler(sig, coordinator.on_stop_signal)
    gevent.signal_handler(signal.SIGHUP, coordinator.on_hangup)
    announce(line)
    coordinator.stopped.wait()
    return coordinator.exit_code
