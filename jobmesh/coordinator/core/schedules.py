"""Schedules: the core's part for recurring schedules (docs/OPERATIONS.md, "Recurring schedules").

A schedule makes jobs from a template at fire times (``firetimes.Rule``). This part owns
every schedule, a heap of their next fire times (wall clock), the firing, the policies,
and the schedules' rows to commit. A fire makes its job through the table's one way of
making jobs (``table.new_job`` + ``table.admit``, idempotency key
``schedule:NAME:SCHEDULEDFOR``) and advances the schedule's cursor in the same batch, so
the runtime commits both in one transaction: a crash or a failed commit loses both or
neither, and after a reload the fire is made again exactly once.

Each schedule keeps a cursor (wall clock, epoch ms): every fire time up to it was handled
(made a job, skipped, or missed). Only fire times after the cursor ever fire, so a wall
clock that steps back never fires a time twice. Fire times that passed while the
coordinator was down, while admission was full or storage failing, or that a forward
step of the wall clock jumped over, follow the schedule's ``missed`` policy inside its
catch-up window (``catch_up``); in normal running every due fire time makes its job.

The part is not a listener of the table: it looks at a schedule's last job only when it
fires (overlap) or is shown, so jobs pay nothing for schedules. Pure: ``now`` is core
time, ``table.drift`` turns it into the wall clock.
"""

from __future__ import annotations

import bisect
import heapq
import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

import ujson

from jobmesh.coordinator.core.firetimes import NAME, Rule, RuleError, jitter_delay
from jobmesh.coordinator.core.requests import MAX_PAYLOAD_BYTES, SCHEDULE_KEYS as KEY_PREFIX, rejected
from jobmesh.coordinator.core.table import JobTable
from jobmesh.auth import type_refusal
from jobmesh.protocol import messages as m
from jobmesh.protocol.jobs import JobState, Priority
from jobmesh.protocol.messages import quote
from jobmesh.store.base import Store

log = logging.getLogger(__name__)

MISSED = ("latest", "all", "skip")
OVERLAP = ("skip", "allow")
CATCH_UP_MAX = 100  # jobs one schedule makes at most for the fire times of one catch-up
RECENT_JOBS = 5  # the last jobs a schedule remembers (``show``)
DEFAULT_WINDOW = 86_400_000
PREVIEW_MAX = 1000
LIST_MAX = 1000
LIST_MAX_BYTES = 900 * 1024  # keep SCHEDULE_LIST below the 1 MiB frame limit
MAX_MILLIS = 253_402_300_799_999
SCHEDULES_NOT_APPLIED = "schedules file not applied, the schedules stay as they were: %s"  # the log line, everywhere

CheckPayload = Callable[[str, dict[str, Any]], "str | None"]


def unknown(name: str) -> m.Message:
    return m.Error("unknown schedule %s" % quote(name))


