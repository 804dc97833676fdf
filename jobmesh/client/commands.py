"""The client commands: submit, status, list, workers, cancel, wait, events, retry, purge,
schedule, limit, pause, resume and workflow (``top`` is in top.py).

Each handler takes a connected-on-demand ``CoordinatorClient``, docopt's dict and a
``Console``, writes its output (text, or one JSON document with ``--json``) through the
console and returns the exit code the contract names (README.md, "Command line"). This
module never touches the process's streams: ``cli.py`` supplies the console. Bad flag
values raise ``ConfigError`` before anything is sent; ``cli.main`` turns that into exit 2.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Callable, TextIO

from jobmesh.addresses import parse_addresses
from jobmesh.auth import read_token, roles_for, token_file_of, warn_if_exposed
from jobmesh.canvas import CanvasError
from jobmesh.client import render, top
from jobmesh.client.api import EPOCH, CoordinatorClient, WaitTimeout, submit_request
from jobmesh.errors import ClientError, ConfigError, CoordinatorUnavailable, InvalidRequest, RequestFailed, SubmitRejected
from jobmesh.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_TIMEOUT, EXIT_UNREACHABLE, EXIT_USAGE
from jobmesh.protocol import messages as m
from jobmesh.protocol.jobs import JobState, Priority
from jobmesh.protocol.payloads import TASK_TYPES

MAX_PAGE = 1000
MAX_KEY = 256  # characters of a --concurrency-key or --unique-key
AUTO_KEY_PREFIX = "cli-"  # the idempotency key submit adds when given none
AUTH_REFUSALS = ("authentication required", "authentication failed")  # the coordinator's words
_EPOCH_MILLIS = re.compile(r"[+-]?[0-9]+")
RUN_AT_FORMS = "epoch milliseconds or an ISO 8601 time such as 2026-12-24T18:00:00Z"
EPOCH_SECONDS_2000 = 946_684_800  # 2000-01-01T00:00:00Z: a --run-at number below this many ms is a mistake
EPOCH_MILLIS_2000 = EPOCH_SECONDS_2000 * 1000
_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h|d)?")
DURATION_UNITS = {None: 1, "ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
DURATION_FORMS = "a number with a unit (90s, 15m, 12h, 7d) or plain milliseconds"


@dataclass(frozen=True)
class Console:
    """Where a command's output goes: the process's streams (``cli.py``) or a test's StringIO."""

    stdout: TextIO
    stderr: TextIO
    stdin: TextIO | None = None

    def out(self, text: str) -> None:
        """A line of output; control characters in it are shown escaped (``render.printable``)."""
        self.stdout.write(render.printable(text) + "\n")
        self.stdout.flush()

    def terminal(self) -> bool:
        """Whether the output goes to a terminal."""
        isatty = getattr(self.stdout, "isatty", None)
        return isatty is not None and bool(isatty())

    def screen(self, codes: str, text: str) -> None:
        """Terminal ``codes`` of our own (``top``'s clear-screen), then a line of output; into
        a pipe or a file, only the line (codes are for a terminal)."""
        self.stdout.write((codes if self.terminal() else "") + render.printable(text) + "\n")
        self.stdout.flush()

    def live(self, text: str | None) -> None:
        """A line redrawn in place (``wait``'s progress), cut to the terminal's width so it
        never wraps; None erases it. Only for a terminal: callers check ``terminal()``."""
        line = "" if text is None else render.printable(text)[: max(1, shutil.get_terminal_size().columns - 1)]
        self.stdout.write("\r\x1b[K" + line)
        self.stdout.flush()

    def error(self, command: str, text: str) -> None:
        """One line on stderr, named after the command: ``jobmesh COMMAND: TEXT``."""
        self.stderr.write("jobmesh %s: %s\n" % (command, render.printable(text)))
        self.stderr.flush()


def _now_millis() -> int:
    return int(time.time() * 1000)


def _int_flag(args: dict[str, Any], flag: str, low: int) -> int:
    raw = args[flag]
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ConfigError("%s must be an integer, got %r" % (flag, raw)) from None
    if value < low:
        raise ConfigError("%s must be >= %d, got %d" % (flag, low, value))
    return value


def _priority_flag(args: dict[str, Any]) -> Priority:
    try:
        return Priority.parse(str(args["--priority"]).upper())
    except ValueError as exc:
        raise ConfigError("--priority: %s" % exc) from None


def _timeout_seconds(args: dict[str, Any]) -> float | None:
    millis = _int_flag(args, "--timeout-millis", 0)
    return None if millis == 0 else millis / 1000.0


