"""Human text and ``--json`` output for the client commands.

Pure functions of the wire dicts and the current time (epoch millis), so they are
unit-tested without a coordinator. ``--json`` output is one compact JSON document with
the wire field names, exactly as the coordinator sent them.
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterable, Sequence

MISSING = "-"


def to_json(document: Any) -> str:
    return json.dumps(document, ensure_ascii=False)


def compact(value: Any) -> str:
    """A result object or error on one line; ``-`` for null."""
    if value is None:
        return MISSING
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def age(then_millis: int | None, now_millis: int) -> str:
    """How long ago, coarsely: ``just now``, ``42s ago``, ``5m ago``, ``3h ago``, ``2d ago``."""
    if then_millis is None:
        return MISSING
    seconds = (now_millis - then_millis) // 1000
    if seconds < 1:
        return "just now"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return "%d%s ago" % (seconds // size, unit)
    return "%ds ago" % seconds


def relative(then_millis: int | None, now_millis: int) -> str:
    """Like ``age``, but a time at least a second ahead reads ``in 42s``, ``in 5m``, ``in 3h``, ``in 2d``."""
    if then_millis is None or then_millis - now_millis < 1000:
        return age(then_millis, now_millis)
    seconds = (then_millis - now_millis) // 1000
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return "in %d%s" % (seconds // size, unit)
    return "in %ds" % seconds


def timestamp(millis: int | None, zone: bool = False) -> str:
    """Local time, ``2026-12-01 18:00:00``; with ``zone``, its abbreviation follows (``... UTC``)."""
    if millis is None:
        return MISSING
    return time.strftime("%Y-%m-%d %H:%M:%S %Z" if zone else "%Y-%m-%d %H:%M:%S", time.localtime(millis / 1000))


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Left-aligned columns two spaces apart; the last column is not padded."""
    lines = [list(headers)] + [[MISSING if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(headers))]
    out = []
    for line in lines:
        cells = [cell.ljust(width) for cell, width in zip(line[:-1], widths)] + [line[-1]]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def attempts(job: dict[str, Any]) -> str:
    return "%s/%s" % (job.get("attempts", MISSING), job.get("maxAttempts", MISSING))


def job_detail(job: dict[str, Any], now_millis: int) -> str:
    """One job as labelled lines, for ``status``, ``cancel`` and ``wait``."""
    created = job.get("createdAtMillis")
    updated = job.get("updatedAtMillis")
    rows = [
        ("job", job.get("jobId")),
        ("type", job.get("taskType")),
        ("state", job.get("state")),
        ("priority", job.get("priority")),
        ("attempts", "%s of %s" % (job.get("attempts", MISSING), job.get("maxAttempts", MISSING))),
        ("worker", job.get("workerId")),
        ("result", compact(job.get("result"))),
        ("error", compact(job.get("error"))),
        ("created", "%s (%s)" % (age(created, now_millis), timestamp(created))),
        ("updated", "%s (%s)" % (age(updated, now_millis), timestamp(updated))),
    ]
    run_at = job.get("runAtMillis")
    if run_at is not None:  # only scheduled jobs have one; others keep the lines above
        rows.append(("runs at", "%s (%s)" % (relative(run_at, now_millis), timestamp(run_at, zone=True))))
    return "\n".join("%-9s %s" % (label, MISSING if value is None else value) for label, value in rows)


def job_table(jobs: list[dict[str, Any]], now_millis: int) -> str:
    if not jobs:
        return "no jobs"
    return table(
        ("JOB", "TYPE", "STATE", "PRIORITY", "ATTEMPTS", "WORKER", "UPDATED"),
        (
            (j.get("jobId"), j.get("taskType"), j.get("state"), j.get("priority"), attempts(j),
             j.get("workerId"), age(j.get("updatedAtMillis"), now_millis))
            for j in jobs
        ),
    )


def task_types(worker: dict[str, Any]) -> str:
    """A worker's declared task types, comma-separated; ``-`` when absent (an older coordinator)."""
    types = worker.get("taskTypes")
    if not types:
        return MISSING
    return ",".join(str(t) for t in types)


def worker_table(workers: list[dict[str, Any]], now_millis: int) -> str:
    if not workers:
        return "no live workers"
    return table(
        ("WORKER", "CAPACITY", "ACTIVE", "LAST HEARTBEAT", "TYPES"),
        (
            (w.get("workerId"), w.get("capacity"), w.get("activeJobs"), age(w.get("lastHeartbeatMillis"), now_millis),
             task_types(w))
            for w in workers
        ),
    )


def submitted(job_id: str) -> str:
    return "submitted job %s" % job_id


def cancelled(was_cancelled: bool, job: dict[str, Any]) -> str:
    if was_cancelled:
        return "cancelled job %s" % job.get("jobId")
    return "job %s already %s; nothing to cancel" % (job.get("jobId"), job.get("state"))
