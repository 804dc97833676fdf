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

from jobmesh.addresses import Address, parse_addresses
from jobmesh.auth import read_token, token_file_of
from jobmesh.errors import ConfigError
from jobmesh.tls import ClientTls, client_tls

SYNC_MODES = ("FULL", "NORMAL", "OFF")
# The most any millisecond setting (a flag ending in ``-millis``) may say: ten years. Above
# it a deadline, a retry time or a lease end no longer fits the store's integers.
MAX_SETTING_MILLIS = 315_360_000_000
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
    # A Periodic func with no worker and no live job is forgotten (no longer in STATUS) after this.
    periodic_forget_idle_millis: int = 3_600_000


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
    # A shared store's writer session (PostgreSQL): its idle and TCP timeouts, so a frozen or
    # cut-off leader loses its lock to a standby within about this long.
    db_session_timeout_millis: int = 5000
    log_level: str = "INFO"
    # On SIGTERM/SIGINT, how long running attempts may finish before the stop (0: stop at once).
    drain_millis: int = 0
    log_format: str = "text"
    auth_file: str | None = None  # tokens with roles (jobmesh/auth.py); None: nobody is asked for one
    # With auth_file: a connection's TLS handshake and AUTH (or Periodic registration) must be done within this.
    auth_timeout_millis: int = 10_000
    insecure: bool = False  # allow a non-loopback --bind without --auth-file
    schedules_file: str | None = None  # --schedules: a TOML file of recurring schedules (absolute path)
    # TLS on the worker, client and metrics ports (all three None: plaintext); paths of PEM files.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None  # clients must present a certificate this CA signed
    tls_handshake_timeout_millis: int = 10_000


@dataclass(frozen=True)
class WorkerConfig:
    # The coordinators' worker ports, tried in turn (a leader and its standbys).
    coordinators: tuple[Address, ...] = (Address("127.0.0.1", 7070),)
    worker_id: str = ""
    capacity: int = 4
    heartbeat_interval_millis: int = 2000
    log_level: str = "INFO"
    log_format: str = "text"
    # Modules whose @task functions this worker runs (``--tasks``), besides the built-ins.
    task_modules: tuple[str, ...] = ()
    # A Django project's settings module (``--django``): its tasks run too, through DJANGO_WORKER.
    django_settings: str | None = None
    # After a cancel, how long a user task gets to return before SIGTERM, then before SIGKILL.
    cancel_grace_millis: int = 5000
    # How long running attempts are kept while the coordinator is unreachable (0: stopped at once).
    keep_running_millis: int = 30_000
    # The token sent in AUTH (--token-file, JOBMESH_TOKEN, JOBMESH_TOKEN_FILE); never shown.
    token: str | None = field(default=None, repr=False)
    token_file: str | None = None  # the file the token came from, read again on SIGHUP (None: not a file)
    tls: ClientTls | None = None  # how it speaks TLS to the coordinator (None: plaintext)
    connect_timeout_millis: int = 1000  # per address, before the next is tried


_MODULE_NAME = re.compile(r"[^\W\d]\w*(\.[^\W\d]\w*)*\Z")
# The task module that registers a Django project's tasks (``--django``); see that module.
DJANGO_WORKER = "jobmesh.contrib.django_worker"


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


def _int_or_zero(args: dict[str, Any], flag: str) -> int:
    """A flag of milliseconds >= 0 that only some commands take (absent or unset: 0)."""
    return _int(args, flag, 0) if args.get(flag) is not None else 0


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


def _schedules_file(args: dict[str, Any]) -> str | None:
    """``--schedules``: an absolute path (``up`` hands it to its coordinator), or None."""
    path = _path(args, "--schedules")
    return None if path is None else os.path.abspath(path)


