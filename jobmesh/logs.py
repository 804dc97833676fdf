"""The two formats of the processes' logs on stderr: ``text`` and ``json`` (``--log-format``).

``text`` is the classic ``2026-12-01 18:55:32,123 INFO jobmesh.x: message`` line. ``json``
writes each record as one JSON object on one line::

    {"ts": "2026-12-01T18:55:32.123Z", "level": "INFO", "logger": "jobmesh.coordinator.core.face",
     "message": "retry job=j-1 attempt=1/3 in=20ms error=...", "jobId": "j-1", "attempt": "1/3"}

``jobId``, ``attemptId`` and ``workerId`` come from ``extra={"job_id": ...}`` (also
``attempt_id``, ``worker_id``) or, failing that, from the house style's key=value pairs in the
message (``job=``, ``attempt=``, ``worker=``; not ``worker=HOST:PORT``, an address). An ``attempt=`` that is a number (``2``) or a
count (``1/3``) is an attempt number, not a lease, so it goes to ``attempt`` instead. A
traceback goes to ``exc``, inside the same object. ``JsonLines`` turns text that other code
writes to a stream (gevent's hub prints its errors and blocking reports itself) into the same
objects, one per line.

Only ``cli.py`` installs these (STYLE.md: one place configures handlers). Stdlib only.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any, TextIO

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# key=value ids as the house style writes them ("job=%s attempt=%s worker=%s"); a value
# ends at whitespace, and a trailing ':' ',' or ';' belongs to the sentence, not the id.
_PAIR = re.compile(r"(?<![\w.-])(job|attempt|worker)=([^\s,;]+?)[:,;]?(?=\s|$)")
_ATTEMPT_NUMBER = re.compile(r"\d+(/\d+)?\Z")
# "listening worker=127.0.0.1:7070 ..." names the worker *port*, not a worker.
_ADDRESS = re.compile(r"(\d{1,3}(\.\d{1,3}){3}|\[[0-9a-fA-F:.]*\]|localhost):\d+\Z")
_FIELDS = {"job": "jobId", "attempt": "attemptId", "worker": "workerId"}
_EXTRA = {"job_id": "jobId", "attempt_id": "attemptId", "worker_id": "workerId"}


def utc_iso(seconds: float) -> str:
    """Epoch seconds as ISO 8601 UTC with milliseconds: ``2026-12-01T18:55:32.123Z``."""
    whole, millis = divmod(round(seconds * 1000), 1000)
    return "%s.%03dZ" % (time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)), millis)


def id_fields(message: str) -> dict[str, str]:
    """The ``jobId``/``attemptId``/``workerId`` (or ``attempt``) named by key=value pairs in ``message``."""
    found: dict[str, str] = {}
    for key, value in _PAIR.findall(message):
        if value in ("None", "-") or _ADDRESS.match(value):
            continue
        name = _FIELDS[key]
        if key == "attempt" and _ATTEMPT_NUMBER.match(value):
            name = "attempt"
        found.setdefault(name, value)
    return found


def json_line(level: str, logger: str, message: str, seconds: float | None = None, **fields: Any) -> str:
    """One log object as a line (without the newline)."""
    obj: dict[str, Any] = {"ts": utc_iso(time.time() if seconds is None else seconds), "level": level,
                           "logger": logger, "message": message}
    obj.update(id_fields(message))
    obj.update((k, v) for k, v in fields.items() if v is not None)
    return json.dumps(obj, ensure_ascii=False, default=str)


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object on one line (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        fields = {wire: str(getattr(record, attr)) for attr, wire in _EXTRA.items()
                  if getattr(record, attr, None) is not None}
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            fields["exc"] = record.exc_text
        if record.stack_info:
            fields["stack"] = self.formatStack(record.stack_info)
        return json_line(record.levelname, record.name, record.getMessage(), record.created, **fields)


class JsonLines:
    """A text stream that writes each line written to it as a JSON log object on ``target``.

    For code that prints to a stream instead of logging (gevent's hub: greenlet errors and
    the monitor thread's blocking reports). A partial line waits for its newline, or for
    ``flush``. No lock: the monitor thread writes whole lines, and a lock here would be
    gevent's in a patched process.
    """

    def __init__(self, target: TextIO, logger: str, level: str = "ERROR"):
        self.target = target
        self.logger = logger
        self.level = level
        self._partial = ""

    def write(self, text: str) -> int:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            self._emit(line)
        return len(text)

    def flush(self) -> None:
        if self._partial:
            line, self._partial = self._partial, ""
            self._emit(line)
        self.target.flush()

    def _emit(self, line: str) -> None:
        if line.strip():
            self.target.write(json_line(self.level, self.logger, line) + "\n")
            self.target.flush()

    def isatty(self) -> bool:
        return False