def iso(millis: int) -> str:
    return datetime.fromtimestamp(millis / 1000, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


@dataclass(slots=True, eq=False)
class Schedule:
    """One schedule: its definition, its cursor and counts (stored), its rule and next
    fire time (derived)."""

    name: str
    cron: str | None
    every_millis: int | None
    timezone: str
    task_type: str
    payload: dict[str, Any]
    priority: Priority
    max_attempts: int  # 0: none named; each job takes its type's declared budget, else the coordinator's
    missed: str
    catchup_window_millis: int
    overlap: str
    jitter_millis: int
    paused: bool
    origin: str
    created_at: int
    cursor: int  # every fire time up to here was handled (wall clock)
    last_fire: int | None = None  # the nominal time of the last fire that made a job
    last_job_id: str | None = None
    fired: int = 0
    skipped: int = 0
    missed_count: int = 0
    recent: list[list[Any]] = field(default_factory=list)  # [job id, scheduled for], newest last
    # A file-made schedule: the ``paused`` its file said when last applied (None: not known).
    # A re-read that says the same keeps the paused state set over the wire.
    file_paused: bool | None = None
    rule: Rule = field(init=False, repr=False)
    payload_json: str = field(init=False, repr=False)
    next_fire: int | None = None  # wall clock; None while paused or never again

    def __post_init__(self) -> None:
        self.rule = Rule(self.cron, self.every_millis, self.timezone, self.created_at)
        self.payload_json = ujson.dumps(self.payload, ensure_ascii=False, escape_forward_slashes=False)

    def definition(self) -> dict[str, Any]:
        """The fields a user sets (SCHEDULE_PUT, the schedules file)."""
        return {"name": self.name, "cron": self.cron, "everyMillis": self.every_millis, "timezone": self.timezone,
                "taskType": self.task_type, "payload": self.payload, "priority": self.priority.value,
                "maxAttempts": self.max_attempts, "missed": self.missed,
                "catchupWindowMillis": self.catchup_window_millis, "overlap": self.overlap,
                "jitterMillis": self.jitter_millis, "paused": self.paused}

    def body(self) -> str:
        """The stored form (the store's ``schedules`` row)."""
        body = self.definition()
        body.update(origin=self.origin, createdAtMillis=self.created_at, cursorMillis=self.cursor,
                    lastFireMillis=self.last_fire, lastJobId=self.last_job_id, firedCount=self.fired,
                    skippedCount=self.skipped, missedCount=self.missed_count, recentJobs=self.recent,
                    filePaused=self.file_paused)
        return ujson.dumps(body, ensure_ascii=False, escape_forward_slashes=False)

    def view(self, state_of: Callable[[str], str | None], attempts_of: Callable[[str], int]) -> dict[str, Any]:
        """The wire form, one shape for every SCHEDULE and each SCHEDULE_LIST item: every
        field of the contract, ``origin``, and the last jobs with the states ``state_of``
        finds for them (None: not found, e.g. purged): ``lastJobState`` and ``recentJobs``.
        ``maxAttempts`` is the budget its next job gets (``attempts_of`` its task type's
        when the schedule names none)."""
        out = self.definition()
        out.update(maxAttempts=self.max_attempts or attempts_of(self.task_type), origin=self.origin,
                   createdAtMillis=self.created_at, nextFireMillis=self.next_fire,
                   lastFireMillis=self.last_fire, lastJobId=self.last_job_id,
                   lastJobState=None if self.last_job_id is None else state_of(self.last_job_id),
                   recentJobs=[{"jobId": job_id, "scheduledFor": fire, "state": state_of(job_id)}
                               for job_id, fire in self.recent],
                   firedCount=self.fired, skippedCount=self.skipped, missedCount=self.missed_count)
        return out


def from_body(name: str, text: str) -> Schedule:
    """A stored schedule; raises ValueError (or RuleError) if the row does not decode."""
    b = ujson.loads(text)
    return Schedule(name, b["cron"], b["everyMillis"], b["timezone"], b["taskType"], b["payload"],
                    Priority.parse(b["priority"]), b["maxAttempts"], b["missed"], b["catchupWindowMillis"],
                    b["overlap"], b["jitterMillis"], b["paused"], b["origin"], b["createdAtMillis"],
                    b["cursorMillis"], b["lastFireMillis"], b["lastJobId"], b["firedCount"], b["skippedCount"],
                    b["missedCount"], b["recentJobs"], b.get("filePaused"))


def _field(obj: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = obj.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RuleError("%s has the wrong type: %s" % (name, quote(value)))
    return value


def parse_definition(obj: dict[str, Any], check: CheckPayload, origin: str, now_wall: int) -> Schedule:
    """A new schedule from a SCHEDULE_PUT's ``schedule`` (or a schedules-file table), created
    at ``now_wall``; ``RuleError`` saying what is wrong."""
    name = _field(obj, "name", str, None)
    if name is None or not NAME.match(name):
        raise RuleError("name must be 1-128 characters of letters, digits and _ . : -, got %s"
                        % quote(obj.get("name")))
    cron = _field(obj, "cron", str, None)
    every = _field(obj, "everyMillis", int, None)
    tz = _field(obj, "timezone", str, "UTC")
    Rule(cron, every, tz)  # the rule's errors first: they are the likeliest
    task_type = _field(obj, "taskType", str, None)
    if task_type is None:
        raise RuleError("schedule %s needs a taskType" % name)
    payload = _field(obj, "payload", dict, {})
    problem = check(task_type, payload)
    if problem is not None:
        raise RuleError(problem)
    if len(ujson.dumps(payload, ensure_ascii=True)) > MAX_PAYLOAD_BYTES:
        raise RuleError("payload is too large for a task assignment (at most %d bytes)" % MAX_PAYLOAD_BYTES)
    try:
        priority = Priority.parse(_field(obj, "priority", str, "NORMAL"))
    except ValueError as exc:
        raise RuleError(str(exc)) from None
    max_attempts = _field(obj, "maxAttempts", int, 0)  # 0: the type's, or the coordinator's, per job
    if max_attempts and not 1 <= max_attempts <= 1_000_000:
        raise RuleError("maxAttempts must be 1..1000000, got %d" % max_attempts)
    missed = _field(obj, "missed", str, "latest")
    if missed not in MISSED:
        raise RuleError("missed must be one of %s, got %s" % (", ".join(MISSED), quote(missed)))
    overlap = _field(obj, "overlap", str, "skip")
    if overlap not in OVERLAP:
        raise RuleError("overlap must be one of %s, got %s" % (", ".join(OVERLAP), quote(overlap)))
    window = _field(obj, "catchupWindowMillis", int, DEFAULT_WINDOW)
    jitter = _field(obj, "jitterMillis", int, 0)
    for label, value in (("catchupWindowMillis", window), ("jitterMillis", jitter)):
        if not 0 <= value <= MAX_MILLIS:
            raise RuleError("%s must be a non-negative integer, got %d" % (label, value))
    paused = _field(obj, "paused", bool, False)
    return Schedule(name, cron, every, tz, task_type, payload, priority, max_attempts, missed, window, overlap,
                    jitter, paused, origin, now_wall, now_wall)


class Schedules:
    """The schedules and their firing; see the module docstring."""

    def __init__(self, table: JobTable, check_payload: CheckPayload) -> None:
        self.table = table
        self.config = table.config
        self.check_payload = check_payload
        self.by_name: dict[str, Schedule] = {}
        self.heap: list[tuple[int, str]] = []  # (next fire time, name); stale entries skipped
        self.behind = False  # fires were held back (admission, storage): the next pass follows ``missed``
        # Since the process started (metrics), by schedule name.
        self.fires: dict[str, int] = {}
        self.skips: dict[str, int] = {}
        self.misses: dict[str, int] = {}
        self._dirty: dict[str, Schedule | None] = {}
        self._sorted: list[str] | None = None  # the names in order, for listings (None: rebuild)
        # A schedules file that waits for task types no worker has declared yet, and those types.
        self.pending_file: list[dict[str, Any]] | None = None
        self.waiting: list[str] = []

    # ---- recovery, rows ------------------------------------------------------------------

    def load(self, store: Store, now: int) -> None:
        """Recovery: every stored schedule, then the fire times that passed while the
        coordinator was down follow each one's ``missed`` policy."""
        for name, text in store.load_schedules():
            try:
                schedule = from_body(name, text)
            except (ValueError, KeyError, TypeError) as exc:
                log.error("schedule %s: its stored row does not decode (%s); it is left out", quote(name), exc)
                continue
            self.by_name[name] = schedule
            self._arm(schedule)
        self.catch_up(now)

    def take_dirty(self) -> list[tuple[str, str | None]]:
        """Rows to commit: (name, body) per changed schedule, (name, None) per deleted one."""
        if not self._dirty:
            return []
        rows = [(name, None if s is None else s.body()) for name, s in self._dirty.items()]
        self._dirty = {}
        return rows

    def carry_totals(self, old: Schedules) -> None:
        """A reload: the per-schedule counters count since the process started, and a
        schedules file that waits for its task types goes on waiting."""
        for mine, theirs in ((self.fires, old.fires), (self.skips, old.skips), (self.misses, old.misses)):
            for name, n in theirs.items():
                mine[name] = mine.get(name, 0) + n
        if self.pending_file is None:
            self.pending_file, self.waiting = old.pending_file, old.waiting

    def _touch(self, schedule: Schedule) -> None:
        self._dirty[schedule.name] = schedule

    def _arm(self, schedule: Schedule) -> None:
        """Recompute the next fire time and put it on the heap."""
        after = None if schedule.paused else schedule.rule.after(schedule.cursor)
        schedule.next_fire = after if after is not None and after <= MAX_MILLIS else None  # None: never again
        if schedule.next_fire is not None:
            heapq.heappush(self.heap, (schedule.next_fire, schedule.name))
            if len(self.heap) > 2 * len(self.by_name) + 1024:
                self.heap = [(s.next_fire, s.name) for s in self.by_name.values() if s.next_fire is not None]
                heapq.heapify(self.heap)

    # ---- firing ----------------------------------------------------------------------------

    def fire_due(self, now: int) -> None:
        """The sweep's step: every schedule whose next fire time has come makes its jobs.
        After fires were held back, the passed times follow ``missed`` instead."""
        if self.pending_file is not None:
            self._apply_waiting_file(now)
        heap = self.heap
        wall = now + self.table.drift
        if not heap or heap[0][0] > wall:
            return
        if self.behind:
            self.catch_up(now)
            return
        while heap and heap[0][0] <= wall:
            at, name = heap[0]
            schedule = self.by_name.get(name)
            if schedule is None or schedule.next_fire != at:
                heapq.heappop(heap)  # deleted, paused or re-armed since
                continue
            if not self._fire(schedule, now, wall, False):
                self.behind = True  # admission is full: wait, then follow ``missed``
                return
            heapq.heappop(heap)
            self._arm(schedule)

    def hold(self) -> None:
        """Fires could not be made (storage failing): the times that pass meanwhile will
        follow ``missed``."""
        self.behind = True

    def catch_up(self, now: int) -> None:
        """Fire times that passed while no fire could be made (down, admission full,
        storage failing, or a forward step of the wall clock) follow each schedule's
        ``missed`` policy."""
        wall = now + self.table.drift
        self.behind = False
        for schedule in self.by_name.values():
            if schedule.next_fire is not None and schedule.next_fire <= wall:
                if not self._fire(schedule, now, wall, True):
                    self.behind = True
                    return
                self._arm(schedule)

    def _fire(self, s: Schedule, now: int, wall: int, policy: bool) -> bool:
        """Handle ``s``'s fire times in (cursor, wall]; False if admission is full (nothing
        changed). With ``policy`` they follow ``missed`` and the catch-up window."""
        keep = CATCH_UP_MAX if policy else 1000
        count, times = s.rule.span(s.cursor, wall, keep)
        if policy:
            window_start = wall - s.catchup_window_millis
            times = [t for t in times if t > window_start]
            if s.missed == "latest":
                times = times[-1:]
            elif s.missed == "skip":
                times = []
        missed = count - len(times)
        skipped = 0
        if times and s.overlap == "skip" and s.last_job_id is not None and s.last_job_id in self.table.jobs:
            skipped, times = len(times), []
        if times and self.table.active_count + len(times) > self.config.max_active_jobs:
            return False
        for fire in times:
            self._make(s, now, fire)
            s.last_fire = fire
        if missed:
            s.missed_count += missed
            self.misses[s.name] = self.misses.get(s.name, 0) + missed
            log.info("schedule %s: %d fire times made no job (missed=%s)", s.name, missed, s.missed)
        if skipped:
            s.skipped += skipped
            self.skips[s.name] = self.skips.get(s.name, 0) + skipped
            log.info("schedule %s: skipped %d fire times: job %s has not ended (overlap=skip)", s.name, skipped,
                     s.last_job_id)
        s.cursor = max(s.cursor, wall)
        self._touch(s)
        return True

    def _make(self, s: Schedule, now: int, fire: int, detail: str = "", submitted_by: str | None = None) -> str:
        """The job of fire time ``fire`` (SUBMITTED now; SCHEDULED while its jitter lasts)."""
        table = self.table
        delay = jitter_delay(s.name, fire, s.jitter_millis)
        run_at = fire + delay if delay else None
        later = run_at is not None and run_at > now + table.drift
        attempts = s.max_attempts or table.max_attempts_of(s.task_type)  # as a submit naming none
        job = table.new_job(now, s.task_type, s.payload, attempts, s.priority,
                            JobState.SCHEDULED if later else JobState.QUEUED, KEY_PREFIX + "%s:%d" % (s.name, fire),
                            None, s.payload_json, run_at)
        table.give_defaults(job, None)
        job.schedule_name = s.name
        job.scheduled_for = fire
        job.submitted_by = submitted_by
        table.admit(job, now, detail or "fired by schedule %s for %s" % (s.name, iso(fire)))
        s.last_job_id = job.job_id
        s.fired += 1
        s.recent.append([job.job_id, fire])
        del s.recent[:-RECENT_JOBS]
        self.fires[s.name] = self.fires.get(s.name, 0) + 1
        return job.job_id

    # ---- requests ---------------------------------------------------------------------------

    def put(self, now: int, req: m.SchedulePut) -> m.Message:
        try:
            schedule = self._prepare(req.schedule, "api", now + self.table.drift)
        except RuleError as exc:
            return m.Error(str(exc))
        self._install(schedule)
        return self._reply(schedule)

    def _prepare(self, obj: dict[str, Any], origin: str, wall: int, check: CheckPayload | None = None,
                 paused: bool | None = None) -> Schedule:
        """The schedule ``obj`` defines, put at ``wall``, as it would replace the one of its
        name: a replaced one keeps its creation time, cursor and counts (fire times already
        handled are not made again); pausing or resuming follows ``paused`` (default: the
        definition's). Raises ``RuleError``, changing nothing, also when its next fire time
        would be at or after the year 10000."""
        new = parse_definition(obj, check or self.check_payload, origin, wall)
        if paused is not None:
            new.paused = paused
        old = self.by_name.get(new.name)
        if old is not None:
            new = Schedule(new.name, new.cron, new.every_millis, new.timezone, new.task_type, new.payload,
                           new.priority, new.max_attempts, new.missed, new.catchup_window_millis, new.overlap,
                           new.jitter_millis, new.paused, origin, old.created_at,
                           old.cursor if new.paused or not old.paused else max(old.cursor, wall),
                           old.last_fire, old.last_job_id, old.fired, old.skipped, old.missed_count, old.recent,
                           old.file_paused)
        first = new.rule.after(new.cursor)
        if first is not None and first > MAX_MILLIS:
            raise RuleError("schedule %s would next fire after the year 9999 (at %d ms since 1970): give a "
                            "shorter everyMillis" % (new.name, first))
        return new

    def _install(self, schedule: Schedule) -> None:
        """Put a prepared schedule in force (creating or replacing its name)."""
        if schedule.name not in self.by_name:
            self._sorted = None
        self.by_name[schedule.name] = schedule
        self._arm(schedule)
        self._touch(schedule)

    def _held_state(self, job_id: str) -> str | None:
        """A job's state when memory holds the job (a listing or a change reads no row)."""
        job = self.table.jobs.get(job_id) or self.table.finished.get(job_id)
        return None if job is None else job.state.value

    def _read_state(self, job_id: str) -> str | None:
        """A job's state, a finished job read back from the store if need be (``ReadPending``:
        the request is applied again once the row is read)."""
        job = self.table.lookup(job_id)
        return None if job is None else job.state.value

    def _reply(self, schedule: Schedule) -> m.Message:
        """SCHEDULE after a change: states as memory holds them, so nothing is read (and
        the change is never applied twice)."""
        return m.Schedule(schedule.view(self._held_state, self.table.max_attempts_of))

    def get(self, now: int, name: str) -> m.Message:
        """SCHEDULE with its recent jobs and their states (a finished job may be read back)."""
        schedule = self.by_name.get(name)
        if schedule is None:
            return unknown(name)
        return m.Schedule(schedule.view(self._read_state, self.table.max_attempts_of))

    def list_schedules(self, now: int, req: m.ScheduleList) -> m.Message:
        """SCHEDULE_LIST: by name, a page of ``limit`` after ``after`` (shorter when the
        frame would be too large), each with the states of the jobs memory holds."""
        limit = req.limit if req.limit is not None else LIST_MAX
        if not 1 <= limit <= LIST_MAX:
            return m.Error("limit must be 1..%d, got %s" % (LIST_MAX, quote(limit)))
        if self._sorted is None:
            self._sorted = sorted(self.by_name)
        names = self._sorted
        start = 0 if req.after is None else bisect.bisect_right(names, req.after)
        page = names[start:start + limit]
        out: list[dict[str, Any]] = []
        size = 0
        for name in page:
            view = self.by_name[name].view(self._held_state, self.table.max_attempts_of)
            size += len(ujson.dumps(view, ensure_ascii=False).encode("utf-8")) + 1
            if size > LIST_MAX_BYTES and out:
                return m.ScheduleList(schedules=out, next_after=out[-1]["name"])
            out.append(view)
        return m.ScheduleList(schedules=out, next_after=page[-1] if start + limit < len(names) else None)

    def set_paused(self, now: int, name: str, paused: bool) -> m.Message:
        """SCHEDULE_PAUSE and SCHEDULE_RESUME; resuming fires nothing for the times that
        passed while paused."""
        schedule = self.by_name.get(name)
        if schedule is None:
            return unknown(name)
        if schedule.paused != paused:
            schedule.paused = paused
            if not paused:
                schedule.cursor = max(schedule.cursor, now + self.table.drift)
            self._arm(schedule)
            self._touch(schedule)
        return self._reply(schedule)

    def delete(self, now: int, name: str) -> m.Message:
        """SCHEDULE with its last state; its jobs stay."""
        schedule = self.by_name.get(name)
        if schedule is None:
            return unknown(name)
        self.remove(name)
        schedule.next_fire = None
        return self._reply(schedule)

    def remove(self, name: str) -> None:
        del self.by_name[name]
        self._sorted = None
        self._dirty[name] = None

    def trigger(self, now: int, name: str, submitted_by: str | None = None,
                task_types: tuple[str, ...] | None = None) -> m.Message:
        """A job now, scheduledFor now, outside the overlap rule, submitted by the token
        ``submitted_by`` names (auth on; limited to its ``task_types``). Fire times already
        due are made first, so a trigger at the very instant of a fire time is that fire's job."""
        schedule = self.by_name.get(name)
        if schedule is None:
            return unknown(name)
        refused = type_refusal(submitted_by, task_types, schedule.task_type)
        if refused is not None:
            return m.Error(refused)
        table = self.table
        wall = now + table.drift
        if not schedule.paused and schedule.next_fire is not None and schedule.next_fire <= wall:
            if self.behind or not self._fire(schedule, now, wall, False):
                return rejected(self.table)
            self._arm(schedule)
        if schedule.last_fire == wall and schedule.last_job_id is not None:
            return m.JobSubmitted(schedule.last_job_id)
        existing = table.keys.get(KEY_PREFIX + "%s:%d" % (name, wall))
        if existing is not None:  # a trigger in the same millisecond
            return m.JobSubmitted(existing)
        if table.active_count >= self.config.max_active_jobs:
            return rejected(self.table)
        detail = "triggered from schedule %s" % name
        if submitted_by is not None:
            detail += " by %s" % submitted_by
        job_id = self._make(schedule, now, wall, detail, submitted_by)
        self._touch(schedule)
        return m.JobSubmitted(job_id)

    def preview(self, now: int, req: m.SchedulePreview) -> m.Message:
        """The next ``count`` fire times after ``fromMillis`` (default: now) of any rule."""
        count = req.count if req.count is not None else 10
        if not 1 <= count <= PREVIEW_MAX:
            return m.Error("count must be 1..%d, got %s" % (PREVIEW_MAX, quote(count)))
        start = req.from_millis if req.from_millis is not None else now + self.table.drift
        if not 0 <= start <= MAX_MILLIS:
            return m.Error("fromMillis must be a time before the year 10000, got %s" % quote(start))
        try:
            rule = Rule(req.cron, req.every_millis, req.timezone or "UTC", start)
        except RuleError as exc:
            return m.Error(str(exc))
        times = [t for t in rule.upcoming(start, count) if t <= MAX_MILLIS]
        return m.SchedulePreview(cron=req.cron, every_millis=req.every_millis, timezone=req.timezone or "UTC",
                                 from_millis=start, count=count, fire_times=times)

    # ---- the schedules file -------------------------------------------------------------------

    def apply_file(self, now: int, definitions: list[dict[str, Any]]) -> str | None:
        """The schedules file's set: each replaces its schedule, file-made schedules the file
        no longer names are deleted, API-made ones are left alone (a file schedule whose
        name an API schedule holds is an error). All or nothing: the reason, or None.

        A schedule the file defines again keeps the paused state it has (paused or resumed
        over the wire) unless the file's own ``paused`` changed since it was last applied.
        A file that names task types no worker has declared yet (a fresh database, workers
        not registered) is checked now and applied by the first sweep once they are known
        (``waiting_for``); until then the schedules in force stay."""
        wall = now + self.table.drift
        known = self.table.known_types
        missing = sorted({t for t in (obj.get("taskType") for obj in definitions) if isinstance(t, str)} - known)

        def check(task_type: str, payload: dict[str, Any]) -> str | None:  # a type still missing is checked later
            return None if task_type in missing else self.check_payload(task_type, payload)

        parsed: dict[str, Schedule] = {}
        for obj in definitions:
            name = obj.get("name")
            old = self.by_name.get(name) if isinstance(name, str) else None
            if old is not None and old.origin != "file":
                return "schedule %s exists and was made through the API; rename it in the file" % quote(name)
            try:
                schedule = self._prepare(obj, "file", wall, check, self._file_pause(obj, old))
            except RuleError as exc:
                return "schedule %s: %s" % (quote(name), exc)
            if schedule.name in parsed:
                return "schedule %s is defined twice" % quote(schedule.name)
            schedule.file_paused = bool(obj.get("paused", False))
            parsed[schedule.name] = schedule
        self.pending_file, self.waiting = (definitions, missing) if missing else (None, [])
        if missing:
            log.warning("schedules file: waiting for task types %s, which no worker has declared yet; it is applied "
                        "once one has (the schedules in force stay until then)", ", ".join(map(quote, missing)))
            return None
        for name, schedule in parsed.items():
            old = self.by_name.get(name)
            if old is None or old.definition() != schedule.definition() or old.file_paused != schedule.file_paused:
                self._install(schedule)
        for name in [n for n, s in self.by_name.items() if s.origin == "file" and n not in parsed]:
            self.remove(name)
        return None

    @staticmethod
    def _file_pause(obj: dict[str, Any], old: Schedule | None) -> bool | None:
        """The paused state a file-made schedule gets when its file is applied again: the one
        it has, unless the file's ``paused`` changed since the last time (None: the file's)."""
        said = obj.get("paused", False)
        if old is None or not isinstance(said, bool) or old.file_paused not in (None, said):
            return None
        return old.paused

    def waiting_for(self) -> list[str]:
        """The task types a schedules file waits for before it is applied (none: not waiting)."""
        return list(self.waiting)

    def _apply_waiting_file(self, now: int) -> None:
        """A sweep's step: the schedules file that waited for task types, once they are known."""
        if not self.table.known_types.issuperset(self.waiting):
            return
        definitions, self.pending_file = self.pending_file or [], None
        self.waiting = []
        problem = self.apply_file(now, definitions)
        if problem is not None:
            log.error(SCHEDULES_NOT_APPLIED, problem)
        elif not self.waiting:
            log.info("schedules file applied: %d schedules from it, their task types now known", len(definitions))

    def next_due(self) -> int | None:
        """The earliest next fire time (wall clock), or None; stale heap entries go first."""
        heap = self.heap
        while heap:
            at, name = heap[0]
            schedule = self.by_name.get(name)
            if schedule is not None and schedule.next_fire == at:
                return at
            heapq.heappop(heap)
        return None