def coordinator_config(args: dict[str, Any]) -> CoordinatorConfig:
    """Build from docopt's dict for ``jobmesh coordinator`` / ``jobmesh up``."""
    periodic = args.get("--periodic-port")
    metrics = args.get("--metrics-port")
    db = str(args["--db"])
    if not db.strip():
        raise ConfigError("--db must name a file or a PostgreSQL URL")
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
        auth_timeout_millis=_int(args, "--auth-timeout-millis", 1),
        periodic_keepalive_millis=_int(args, "--periodic-keepalive-millis", 0),
        periodic_forget_idle_millis=_int(args, "--periodic-forget-idle-millis", 0),
        sweep_interval_millis=_int(args, "--sweep-interval-millis", 1),
        db_synchronous=db_synchronous(args, db),
        db_session_timeout_millis=_int(args, "--db-session-timeout-millis", 100)
        if args.get("--db-session-timeout-millis") is not None else CoordinatorConfig.db_session_timeout_millis,
        log_level=_choice(args, "--log-level", LOG_LEVELS),
        drain_millis=_int_or_zero(args, "--drain-millis"),
        lease_grace_millis=lease_grace(args, db),
        log_format=log_format(args),
        periodic_key=_path(args, "--periodic-key"),
        periodic_authorized_keys=_path(args, "--periodic-authorized-keys"),
        auth_file=_path(args, "--auth-file"),
        insecure=bool(args.get("--insecure")),
        schedules_file=_schedules_file(args),
        **server_tls(args),
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


def is_database_url(db: str) -> bool:
    """Whether ``--db`` names a PostgreSQL database by URL (a store several coordinators
    share) rather than a SQLite file (as ``store/opening.py`` decides)."""
    return db.lower().startswith(("postgresql://", "postgres://"))


def lease_grace(args: dict[str, Any], db: str) -> int:
    """``--lease-grace-millis``; when not given, 0 on a SQLite file and the heartbeat
    timeout on a shared store, whose standby takes over with the leader's running work."""
    if args.get("--lease-grace-millis") is not None:
        return _int(args, "--lease-grace-millis", 0)
    return _int(args, "--heartbeat-timeout-millis", 1) if is_database_url(db) else 0


def db_synchronous(args: dict[str, Any], db: str) -> str:
    """``--db-synchronous``, SQLite's PRAGMA: FULL when not given. Refused with a
    PostgreSQL URL, where it would change nothing: the server decides what a commit
    survives (``synchronous_commit``, ``fsync``)."""
    if args.get("--db-synchronous") is None:
        return CoordinatorConfig.db_synchronous
    if is_database_url(db):
        raise ConfigError("--db-synchronous is SQLite's and does nothing on PostgreSQL, whose server decides what "
                          "a commit survives (synchronous_commit): leave it out with a PostgreSQL --db")
    return _choice(args, "--db-synchronous", SYNC_MODES)


def _path(args: dict[str, Any], flag: str) -> str | None:
    value = args.get(flag)
    if value is None:
        return None
    if not str(value).strip():
        raise ConfigError("%s must name a file" % flag)
    return str(value)


def server_tls(args: dict[str, Any]) -> dict[str, Any]:
    """The coordinator's TLS fields from ``--tls-cert``, ``--tls-key``, ``--tls-client-ca``
    (the files are read when the coordinator starts)."""
    cert, key, client_ca = (args.get(flag) or None for flag in ("--tls-cert", "--tls-key", "--tls-client-ca"))
    if (cert is None) != (key is None):
        raise ConfigError("--tls-cert and --tls-key go together (the coordinator's certificate and its private key)")
    if client_ca is not None and cert is None:
        raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key (client certificates are checked over TLS)")
    fields: dict[str, Any] = {"tls_cert": cert, "tls_key": key, "tls_client_ca": client_ca}
    if args.get("--tls-handshake-timeout-millis") is not None:
        fields["tls_handshake_timeout_millis"] = _int(args, "--tls-handshake-timeout-millis", 1)
    return fields


def tls_of(args: dict[str, Any]) -> ClientTls | None:
    """A client's or worker's TLS settings from ``--tls``, ``--tls-ca``, ``--tls-cert`` and
    ``--tls-key`` (None: plaintext)."""
    return client_tls(bool(args.get("--tls")), args.get("--tls-ca"), args.get("--tls-cert"), args.get("--tls-key"))


