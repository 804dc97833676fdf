"""Human text and ``--json`` output for the client commands.

Pure functions of the wire dicts and the current time (epoch millis), so they are
unit-tested without a coordinator. ``--json`` output is one compact JSON document with
the wire field names, exactly as the coordinator sent them.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterable, Sequence
from zoneinfo import ZoneInfo

MISSING = "-"
LATEST_DATE = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z: a later time has no calendar date here
# Control characters (C0 but newline and tab, DEL, C1): a value that holds one (a Periodic
# func, a name, an error text) must not drive the reader's terminal.
_CONTROL = {c: "\\x%02x" % c for c in list(range(0x20)) + list(range(0x7f, 0xa0)) if c not in (0x09, 0x0a)}


def printable(text: str) -> str:
    """``text`` with every control character but newline and tab shown as ``\\xNN``."""
    return text.translate(_CONTROL)


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
    """Like ``age``, but a time ahead reads ``in 42s``, ``in 5m``, ``in 3h``, ``in 2d``. A time
    ahead counts whole seconds up, so a job due in 5 minutes reads ``in 5m`` a few
    milliseconds later and one due in 2 s reads ``in 2s``, never ``just now``."""
    if then_millis is None or then_millis <= now_millis:
        return age(then_millis, now_millis)
    seconds = -((now_millis - then_millis) // 1000)  # rounded up
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return "in %d%s" % (seconds // size, unit)
    return "in %ds" % seconds


def timestamp(millis: int | None, zone: bool = False, fraction: bool = False) -> str:
    """Local time, ``2026-12-01 18:00:00``; with ``fraction``, milliseconds follow the seconds
    (``18:00:00.250``); with ``zone``, the zone's abbreviation ends it (``... UTC``)."""
    if millis is None:
        return MISSING
    try:
        if millis > LATEST_DATE:
            raise ValueError(millis)
        local = time.localtime(millis // 1000)
    except (OverflowError, ValueError, OSError):
        return undated(millis)
    text = time.strftime("%Y-%m-%d %H:%M:%S", local)
    if fraction:
        text += ".%03d" % (millis % 1000)
    return text + time.strftime(" %Z", local) if zone else text


def when(millis: int | None, now_millis: int) -> str:
    """A moment both ways: ``in 4m (2026-12-24 18:00:00 UTC)``, ``3s ago (...)``."""
    return "%s (%s)" % (relative(millis, now_millis), timestamp(millis, zone=True))


def offset(millis: int, origin: int) -> str:
    """Seconds from ``origin`` with millisecond precision: ``+0.000s``, ``+1.204s``, ``-0.500s``."""
    delta = millis - origin
    return "%s%d.%03ds" % ("-" if delta < 0 else "+", abs(delta) // 1000, abs(delta) % 1000)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Left-aligned columns two spaces apart; the last column is not padded."""
    lines = [list(headers)] + [[MISSING if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(headers))]
    out = []
    for line in lines:
        cells = [cell.ljust(width) for cell, width in zip(line[:-1], widths)] + [line[-1]]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def _max_attempts(job: dict[str, Any]) -> Any:
    """maxAttempts; a Periodic job's 0 means no limit."""
    if job.get("protocol") == "periodic" and job.get("maxAttempts") == 0:
        return "unlimited"
    return job.get("maxAttempts", MISSING)


def attempts(job: dict[str, Any]) -> str:
    return "%s/%s" % (job.get("attempts", MISSING), _max_attempts(job))


def last_assignment(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The job's last ASSIGNED event that names a worker, in its timeline, or None."""
    for event in reversed(events):
        if event.get("event") == "ASSIGNED" and event.get("workerId") is not None:
            return event
    return None


def last_worker(events: list[dict[str, Any]]) -> str | None:
    """``w-1 (attempt 2)``: the worker of the job's last assignment in its timeline, or None."""
    event = last_assignment(events)
    if event is None:
        return None
    attempt = event.get("attempt")
    return str(event["workerId"]) if attempt is None else "%s (attempt %s)" % (event["workerId"], attempt)


def progress(job: dict[str, Any]) -> str | None:
    """``42% compressing chunk 7``: a running job's last progress report (its snapshot's
    ``progress``) on one line, the percentage rounded down; None without one."""
    report = job.get("progress")
    if job.get("state") != "RUNNING" or not isinstance(report, dict):
        return None
    fraction = report.get("fraction")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        return None
    text = "%d%%" % math.floor(fraction * 100 + 1e-9)  # 0.29 is 29%, not 28% (0.29 * 100 < 29)
    message = report.get("message")
    if isinstance(message, str) and message.strip():
        text += " " + " ".join(message.split())
    return text


def watch_line(job: dict[str, Any], now_millis: int) -> str:
    """What ``wait`` shows on a terminal while the job runs: ``job J RUNNING 42% compressing
    chunk 7``, or why it waits."""
    shown = progress(job)
    if shown is None and job.get("waitingReason") is not None:
        shown = waiting(job, now_millis)
    return " ".join(str(part) for part in ("job", job.get("jobId"), job.get("state"), shown) if part is not None)


def job_detail(job: dict[str, Any], now_millis: int, workers: list[dict[str, Any]] | None = None,
               events: list[dict[str, Any]] | None = None, held: Held | None = None,
               waiting_on: list[str] | None = None) -> str:
    """One job as labelled lines, for ``status``, ``cancel`` and ``wait``; ``workers``,
    ``held`` and ``waiting_on`` as for ``waiting``. The snapshot names a worker only while the
    job runs; with ``events`` (its timeline) a job that is not running shows the worker of
    its last attempt. A workflow's job names its workflow and its ref there."""
    created = job.get("createdAtMillis")
    updated = job.get("updatedAtMillis")
    rows = [
        ("job", job.get("jobId")),
        ("type", job.get("taskType")),
        ("state", job.get("state")),
        ("priority", job.get("priority")),
        ("attempts", "%s of %s" % (job.get("attempts", MISSING), _max_attempts(job))),
        ("worker", job.get("workerId") or (last_worker(events) if events else None)),
        ("result", compact(job.get("result"))),
        ("error", compact(job.get("error"))),
        ("created", when(created, now_millis)),
        ("updated", when(updated, now_millis)),
    ]
    # The lines below appear only when they apply, so other jobs read as before.
    if job.get("retryOf") is not None:
        rows.insert(1, ("retry of", job["retryOf"]))
    if job.get("protocol") == "periodic":  # a Periodic job: its func is the type; show its name
        rows.insert(rows.index(("type", job.get("taskType"))) + 1, ("name", "%s (Periodic)" % job.get("name")))
    if job.get("waitingReason") is not None:
        rows.insert(rows.index(("state", job.get("state"))) + 1,
                    ("waiting", waiting(job, now_millis, workers, held, waiting_on)))
    keys = job_keys(job)
    if keys is not None:
        rows.insert(rows.index(("priority", job.get("priority"))), ("keys", keys))
    shown = progress(job)
    if shown is not None:  # a running job's last report
        rows.insert(rows.index(("state", job.get("state"))) + 1, ("progress", shown))
    if job.get("submittedBy") is not None:  # the token's name, with --auth-file
        rows.insert(rows.index(("created", when(created, now_millis))), ("submitter", job["submittedBy"]))
    if job.get("workflowId") is not None:
        rows.insert(1, ("workflow", "%s (ref %s)" % (job["workflowId"], job.get("ref"))))
    if job.get("scheduleName") is not None:
        rows.insert(1, ("schedule", "%s, fire time %s" % (job["scheduleName"], timestamp(job.get("scheduledFor"),
                                                                                          zone=True))))
    run_at = job.get("runAtMillis")
    if run_at is not None:
        rows.append(("runs at", when(run_at, now_millis)))
    retry_at = job.get("retryAtMillis")
    if retry_at is not None:
        rows.append(("retry at", when(retry_at, now_millis)))
    return "\n".join("%-9s %s" % (label, MISSING if value is None else value) for label, value in rows)


def runs_job(worker: dict[str, Any], job: dict[str, Any]) -> bool:
    """Whether the worker declared the job's type (its func, for a Periodic job and worker)."""
    return (worker.get("protocol", "json") == job.get("protocol", "json")
            and job.get("taskType") in (worker.get("taskTypes") or ()))


def job_keys(job: dict[str, Any]) -> str | None:
    """``concurrency acme, unique report-7``: the job's keys, None when it has neither."""
    keys = [(name, job.get(field)) for name, field in (("concurrency", "concurrencyKey"), ("unique", "uniqueKey"))]
    shown = ["%s %s" % (name, value) for name, value in keys if value is not None]
    return ", ".join(shown) or None


@dataclass(frozen=True)
class Held:
    """What a job held back by a limit waits on: its type's limit (a LIMIT's dict) and, for
    a per-key limit, how many jobs of the type with the job's key are running."""

    limit: dict[str, Any]
    running_for_key: int | None = None


LIMIT_REASONS = ("TYPE_PAUSED", "CONCURRENCY_LIMIT", "KEY_CONCURRENCY_LIMIT", "RATE_LIMIT")


def rate(per_second: Any) -> str:
    """``10 starts a second``, ``1 start a second``, ``0.5 starts a second``."""
    return "%s start%s a second" % (number(per_second), "" if per_second == 1 else "s")


def number(value: Any) -> str:
    """A count or a rate without a needless fraction: ``10``, ``0.5``; ``-`` for null."""
    if value is None:
        return MISSING
    return "%g" % value if isinstance(value, float) else str(value)


def held_back(job: dict[str, Any], held: Held | None) -> str:
    """Why a limit holds the job back, in words; with ``held`` (its type's limit, fetched
    by the caller) the figures too: ``3 of 3 EXPORT jobs for key acme are running``."""
    reason = job.get("waitingReason")
    task_type = job.get("taskType")
    key = job.get("concurrencyKey")
    limit = held.limit if held is not None else {}
    if reason == "TYPE_PAUSED":
        return "%s is paused (jobmesh resume %s starts its jobs again)" % (task_type, task_type)
    if reason == "CONCURRENCY_LIMIT":
        if limit.get("maxRunning") is None:
            return "as many %s jobs are running as its limit allows" % task_type
        return "%s of %s %s jobs are running" % (number(limit.get("running")), number(limit["maxRunning"]), task_type)
    if reason == "KEY_CONCURRENCY_LIMIT":
        running = None if held is None else held.running_for_key
        if limit.get("maxRunningPerKey") is None or running is None:
            return "as many %s jobs for key %s are running as its limit allows" % (task_type, key)
        return "%d of %s %s jobs for key %s are running" % (running, number(limit["maxRunningPerKey"]), task_type, key)
    # RATE_LIMIT: the type's rate, its rate per key, or both
    rates = []
    if limit.get("ratePerSecond") is not None:
        rates.append(rate(limit["ratePerSecond"]))
    if limit.get("ratePerKeyPerSecond") is not None and key is not None:
        rates.append("%s for key %s" % (rate(limit["ratePerKeyPerSecond"]), key))
    return "rate limit: %s" % (", ".join(rates) if rates else "%s starts as fast as its limit allows" % task_type)


def waiting(job: dict[str, Any], now_millis: int, workers: list[dict[str, Any]] | None = None,
            held: Held | None = None, waiting_on: list[str] | None = None) -> str:
    """Why a job is not running, in words (its ``waitingReason``).

    ``workers`` (a WORKER_LIST, when the caller fetched one) gives WORKERS_BUSY its counts:
    the workers that declared the job's type, their slots in use and in all. ``held``
    gives a limit's reason its figures (``held_back``); ``waiting_on``, DEPENDENCIES the
    refs of the workflow's jobs it waits for.
    """
    reason = job.get("waitingReason")
    task_type = job.get("taskType")
    if reason in LIMIT_REASONS:
        return held_back(job, held)
    if reason == "DEPENDENCIES":
        if waiting_on:
            return "waiting for dependencies: %s" % refs(waiting_on, DEPENDENCIES_SHOWN)
        return "waiting for its dependencies in workflow %s" % job.get("workflowId")
    if reason == "SCHEDULED":
        return "scheduled: runs %s" % when(job.get("runAtMillis"), now_millis)
    if reason == "RETRY_BACKOFF":
        return "retry backoff: next attempt %s" % when(job.get("retryAtMillis"), now_millis)
    if reason == "NO_WORKER":
        return "no worker is connected"
    if reason == "NO_WORKER_FOR_TYPE":
        return "no connected worker runs %s" % task_type
    if reason == "WORKERS_BUSY":
        able = [w for w in workers or () if runs_job(w, job)]
        if not able:
            return "every worker that runs %s is busy" % task_type
        slots = "(%d/%d slots)" % (sum(w.get("activeJobs") or 0 for w in able), sum(w.get("capacity") or 0 for w in able))
        if len(able) == 1:
            return "the one worker that runs %s is busy %s" % (task_type, slots)
        return "all %d workers that run %s are busy %s" % (len(able), task_type, slots)
    if reason == "BEHIND_OTHER_JOBS":
        return "behind other queued jobs"
    if reason == "LOCK_WAIT":
        return "waiting for a lock another job of that lock holds (Periodic ACQUIRE)"
    return MISSING if reason is None else str(reason)


def event_table(events: list[dict[str, Any]]) -> str:
    """A job's timeline, oldest first: time from the first event, wall-clock time, event,
    attempt, the worker of that attempt, and the detail (with the retry time, if any)."""
    if not events:
        return "no events"
    origin = events[0].get("atMillis") or 0
    worker_of: dict[Any, Any] = {}  # attempt (number or id) -> the worker it was assigned to
    rows = []
    for event in events:
        at = event.get("atMillis") or 0
        attempt, attempt_id, worker = event.get("attempt"), event.get("attemptId"), event.get("workerId")
        keys = [key for key in (attempt_id, attempt) if key is not None]
        if worker is not None:
            worker_of.update((key, worker) for key in keys)
        else:
            worker = next((worker_of[key] for key in keys if key in worker_of), None)
        detail = [] if event.get("detail") is None else [compact(event["detail"])]
        if event.get("retryAtMillis") is not None:
            retry_at = event["retryAtMillis"]
            detail.append("retry at %s (%s)" % (timestamp(retry_at, zone=True, fraction=True), offset(retry_at, origin)))
        rows.append((offset(at, origin), timestamp(at, zone=True, fraction=True), event.get("event"), attempt,
                     worker, "; ".join(detail) or None))
    return table(("AT", "TIME", "EVENT", "ATTEMPT", "WORKER", "DETAIL"), rows)


def job_table(jobs: list[dict[str, Any]], now_millis: int, last_workers: dict[str, str] | None = None) -> str:
    """``list``: one job a row. The snapshot names a worker only while the job runs;
    ``last_workers`` (jobId -> workerId, from the timelines) names the worker of the last
    attempt of the others."""
    if not jobs:
        return "no jobs"
    ran = last_workers or {}
    return table(
        ("JOB", "TYPE", "STATE", "PRIORITY", "ATTEMPTS", "WORKER", "UPDATED"),
        (
            (j.get("jobId"), j.get("taskType"), j.get("state"), j.get("priority"), attempts(j),
             j.get("workerId") or ran.get(j.get("jobId") or ""), updated_cell(j.get("updatedAtMillis"), now_millis))
            for j in jobs
        ),
    )


def updated_cell(millis: int | None, now_millis: int) -> str:
    """``2026-12-01 18:55:32 UTC (3s ago)``: the time in its zone, then how long ago."""
    if millis is None:
        return MISSING
    return "%s (%s)" % (timestamp(millis, zone=True), age(millis, now_millis))


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
             task_types(w) + (" (periodic)" if w.get("protocol") == "periodic" else ""))
            for w in workers
        ),
    )