def parse_payload(text: str | None, stdin: TextIO | None = None) -> dict[str, Any]:
    """PAYLOAD_JSON as a dict: absent means ``{}``, ``-`` reads stdin; ConfigError if not an object."""
    if text is None:
        return {}
    source = "PAYLOAD_JSON"
    if text == "-":
        if stdin is None:
            raise ConfigError("PAYLOAD_JSON is -, but there is no stdin to read it from")
        text = stdin.read()
        source = "the payload on stdin"
    try:
        payload = json.loads(text)
    except ValueError as exc:
        raise ConfigError("%s is not valid JSON (%s): %r" % (source, exc, text[:200])) from None
    if not isinstance(payload, dict):
        raise ConfigError("%s must be a JSON object like {\"text\": \"...\"}, got %r" % (source, text[:200]))
    return payload


def parse_run_at(text: str, flag: str = "--run-at") -> datetime:
    """``--run-at``: epoch milliseconds, or ISO 8601 (no zone: local time) -> an aware datetime.

    ConfigError for anything else, and for a time before the epoch.
    """
    raw = text.strip()
    try:
        if _EPOCH_MILLIS.fullmatch(raw):
            millis = int(raw)
            if millis < 0:
                raise ConfigError("%s must not be negative, got %s" % (flag, raw))
            if millis < EPOCH_MILLIS_2000:
                hint = (" (%s looks like epoch seconds: %s000 is that time in milliseconds)" % (raw, raw)
                        if EPOCH_SECONDS_2000 <= millis < 10**11 else "")
                raise ConfigError("%s in epoch milliseconds must be after 2000-01-01, got %s%s" % (flag, raw, hint))
            return EPOCH + timedelta(milliseconds=millis)
        when = datetime.fromisoformat(raw)
        if when.tzinfo is None:
            when = when.astimezone()  # a naive time is local time
    except (ValueError, OverflowError):
        raise ConfigError("%s must be %s, got %r" % (flag, RUN_AT_FORMS, text)) from None
    if when < EPOCH:
        raise ConfigError("%s must not be before 1970-01-01T00:00:00Z, got %r" % (flag, text))
    return when


def parse_duration_millis(text: str, flag: str = "--older-than") -> int:
    """``90s``, ``15m``, ``12h``, ``7d``, ``500ms`` or plain milliseconds (``5000``) as milliseconds.

    A fraction needs a unit (``1.5h``). ConfigError, naming ``flag``, for anything else.
    """
    match = _DURATION.fullmatch(str(text).strip().lower())
    if match is None or (match[2] is None and "." in match[1]):
        raise ConfigError("%s must be %s, got %r" % (flag, DURATION_FORMS, text))
    return round(float(match[1]) * DURATION_UNITS[match[2]])


def schedule_options(args: dict[str, Any]) -> dict[str, Any]:
    """``--delay-millis`` / ``--run-at`` as ``CoordinatorClient.submit`` keywords (at most one)."""
    delay, run_at = args.get("--delay-millis"), args.get("--run-at")
    if delay is not None and run_at is not None:
        raise ConfigError("give --delay-millis or --run-at, not both")
    if delay is not None:
        return {"delay": timedelta(milliseconds=_int_flag(args, "--delay-millis", 0))}
    if run_at is not None:
        return {"run_at": parse_run_at(run_at)}
    return {}


def task_type_name(text: str) -> str:
    """A built-in in any case means the built-in (``sleep`` is SLEEP); other names are case-sensitive."""
    upper = text.upper()
    return upper if upper in TASK_TYPES else text


def _stopped_running(job: dict[str, Any]) -> bool:
    """Whether the job had an attempt but runs none now: its snapshot, which names a worker
    only while RUNNING, does not say who ran the last one; its timeline does."""
    return job.get("workerId") is None and bool(job.get("attempts"))


def _timeline(client: CoordinatorClient, job_id: str) -> list[dict[str, Any]]:
    """The job's timeline, or none if it is gone (purged since its snapshot was read)."""
    try:
        return client.events(job_id)
    except RequestFailed:
        return []


def _show_job(client: CoordinatorClient, console: Console, job: dict[str, Any], as_json: bool,
              **extra: Any) -> None:
    if as_json:
        console.out(render.to_json(dict(job, **extra)))
    else:
        timeline = _timeline(client, job["jobId"]) if _stopped_running(job) else None
        console.out(render.job_detail(job, _now_millis(), events=timeline))


def _last_workers(client: CoordinatorClient, jobs: list[dict[str, Any]]) -> dict[str, str]:
    """jobId -> the worker of its last attempt, for each job that has stopped running."""
    found = {}
    for job in jobs:
        if _stopped_running(job):
            event = render.last_assignment(_timeline(client, job["jobId"]))
            if event is not None:
                found[job["jobId"]] = str(event["workerId"])
    return found