def worker_config(args: dict[str, Any]) -> WorkerConfig:
    """Build from docopt's dict for ``jobmesh worker``."""
    coordinators = parse_addresses(str(args["--coordinator"]))
    worker_id = args.get("--id") or "worker-" + uuid.uuid4().hex[:8]
    if not str(worker_id).strip():
        raise ConfigError("--id must not be empty")
    django = args.get("--django")
    if django is not None and not _MODULE_NAME.match(str(django)):
        raise ConfigError("--django must be the dotted name of a Django settings module, got %r" % django)
    return WorkerConfig(
        coordinators=coordinators,
        worker_id=str(worker_id),
        capacity=_int(args, "--capacity", 1, 1024),
        heartbeat_interval_millis=_int(args, "--heartbeat-interval-millis", 1),
        log_level=_choice(args, "--log-level", LOG_LEVELS),
        log_format=log_format(args),
        task_modules=parse_task_modules(args.get("--tasks")) + ((DJANGO_WORKER,) if django is not None else ()),
        django_settings=None if django is None else str(django),
        cancel_grace_millis=_int(args, "--cancel-grace-millis", 0),
        keep_running_millis=_int(args, "--keep-running-millis", 0),
        token=read_token(_path(args, "--token-file")),
        token_file=token_file_of(_path(args, "--token-file")),
        tls=tls_of(args),
        connect_timeout_millis=_int(args, "--connect-timeout-millis", 1),
    )


# ---- settings from flags, the environment and a TOML file ------------------------------
#
# The flags a command takes come from its docopt usage text, so every flag is covered
# without being listed here. Precedence: a flag on the command line, then JOBMESH_<FLAG>,
# then the --config file (or $JOBMESH_CONFIG), then the usage text's default.

ENV_PREFIX = "JOBMESH_"
CONFIG_ENV = "JOBMESH_CONFIG"
ACTIONS = ("--help", "--version", "--config", "--print-config")  # taken from the command line only
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_SECRET = re.compile(r"token|secret|password|(^|-)key$")


def env_name(flag: str) -> str:
    """``--heartbeat-timeout-millis`` -> ``JOBMESH_HEARTBEAT_TIMEOUT_MILLIS``."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


@dataclass(frozen=True)
class Source:
    """Where a setting's value came from: ``kind`` is ``command line``, ``environment``
    (``where`` the variable), ``config file`` (``where`` its path) or ``default``."""

    kind: str
    where: str = ""

    def __str__(self) -> str:
        return "%s %s" % (self.kind, self.where) if self.where else self.kind


COMMAND_LINE = Source("command line")
DEFAULT = Source("default")


def read_config_file(path: str) -> dict[str, Any]:
    """The TOML file's table; ``ConfigError`` naming the file if it cannot be read or parsed."""
    import tomllib

    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError("%s: cannot read the config file: %s" % (path, exc.strerror or exc)) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError("%s: not a valid TOML file: %s" % (path, " ".join(str(exc).split()))) from None


def _env_value(raw: str, flag: str, var: str, switch: bool) -> Any:
    if not switch:
        return raw
    if raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    raise ConfigError("%s=%r: %s is a switch: give 1/true/yes/on or 0/false/no/off" % (var, raw, flag))


def _file_value(value: Any, key: str, path: str, switch: bool) -> Any:
    if switch:
        if isinstance(value, bool):
            return value
        raise ConfigError("%s: %s must be true or false, got %r" % (path, key, value))
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return ",".join(value)  # tasks = ["a", "b"] is --tasks=a,b
    raise ConfigError("%s: %s must be a string or an integer, got %r" % (path, key, value))