def submitted(job_id: str) -> str:
    return "submitted job %s" % job_id


def resubmitted(job: dict[str, Any], key: str) -> str:
    """A keyed submit that found its job already there: nothing new was created."""
    return "job %s was already submitted with idempotency key %s at %s (%s); no new job" % (
        job["jobId"], printable(repr(key)), timestamp(job.get("createdAtMillis"), zone=True), job.get("state"))


def duplicate(job_id: str, unique_key: str) -> str:
    """A submit with a unique key that a job not yet finished holds: nothing new was made."""
    return "job %s is already active with unique key %s; no new job" % (job_id, unique_key)


def retried(new_job_id: str, old_job_id: str) -> str:
    return "submitted job %s (retry of %s)" % (new_job_id, old_job_id)


def cancelled(was_cancelled: bool, job: dict[str, Any]) -> str:
    if was_cancelled:
        return "cancelled job %s" % job.get("jobId")
    return "job %s already %s; nothing to cancel" % (job.get("jobId"), job.get("state"))


# ---- recurring schedules ----------------------------------------------------------------


def zoned(millis: int | None, zone_name: str) -> str:
    """A fire time as the schedule's zone reads it: ``2026-10-25 02:30:00 CEST``."""
    if millis is None:
        return MISSING
    if millis > LATEST_DATE:
        return undated(millis)
    try:
        zone = ZoneInfo(zone_name)
    except (ValueError, KeyError, OSError):
        zone = ZoneInfo("UTC")
    for tz in (zone, timezone.utc):  # in UTC when the zone's date would pass the year 9999
        try:
            return datetime.fromtimestamp(millis / 1000, tz).strftime("%Y-%m-%d %H:%M:%S %Z")
        except (OverflowError, ValueError, OSError):
            continue
    return undated(millis)


