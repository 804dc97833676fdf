"""Limits per task type: concurrency, rate and pause, and jobs unique while active.

``Limits`` is the core's part for docs/PROTOCOL.md, "Limits". It keeps each limited
type's ``TypeLimit`` (its settings, its RUNNING jobs in total and per concurrency key,
its QUEUED jobs per key, its token buckets), the index of unique keys held by live jobs,
and the due times at which a rate-limited type or key gets its next token. As the
table's listener it counts every start (a move to RUNNING: an ASSIGNED event) and every
end of an attempt; a RUNNING job recovery kept on its lease counts as it is adopted. It
listens only while there is something to keep (``listen``, ``settle``): a coordinator
with no limit and no live unique key pays nothing per job.

Limits are exact because they are checked where the core assigns: the JSON part's queue
of a limited type is a ``scheduler.KeyedJobs`` whose ``Gate`` is the type's
``TypeLimit``, and the Periodic part asks the same gate before each dispatch. A type
without a limit costs one dict lookup per move here (none at all while nothing is
limited) and nothing in the scheduler.

When a type or key may start again (an attempt ended, a token is due, the limit was
changed), the parts that hold its jobs are told (``on_open``); a token's due time is
kept on ``_wakes``, which the runtime arms a timer for (``next_wake``), so nothing polls.

A limit is stored as one row per type (``Batch.limits``: the type and a JSON body),
written with the batch that changed it, and loaded at recovery (a restart, a reload
after a storage outage, a standby taking over), before the jobs, so that the RUNNING
jobs recovered count against it. Buckets start full.
"""

from __future__ import annotations

import heapq
import logging
import math
from fractions import Fraction
from typing import Any, Callable

import ujson

from jobmesh.coordinator.core.table import JobTable
from jobmesh.protocol import messages as m
from jobmesh.protocol.jobs import TERMINAL, JobState, Priority
from jobmesh.protocol.messages import quote
from jobmesh.store.base import Store
from jobmesh.store.job import Job

log = logging.getLogger(__name__)

MAX_KEY_CHARS = 256  # concurrencyKey and uniqueKey: 1-256 characters, no NUL
MAX_COUNT = 1 << 31  # maxRunning, maxRunningPerKey and burst are below this
MAX_RATE = 1e9  # starts per second
# The reasons a QUEUED job is held back, in precedence order (the first that holds is shown).
TYPE_PAUSED, CONCURRENCY_LIMIT, KEY_CONCURRENCY_LIMIT, RATE_LIMIT = REASONS = (
    "TYPE_PAUSED", "CONCURRENCY_LIMIT", "KEY_CONCURRENCY_LIMIT", "RATE_LIMIT")
COUNTS = ("maxRunning", "maxRunningPerKey", "burst")
RATES = ("ratePerSecond", "ratePerKeyPerSecond")
FIELDS = ("taskType",) + COUNTS + RATES + ("paused",)
COUNTED = ("running", "queued")  # a limit object as read carries these; a put ignores them
_PRIORITIES = tuple(Priority)


def check_key(name: str, value: str | None) -> str | None:
    """Why a submit's ``concurrencyKey`` / ``uniqueKey`` is refused; None if it is fine."""
    if value is None:
        return None
    if not 1 <= len(value) <= MAX_KEY_CHARS:
        return "%s must be 1-%d characters" % (name, MAX_KEY_CHARS)
    if "\x00" in value:
        return "%s must not contain the NUL character (\\u0000)" % name
    return None


class Bucket:
    """A token bucket on starts: at most ``size`` tokens, ``rate`` more per second, one
    taken per start; so in any t seconds at most size + rate·t starts. Exact arithmetic
    (``Fraction``) on core milliseconds: no rounding lets an extra start through."""

    __slots__ = ("rate", "size", "tokens", "stamp")

    def __init__(self, rate: Fraction, size: int, now: int) -> None:
        self.rate = rate
        self.size = size
        self.tokens = Fraction(size)  # full
        self.stamp = now

    def level(self, now: int) -> Fraction:
        if now > self.stamp:
            self.tokens = min(Fraction(self.size), self.tokens + self.rate * (now - self.stamp) / 1000)
            self.stamp = now
        return self.tokens

    def ready(self, now: int) -> bool:
        return self.level(now) >= 1

    def take(self, now: int) -> None:
        self.level(now)
        self.tokens -= 1

    def due(self, now: int, tokens: int = 1) -> int:
        """The first core millisecond at which the bucket holds ``tokens`` tokens."""
        missing = tokens - self.level(now)
        return now if missing <= 0 else now + math.ceil(missing * 1000 / self.rate)