def _await(command: str, client: CoordinatorClient, console: Console, job_id: str, timeout: float | None,
           as_json: bool) -> int:
    """Wait for the job, print its final snapshot, and map its end state to an exit code.
    On a terminal (and not ``--json``), a line shows the job meanwhile: its state and progress."""
    try:
        job = _watch(client, console, job_id, timeout, as_json)
    except WaitTimeout as exc:
        _show_job(client, console, exc.job, as_json)
        console.error(command, "timed out: %s" % exc)
        return EXIT_TIMEOUT
    _show_job(client, console, job, as_json)
    if job.get("state") == JobState.COMPLETED.value:
        return EXIT_OK
    console.error(command, "job %s ended %s: %s"
                  % (job_id, job.get("state"), job.get("error") or "no error recorded"))
    return EXIT_FAILED


def _watch(client: CoordinatorClient, console: Console, job_id: str, timeout: float | None,
           as_json: bool) -> dict[str, Any]:
    """``client.wait``, with the live line on a terminal, erased before anything else is written."""
    if as_json or not console.terminal():
        return client.wait(job_id, timeout=timeout)
    try:
        return client.wait(job_id, timeout=timeout,
                           on_snapshot=lambda job: console.live(render.watch_line(job, _now_millis())))
    finally:
        console.live(None)


# ---- handlers ---------------------------------------------------------------------------


def submit(client: CoordinatorClient, args: dict[str, Any], console: Console) -> int:
    task_type = task_type_name(str(args["TASK_TYPE"]))
    priority = _priority_flag(args)
    max_attempts = _int_flag(args, "--max-attempts", 0)
    retries = _int_flag(args, "--submit-retries", 0)
    timeout = _timeout_seconds(args)
    schedule = schedule_options(args)
    payload = parse_payload(args["PAYLOAD_JSON"], console.stdin)
    as_json = args["--json"]
    key = args["--idempotency-key"]
    # The reply to a repeated keyed submit is the first one's, by design; the text output
    # tells a repeat of the user's own key apart by the job's age on the coordinator's clock.
    asked_at = client.stats().at_millis if key is not None and not as_json else None
    if key is None:
        # A key of our own makes the submit safe to send again: when the connection is lost
        # before the reply (a takeover), the client sends it once more round the address
        # list, and the coordinator that already made the job answers with it.
        key = AUTO_KEY_PREFIX + secrets.token_hex(16)
    unique_key = _key_flag(args, "--unique-key")
    try:
        reply = client.send_submit(submit_request(task_type, payload, max_attempts, priority.value, key,
                                                  concurrency_key=_key_flag(args, "--concurrency-key"),
                                                  unique_key=unique_key, **schedule), retries)
    except SubmitRejected as exc:
        console.error("submit", "rejected, the coordinator is overloaded: %s%s"
                      % (exc, "; try --submit-retries=N" if exc.retryable and not retries else ""))
        return EXIT_FAILED
    job_id = reply.job_id
    if not as_json:
        earlier = None
        if asked_at is not None and not reply.duplicate:
            job = client.status(job_id)
            earlier = job if job["createdAtMillis"] < asked_at else None
        if reply.duplicate:
            console.out(render.duplicate(job_id, str(unique_key)))
        else:
            console.out(render.submitted(job_id) if earlier is None else render.resubmitted(earlier, key))
    if not args["--wait"]:
        if as_json:
            # {"jobId": ...} as the contract prints it, with "duplicate" only when it is one
            console.out(render.to_json(dict({"jobId": job_id}, **({"duplicate": True} if reply.duplicate else {}))))
        return EXIT_OK
    try:
        return _await("submit", client, console, job_id, timeout, as_json)
    except CoordinatorUnavailable as exc:
        raise CoordinatorUnavailable("job %s was submitted, then: %s" % (job_id, exc)) from exc


def status(client: CoordinatorClient, args: dict[str, Any], console: Console) -> int:
    job = client.status(args["JOB_ID"])
    if args["--json"]:
        console.out(render.to_json(job))
        return EXIT_OK
    # Busy workers are worth counting: say how many run the type and how full they are.
    found = client.workers() if job.get("waitingReason") == "WORKERS_BUSY" else None
    timeline = _timeline(client, job["jobId"]) if _stopped_running(job) else None
    console.out(render.job_detail(job, _now_millis(), found, timeline, _held(client, job), _waiting_on(client, job)))
    return EXIT_OK


