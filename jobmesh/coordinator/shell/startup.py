"""Start-up: the store, leading or standing by, recovery, the job ports.

Start order (``runtime.Coordinator.start``): open the store → on SQLite lead at once
(``Store.lead``: the file lock, one coordinator per file, taken or refused before any port
opens) → the metrics port → on a shared store lead (this process stands by, serving only
the metrics port, until it gets the leadership, ``lead``) → recover from the store (inline, before any job port,
``recovered_core``) → core greenlet → sweep timer → job ports (``open_ports``) → the
"listening" line.
"""

from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING, Callable

import gevent
import gevent.event
import gevent.pool
import gevent.server

from jobmesh.addresses import Address
from jobmesh.auth import warn_if_exposed
from jobmesh.config import CoordinatorConfig, is_loopback
from jobmesh.coordinator.core.face import CoordinatorCore
from jobmesh.coordinator.ports.guard import Guard, pending_bound
from jobmesh.coordinator.ports.periodic import PeriodicPort
from jobmesh.coordinator.ports.server import Servers
from jobmesh.coordinator.shell.clock import now_millis
from jobmesh.coordinator.shell import schedule_file
from jobmesh.store.base import LeadershipLost, StorageFault, Store, outcome_of
from jobmesh.store.opening import CannotOpen, open_store, shown
from jobmesh.errors import ConfigError

if TYPE_CHECKING:
    from jobmesh.periodic.rsa import ServerKeys

log = logging.getLogger("jobmesh.coordinator.shell.runtime")  # one logger for the runtime's lines

BACKLOG = 4096
FD_MARGIN = 256
WORKER_FD_RESERVE = 512  # descriptors client connections may not take (new workers can always register)
RECONNECT_INITIAL = 0.5  # a standby whose session ended connects again after this, doubling
RECONNECT_CAP = 5.0


class CannotStart(Exception):
    """A start-up failure whose message is the whole story (one line, exit 1)."""


def store_of(config: CoordinatorConfig) -> Store:
    """The store --db names; raises ``CannotOpen``."""
    return open_store(config.db, config.db_synchronous, config.db_session_timeout_millis)


def lead(store: Store, config: CoordinatorConfig, standing_by: Callable[[], None]) -> tuple[Store, bool]:
    """Return once this process leads its store (at once on SQLite): the store (a standby
    may have connected again) and True; False if a stop signal came first. A standby
    whose database session ends (the server restarted, the network) connects again and
    stands by again, however long that takes."""
    if not store.shared:  # led since it was opened (its file lock)
        return store, True
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
                return store, False
            exc = leading.value
            if exc is None:
                if stop.is_set():  # the signal came as the leadership did: stop all the same
                    return store, False
                break
            if not isinstance(exc, (LeadershipLost, StorageFault)):
                raise exc
            log.warning("lost the database session while standing by (%s); connecting again in %.1f s",
                        exc.reason, delay)
            store.close()
            again = _reconnect(config, stop, delay)
            if again is None:
                return store, False
            store = again
            delay = min(RECONNECT_CAP, delay * 2)
    finally:
        for handler in handlers:
            handler.cancel()
    log.info("leading the database: recovering, then opening the job ports")
    return store, True


def _reconnect(config: CoordinatorConfig, stop: gevent.event.Event, delay: float) -> Store | None:
    """Open the store again after ``delay`` (doubling while it fails); None if ``stop`` came first."""
    while not stop.wait(delay):
        try:
            return store_of(config)
        except CannotOpen as exc:
            log.warning("%s; trying again", exc)
        delay = min(RECONNECT_CAP, delay * 2)
    return None


def recovered_core(config: CoordinatorConfig, store: Store, old: CoordinatorCore | None,
                   draining: bool) -> CoordinatorCore:
    """A fresh core with the database's state, after recovery (its rows not yet written);
    ``old``: the core a reload replaces (its known wall-clock offset is kept)."""
    core = CoordinatorCore(store, config)  # a CoordinatorConfig is a CoreConfig
    found = core.recover(now_millis(), old)
    core.draining = draining
    log.info(
        "recovered db=%s active=%d queued=%d scheduled=%d retry_wait=%d requeued=%d due_while_down=%d"
        " failed_on_restart=%d damaged=%d task_types=%d next_seq=%d schedules=%d waiting=%d workflows=%d",
        shown(config.db), found.active, found.queued, found.scheduled, found.retry_wait, found.requeued,
        found.due, found.failed, found.damaged, found.task_types, found.next_seq, found.schedules, found.waiting,
        found.workflows,
    )
    return core


