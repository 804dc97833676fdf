"""Limits hold at every instant, and never keep a job waiting that could run: a property
test (hypothesis) through the real core.

Random submits (two types, a few concurrency keys, priorities), results (successes and
failures), worker losses and new workers, cancels, limit changes (puts, deletes, pauses,
resumes) and the passing of time (the token wake-up and the sweep) go through the core as
the runtime applies them. After every batch, checked against a model of the limits kept
here from the starts seen (TASK_ASSIGN frames), not from the core's own counters:

* no type has more jobs RUNNING than its maxRunning, no key more than maxRunningPerKey
  (a limit lowered below what runs lets those attempts finish: no more than they run);
* every run of starts since a bucket was (re)filled fits ``burst + rate × t`` (per type)
  and ``1 + ratePerKey × t`` (per key);
* no job waits that could run: every QUEUED job that no limit holds back has no free
  worker that runs its type.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jobmesh.coordinator.core import events as ev
from jobmesh.protocol import messages as m
from jobmesh.protocol.jobs import JobState
from tests.unit.test_core import Harness

TYPES = ("SLEEP", "EXPORT")
KEYS = (None, "a", "b")
PAYLOAD = {"durationMillis": 10}


class Model:
    """The limits as set, and the starts seen since each bucket was filled."""

    def __init__(self) -> None:
        self.limits: dict[str, dict[str, Any]] = {}
        self.starts: dict[str, list[int]] = {t: [] for t in TYPES}  # since the type's bucket was filled
        self.key_starts: dict[tuple[str, str], list[int]] = {}  # since the key's buckets were filled
        self.before: dict[str, set[str]] = {}  # the jobs running when the type's limit was last set

    def put(self, task_type: str, limit: dict[str, Any], running: set[str] = frozenset()) -> None:
        self.before[task_type] = set(running)
        old = self.limits.get(task_type, {})
        rate, burst = limit.get("ratePerSecond"), limit.get("burst")
        if rate is not None and burst is None:
            burst = max(1, -(-Fraction(repr(float(rate))) // 1))
        new = dict(limit, burst=burst)
        if (old.get("ratePerSecond"), old.get("burst")) != (rate, burst):
            self.starts[task_type] = []
        if old.get("ratePerKeyPerSecond") != limit.get("ratePerKeyPerSecond"):
            for slot in [s for s in self.key_starts if s[0] == task_type]:
                del self.key_starts[slot]
        self.limits[task_type] = new

    def delete(self, task_type: str) -> None:
        self.put(task_type, {})
        self.limits.pop(task_type, None)

    def started(self, task_type: str, key: str | None, now: int) -> None:
        self.starts[task_type].append(now)
        if key is not None:
            self.key_starts.setdefault((task_type, key), []).append(now)

    @staticmethod
    def tokens(starts: list[int], rate: Any, size: int, now: int) -> Fraction:
        """The bucket's tokens at ``now``: full when filled, ``rate`` a second, one per start."""
        rate = Fraction(repr(float(rate)))
        tokens = Fraction(size)
        stamp = None
        for at in starts:
            if stamp is not None:
                tokens = min(Fraction(size), tokens + rate * (at - stamp) / 1000)
            tokens -= 1
            stamp = at
        if stamp is not None:
            tokens = min(Fraction(size), tokens + rate * (now - stamp) / 1000)
        return tokens

    def holds(self, task_type: str, key: str | None, running: dict, now: int) -> bool:
        """Whether a limit holds back a QUEUED job of this type and key now."""
        limit = self.limits.get(task_type)
        if limit is None:
            return False
        if limit.get("paused"):
            return True
        total = sum(n for (t, _k), n in running.items() if t == task_type)
        if limit.get("maxRunning") is not None and total >= limit["maxRunning"]:
            return True
        if key is not None and limit.get("maxRunningPerKey") is not None:
            if running.get((task_type, key), 0) >= limit["maxRunningPerKey"]:
                return True
        if limit.get("ratePerSecond") is not None:
            if self.tokens(self.starts[task_type], limit["ratePerSecond"], limit["burst"], now) < 1:
                return True
        if key is not None and limit.get("ratePerKeyPerSecond") is not None:
            if self.tokens(self.key_starts.get((task_type, key), []), limit["ratePerKeyPerSecond"], 1, now) < 1:
                return True
        return False

    def check_buckets(self) -> None:
        for task_type, starts in self.starts.items():
            limit = self.limits.get(task_type) or {}
            if limit.get("ratePerSecond") is not None:
                fits(starts, Fraction(repr(float(limit["ratePerSecond"]))), limit["burst"], task_type)
        for (task_type, key), starts in self.key_starts.items():
            limit = self.limits.get(task_type) or {}
            if limit.get("ratePerKeyPerSecond") is not None:
                fits(starts, Fraction(repr(float(limit["ratePerKeyPerSecond"]))), 1, (task_type, key))


