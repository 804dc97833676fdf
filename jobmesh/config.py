"""Frozen configuration per command, built and validated once from docopt's dict.

All durations are integers in milliseconds. Every builder raises ``ConfigError`` with a
message that names the flag, so the CLI can print it and exit 2.
"""

from __future__ import annotations

import ipaddress
import os
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from jobmesh.auth import read_token
from jobmesh.errors import ConfigError

SYNC_MODES = ("FULL", "NORMAL", "OFF")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")


@dataclass(frozen=True)
class CoreConfig:
    """The settings the coordinator core itself uses (scheduling, failure detection, retries)."""

    heartbeat_timeout_millis: int = 6000
    task_timeout_millis: int = 600_000
    max_active_jobs: int = 100_000
    aging_step_millis: int = 60_000
    retry_base_millis: int = 1000
    retry_cap_millis: int = 30_000
    default_max_attempts: int = 3
    retain_finished_millis: int = 7 * 24 * 3600 * 1000  # finished jobs are purged after this (0: never)
    # How long a RUNNING job found at start stays on its old lease for its worker to claim
    # (WORKER_REGISTER ``running``); 0: recovery requeues or fails it at once.
    lease_grace_millis: int = 0


@dataclass(frozen=True)
class CoordinatorConfig(CoreConfig):
    """``jobmesh coordinator``: the core's settings plus listeners, storage and logging."""

    bind: str = "127.0.0.1"
    worker_port: int = 7070
    client_port: int = 7071
    periodic_port: int | None = None
    metrics_port: int | None = None  # the HTTP metrics port and dashboard; off when None
    db: str = "jobmesh.db"
    sweep_interval_millis: int = 500
    idle_timeout_millis: int = 120_000
    periodic_keepalive_millis: int = 120_000  # Periodic connections silent this long are closed (0: never)
    # Periodic's RSA handshake: the server's private key and the authorized public keys
    # (a PEM file or a directory of *.pem); both or neither.
    periodic_key: str | None = None
    periodic_authorized_keys: str | None = None
    db_synchronous: str = "FULL"
    log_level: str = "INFO"
    # On SIGTERM/SIGINT, how long running attempts may finish before the stop (0: stop at once).
    drain_millis: int = 0
    log_format: str = "text"
    auth_file: str | None = None  # tokens with roles (jobmesh/auth.py); None: nobody is asked for one
    insecure: bool = False  # allow a non-loopback --bind without --auth-file
    schedules_file: str | None = None  # --schedules: a TOML file of recurring schedules (absolute path)


@dataclass(frozen=True)
class WorkerConfig:
    coordinator_host: str = "127.0.0.1"
    coordinator_port: int = 7070
    worker_id: str = ""
    capacity: int = 4
    heartbeat_interval_millis: int = 2000
    log_level: str = "INFO"
    log_format: str = "text"
    # Modules whose @task functions this worker runs (``--tasks``), besides the built-ins.
    task_modules: tuple[str, ...] = ()
    # After a cancel, how long a user task gets to return before SIGTERM, then before SIGKILL.
    cancel_grace_millis: int = 5000
    # How long running attempts are kept while the coordinator is unreachable (0: stopped at once).
    keep_running_millis: int = 30_000
    # The token sent in AUTH (--token-file, JOBMESH_TOKEN, JOBMESH_TOKEN_FILE); never shown.
    token: str | None = field(default=None, repr=False)


_MODULE_NAME = re.compile(r"[^\W\d]\w*(\.[^\W\d]\w*)*\Z")


def parse_task_modules(value: Any) -> tuple[str, ...]:
    """``--tasks=MODULE[,MODULE...]`` as a tuple of module names (none when not given)."""
    if value is None:
        return ()
    names = [name.strip() for name in str(value).split(",")]
    for name in names:
        if not _MODULE_NAME.match(name):
            raise ConfigError("--tasks must be MODULE[,MODULE...] (dotted Python module names), got %r" % value)
    return tuple(dict.fromkeys(names))


def _int(args: dict[str, Any], flag: str, low: int, high: int | None = None) -> int:
    raw = args[flag]
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ConfigError("%s must be an integer, got %r" % (flag, raw)) from None
    if value < low or (high is not None and value > high):
        bound = "%d..%d" % (low, high) if high is not None else ">= %d" % low
        raise ConfigError("%s must be %s, got %d" % (flag, bound, value))
    return value


def parse_hostport(value: str, flag: str = "--coordinator") -> tuple[str, int]:
    """Split ``HOST:PORT`` (IPv6 as ``[::1]:PORT``); ConfigError if malformed."""
    host, sep, port = str(value).rpartition(":")
    if not sep or not host:
        raise ConfigError("%s must be HOST:PORT, got %r" % (flag, value))
    host = host.strip("[]")
    try:
        number = int(port)
    except ValueError:
        raise ConfigError("%s must be HOST:PORT with a numeric port, got %r" % (flag, value)) from None
    if not 1 <= number <= 65535:
        raise ConfigError("%s port must be 1..65535, got %d" % (flag, number))
    return host, number


def _choice(args: dict[str, Any], flag: str, choices: tuple[str, ...]) -> str:
    value = str(args.get(flag) or "").upper()
    if value not in choices:
        raise ConfigError("%s must be one of %s, got %r" % (flag, ", ".join(choices), args.get(flag)))
    return value


