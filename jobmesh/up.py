"""``jobmesh up``: a coordinator and N local workers as one supervised unit.

The coordinator and every worker are child processes (``python -m jobmesh ...``, started
with ``gevent.subprocess``; never multiprocessing, which hangs in a patched process), so
``--worker-port=0`` works: the workers are pointed at the port from the coordinator's
"listening" line, which is relayed to our stdout. Children inherit stderr; the
coordinator's stdout is read continuously so its pipe never fills. The workers' stdout is
our stderr, so nothing a task prints lands beside the listening line.

Supervision: a worker that exits is restarted after a backoff (0.5 s doubling to 10 s,
reset once a worker has run for 30 s). So is a coordinator that exits when ``up`` did not
stop it (a crash, a kill): on the ports its first start listened on (so ``--worker-port=0``
still names one port the workers know) and the same database. Its workers keep their
running attempts meanwhile (``jobmesh worker --keep-running-millis``), and the
coordinator runs with ``--lease-grace-millis`` (by default the heartbeat timeout), so
when they register again they keep those attempts: a restart under ``up`` costs a
running job nothing. Only a coordinator that fails its first start ends ``up`` (exit 1).
On a shared PostgreSQL database the coordinator may stand by while another leads: ``up``
then waits for its listening line without a time limit and starts the workers then; one
that lost the leadership (exit 75) is started again like any other and stands by.
On Linux each child also gets SIGTERM if ``up`` itself dies, so no worker is left
orphaned.

Stopping (SIGINT/SIGTERM, exit 0) drains: the coordinator is told first (SIGTERM; it
runs with ``--drain-millis``, so it assigns nothing more and waits for running
attempts), the workers keep running until it has exited, so their attempts can finish
and be reported, and only then are they stopped (SIGTERM, a bounded wait, SIGKILL for
leftovers). A second signal during the drain is passed on: the coordinator stops at
once. Children run in their own sessions, so a terminal's Ctrl-C reaches only ``up``,
which decides the order; without that the workers would stop their tasks at once.

With ``--auth-file`` the workers present a worker token. Given one like any worker
(``--token-file``, ``JOBMESH_TOKEN``, ``JOBMESH_TOKEN_FILE``), ``up`` checks it against
the file at start. Given none, ``up`` makes one for this run (``WorkersToken``): a
random token held only in memory and in its workers' environment, whose hash is added
to a private copy of the auth file that the coordinator reads instead (a directory of
mode 0700, removed when ``up`` ends). The user's file is never written. Either way the
workers get the token in their environment (``JOBMESH_TOKEN``), never on a command
line. SIGHUP rebuilds the copy from the user's file and is passed on to the coordinator,
which re-reads it.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any, Callable

import gevent
from gevent import subprocess
from gevent.event import AsyncResult, Event

from jobmesh.addresses import Address, parse_address
from jobmesh.auth import (TOKEN_BYTES, TOKEN_ENV, TOKEN_FILE_ENV, WORKER, AuthFile, AuthFileError, entry_text,
                          read_token, replace_file, token_digest)
from jobmesh.config import CoordinatorConfig, coordinator_config, env_name, is_database_url, parse_task_modules
from jobmesh.errors import BadAddress, ConfigError
from jobmesh.exitcodes import EXIT_FAILED, EXIT_LEADERSHIP_LOST, EXIT_OK
from jobmesh.store.opening import shown

log = logging.getLogger(__name__)

LISTENING = re.compile(r"jobmesh coordinator listening (?P<ports>.*)")
STANDING_BY = "jobmesh coordinator standing by"
START_TIMEOUT = 30.0
POLL_INTERVAL = 0.2
RESTART_INITIAL = 0.5
RESTART_CAP = 10.0
HEALTHY_AFTER = 30.0
STOP_TIMEOUT = 10.0
STOP_NOW_WAIT = 2.0  # after a second stop signal, how long the coordinator gets to exit before the workers
# A coordinator that exits within this long of our own stop signal exited because of it
# (Ctrl-C reaches the whole process group at once).
STOP_GRACE = 0.5


def _die_with_parent() -> Callable[[], None] | None:
    """Linux: have the kernel send SIGTERM to the child when ``up`` dies (prctl PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG

    return preexec


def coordinator_argv(cfg: CoordinatorConfig) -> list[str]:
    flags: dict[str, Any] = {
        "bind": cfg.bind,
        "worker-port": cfg.worker_port,
        "client-port": cfg.client_port,
        "db": cfg.db,
        "heartbeat-timeout-millis": cfg.heartbeat_timeout_millis,
        "task-timeout-millis": cfg.task_timeout_millis,
        "max-active-jobs": cfg.max_active_jobs,
        "aging-step-millis": cfg.aging_step_millis,
        "retry-base-millis": cfg.retry_base_millis,
        "retry-cap-millis": cfg.retry_cap_millis,
        "default-max-attempts": cfg.default_max_attempts,
        "sweep-interval-millis": cfg.sweep_interval_millis,
        "db-session-timeout-millis": cfg.db_session_timeout_millis,
        "retain-finished-millis": cfg.retain_finished_millis,
        "idle-timeout-millis": cfg.idle_timeout_millis,
        "auth-timeout-millis": cfg.auth_timeout_millis,
        "periodic-keepalive-millis": cfg.periodic_keepalive_millis,
        "periodic-forget-idle-millis": cfg.periodic_forget_idle_millis,
        "log-level": cfg.log_level,
        "drain-millis": cfg.drain_millis,
        "lease-grace-millis": cfg.lease_grace_millis,
        "log-format": cfg.log_format,
    }
    if not is_database_url(cfg.db):  # SQLite's; refused with a PostgreSQL URL
        flags["db-synchronous"] = cfg.db_synchronous
    if cfg.periodic_port is not None:
        flags["periodic-port"] = cfg.periodic_port
    if cfg.metrics_port is not None:
        flags["metrics-port"] = cfg.metrics_port
    if cfg.tls_cert is not None:
        flags.update({"tls-cert": cfg.tls_cert, "tls-key": cfg.tls_key,
                      "tls-handshake-timeout-millis": cfg.tls_handshake_timeout_millis})
        if cfg.tls_client_ca is not None:
            flags["tls-client-ca"] = cfg.tls_client_ca
    if cfg.schedules_file is not None:
        flags["schedules"] = cfg.schedules_file
    if cfg.periodic_key is not None:
        flags["periodic-key"] = os.path.abspath(cfg.periodic_key)
        flags["periodic-authorized-keys"] = os.path.abspath(str(cfg.periodic_authorized_keys))
    if cfg.auth_file is not None:
        flags["auth-file"] = os.path.abspath(cfg.auth_file)
    if shown(cfg.db) != cfg.db:  # a password: in the environment (coordinator_environment), never on a command line
        del flags["db"]
    argv_flags = ["--%s=%s" % kv for kv in flags.items()] + (["--insecure"] if cfg.insecure else [])
    return [sys.executable, "-m", "jobmesh", "coordinator"] + argv_flags


def coordinator_environment(cfg: CoordinatorConfig) -> dict[str, str]:
    """The coordinator's environment: ours, and a --db URL holding a password, which any
    local user could read on a command line."""
    env = child_environment()
    if shown(cfg.db) != cfg.db:
        env[env_name("--db")] = cfg.db
    return env


def listening_ports(line: str) -> dict[str, tuple[str, int]]:
    """``{"worker": (host, port), "client": ..., ...}`` from the text after "listening"."""
    ports = {}
    for item in line.split():
        name, _, text = item.partition("=")
        try:
            address = parse_address(text, name)
        except BadAddress:
            continue
        ports[name] = (address.host, address.port)
    return ports


def pinned(cfg: CoordinatorConfig, ports: dict[str, tuple[str, int]]) -> CoordinatorConfig:
    """The configuration that restarts a coordinator on the ports it listened on."""
    return replace(cfg, worker_port=ports["worker"][1], client_port=ports["client"][1],
                   periodic_port=ports["periodic"][1] if "periodic" in ports else cfg.periodic_port,
                   metrics_port=ports["metrics"][1] if "metrics" in ports else cfg.metrics_port)


def worker_tls_argv(cfg: CoordinatorConfig) -> list[str]:
    """How the local workers speak TLS to a coordinator with ``--tls-cert``: they trust
    exactly its certificate (so it must carry the address they connect to) and, when it
    asks for client certificates, present that same certificate."""
    if cfg.tls_cert is None:
        return []
    argv = ["--tls-ca=%s" % cfg.tls_cert]
    if cfg.tls_client_ca is not None:
        argv += ["--tls-cert=%s" % cfg.tls_cert, "--tls-key=%s" % cfg.tls_key]
    return argv


# Variables the children must not read: up has resolved its settings and passes them as
# flags; the config file may hold keys the child does not take, and JOBMESH_TLS_CERT and
# JOBMESH_TLS_KEY name the coordinator's certificate, not a worker's client certificate.
HIDDEN_FROM_CHILDREN = ("JOBMESH_CONFIG", "JOBMESH_TLS", "JOBMESH_TLS_CA", "JOBMESH_TLS_CERT", "JOBMESH_TLS_KEY")


def child_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in HIDDEN_FROM_CHILDREN}