def fits(starts: list[int], rate: Fraction, burst: int, what: Any) -> None:
    for i in range(len(starts)):
        for j in range(i, len(starts)):
            assert j - i + 1 <= burst + rate * (starts[j] - starts[i]) / 1000, (what, starts, rate, burst)


counts = st.one_of(st.none(), st.integers(1, 3), st.just(0))
rates = st.one_of(st.none(), st.none(), st.sampled_from([0.5, 1, 2, 3.5, 10]))
limit_fields = st.fixed_dictionaries({"maxRunning": counts, "maxRunningPerKey": counts, "ratePerSecond": rates,
                                      "ratePerKeyPerSecond": rates}, optional={"burst": st.integers(1, 4)})
submits = st.tuples(st.just("submit"), st.sampled_from(TYPES), st.sampled_from(KEYS),
                    st.sampled_from(["LOW", "NORMAL", "HIGH"]))
results = st.tuples(st.just("result"), st.integers(0, 50), st.booleans())
ops = st.one_of(
    submits, submits, submits, submits, results, results, results,
    st.tuples(st.just("lose"), st.integers(0, 10)),
    st.tuples(st.just("worker"), st.integers(1, 4)),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("limit"), st.sampled_from(TYPES), limit_fields),
    st.tuples(st.just("delete"), st.sampled_from(TYPES)),
    st.tuples(st.just("pause"), st.sampled_from(TYPES), st.booleans()),
    st.tuples(st.just("time"), st.sampled_from([1, 100, 333, 500, 1000, 2500])),
)


def _limit(**fields: Any) -> tuple:
    return ("limit", "SLEEP", dict(dict.fromkeys(["maxRunning", "maxRunningPerKey", "ratePerSecond",
                                                  "ratePerKeyPerSecond"]), **fields))


@example([_limit(maxRunningPerKey=1)],  # a key's attempt ends: its next job starts
         [("submit", "SLEEP", "a", "LOW"), ("submit", "SLEEP", "a", "LOW"), ("result", 0, True),
          ("submit", "SLEEP", "b", "LOW"), ("submit", "SLEEP", "a", "HIGH"), ("lose", 0), ("worker", 2)])
@example([_limit(ratePerSecond=2, burst=2)],  # a burst, then a start per token
         [("submit", "SLEEP", None, "LOW")] * 5 + [("worker", 4), ("time", 333), ("time", 333), ("result", 0, False),
                                                   ("time", 1000), ("submit", "EXPORT", "a", "HIGH")])
@example([_limit(ratePerKeyPerSecond=1)],
         [("submit", "SLEEP", "a", "LOW")] * 3 + [("submit", "SLEEP", "b", "LOW"), ("time", 500), ("time", 500),
                                                  ("pause", "SLEEP", True), ("time", 1000), ("pause", "SLEEP", False)])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(TYPES), limit_fields).map(lambda t: ("limit",) + t), max_size=2),
       st.lists(ops, min_size=20, max_size=60))