def _rate(value: float) -> Fraction:
    return Fraction(repr(float(value)))


class TypeLimit:
    """One task type's limit and what it counts: the ``Gate`` of its queue."""

    def __init__(self, task_type: str, wake: Callable[[int, str, str | None], None]) -> None:
        self.task_type = task_type
        self._wake = wake  # (due, type, key): ask to be told when a token is there
        self.max_running: int | None = None
        self.max_per_key: int | None = None
        self.rate: float | None = None
        self.burst: int | None = None
        self.rate_per_key: float | None = None
        self.paused = False
        self.running = 0
        self.running_by_key: dict[str, int] = {}
        self.queued_by_key: dict[str | None, int] = {}
        self.bucket: Bucket | None = None
        self.key_buckets: dict[str, Bucket] = {}

    # ---- settings ------------------------------------------------------------------

    def settings(self) -> dict[str, Any]:
        return {"taskType": self.task_type, "maxRunning": self.max_running, "maxRunningPerKey": self.max_per_key,
                "ratePerSecond": self.rate, "burst": self.burst, "ratePerKeyPerSecond": self.rate_per_key,
                "paused": self.paused}

    def body(self) -> str:
        body = self.settings()
        del body["taskType"]
        return ujson.dumps(body)

    def apply(self, fields: dict[str, Any], now: int) -> None:
        """Take these settings (checked already; ``paused`` absent: kept). A bucket whose
        rate or size changed starts full; one that did not goes on as it was."""
        self.max_running = fields.get("maxRunning")
        self.max_per_key = fields.get("maxRunningPerKey")
        rate, rate_per_key = fields.get("ratePerSecond"), fields.get("ratePerKeyPerSecond")
        burst: int | None = fields.get("burst")
        if rate is None:
            self.bucket = None
        else:
            if burst is None:
                burst = max(1, math.ceil(rate))
            if self.bucket is None or rate != self.rate or burst != self.burst:
                self.bucket = Bucket(_rate(rate), burst, now)
        if rate_per_key != self.rate_per_key:
            self.key_buckets = {}
        self.rate, self.burst, self.rate_per_key = rate, burst, rate_per_key
        if fields.get("paused") is not None:
            self.paused = fields["paused"]

    def limited(self) -> bool:
        """Whether anything is set (else the type needs no entry)."""
        return self.paused or any(v is not None for v in (self.max_running, self.max_per_key, self.rate,
                                                          self.rate_per_key))

    # ---- the gate --------------------------------------------------------------------

    def open(self, now: int) -> bool:
        if self.paused or (self.max_running is not None and self.running >= self.max_running):
            return False
        bucket = self.bucket
        if bucket is not None and not bucket.ready(now):
            self._wake(bucket.due(now), self.task_type, None)
            return False
        return True

    def key_open(self, key: str, now: int) -> bool:
        if self.max_per_key is not None and self.running_by_key.get(key, 0) >= self.max_per_key:
            return False  # the end of one of its attempts opens it again
        bucket = self.key_buckets.get(key)
        if bucket is not None and not bucket.ready(now):
            self._wake(bucket.due(now), self.task_type, key)
            return False
        return True

    def reason(self, key: str | None, now: int) -> str | None:
        """Why a QUEUED job with this key is held back now, the first reason that holds; None if nothing does."""
        if self.paused:
            return TYPE_PAUSED
        if self.max_running is not None and self.running >= self.max_running:
            return CONCURRENCY_LIMIT
        if key is not None and self.max_per_key is not None and self.running_by_key.get(key, 0) >= self.max_per_key:
            return KEY_CONCURRENCY_LIMIT
        if self.bucket is not None and not self.bucket.ready(now):
            return RATE_LIMIT
        bucket = None if key is None else self.key_buckets.get(key)
        if bucket is not None and not bucket.ready(now):
            return RATE_LIMIT
        return None

    # ---- counting --------------------------------------------------------------------

    def started(self, key: str | None, now: int, token: bool = True) -> None:
        """A job of the type started (``token``: a new start, which takes a token; a
        lease kept by recovery counts without one)."""
        self.running += 1
        if key is not None:
            self.running_by_key[key] = self.running_by_key.get(key, 0) + 1
        if not token:
            return
        if self.bucket is not None:
            self.bucket.take(now)
        if key is not None and self.rate_per_key is not None:
            bucket = self.key_buckets.get(key)
            if bucket is None:
                bucket = self.key_buckets[key] = Bucket(_rate(self.rate_per_key), 1, now)
            bucket.take(now)
            self._wake(bucket.due(now), self.task_type, key)  # then the key opens, or its bucket is forgotten

    def ended(self, key: str | None, now: int) -> None:
        self.running -= 1
        if key is not None:
            n = self.running_by_key.get(key, 0) - 1
            if n > 0:
                self.running_by_key[key] = n
                return
            self.running_by_key.pop(key, None)
            bucket = self.key_buckets.get(key)
            if bucket is not None:  # forgotten once full again (``forget_full``)
                self._wake(bucket.due(now, bucket.size), self.task_type, key)

    def queue(self, key: str | None, delta: int) -> None:
        n = self.queued_by_key.get(key, 0) + delta
        if n > 0:
            self.queued_by_key[key] = n
        else:
            self.queued_by_key.pop(key, None)

    def forget_full(self, key: str, now: int) -> None:
        """A key's bucket that is full again and has no running job holds nothing to remember."""
        bucket = self.key_buckets.get(key)
        if bucket is not None and key not in self.running_by_key and bucket.level(now) >= bucket.size:
            del self.key_buckets[key]

    def held(self, now: int) -> dict[str, int]:
        """QUEUED jobs held back, by reason: O(keys with queued jobs)."""
        out: dict[str, int] = {}
        for key, n in self.queued_by_key.items():
            reason = self.reason(key, now)
            if reason is not None:
                out[reason] = out.get(reason, 0) + n
        return out