def layered(parsed: dict[str, Any], given: set[str], environ: Any,
            flags: Any = None) -> tuple[dict[str, Any], dict[str, Source]]:
    """Docopt's dict with every setting taken from the first place that has it.

    ``parsed`` is docopt's dict (defaults filled in), ``given`` the flags the command
    line named (docopt cannot tell a default from a flag given), ``environ`` the
    environment; ``flags`` limits the settings that may come from elsewhere (None: every
    flag but ``ACTIONS``). The file is ``--config`` or ``$JOBMESH_CONFIG``, when the
    command takes ``--config``. Returns the dict and each setting's ``Source``.
    ``ConfigError`` names the file or the variable at fault: an unknown key, a value of
    the wrong type, a bad switch.
    """
    options = [k for k in parsed if k.startswith("--") and k not in ACTIONS and (flags is None or k in flags)]
    args = dict(parsed)
    sources: dict[str, Source] = {}
    table: dict[str, Any] = {}
    path = None
    if "--config" in parsed:
        path = parsed["--config"] or environ.get(CONFIG_ENV) or None
        if path:
            table = read_config_file(path)
            for key in table:
                if "--" + key not in options:
                    raise ConfigError("%s: unknown key %r%s" % (path, key, _close_flag(key, options)))
    for flag in options:
        switch = isinstance(parsed[flag], bool)
        if flag in given:
            sources[flag] = COMMAND_LINE
            continue
        var = env_name(flag)
        raw = environ.get(var)
        if raw:  # an empty variable counts as unset
            args[flag] = _env_value(raw, flag, var, switch)
            sources[flag] = Source("environment", var)
        elif flag[2:] in table:
            args[flag] = _file_value(table[flag[2:]], flag[2:], str(path), switch)
            sources[flag] = Source("config file", str(path))
        else:
            sources[flag] = DEFAULT
    check_millis(args, sources)
    return args, sources


def check_millis(args: dict[str, Any], sources: dict[str, Source]) -> None:
    """Every ``--*-millis`` setting of the command, however it was given, is at most
    ``MAX_SETTING_MILLIS``; ``ConfigError`` naming the flag and where it was set. A value
    that is no integer is left to the command's own parsing, which says so."""
    for flag, raw in args.items():
        if not flag.endswith("-millis") or raw is None or isinstance(raw, bool):
            continue
        text = str(raw).strip()
        try:
            value = int(text)
        except ValueError:
            continue
        if value > MAX_SETTING_MILLIS:
            shown = text if len(text) <= 40 else "%s... (%d characters)" % (text[:20], len(text))
            raise ConfigError(blame("%s must be at most %d (ten years), got %s" % (flag, MAX_SETTING_MILLIS, shown),
                                    sources))


def _close_flag(key: str, options: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(key, [o[2:] for o in options], n=1, cutoff=0.6)
    return " (did you mean %r?)" % close[0] if close else ""


def blame(message: str, sources: dict[str, Source]) -> str:
    """A ConfigError's message, naming where the flag it is about was set when that was
    not the command line: ``--worker-port must be ... (from JOBMESH_WORKER_PORT)``."""
    for flag in re.findall(r"--[a-z0-9][a-z0-9-]*", message):
        source = sources.get(flag)
        if source is not None and source.where:
            return "%s (from %s)" % (message, source.where)
    return message


def describe_settings(args: dict[str, Any], sources: dict[str, Source]) -> list[str]:
    """``--print-config``: one line per setting, in TOML (usable as a --config file), with
    its source as a comment; values of keys and tokens are never shown."""
    rows = []
    for flag, source in sources.items():
        key, value = flag[2:], args.get(flag)
        if value is None:
            text = "# %s is not set" % key
        elif _SECRET.search(key):
            text = "# %s = (set, not shown)" % key
        elif isinstance(value, bool):
            text = "%s = %s" % (key, "true" if value else "false")
        elif re.fullmatch(r"-?[0-9]+", str(value)):
            text = "%s = %s" % (key, value)
        else:
            text = "%s = %s" % (key, _toml_string(str(value)))
        rows.append((text, str(source)))
    width = max((len(text) for text, _ in rows), default=0)
    return ["%-*s  # %s" % (width, text, where) for text, where in rows]


def _toml_string(text: str) -> str:
    import json

    return json.dumps(text, ensure_ascii=False)  # JSON's escapes are TOML basic-string escapes