def _waiting_on(client: CoordinatorClient, job: dict[str, Any]) -> list[str] | None:
    """For a workflow's job waiting for its dependencies, the refs of those not yet
    COMPLETED (from its workflow: the snapshot names the workflow, not the dependencies)."""
    if job.get("waitingReason") != "DEPENDENCIES" or not isinstance(job.get("workflowId"), str):
        return None
    try:
        workflow = client.workflow_status(job["workflowId"])
    except RequestFailed:  # a courtesy, as _held's figures are
        return None
    jobs = render.workflow_jobs(workflow)
    states = {j.get("ref"): j.get("state") for j in jobs}
    mine = next((j for j in jobs if j.get("jobId") == job.get("jobId")), None)
    if mine is None or not isinstance(mine.get("dependsOn"), list):
        return None
    return [str(ref) for ref in mine["dependsOn"] if states.get(ref) != JobState.COMPLETED.value]


def _held(client: CoordinatorClient, job: dict[str, Any]) -> render.Held | None:
    """For a job a limit holds back, its type's limit, and for a per-key limit how many jobs
    with its key run (counted over the type's RUNNING jobs, as few as its workers' slots)."""
    reason = job.get("waitingReason")
    if reason not in render.LIMIT_REASONS or reason == "TYPE_PAUSED":
        return None
    task_type = str(job.get("taskType"))
    try:
        limit = client.limits.get(task_type)
        running_for_key = None
        if reason == "KEY_CONCURRENCY_LIMIT":
            key = job.get("concurrencyKey")
            running_for_key = sum(1 for other in client.iter_jobs(JobState.RUNNING, MAX_PAGE, task_type)
                                  if other.get("concurrencyKey") == key)
    except RequestFailed:  # the figures are a courtesy: without them the reason still reads as words
        return None
    return render.Held(limit, running_for_key)


def _key_flag(args: dict[str, Any], flag: str) -> str | None:
    """``--concurrency-key`` / ``--unique-key``: 1-256 characters, no NUL (CONTRACT)."""
    value = args.get(flag)
    if value is None:
        return None
    if not 1 <= len(value) <= MAX_KEY or "\0" in value:
        raise ConfigError("%s must be 1-%d characters without NUL, got %r" % (flag, MAX_KEY, value[:300]))
    return str(value)


def events(client: CoordinatorClient, args: dict[str, Any], console: Console) -> int:
    timeline = client.events(args["JOB_ID"])
    console.out(render.to_json(timeline) if args["--json"] else render.event_table(timeline))
    return EXIT_OK


def retry(client: CoordinatorClient, args: dict[str, Any], console: Console) -> int:
    old = args["JOB_ID"]
    try:
        new = client.retry(old)
    except SubmitRejected as exc:
        console.error("retry", "rejected, the coordinator is overloaded: %s" % exc)
        return EXIT_FAILED
    console.out(render.to_json({"jobId": new, "retryOf": old}) if args["--json"] else render.retried(new, old))
    return EXIT_OK


def purge(client: CoordinatorClient, args: dict[str, Any], console: Console) -> int:
    """PURGE_JOBS until the coordinator says no more remain; prints the total. With
    ``--dry-run``, one request that deletes nothing and says how many would go."""
    older_than = parse_duration_millis(args["--older-than"])
    if args["--dry-run"]:
        count, more = client.purge(older_than, dry_run=True)
        if args["--json"]:
            console.out(render.to_json({"wouldPurge": count, "more": more, "olderThanMillis": older_than}))
        else:
            console.out("would purge %s%d finished job%s last updated more than %s ago (nothing deleted)"
                        % ("at least " if more else "", count, "" if count == 1 else "s",
                           args["--older-than"].strip()))
        return EXIT_OK
    total = 0
    while True:
        purged, more = client.purge(older_than)
        total += purged
        if not more or purged == 0:  # purged == 0 with more: ask no further rather than spin
            break
    if args["--json"]:
        console.out(render.to_json({"purged": total, "olderThanMillis": older_than}))
    else:
        console.out("purged %d finished job%s last updated more than %s ago"
                    % (total, "" if total == 1 else "s", args["--older-than"].strip()))
    return EXIT_OK