def worker_target(host: str, port: int) -> str:
    """Where a local worker connects, given the coordinator's listening address."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return str(Address(host, port))


def worker_heartbeat_millis(heartbeat_timeout_millis: int) -> int:
    """The workers' heartbeat period: the default 2000 ms, but at least three beats per timeout."""
    return max(1, min(2000, heartbeat_timeout_millis // 3))


def _count(args: dict[str, Any], flag: str, low: int, high: int) -> int:
    try:
        value = int(str(args[flag]).strip())
    except ValueError:
        raise ConfigError("%s must be an integer, got %r" % (flag, args[flag])) from None
    if not low <= value <= high:
        raise ConfigError("%s must be %d..%d, got %d" % (flag, low, high, value))
    return value


class Child:
    """One supervised process (a worker, or the coordinator) and its restart bookkeeping."""

    def __init__(self, worker_id: str, argv: list[str]):
        self.worker_id = worker_id
        self.argv = argv
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.failures = 0
        self.restart_at: float | None = None


class Supervisor:
    def __init__(self, cfg: CoordinatorConfig, workers: int, capacity: int, task_modules: tuple[str, ...] = (),
                 token: str | None = None, own_token: WorkersToken | None = None):
        self.cfg = cfg
        self.token = token  # the workers' token (with --auth-file), passed in their environment
        self.own_token = own_token  # when up made that token: the auth file copy to rebuild on SIGHUP
        self.workers = workers
        self.capacity = capacity
        self.task_modules = task_modules
        self.stop_requested = Event()
        self.stop_now = Event()  # a second stop signal: do not wait for the drain
        self._stop_now_at = 0.0
        self.coordinator: subprocess.Popen | None = None
        self.coordinator_slot = Child("coordinator", [])  # restarts: argv pinned to its ports once it listened
        self.slots: list[Child] = []
        self._preexec = _die_with_parent()

    def _spawn(self, argv: list[str], env: dict[str, str] | None = None, **kwargs: Any) -> subprocess.Popen:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, preexec_fn=self._preexec, start_new_session=True,
                                env=child_environment() if env is None else env, **kwargs)

    def run(self) -> int:
        handlers = [gevent.signal_handler(s, self.request_stop, s) for s in (signal.SIGTERM, signal.SIGINT)]
        # SIGHUP re-reads the coordinator's --schedules and --auth-file: pass it on.
        handlers.append(gevent.signal_handler(signal.SIGHUP, self._hangup))
        try:
            coordinator, target = self._start_coordinator()
            if target is None:  # a stop before it listened (standing by, say) is no failed start
                return EXIT_OK if self.stop_requested.is_set() else EXIT_FAILED
            heartbeat = worker_heartbeat_millis(self.cfg.heartbeat_timeout_millis)
            for n in range(1, self.workers + 1):
                argv = [sys.executable, "-m", "jobmesh", "worker", "--coordinator=%s" % target,
                        "--id=local-%d" % n, "--capacity=%d" % self.capacity,
                        "--heartbeat-interval-millis=%d" % heartbeat, "--log-level=%s" % self.cfg.log_level,
                        "--log-format=%s" % self.cfg.log_format] + worker_tls_argv(self.cfg)
                if self.task_modules:
                    argv.append("--tasks=%s" % ",".join(self.task_modules))
                slot = Child("local-%d" % n, argv)
                self.slots.append(slot)
                self._start_worker(slot)
            log.info("up coordinator_pid=%d workers=%d capacity=%d worker_port=%s",
                     coordinator.pid, self.workers, self.capacity, target)
            return self._supervise()
        finally:
            self._stop_children()
            for handler in handlers:
                handler.cancel()

    def _hangup(self) -> None:
        """SIGHUP: the coordinator re-reads its --schedules and --auth-file (the copy rebuilt
        first, when up made the workers' token)."""
        if self.own_token is not None:
            self.own_token.refresh()
        self._signal(self.coordinator, signal.SIGHUP)

    def request_stop(self, signum: int) -> None:
        if not self.stop_requested.is_set():
            log.info("stopping signal=%s drain_millis=%d", signal.Signals(signum).name, self.cfg.drain_millis)
            self.stop_requested.set()
        elif not self.stop_now.is_set():
            log.info("second stop signal=%s: stopping now", signal.Signals(signum).name)
            self._stop_now_at = time.monotonic()
            self.stop_now.set()
            self._signal(self.coordinator, signal.SIGTERM)  # its second signal: it stops at once

    @staticmethod
    def _signal(proc: subprocess.Popen | None, signum: int) -> None:
        if proc is not None and proc.poll() is None:
            try:
                proc.send_signal(signum)
            except OSError:
                pass

    # ---- children ---------------------------------------------------------------------

    def _start_coordinator(self) -> tuple[subprocess.Popen, str | None]:
        """Start the coordinator; return it and the worker target from its listening line
        (None if it did not start or a stop came first)."""
        coordinator = self.coordinator = self._spawn(coordinator_argv(self.cfg), coordinator_environment(self.cfg),
                                                     stdout=subprocess.PIPE)
        listening: AsyncResult = AsyncResult()
        standing_by = Event()
        gevent.spawn(self._relay_stdout, coordinator.stdout, listening, standing_by)
        waiter = gevent.spawn(self.stop_requested.wait)
        try:
            gevent.wait([listening, waiter], timeout=START_TIMEOUT, count=1)
            if standing_by.is_set() and not listening.ready() and not waiter.ready():
                # Another coordinator leads the shared database: this one listens once it
                # takes over, however long that is; its workers start then.
                log.info("coordinator standing by pid=%d: the workers start once it leads", coordinator.pid)
                gevent.wait([listening, waiter], count=1)
        finally:
            waiter.kill()
        match = listening.get() if listening.ready() else None
        ports = listening_ports(match["ports"]) if match is not None else {}
        if "worker" not in ports or "client" not in ports:
            rc = None
            if listening.ready():  # its stdout closed: it is exiting; take its exit code
                try:
                    rc = coordinator.wait(STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    pass
            # As in _supervise: an exit that our own stop signal follows closely came from it.
            if self.stop_requested.wait(STOP_GRACE if rc is not None else 0):
                pass
            elif rc is None:
                log.error("coordinator did not start within %.0f s", START_TIMEOUT)
            else:
                log.error("coordinator did not start rc=%s", rc)
            return coordinator, None
        slot = self.coordinator_slot
        slot.argv = coordinator_argv(pinned(self.cfg, ports))
        slot.started_at = time.monotonic()
        return coordinator, worker_target(*ports["worker"])

    def _check_coordinator(self, now: float) -> None:
        """Restart a coordinator that exited on its own, after a backoff, on its ports."""
        slot = self.coordinator_slot
        if slot.restart_at is not None:
            if now >= slot.restart_at:
                slot.restart_at = None
                slot.started_at = now
                coordinator = self.coordinator = self._spawn(slot.argv, coordinator_environment(self.cfg),
                                                             stdout=subprocess.PIPE)
                gevent.spawn(self._relay_stdout, coordinator.stdout, AsyncResult(), Event())
                log.info("coordinator restarted pid=%d", coordinator.pid)
            return
        assert self.coordinator is not None, "supervised once started"
        rc = self.coordinator.poll()
        if rc is None or self.stop_requested.wait(STOP_GRACE):
            return  # running, or it exited because we are stopping
        if now - slot.started_at >= HEALTHY_AFTER:
            slot.failures = 0
        delay = min(RESTART_CAP, RESTART_INITIAL * 2 ** slot.failures)
        slot.failures += 1
        slot.restart_at = now + delay
        log.warning("coordinator exited pid=%d rc=%s restart_in=%.1fs%s", self.coordinator.pid, rc, delay,
                    " (it lost the database's leadership: it comes back as a standby, or leads)"
                    if rc == EXIT_LEADERSHIP_LOST else "")

    def _relay_stdout(self, stream: Any, listening: AsyncResult, standing_by: Event) -> None:
        """Copy the coordinator's stdout to ours, line by line, and spot the listening line
        (and the standing-by line of a coordinator on a shared database)."""
        for raw in stream:
            line = raw.decode("utf-8", "replace")
            sys.stdout.write(line)
            sys.stdout.flush()
            if line.startswith(STANDING_BY):
                standing_by.set()
            if not listening.ready():
                match = LISTENING.search(line)
                if match:
                    listening.set(match)
        if not listening.ready():
            listening.set(None)

    def _start_worker(self, slot: Child) -> None:
        # The workers' token is the run's, or none (without --auth-file): never one the
        # environment holds for some other coordinator.
        env = {k: v for k, v in child_environment().items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}
        if self.token is not None:  # in the environment, never on a command line
            env[TOKEN_ENV] = self.token
        # Our stdout carries the coordinator's lines only; whatever a worker (or a task in
        # it) prints goes to stderr, with the logs.
        proc = slot.proc = self._spawn(slot.argv, stdout=sys.stderr.fileno(), env=env)
        slot.started_at = time.monotonic()
        slot.restart_at = None
        log.info("worker started worker=%s pid=%d", slot.worker_id, proc.pid)

    def _supervise(self) -> int:
        while not self.stop_requested.wait(POLL_INTERVAL):
            now = time.monotonic()
            self._check_coordinator(now)
            for slot in self.slots:
                self._check_worker(slot, now)
        return EXIT_OK

    def _check_worker(self, slot: Child, now: float) -> None:
        if slot.restart_at is not None:
            if now >= slot.restart_at:
                self._start_worker(slot)
            return
        proc = slot.proc
        assert proc is not None, "a slot is started when it is added"
        rc = proc.poll()
        if rc is None:
            return
        if now - slot.started_at >= HEALTHY_AFTER:
            slot.failures = 0
        delay = min(RESTART_CAP, RESTART_INITIAL * 2 ** slot.failures)
        slot.failures += 1
        slot.restart_at = now + delay
        log.warning("worker exited worker=%s pid=%d rc=%s restart_in=%.1fs", slot.worker_id, proc.pid, rc, delay)

    def _stop_children(self) -> None:
        """Drain: SIGTERM the coordinator and wait for it (its drain time and then some,
        or until a second signal); then SIGTERM the workers; wait (bounded); SIGKILL what
        is left."""
        coordinator = self.coordinator
        if coordinator is not None and coordinator.poll() is None:
            self._signal(coordinator, signal.SIGTERM)
            deadline = time.monotonic() + self.cfg.drain_millis / 1000.0 + STOP_TIMEOUT
            while coordinator.poll() is None and time.monotonic() < deadline:
                if self.stop_now.is_set():
                    # It stops at once now; give it a moment to go first, so that its
                    # workers leaving is not recorded as lost attempts.
                    deadline = min(deadline, self._stop_now_at + STOP_NOW_WAIT)
                gevent.sleep(POLL_INTERVAL / 4)
        procs = [s.proc for s in self.slots if s.proc is not None] + [coordinator]
        procs = [p for p in procs if p is not None]
        for proc in procs:
            if proc.poll() is None:
                try:
                    proc.terminate()
                except OSError:
                    pass
        deadline = time.monotonic() + STOP_TIMEOUT
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("child did not stop in time, killing pid=%d", proc.pid)
                proc.kill()
                proc.wait()


def up_coordinator_config(args: dict[str, Any]) -> CoordinatorConfig:
    """The coordinator's flags under ``up``: a restart keeps running work for the heartbeat
    timeout unless ``--lease-grace-millis`` says otherwise."""
    cfg = coordinator_config(args)
    if args.get("--lease-grace-millis") is None:
        cfg = replace(cfg, lease_grace_millis=cfg.heartbeat_timeout_millis)
    return cfg


def run_up(args: dict[str, Any]) -> int:
    """Run ``jobmesh up`` until SIGINT/SIGTERM (exit 0); 1 if the coordinator does not start."""
    cfg = up_coordinator_config(args)
    workers = _count(args, "--workers", 0, 1024)
    capacity = _count(args, "--capacity", 1, 1024)
    task_modules = parse_task_modules(args.get("--tasks"))
    if task_modules:
        # Import them here first, so a bad module is one line and exit 2 rather than
        # workers that exit at start and are restarted forever.
        from jobmesh.worker.usertasks import load_modules

        load_modules(task_modules)
    token = workers_token(cfg, args.get("--token-file"))
    own = None
    if cfg.auth_file is not None and token is None:
        own = WorkersToken(cfg.auth_file)
        token = own.token
        cfg = replace(cfg, auth_file=own.path)
    try:
        return Supervisor(cfg, workers, capacity, task_modules, token, own).run()
    finally:
        if own is not None:
            own.close()


def workers_token(cfg: CoordinatorConfig, token_file: str | None) -> str | None:
    """With ``--auth-file``: the worker token given for ``up``'s workers (``--token-file``,
    ``JOBMESH_TOKEN``, ``JOBMESH_TOKEN_FILE``), checked against the file, so a wrong one is
    one line at start rather than workers refused forever (``ConfigError``); None when
    none is given (``up`` then makes one) or without ``--auth-file``."""
    if cfg.auth_file is None:
        return None
    token = read_token(token_file)
    if token is None:
        return None
    hint = ("give a worker token of that file (jobmesh token new local-workers --role=worker --auth-file=%s "
            "> worker.token; --token-file=worker.token), or none and up makes one for its workers" % cfg.auth_file)
    identity = AuthFile.load(cfg.auth_file).authenticate(token)
    if identity is None:
        raise ConfigError("the workers' token is not in %s: %s" % (cfg.auth_file, hint))
    if identity.role != WORKER:
        raise ConfigError("the workers' token %r has role %s; up's workers need a worker token: %s"
                          % (identity.name, identity.role, hint))
    return token


class WorkersToken:
    """A worker token ``up`` makes for its own workers, for one run.

    The token is random and lives only in this process and its workers' environment; the
    coordinator reads ``path``: the user's auth file (``source``) with one more worker
    entry, holding the token's hash, in a private directory (mode 0700, removed by
    ``close``). ``refresh`` rebuilds it from the user's file (SIGHUP)."""

    NAME = "up-workers"

    def __init__(self, source: str) -> None:
        self.source = source
        self.token = secrets.token_urlsafe(TOKEN_BYTES)
        self.directory = tempfile.mkdtemp(prefix="jobmesh-up-")
        self.path = os.path.join(self.directory, "auth.toml")
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        """Write the copy; ``AuthFileError`` if the user's file is not valid."""
        names = AuthFile.load(self.source).names()
        name, n = self.NAME, 1
        while name in names:
            n += 1
            name = "%s-%d" % (self.NAME, n)
        with open(self.source, encoding="utf-8") as f:
            text = f.read()
        replace_file(self.path, text.rstrip("\n") + "\n\n" + entry_text(name, WORKER, token_digest(self.token)))

    def refresh(self) -> None:
        try:
            self._build()
        except (AuthFileError, OSError) as exc:
            log.error("kept the auth file in force: %s", exc)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
