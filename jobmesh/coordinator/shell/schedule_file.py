"""The schedules file (``--schedules=FILE``): recurring schedules kept in version control.

A TOML file with one table per schedule, the table's name being the schedule's name::

    [nightly-report]
    cron = "0 3 * * *"
    timezone = "Europe/Paris"
    task_type = "REPORT"
    payload = { day = "yesterday" }

    [health-check]
    every_millis = 30000
    task_type = "SLEEP"
    payload = { durationMillis = 10 }
    overlap = "skip"

Keys are the SCHEDULE fields, in snake_case or as on the wire (``task_type`` or
``taskType``). ``read`` turns the file into SCHEDULE_PUT definitions; what they mean is
checked by the core (``Schedules.apply_file``), which replaces the file's schedules and
deletes the ones the file no longer names, all or nothing.
"""

from __future__ import annotations

import logging
import tomllib
from typing import Any, Callable

from jobmesh.coordinator.core import events as ev
from jobmesh.coordinator.core.face import SCHEDULES_NOT_APPLIED
from jobmesh.errors import ConfigError

log = logging.getLogger("jobmesh.coordinator.shell.runtime")  # one logger for the runtime's lines

KEYS = {"cron": "cron", "every_millis": "everyMillis", "timezone": "timezone", "task_type": "taskType",
        "payload": "payload", "priority": "priority", "max_attempts": "maxAttempts", "missed": "missed",
        "catchup_window_millis": "catchupWindowMillis", "overlap": "overlap", "jitter_millis": "jitterMillis",
        "paused": "paused"}
WIRE = {wire: wire for wire in KEYS.values()}


def read(path: str) -> list[dict[str, Any]]:
    """The file's schedules as SCHEDULE_PUT definitions; ``ConfigError`` naming the file
    if it cannot be read, is not TOML, or holds a key no schedule has."""
    try:
        with open(path, "rb") as f:
            document = tomllib.load(f)
    except OSError as exc:
        raise ConfigError("--schedules: cannot read %s: %s" % (path, exc.strerror or exc)) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError("--schedules: %s is not valid TOML: %s" % (path, exc)) from None
    definitions = []
    for name, table in document.items():
        if not isinstance(table, dict):
            raise ConfigError("--schedules: %s: %s must be a table ([%s]) of schedule fields" % (path, name, name))
        definition: dict[str, Any] = {"name": name}
        for key, value in table.items():
            wire = KEYS.get(key) or WIRE.get(key)
            if wire is None:
                raise ConfigError("--schedules: %s: schedule %s has an unknown key %r (known: %s)"
                                  % (path, name, key, ", ".join(KEYS)))
            definition[wire] = value
        definitions.append(definition)
    return definitions


def reload(path: str | None, post: Callable[[ev.Event], None]) -> None:
    """SIGHUP: read the file at ``path`` again and ``post`` its definitions to the core; a
    file that does not parse is logged and changes nothing (so does one the core refuses)."""
    if path is None:
        log.info("SIGHUP: no --schedules file to read")
        return
    try:
        definitions = read(path)
    except ConfigError as exc:
        log.error(SCHEDULES_NOT_APPLIED, exc)
        return
    log.info("SIGHUP: applying the schedules file %s (%d schedules)", path, len(definitions))
    post(ev.SchedulesFile(definitions))