def list_jobs(client: CoordinatorClient, args: dict[str, Any], console: Console) -> int:
    limit = _int_flag(args, "--limit", 1)
    state = args["--state"]
    if state is not None:
        try:
            state = JobState(state.upper()).value
        except ValueError:
            raise ConfigError("--state must be one of %s, got %r"
                              % (", ".join(s.value for s in JobState), state)) from None
    task_type = args.get("--type")
    if task_type is not None:
        task_type = task_type_name(task_type)
    jobs: list[dict[str, Any]] = []
    cursor = None
    while len(jobs) < limit:
        page, cursor = client.list_jobs(min(MAX_PAGE, limit - len(jobs)), state, cursor, task_type=task_type)
        jobs.extend(page)
        if cursor is None or not page:
            break
    jobs = jobs[:limit]
    if args["--json"]:
        console.out(render.to_json(jobs))
    else:
        console.out(render.job_table(jobs, _now_millis(), _last_workers(client, jobs)))
    return EXIT_OK


def workers(client: CoordinatorClient, args: dict[str, Any], console: Console) -> int:
    found = client.workers()
    console.out(render.to_json(found) if args["--json"] else render.worker_table(found, _now_millis()))
    return EXIT_OK


def cancel(client: CoordinatorClient, args: dict[str, Any], console: Console) -> int:
    was_cancelled, job = client.cancel(args["JOB_ID"])
    if args["--json"]:
        _show_job(client, console, job, True, cancelled=was_cancelled)
    else:
        console.out(render.cancelled(was_cancelled, job))
        _show_job(client, console, job, False)
    return EXIT_OK


def wait(client: CoordinatorClient, args: dict[str, Any], console: Console) -> int:
    return _await("wait", client, console, args["JOB_ID"], _timeout_seconds(args), args["--json"])


# ---- recurring schedules ----------------------------------------------------------------

SCHEDULE_SHOWS = 5  # fire times ``schedule show`` lists


def _choice_flag(args: dict[str, Any], flag: str, choices: tuple[str, ...]) -> str:
    value = str(args[flag]).strip().lower()
    if value not in choices:
        raise ConfigError("%s must be one of %s, got %r" % (flag, ", ".join(choices), args[flag]))
    return value


def _rule_flags(args: dict[str, Any]) -> dict[str, Any]:
    """--cron / --every-millis and --tz as SCHEDULE_PUT / SCHEDULE_PREVIEW fields."""
    rule: dict[str, Any] = {"timezone": str(args["--tz"]).strip()}
    if args["--cron"] is not None:
        rule["cron"] = args["--cron"]
    else:
        rule["everyMillis"] = _int_flag(args, "--every-millis", 1000)
    return rule


def schedule_add(client: CoordinatorClient, args: dict[str, Any], console: Console) -> int:
    priority = _priority_flag(args)
    definition = dict(_rule_flags(args), name=args["NAME"], taskType=task_type_name(str(args["TASK_TYPE"])),
                      payload=parse_payload(args["PAYLOAD_JSON"], console.stdin), priority=priority.value,
                      maxAttempts=_int_flag(args, "--max-attempts", 0),
                      missed=_choice_flag(args, "--missed", ("latest", "all", "skip")),
                      catchupWindowMillis=_int_flag(args, "--catchup-window-millis", 0),
                      overlap=_choice_flag(args, "--overlap", ("skip", "allow")),
                      jitterMillis=_int_flag(args, "--jitter-millis", 0), paused=bool(args["--paused"]))
    schedule = client.request(m.SchedulePut(definition), m.Schedule).schedule
    if args["--json"]:
        console.out(render.to_json(schedule))
    else:
        console.out("schedule %s saved; next fire %s" % (
            schedule["name"], "none (paused)" if schedule.get("paused") else
            render.zoned(schedule.get("nextFireMillis"), schedule.get("timezone") or "UTC")))
    return EXIT_OK


def schedule_show(client: CoordinatorClient, args: dict[str, Any], console: Console) -> int:
    schedule = client.schedules.get(args["NAME"])
    upcoming: list[int] = []
    first, every = schedule.get("nextFireMillis"), schedule.get("everyMillis")
    if first is not None and every is not None:  # an interval counts from its creation, not from now
        upcoming = [first + i * every for i in range(SCHEDULE_SHOWS)]
    elif first is not None:
        upcoming = client.request(m.SchedulePreview(cron=schedule.get("cron"), timezone=schedule.get("timezone"),
                                                    from_millis=first - 1, count=SCHEDULE_SHOWS),
                                  m.SchedulePreview, idempotent=True).fire_times
    if args["--json"]:
        console.out(render.to_json(dict(schedule, nextFireTimes=upcoming)))
    else:
        console.out(render.schedule_detail(schedule, upcoming, _now_millis()))
    return EXIT_OK