def undated(millis: int) -> str:
    """A time no calendar date here can show (after the year 9999): its epoch milliseconds."""
    return "%s%d ms since 1970" % ("after 9999-12-31: " if millis > LATEST_DATE else "", millis)


def rule(schedule: dict[str, Any]) -> str:
    """``cron '0 3 * * *' Europe/Paris`` or ``every 30000 ms``."""
    if schedule.get("cron") is not None:
        return "cron %r %s" % (schedule["cron"], schedule.get("timezone"))
    return "every %s ms" % schedule.get("everyMillis")


def schedule_table(schedules: list[dict[str, Any]], now_millis: int) -> str:
    if not schedules:
        return "no schedules"
    return table(
        ("NAME", "RULE", "TYPE", "NEXT FIRE", "LAST JOB", "STATE", "FIRED", "SKIPPED", "MISSED"),
        ((s.get("name"), rule(s), s.get("taskType"),
          "paused" if s.get("paused") else when(s.get("nextFireMillis"), now_millis),
          s.get("lastJobId"), s.get("lastJobState"), s.get("firedCount"), s.get("skippedCount"),
          s.get("missedCount")) for s in schedules),
    )


def schedule_detail(schedule: dict[str, Any], upcoming: list[int], now_millis: int) -> str:
    """``show``: the schedule, its next fire times, and its last jobs with their states."""
    tz = str(schedule.get("timezone") or "UTC")
    rows = [
        ("schedule", schedule.get("name")),
        ("rule", rule(schedule)),
        ("job", "%s %s, priority %s, %s attempts" % (schedule.get("taskType"), compact(schedule.get("payload")),
                                                     schedule.get("priority"), schedule.get("maxAttempts"))),
        ("policies", "missed=%s (window %s ms), overlap=%s, jitter %s ms" % (
            schedule.get("missed"), schedule.get("catchupWindowMillis"), schedule.get("overlap"),
            schedule.get("jitterMillis"))),
        ("state", "paused" if schedule.get("paused") else "active"),
        ("made by", schedule.get("origin")),
        ("created", when(schedule.get("createdAtMillis"), now_millis)),
        ("last fire", zoned(schedule.get("lastFireMillis"), tz)),
        ("counts", "%s fired, %s skipped, %s missed" % (schedule.get("firedCount"), schedule.get("skippedCount"),
                                                        schedule.get("missedCount"))),
    ]
    out = ["%-9s %s" % (label, MISSING if value is None else value) for label, value in rows]
    out.append("next fire times:" if upcoming else "next fire times: none (paused)")
    out.extend("  %s  (%s)" % (zoned(t, tz), relative(t, now_millis)) for t in upcoming)
    recent = schedule.get("recentJobs") or []
    out.append("last jobs:" if recent else "last jobs: none yet")
    out.extend("  %s  %s  for %s" % (j.get("jobId"), j.get("state") or "purged", zoned(j.get("scheduledFor"), tz))
               for j in reversed(recent))
    return "\n".join(out)