def log_format(args: dict[str, Any]) -> str:
    """``--log-format``: ``text`` or ``json`` (any case); ``text`` when the flag is absent."""
    value = str(args.get("--log-format") or "text").lower()
    if value not in LOG_FORMATS:
        raise ConfigError("--log-format must be one of %s, got %r" % (", ".join(LOG_FORMATS), args.get("--log-format")))
    return value


def is_loopback(bind: str) -> bool:
    """Whether ``--bind`` names a loopback address (127.0.0.0/8, ::1, localhost)."""
    host = bind.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from elsewhere


def _schedules_file(value: Any) -> str | None:
    """``--schedules``: an absolute path (``up`` hands it to its coordinator), or None."""
    if value is None:
        return None
    if not str(value).strip():
        raise ConfigError("--schedules must name a file")
    return os.path.abspath(str(value))


def coordinator_config(args: dict[str, Any]) -> CoordinatorConfig:
    """Build from docopt's dict for ``jobmesh coordinator`` / ``jobmesh up``."""
    periodic = args.get("--periodic-port")
    metrics = args.get("--metrics-port")
    db = str(args["--db"])
    if not db.strip():
        raise ConfigError("--db must name a file")
    bind = str(args["--bind"]).strip()
    if not bind:
        raise ConfigError("--bind must name an address")
    cfg = CoordinatorConfig(
        bind=bind,
        worker_port=_int(args, "--worker-port", 0, 65535),
        client_port=_int(args, "--client-port", 0, 65535),
        periodic_port=None if periodic in (None, "") else _int(args, "--periodic-port", 0, 65535),
        metrics_port=None if metrics in (None, "") else _int(args, "--metrics-port", 0, 65535),
        db=db,
        heartbeat_timeout_millis=_int(args, "--heartbeat-timeout-millis", 1),
        task_timeout_millis=_int(args, "--task-timeout-millis", 1),
        max_active_jobs=_int(args, "--max-active-jobs", 1),
        aging_step_millis=_int(args, "--aging-step-millis", 1),
        retry_base_millis=_int(args, "--retry-base-millis", 0),
        retry_cap_millis=_int(args, "--retry-cap-millis", 0),
        default_max_attempts=_int(args, "--default-max-attempts", 1),
        retain_finished_millis=_int(args, "--retain-finished-millis", 0),
        idle_timeout_millis=_int(args, "--idle-timeout-millis", 1),
        periodic_keepalive_millis=_int(args, "--periodic-keepalive-millis", 0),
        sweep_interval_millis=_int(args, "--sweep-interval-millis", 1),
        db_synchronous=_choice(args, "--db-synchronous", SYNC_MODES),
        log_level=_choice(args, "--log-level", LOG_LEVELS),
        drain_millis=_int(args, "--drain-millis", 0) if args.get("--drain-millis") is not None else 0,
        lease_grace_millis=(_int(args, "--lease-grace-millis", 0) if args.get("--lease-grace-millis") is not None
                            else 0),
        log_format=log_format(args),
        periodic_key=_path(args, "--periodic-key"),
        periodic_authorized_keys=_path(args, "--periodic-authorized-keys"),
        auth_file=_path(args, "--auth-file"),
        insecure=bool(args.get("--insecure")),
        schedules_file=_schedules_file(args.get("--schedules")),
    )
    if (cfg.periodic_key is None) != (cfg.periodic_authorized_keys is None):
        raise ConfigError("--periodic-key and --periodic-authorized-keys go together (the RSA handshake needs both)")
    if cfg.periodic_key is not None and cfg.periodic_port is None:
        raise ConfigError("--periodic-key needs --periodic-port")
    if cfg.retry_cap_millis < cfg.retry_base_millis:
        raise ConfigError("--retry-cap-millis must be >= --retry-base-millis")
    if cfg.auth_file is None and not cfg.insecure and not is_loopback(cfg.bind):
        raise ConfigError("--bind=%s is reachable from other machines: give --auth-file=PATH (tokens, "
                          "docs/SECURITY.md), or --insecure to serve anyone who can connect" % cfg.bind)
    return cfg


def _path(args: dict[str, Any], flag: str) -> str | None:
    value = args.get(flag)
    if value is None:
        return None
    if not str(value).strip():
        raise ConfigError("%s must name a file" % flag)
    return str(value)


def worker_config(args: dict[str, Any]) -> WorkerConfig:
    """Build from docopt's dict for ``jobmesh worker``."""
    host, port = parse_hostport(args["--coordinator"])
    worker_id = args.get("--id") or "worker-" + uuid.uuid4().hex[:8]
    if not str(worker_id).strip():
        raise ConfigError("--id must not be empty")
    return WorkerConfig(
        coordinator_host=host,
        coordinator_port=port,
        worker_id=str(worker_id),
        capacity=_int(args, "--capacity", 1, 1024),
        heartbeat_interval_millis=_int(args, "--heartbeat-interval-millis", 1),
        log_level=_choice(args, "--log-level", LOG_LEVELS),
        log_format=log_format(args),
        task_modules=parse_task_modules(args.get("--tasks")),
        cancel_grace_millis=_int(args, "--cancel-grace-millis", 0),
        keep_running_millis=_int(args, "--keep-running-millis", 0),
        token=read_token(_path(args, "--token-file")),
    )