def schedule_preview(client: CoordinatorClient, args: dict[str, Any], console: Console) -> int:
    rule = _rule_flags(args)
    start = None if args["--from"] is None else (parse_run_at(args["--from"], "--from") - EPOCH) // timedelta(milliseconds=1)
    count = _int_flag(args, "--count", 1)
    reply = client.request(m.SchedulePreview(cron=rule.get("cron"), every_millis=rule.get("everyMillis"),
                                             timezone=rule["timezone"], from_millis=start, count=count),
                           m.SchedulePreview, idempotent=True)
    if args["--json"]:
        console.out(render.to_json(reply.fire_times))
    else:
        console.out(render.fire_times(reply.fire_times, rule["timezone"]))
    return EXIT_OK


def _schedule_change(client: CoordinatorClient, args: dict[str, Any], console: Console, request: m.Message,
                     said: str) -> int:
    schedule = client.request(request, m.Schedule).schedule
    console.out(render.to_json(schedule) if args["--json"] else "schedule %s %s" % (schedule["name"], said))
    return EXIT_OK


def schedule(client: CoordinatorClient, args: dict[str, Any], console: Console) -> int:
    """``jobmesh schedule SUBCOMMAND``."""
    name = args["NAME"]
    if args["add"]:
        return schedule_add(client, args, console)
    if args["show"]:
        return schedule_show(client, args, console)
    if args["preview"]:
        return schedule_preview(client, args, console)
    if args["pause"]:
        return _schedule_change(client, args, console, m.SchedulePause(name), "paused")
    if args["resume"]:
        return _schedule_change(client, args, console, m.ScheduleResume(name),
                                "resumed (fire times that passed while paused make no job)")
    if args["rm"]:
        return _schedule_change(client, args, console, m.ScheduleDelete(name), "deleted (its jobs stay)")
    if args["trigger"]:
        job_id = client.schedules.trigger(name)
        console.out(render.to_json({"jobId": job_id}) if args["--json"] else render.submitted(job_id))
        return EXIT_OK
    found = client.schedules.list()
    console.out(render.to_json(found) if args["--json"] else render.schedule_table(found, _now_millis()))
    return EXIT_OK


# ---- limits -----------------------------------------------------------------------------

# ``limit set``'s flags: the LIMIT field each sets, and whether it is a count or a rate.
LIMIT_FLAGS = (("--max-running", "maxRunning", int), ("--max-running-per-key", "maxRunningPerKey", int),
               ("--rate", "ratePerSecond", float), ("--burst", "burst", int),
               ("--rate-per-key", "ratePerKeyPerSecond", float))


def _rate_flag(args: dict[str, Any], flag: str) -> float:
    raw = args[flag]
    try:
        value = float(str(raw).strip())
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ConfigError("%s must be a number of starts a second above 0, e.g. 10 or 0.5, got %r" % (flag, raw))
    return value


def limit_set(client: CoordinatorClient, args: dict[str, Any], console: Console) -> int:
    values: dict[str, Any] = {}
    for flag, field, kind in LIMIT_FLAGS:
        if args[flag] is not None:
            low = 1 if field == "burst" else 0  # a bucket holds at least one start
            values[field] = _int_flag(args, flag, low) if kind is int else _rate_flag(args, flag)
    if not values:
        raise ConfigError("give at least one of %s (to remove the type's limits: jobmesh limit rm %s)"
                          % (", ".join(flag + "=..." for flag, _, _ in LIMIT_FLAGS), args["TASK_TYPE"]))
    if "burst" in values and "ratePerSecond" not in values:
        raise ConfigError("--burst is the bucket of --rate: give --rate too")
    limit = client.limits.put(task_type_name(str(args["TASK_TYPE"])), values.get("maxRunning"),
                              values.get("maxRunningPerKey"), values.get("ratePerSecond"), values.get("burst"),
                              values.get("ratePerKeyPerSecond"))
    return _show_limit(limit, args, console, "limits of %s set" % limit.get("taskType"))


def _show_limit(limit: dict[str, Any], args: dict[str, Any], console: Console, said: str | None = None) -> int:
    if args["--json"]:
        console.out(render.to_json(limit))
    else:
        if said is not None:
            console.out(said)
        console.out(render.limit_detail(limit))
    return EXIT_OK


def limit_command(client: CoordinatorClient, args: dict[str, Any], console: Console) -> int:
    """``jobmesh limit set|list|show|rm``."""
    if args["set"]:
        return limit_set(client, args, console)
    if args["list"]:
        found = client.limits.list()
        console.out(render.to_json(found) if args["--json"] else render.limit_table(found))
        return EXIT_OK
    task_type = task_type_name(str(args["TASK_TYPE"]))
    if args["show"]:
        return _show_limit(client.limits.get(task_type), args, console)
    return _show_limit(client.limits.delete(task_type), args, console,
                       "limits of %s removed, and its pause if it had one; this was the last state:" % task_type)