def fire_times(times: list[int], zone_name: str) -> str:
    """``preview``: one fire time a line, in the zone, with its epoch milliseconds."""
    if not times:
        return "no fire times"
    return "\n".join("%s  %d" % (zoned(t, zone_name), t) for t in times)


# ---- limits -----------------------------------------------------------------------------


def limit_rules(limit: dict[str, Any]) -> str:
    """A type's limits in words: ``at most 5 running, 2 per key; 10 starts a second (burst 10)``."""
    parts = []
    if limit.get("maxRunning") is not None:
        parts.append("at most %s running" % number(limit["maxRunning"]))
    if limit.get("maxRunningPerKey") is not None:
        parts.append("at most %s running per key" % number(limit["maxRunningPerKey"]))
    if limit.get("ratePerSecond") is not None:
        parts.append("%s (burst %s)" % (rate(limit["ratePerSecond"]), number(limit.get("burst"))))
    if limit.get("ratePerKeyPerSecond") is not None:
        parts.append("%s per key" % rate(limit["ratePerKeyPerSecond"]))
    return "; ".join(parts) or "no limit"


def limit_state(limit: dict[str, Any]) -> str:
    return "PAUSED" if limit.get("paused") else "active"


def limit_table(limits: list[dict[str, Any]]) -> str:
    """``limit list``: one type a row, its limits, running and queued jobs, and its state."""
    if not limits:
        return "no limits (jobmesh limit set TASK_TYPE --max-running=N adds one)"
    return table(
        ("TYPE", "STATE", "MAX RUNNING", "PER KEY", "RATE/S", "BURST", "RATE/S PER KEY", "RUNNING", "QUEUED"),
        ((lim.get("taskType"), limit_state(lim), number(lim.get("maxRunning")), number(lim.get("maxRunningPerKey")),
          number(lim.get("ratePerSecond")), number(lim.get("burst")), number(lim.get("ratePerKeyPerSecond")),
          number(lim.get("running")), number(lim.get("queued"))) for lim in limits),
    )