def test_limits_hold_at_every_instant_and_no_runnable_job_waits(first, then):
    steps = first + then
    h = Harness(max_active_jobs=10_000)
    model = Model()
    now = 1000
    workers = 0
    h.register(now, "w0", capacity=3, task_types=list(TYPES))
    seen = 0  # frames looked at
    for op in steps:
        kind = op[0]
        if kind == "submit":
            _, task_type, key, priority = op
            reply = h.request(now, m.SubmitJob(task_type, dict(PAYLOAD), 2, None, priority, concurrency_key=key))
            assert isinstance(reply, m.JobSubmitted), reply
            h.step(now)
        elif kind == "result":
            leased = sorted(h.core.table.leases)
            if leased:
                h.report(now, leased[op[1] % len(leased)], success=op[2], error=None if op[2] else "boom")
        elif kind == "lose":
            live = sorted(s.worker_id for s in h.core.json.workers)
            if live:
                h.disconnect(now, live[op[1] % len(live)])
        elif kind == "worker":
            workers += 1
            h.register(now, "w%d" % workers, capacity=op[1], task_types=list(TYPES))
        elif kind == "cancel":
            active = sorted(h.core.table.jobs)
            if active:
                h.cancel(now, active[op[1] % len(active)])
        elif kind == "limit":
            _, task_type, fields = op
            reply = h.request(now, m.LimitPut(dict(fields, taskType=task_type)))
            if isinstance(reply, m.Limit):
                model.put(task_type, dict(fields, paused=model.limits.get(task_type, {}).get("paused", False)),
                          set(h.core.table.leases) | h.core.table.unclaimed)
            h.step(now)
        elif kind == "delete":
            h.request(now, m.LimitDelete(op[1]))
            model.delete(op[1])
            h.step(now)
        elif kind == "pause":
            _, task_type, paused = op
            h.request(now, m.TypePause(task_type) if paused else m.TypeResume(task_type))
            current = dict(model.limits.get(task_type, {}))
            model.put(task_type, dict(current, paused=paused), set(h.core.table.leases) | h.core.table.unclaimed)
            h.step(now)
        else:
            now += op[1]
            h.apply(now, ev.TOKENS_DUE)
            h.sweep(now)
        # the starts of this step, at this instant
        for conn, msg in h.sent[seen:]:
            if isinstance(msg, m.TaskAssign):
                job = h.core.table.jobs[msg.job_id]
                model.started(job.task_type, job.concurrency_key, now)
        seen = len(h.sent)
        check(h, model, now)


def check(h: Harness, model: Model, now: int) -> None:
    running: dict[tuple[str, str | None], int] = {}  # RUNNING jobs by (type, key or None)
    older: dict[tuple[str, str | None], int] = {}  # of them, those running when the limit was set
    for job in h.core.table.jobs.values():
        if job.state is JobState.RUNNING:
            slot = (job.task_type, job.concurrency_key)
            running[slot] = running.get(slot, 0) + 1
            if job.job_id in model.before.get(job.task_type, ()):
                older[slot] = older.get(slot, 0) + 1
    for task_type in TYPES:
        total = sum(n for (t, _key), n in running.items() if t == task_type)
        total_older = sum(n for (t, _key), n in older.items() if t == task_type)
        limit = model.limits.get(task_type) or {}
        if limit.get("maxRunning") is not None:
            assert total <= max(limit["maxRunning"], total_older), (task_type, total, limit)
        if limit.get("maxRunningPerKey") is not None:
            for key in KEYS[1:]:
                n, n_older = running.get((task_type, key), 0), older.get((task_type, key), 0)
                assert n <= max(limit["maxRunningPerKey"], n_older), (task_type, key, limit)
    model.check_buckets()
    free = {t for s in h.core.json.workers if len(h.core.table.running(s)) < s.capacity for t in s.task_types}
    for job in h.core.table.jobs.values():
        if job.state is JobState.QUEUED and job.task_type in free:
            assert model.holds(job.task_type, job.concurrency_key, running, now), \
                ("a job that could run waits", job.job_id, job.task_type, job.concurrency_key, model.limits)