def first_core(config: CoordinatorConfig, store: Store) -> CoordinatorCore:
    """The core recovered at start, with the --schedules file's schedules applied (they
    commit with recovery's rows). Raises ``LeadershipLost`` if a read found the leadership
    gone, ``ConfigError`` if the core refuses the file."""
    core = recovered_core(config, store, None, False)
    if config.schedules_file is not None:
        problem = core.apply_schedules_file(now_millis(), schedule_file.read(config.schedules_file))
        if problem is not None:
            raise ConfigError("--schedules: %s: %s" % (config.schedules_file, problem))
    return core


def open_ports(config: CoordinatorConfig, fd_limit: int, handlers: Servers, periodic: PeriodicPort,
               guard: Guard | None, servers: list[gevent.server.StreamServer]) -> list[gevent.server.StreamServer]:
    """Start the worker, client and (with --periodic-port) Periodic ports, in that order,
    each added to ``servers`` once listening; returns them.

    A Pool caps handlers. Clients may not use the last WORKER_FD_RESERVE descriptors, so
    however many clients connect (or idle), new workers can still register; further
    clients wait in the accept backlog until a client connection ends. With tokens, the
    connections of one address that have not authenticated yet take at most a quarter
    of the client port's slots (guard.py)."""
    per_server = max(64, fd_limit - FD_MARGIN)
    per_client_server = max(32, per_server - WORKER_FD_RESERVE)
    if guard is not None:
        guard.pending_limit = pending_bound(per_client_server)
    ports = [
        gevent.server.StreamServer((config.bind, config.worker_port), handlers.handler("worker"), backlog=BACKLOG,
                                   spawn=gevent.pool.Pool(per_server)),
        gevent.server.StreamServer((config.bind, config.client_port), handlers.handler("client"), backlog=BACKLOG,
                                   spawn=gevent.pool.Pool(per_client_server)),
    ]
    if config.periodic_port is not None:
        ports.append(gevent.server.StreamServer(
            (config.bind, config.periodic_port),
            periodic.handle if guard is None else guard.gate(periodic.handle, "periodic"),
            backlog=BACKLOG, spawn=gevent.pool.Pool(per_client_server),
        ))
    for srv in ports:
        srv.start()
        servers.append(srv)
    return ports


def listening_line(config: CoordinatorConfig, ports: list[gevent.server.StreamServer], metrics_port: int | None,
                   fd_limit: int, tls: bool) -> str:
    """The "listening" line (stdout, CONTRACT.md), logged too."""
    worker, client = ports[0].server_port, ports[1].server_port
    line = "jobmesh coordinator listening worker=%s client=%s" % (Address(config.bind, worker),
                                                                  Address(config.bind, client))
    if config.periodic_port is not None:
        line += " periodic=%s" % Address(config.bind, ports[2].server_port)
    if metrics_port is not None:
        line += " metrics=%s" % Address(config.bind, metrics_port)
    log.info("listening worker=%s:%d client=%s:%d fd_limit=%d tls=%s", config.bind, worker, config.bind, client,
             fd_limit, "off" if not tls else "on" if config.tls_client_ca is None else "on,client-certificates")
    return line


def warn_about_auth(config: CoordinatorConfig, guard: Guard | None) -> None:
    for path, what in ((config.auth_file, "the auth file"), (config.tls_key, "the --tls-key file"),
                       (config.periodic_key, "the --periodic-key file")):
        warn_if_exposed(path, what)
    remote = not is_loopback(config.bind)
    if guard is None:
        if remote:
            log.warning("--insecure: bind=%s is reachable from other machines and no token is asked for: "
                        "anyone who can connect can submit, cancel and read every job", config.bind)
        return
    log.info("tokens on: auth file %s holds %d tokens", config.auth_file, len(guard.auth_file))
    if not len(guard.auth_file):
        log.warning("auth file %s holds no token: every connection will be refused (jobmesh token new)",
                    config.auth_file)
    if remote and not config.tls_cert:
        log.warning("tokens travel in plaintext: bind=%s is reachable from other machines without TLS; "
                    "anyone on the network path can read them (docs/SECURITY.md)", config.bind)
    elif remote and config.periodic_port is not None and config.periodic_key is None:
        log.warning("Periodic tokens travel in plaintext: bind=%s is reachable from other machines and TLS "
                    "covers the worker, client and metrics ports only; give --periodic-key for the Periodic "
                    "port's handshake (docs/PERIODIC.md)", config.bind)


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