def limit_detail(limit: dict[str, Any]) -> str:
    """``limit show`` (and what ``set``, ``rm``, ``pause`` and ``resume`` leave): labelled lines."""
    rows = [
        ("type", limit.get("taskType")),
        ("state", "PAUSED: no new job starts; running jobs go on" if limit.get("paused") else "active"),
        ("limits", limit_rules(limit)),
        ("jobs", "%s running, %s queued" % (number(limit.get("running")), number(limit.get("queued")))),
    ]
    return "\n".join("%-9s %s" % (label, MISSING if value is None else value) for label, value in rows)


# ---- workflows --------------------------------------------------------------------------

WORKFLOW_ROWS = 100  # jobs a workflow's text lists at most
DEPENDS_SHOWN = 3  # refs a job's line names of those it depends on
DEPENDENCIES_SHOWN = 20  # refs ``status`` names of those a job waits for
# The order ``workflow status`` counts jobs by state in: what moves first.
STATE_ORDER = ("RUNNING", "QUEUED", "SCHEDULED", "RETRY_WAIT", "WAITING", "COMPLETED", "FAILED", "CANCELLED")


def workflow_jobs(workflow: dict[str, Any]) -> list[dict[str, Any]]:
    """A WORKFLOW's jobs, each ``{ref, jobId, state, dependsOn}`` (anything else left out)."""
    jobs = workflow.get("jobs")
    return [job for job in jobs if isinstance(job, dict)] if isinstance(jobs, list) else []