class Limits:
    """The limits per task type and the unique keys of live jobs; see the module docstring."""

    def __init__(self, table: JobTable, known: Callable[[str], bool]) -> None:
        self.table = table
        self.known = known  # whether a task type (or Periodic func) is one the coordinator knows
        self.by_type: dict[str, TypeLimit] = {}
        self.unique: dict[tuple[str, str], str] = {}  # (task type, uniqueKey) -> the live job holding it
        self._wakes: list[tuple[int, str, str]] = []  # (due, type, key or ""): a token is due
        self._due: dict[tuple[str, str], int] = {}  # the earliest wake asked for each (type, key or "")
        self._dirty: dict[str, TypeLimit | None] = {}
        self._openers: list[Callable[[str, str | None], None]] = []
        self._changed: list[Callable[[str, TypeLimit | None], None]] = []
        self.now = 0  # the latest core time seen (a snapshot's reason is as of it)
        self._listening = False
        self.listen()  # recovery's jobs: their unique keys, and the RUNNING ones of limited types

    def listen(self) -> None:
        """Be told of every job from now on: a limit is set, or a job with a unique key comes."""
        if not self._listening:
            self.table.listen(self)
            self._listening = True

    def settle(self) -> None:
        """After recovery: with no limit and no unique key held there is nothing to keep
        until one comes (``listen``), so the table need not tell of any job meanwhile."""
        if self._listening and not self.by_type and not self.unique:
            self.table.unlisten(self)
            self._listening = False

    def on_open(self, opener: Callable[[str, str | None], None]) -> None:
        """Tell ``opener(type, key)`` when a type (key None) or one of its keys may start again."""
        self._openers.append(opener)

    def on_change(self, changed: Callable[[str, TypeLimit | None], None]) -> None:
        """Tell ``changed(type, limit or None)`` when a type's limit is set, changed or removed."""
        self._changed.append(changed)

    # ---- the table's listener --------------------------------------------------------

    def entered(self, job: Job, now: int) -> None:
        if job.unique_key is not None:
            self.unique[(job.task_type, job.unique_key)] = job.job_id
        limit = self.by_type.get(job.task_type)
        if limit is not None:
            if job.state is JobState.RUNNING:
                limit.started(job.concurrency_key, now, token=False)  # recovered: a kept lease counts
            elif job.state is JobState.QUEUED:
                limit.queue(job.concurrency_key, 1)

    def moved(self, job: Job, source: JobState, target: JobState, now: int) -> None:
        if target in TERMINAL and job.unique_key is not None:
            if self.unique.get((job.task_type, job.unique_key)) == job.job_id:
                del self.unique[(job.task_type, job.unique_key)]
        limit = self.by_type.get(job.task_type)
        if limit is None:
            return
        self.now = now
        key = job.concurrency_key
        if source is JobState.QUEUED:
            limit.queue(key, -1)
        elif target is JobState.QUEUED:
            limit.queue(key, 1)
        if target is JobState.RUNNING:
            limit.started(key, now)
        elif source is JobState.RUNNING:
            limit.ended(key, now)
            self._open(job.task_type, None)
            if key is not None:
                self._open(job.task_type, key)

    def _open(self, task_type: str, key: str | None) -> None:
        for opener in self._openers:
            opener(task_type, key)

    # ---- gates and wakes -------------------------------------------------------------

    def gate(self, task_type: str) -> TypeLimit | None:
        return self.by_type.get(task_type)

    def _wake_at(self, due: int, task_type: str, key: str | None) -> None:
        slot = (task_type, key or "")
        if self._due.get(slot, due + 1) <= due:
            return  # an earlier wake is asked for already
        self._due[slot] = due
        heapq.heappush(self._wakes, (due, task_type, key or ""))

    def next_wake(self) -> int | None:
        """The earliest core time a token is due (the runtime's timer), or None."""
        return self._wakes[0][0] if self._wakes else None

    def wake(self, now: int) -> None:
        """Tokens due by ``now``: their types and keys may start again."""
        self.now = max(self.now, now)
        wakes = self._wakes
        while wakes and wakes[0][0] <= now:
            due, task_type, key = heapq.heappop(wakes)
            if self._due.get((task_type, key)) != due:
                continue  # replaced by another
            del self._due[(task_type, key)]
            limit = self.by_type.get(task_type)
            if limit is None:
                continue
            if key:
                limit.forget_full(key, now)
            self._open(task_type, key or None)

    # ---- requests ----------------------------------------------------------------------

    def view(self, task_type: str) -> dict[str, Any]:
        """A type's limit object: its settings (all null, not paused, for a type with none)
        and its RUNNING and QUEUED jobs now."""
        limit = self.by_type.get(task_type)
        view = limit.settings() if limit is not None else dict.fromkeys(FIELDS[1:-1], None)
        view["taskType"] = task_type
        view.setdefault("paused", False)
        counts = self.table.counts
        for field, state in (("running", JobState.RUNNING), ("queued", JobState.QUEUED)):
            view[field] = sum(counts.get((state, task_type, p, periodic), 0)
                              for p in _PRIORITIES for periodic in (False, True))
        return {name: view[name] for name in FIELDS + COUNTED}

    def get(self, now: int, req: m.LimitGet) -> m.Message:
        return m.Limit(self.view(req.task_type))

    def list_limits(self, now: int, req: m.LimitList) -> m.Message:
        return m.LimitList(limits=[self.view(name) for name in sorted(self.by_type)])

    def put(self, now: int, req: m.LimitPut) -> m.Message:
        body = req.limit
        task_type = body.get("taskType")
        if not isinstance(task_type, str):
            return m.Error("limit.taskType must be a string")
        problem = check_fields(body)
        if problem is not None:
            return m.Error(problem)
        return self._change(now, task_type, lambda limit: limit.apply(body, now))

    def set_paused(self, now: int, task_type: str, paused: bool) -> m.Message:
        return self._change(now, task_type, lambda limit: setattr(limit, "paused", paused))

    def _change(self, now: int, task_type: str, change: Callable[[TypeLimit], None]) -> m.Message:
        """Change a known type's limit (made if it has none): stored with the batch, its
        queue told, and its jobs may start again at once if the change lets them."""
        problem = self._check_type(task_type)
        if problem is not None:
            return m.Error(problem)
        limit = self.by_type.get(task_type)
        fresh = limit is None
        if limit is None:
            limit = TypeLimit(task_type, self._wake_at)
        change(limit)
        self._set(task_type, limit, fresh)
        log.info("limit of type=%s now %s", task_type, limit.body())
        return m.Limit(self.view(task_type))

    def delete(self, now: int, req: m.LimitDelete) -> m.Message:
        problem = self._check_type(req.task_type)
        if problem is not None:
            return m.Error(problem)
        last = self.view(req.task_type)
        if req.task_type in self.by_type:
            self._drop(req.task_type)
            log.info("limit removed type=%s", req.task_type)
        return m.Limit(last)

    def _check_type(self, task_type: str) -> str | None:
        if task_type in self.by_type or self.known(task_type):
            return None
        return "unknown task type %s: no worker has declared it" % quote(task_type)

    def _set(self, task_type: str, limit: TypeLimit, fresh: bool) -> None:
        if not limit.limited():
            if not fresh:
                self._drop(task_type)
            return
        if fresh:
            self.listen()
            self._count(limit)
            self.by_type[task_type] = limit
        self._dirty[task_type] = limit
        for changed in self._changed:
            changed(task_type, limit)
        self._open(task_type, None)

    def _drop(self, task_type: str) -> None:
        del self.by_type[task_type]
        self._dirty[task_type] = None
        for changed in self._changed:
            changed(task_type, None)
        self._open(task_type, None)

    def _count(self, limit: TypeLimit) -> None:
        """A type that gets a limit: count its RUNNING and QUEUED jobs (O(active jobs), once)."""
        for job in self.table.jobs.values():
            if job.task_type == limit.task_type:
                if job.state is JobState.RUNNING:
                    limit.started(job.concurrency_key, 0, token=False)
                elif job.state is JobState.QUEUED:
                    limit.queue(job.concurrency_key, 1)

    # ---- what a queued job is held back by, and figures ----------------------------------

    def reason(self, job: Job) -> str | None:
        """Why a QUEUED job is held back by its type's limit (as of the latest core time seen); None if it is not."""
        limit = self.by_type.get(job.task_type)
        return None if limit is None else limit.reason(job.concurrency_key, self.now)

    def held(self) -> dict[tuple[str, str], int]:
        """QUEUED jobs held back, by (task type, reason): O(limited types and their keys with queued jobs)."""
        out: dict[tuple[str, str], int] = {}
        for task_type, limit in self.by_type.items():
            for reason, n in limit.held(self.now).items():
                out[(task_type, reason)] = n
        return out

    # ---- recovery and rows ---------------------------------------------------------------

    def load(self, store: Store, now: int) -> None:
        """Recovery, before the jobs are adopted: every stored limit."""
        self.now = now
        for task_type, text in store.load_limits():
            try:
                fields = ujson.loads(text)
                problem = check_fields(fields) if isinstance(fields, dict) else "not an object"
            except ValueError as exc:
                problem = str(exc)
            if problem is not None:
                log.error("limit of type %s: its stored row does not decode (%s); it is left out", quote(task_type),
                          problem)
                continue
            limit = TypeLimit(task_type, self._wake_at)
            limit.apply(fields, now)
            self.by_type[task_type] = limit
            for changed in self._changed:
                changed(task_type, limit)

    def take_dirty(self) -> list[tuple[str, str | None]]:
        """Rows to commit: (type, body) per changed limit, (type, None) per removed one."""
        if not self._dirty:
            return []
        rows = [(name, None if limit is None else limit.body()) for name, limit in self._dirty.items()]
        self._dirty = {}
        return rows


def check_fields(body: dict[str, Any]) -> str | None:
    """Why a limit's fields are refused; None if they are fine."""
    unknown = sorted(set(body).difference(FIELDS, COUNTED))
    if unknown:
        return "limit has unknown field %s (fields: %s)" % (quote(unknown[0]), ", ".join(FIELDS))
    for name in COUNTS:
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < MAX_COUNT):
            return "%s must be an integer from 0 to %d or null, got %s" % (name, MAX_COUNT - 1, quote(value))
    if body.get("burst") == 0:
        return "burst must be at least 1, got 0"
    for name in RATES:
        value = body.get(name)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                  or not 0 < value <= MAX_RATE):
            return "%s must be a number above 0 (at most %g) or null, got %s" % (name, MAX_RATE, quote(value))
    if body.get("burst") is not None and body.get("ratePerSecond") is None:
        return "burst needs ratePerSecond"
    paused = body.get("paused")
    if paused is not None and not isinstance(paused, bool):
        return "paused must be true or false, got %s" % quote(paused)
    return None