def pause(client: CoordinatorClient, args: dict[str, Any], console: Console) -> int:
    task_type = task_type_name(str(args["TASK_TYPE"]))
    return _show_limit(client.limits.pause(task_type), args, console,
                       "%s paused: no new job of it starts (running ones go on) until jobmesh resume %s"
                       % (task_type, task_type))


def resume(client: CoordinatorClient, args: dict[str, Any], console: Console) -> int:
    task_type = task_type_name(str(args["TASK_TYPE"]))
    return _show_limit(client.limits.resume(task_type), args, console, "%s resumed" % task_type)


# ---- workflows --------------------------------------------------------------------------

WORKFLOW_FIELDS = ("jobs", "name", "type")  # what a workflow file may hold


def read_workflow_file(path: str, stdin: TextIO | None) -> tuple[list[Any], str | None]:
    """``workflow submit FILE``: the SUBMIT_WORKFLOW object (without ``type``) in FILE, or on
    stdin for ``-``, as its jobs and name. ``ConfigError``, one line, for a file that cannot
    be read, is not JSON, or is not such an object."""
    where = "the workflow on stdin" if path == "-" else "workflow file %s" % path
    try:
        if path == "-":
            if stdin is None:
                raise ConfigError("FILE is -, but there is no stdin to read the workflow from")
            text = stdin.read()
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("cannot read %s: %s" % (where, getattr(exc, "strerror", None) or exc)) from None
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise ConfigError("%s is not valid JSON: %s" % (where, exc)) from None
    example = '{"name": "etl", "jobs": [{"ref": "a", "taskType": "...", "payload": {}, "dependsOn": []}, ...]}'
    if not isinstance(document, dict) or not isinstance(document.get("jobs"), list):
        raise ConfigError("%s must be a JSON object with a list of jobs: %s" % (where, example))
    unknown = sorted(set(document) - set(WORKFLOW_FIELDS))
    if unknown:
        raise ConfigError("%s: unknown field%s %s; a workflow has jobs and name"
                          % (where, "s" if len(unknown) > 1 else "", ", ".join(map(repr, unknown))))
    if document.get("type", m.SubmitWorkflow.TYPE) != m.SubmitWorkflow.TYPE:
        raise ConfigError("%s: type is %r; a workflow file holds a SUBMIT_WORKFLOW" % (where, document["type"]))
    name = document.get("name")
    if name is not None and not isinstance(name, str):
        raise ConfigError("%s: name must be a string, got %s" % (where, json.dumps(name)[:100]))
    for i, job in enumerate(document["jobs"]):
        if not isinstance(job, dict):
            raise ConfigError("%s: job %d is not an object: %s" % (where, i + 1, json.dumps(job)[:100]))
    return document["jobs"], name


def workflow_submit(client: CoordinatorClient, args: dict[str, Any], console: Console) -> int:
    timeout = _timeout_seconds(args)
    jobs, name = read_workflow_file(str(args["FILE"]), console.stdin)
    # A key of our own, as submit's: the submit may then go again after a lost connection.
    key = args["--idempotency-key"] or AUTO_KEY_PREFIX + secrets.token_hex(16)
    try:
        submitted = client.submit_workflow(jobs, name, idempotency_key=key)
    except CanvasError as exc:
        raise ConfigError(str(exc)) from None
    except SubmitRejected as exc:
        console.error("workflow", "rejected, the coordinator is overloaded: %s" % exc)
        return EXIT_FAILED
    if not args["--wait"]:
        console.out(render.to_json({"workflowId": submitted.workflow_id, "jobIds": submitted.job_ids})
                    if args["--json"] else submitted.workflow_id)
        return EXIT_OK
    if not args["--json"]:
        console.out(render.workflow_submitted(submitted.workflow_id, len(submitted.job_ids)))
    try:
        return _await_workflow(client, console, submitted.workflow_id, timeout, args["--json"])
    except CoordinatorUnavailable as exc:
        raise CoordinatorUnavailable("workflow %s was submitted, then: %s" % (submitted.workflow_id, exc)) from exc


def _await_workflow(client: CoordinatorClient, console: Console, workflow_id: str, timeout: float | None,
                    as_json: bool) -> int:
    """Wait for the workflow, print it, and map how it ended to an exit code, as ``_await``."""
    try:
        workflow = client.wait_workflow(workflow_id, timeout)
    except WaitTimeout as exc:
        _show_workflow(console, exc.job, as_json)
        console.error("workflow", "timed out: %s" % exc)
        return EXIT_TIMEOUT
    _show_workflow(console, workflow, as_json)
    if workflow.get("state") == JobState.COMPLETED.value:
        return EXIT_OK
    console.error("workflow", "workflow %s ended %s%s" % (workflow_id, workflow.get("state"),
                                                         render.workflow_failures(workflow)))
    return EXIT_FAILED


def _show_workflow(console: Console, workflow: dict[str, Any], as_json: bool) -> None:
    console.out(render.to_json(workflow) if as_json else render.workflow_detail(workflow))


def workflow(client: CoordinatorClient, args: dict[str, Any], console: Console) -> int:
    """``jobmesh workflow submit|status|cancel|wait``."""
    if args["submit"]:
        return workflow_submit(client, args, console)
    workflow_id = str(args["ID"])
    if args["wait"]:
        return _await_workflow(client, console, workflow_id, _timeout_seconds(args), args["--json"])
    if args["cancel"]:
        found = client.cancel_workflow(workflow_id)
        if not args["--json"]:
            console.out("cancelled workflow %s: its unfinished jobs are CANCELLED" % workflow_id)
    else:
        found = client.workflow_status(workflow_id)
    _show_workflow(console, found, args["--json"])
    return EXIT_OK


def top_view(client: CoordinatorClient, args: dict[str, Any], console: Console) -> int:
    return top.run(client, console, _int_flag(args, "--interval-millis", 1), _int_flag(args, "--iterations", 0))


HANDLERS: dict[str, Callable[[CoordinatorClient, dict[str, Any], Console], int]] = {
    "submit": submit,
    "status": status,
    "list": list_jobs,
    "workers": workers,
    "cancel": cancel,
    "wait": wait,
    "events": events,
    "retry": retry,
    "purge": purge,
    "top": top_view,
    "schedule": schedule,
    "limit": limit_command,
    "pause": pause,
    "resume": resume,
    "workflow": workflow,
}


# The coordinator's words for a request the token's role may not make (CONTRACT: forbidden: ...).
FORBIDDEN_KIND = re.compile(r"forbidden: token .* \(role (\w+)\) may not send ([A-Z_]+)\Z")
# The commands that have subcommands, and those subcommands, as the role hint names them.
SUBCOMMANDS = {"schedule": ("add", "list", "show", "pause", "resume", "rm", "trigger", "preview"),
               "limit": ("set", "list", "show", "rm"), "workflow": ("submit", "status", "cancel", "wait")}


def _role_hint(command: str, args: dict[str, Any], message: str) -> str:
    """For a request the token's role may not make: the command, and the roles it needs."""
    found = FORBIDDEN_KIND.match(message)
    if found is None:
        return ""
    role, kind = found.groups()
    command += "".join(" " + sub for sub in SUBCOMMANDS.get(command, ()) if args.get(sub))
    return "; 'jobmesh %s' needs a token of role %s, and this one is a %s token" % (
        command, " or ".join(roles_for(kind)), role)


def run_client_command(command: str, args: dict[str, Any], console: Console) -> int:
    """Run one client command; returns its exit code. ConfigError propagates (exit 2)."""
    addresses = parse_addresses(str(args["--coordinator"]))
    connect_timeout = _int_flag(args, "--connect-timeout-millis", 1) / 1000.0
    handler = HANDLERS[command]
    token = read_token(args.get("--token-file"))
    warn_if_exposed(token_file_of(args.get("--token-file")), "the token file")
    warn_if_exposed(args.get("--tls-key"), "the --tls-key file")
    try:
        with CoordinatorClient(addresses, connect_timeout=connect_timeout, tls=bool(args.get("--tls")),
                               tls_ca=args.get("--tls-ca"), tls_cert=args.get("--tls-cert"),
                               tls_key=args.get("--tls-key"), token=token) as client:
            return handler(client, args, console)
    except CoordinatorUnavailable as exc:
        console.error(command, "coordinator unreachable: %s" % exc)
        return EXIT_UNREACHABLE
    except RequestFailed as exc:
        hint = ""
        if exc.message in AUTH_REFUSALS:
            hint = ("; give a token with --token-file=PATH, JOBMESH_TOKEN or JOBMESH_TOKEN_FILE"
                    if token is None else "; the token is not in the coordinator's auth file")
        else:
            hint = _role_hint(command, args, exc.message)
        console.error(command, "the coordinator refused: %s%s" % (exc.message, hint))
        return EXIT_FAILED
    except InvalidRequest as exc:  # nothing was sent: the input is at fault, like a bad flag
        console.error(command, str(exc))
        return EXIT_USAGE
    except ClientError as exc:
        console.error(command, str(exc))
        return EXIT_FAILED