def refs(names: Sequence[Any], shown: int) -> str:
    """``a, b, c`` or ``a, b, c +7 more``; ``-`` for none."""
    if not names:
        return MISSING
    text = ", ".join(str(name) for name in names[:shown])
    return text + (" +%d more" % (len(names) - shown) if len(names) > shown else "")


def state_counts(jobs: list[dict[str, Any]]) -> str:
    """``12 jobs: 1 RUNNING, 8 WAITING, 3 COMPLETED``."""
    counts = Counter(str(job.get("state")) for job in jobs)
    order = [s for s in STATE_ORDER if s in counts] + sorted(set(counts) - set(STATE_ORDER))
    return "%d job%s%s" % (len(jobs), "" if len(jobs) == 1 else "s",
                           ": " + ", ".join("%d %s" % (counts[s], s) for s in order) if jobs else "")


def workflow_detail(workflow: dict[str, Any], rows: int = WORKFLOW_ROWS) -> str:
    """A workflow as labelled lines, then a line per job (ref, state, jobId, what it depends
    on). A workflow of more than ``rows`` jobs lists only the jobs not COMPLETED, at most
    ``rows`` of them, and says how many it left out."""
    jobs = workflow_jobs(workflow)
    head = [("workflow", workflow.get("workflowId")), ("name", workflow.get("name")),
            ("state", workflow.get("state")), ("jobs", state_counts(jobs))]
    out = ["%-9s %s" % (label, MISSING if value is None else value) for label, value in head]
    listed = jobs if len(jobs) <= rows else [j for j in jobs if j.get("state") != "COMPLETED"]
    completed_left = len(jobs) - len(listed)
    more = max(0, len(listed) - rows)
    if listed:
        out.append(table(("REF", "STATE", "JOB", "DEPENDS ON"),
                         ((j.get("ref"), j.get("state"), j.get("jobId"), refs(_listed(j.get("dependsOn")), DEPENDS_SHOWN))
                          for j in listed[:rows])))
    left = []
    if completed_left:
        left.append("%d COMPLETED job%s" % (completed_left, "" if completed_left == 1 else "s"))
    if more:
        left.append("%d more" % more)
    if left:
        out.append("(not listed: %s; --json lists every job)" % " and ".join(left))
    return "\n".join(out)


def workflow_failures(workflow: dict[str, Any]) -> str:
    """``: failed: a, b; cancelled: c +3 more`` for a workflow that did not complete."""
    parts = []
    for state in ("FAILED", "CANCELLED"):
        found = [j.get("ref") for j in workflow_jobs(workflow) if j.get("state") == state]
        if found:
            parts.append("%s: %s" % (state.lower(), refs(found, DEPENDS_SHOWN)))
    return ": " + "; ".join(parts) if parts else ""


def workflow_submitted(workflow_id: str, jobs: int) -> str:
    return "submitted workflow %s (%d job%s)" % (workflow_id, jobs, "" if jobs == 1 else "s")


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []
