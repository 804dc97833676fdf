"""What the load generator submits: task mixes, priority mixes, deterministic requests.

A task spec is a comma-separated list of ``TYPE[:ARG][=WEIGHT]`` or the name of a mix
in ``MIXES``. ARG means: SLEEP duration in ms; SHA256 and WORD_COUNT text length in
characters; PRIME_COUNT the limit; FAIL failUntilAttempt. A priority spec is
``LEVEL[=WEIGHT],...`` (HIGH, NORMAL, LOW). Choices come from a ``random.Random``
seeded per client, so a given ``--seed`` replays the same request sequence.

Declared task types (``--types=N``): the submits go to ``T0..T(N-1)``, equal weights,
payload ``{}`` (a declared type's payload may be any JSON object), instead of the task
spec. ``worker_types(i, n, k)`` is the fixed subset worker ``i`` declares: ``k``
consecutive types from ``T(i mod n)``, so workers ``0..n-k`` between them declare every type.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass
from typing import Any

from jobmesh.protocol.framing import encode_frame
from jobmesh.protocol.payloads import validate_payload

MIXES = {
    "sleep0": "SLEEP:0",
    "mixed": "SLEEP:0=8,SHA256:1000=1,PRIME_COUNT:10000=1",
    "cpu": "PRIME_COUNT:100000=1,SHA256:10000=1,WORD_COUNT:10000=1",
    "sleep10": "SLEEP:10",
    "flaky": "SLEEP:0=9,FAIL:1=1",
}
DEFAULT_ARGS = {"SLEEP": 0, "SHA256": 1000, "WORD_COUNT": 1000, "PRIME_COUNT": 10000, "FAIL": 1}
PRIORITIES = ("HIGH", "NORMAL", "LOW")
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")


class SpecError(ValueError):
    """A task or priority spec that cannot be parsed."""


def _text(n: int, seed: int) -> str:
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n:
        w = rng.choice(WORDS)
        parts.append(w)
        size += len(w) + 1
    return " ".join(parts)[:n]


def _payload(task: str, arg: int, seed: int) -> dict[str, Any]:
    if task == "SLEEP":
        return {"durationMillis": arg}
    if task in ("SHA256", "WORD_COUNT"):
        return {"text": _text(arg, seed)}
    if task == "PRIME_COUNT":
        return {"limit": arg}
    if task == "FAIL":
        return {"failUntilAttempt": arg}
    raise SpecError("unknown task type %r" % task)


def _weights(items: list[tuple[Any, float]]) -> tuple[list[Any], list[float]]:
    values, cum, total = [], [], 0.0
    for value, weight in items:
        if weight < 0:
            raise SpecError("weights must be >= 0")
        if weight == 0:
            continue
        total += weight
        values.append(value)
        cum.append(total)
    if not values:
        raise SpecError("every weight is zero")
    return values, cum


@dataclass(frozen=True)
class Task:
    task_type: str
    arg: int
    payload: dict[str, Any]
    declared: bool = False  # a type workers declare (--types), not a built-in

    @property
    def label(self) -> str:
        return self.task_type if self.declared else "%s:%d" % (self.task_type, self.arg)


def type_names(n: int) -> list[str]:
    """The declared task types of ``--types=n``: T0..T(n-1)."""
    return ["T%d" % i for i in range(n)]


def worker_types(i: int, n: int, k: int) -> list[str]:
    """What worker ``i`` declares with ``--types=n --types-per-worker=k``: types i..i+k-1 mod n."""
    return ["T%d" % ((i + j) % n) for j in range(k)]


def declared_tasks(n: int) -> list[tuple[Task, float]]:
    """``--types=n``: every declared type with weight 1 and payload ``{}``."""
    if n < 1:
        raise SpecError("--types must be >= 1")
    return [(Task(name, 0, {}, declared=True), 1.0) for name in type_names(n)]


def parse_tasks(spec: str, seed: int = 1) -> list[tuple[Task, float]]:
    spec = MIXES.get(spec.strip(), spec)
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        body, _, weight = part.partition("=")
        name, _, arg = body.partition(":")
        name = name.strip().upper()
        try:
            value = int(arg) if arg else DEFAULT_ARGS[name]
            w = float(weight) if weight else 1.0
        except (KeyError, ValueError):
            raise SpecError("bad task spec %r (TYPE[:ARG][=WEIGHT], or one of %s)" % (part, ", ".join(MIXES)))
        payload = _payload(name, value, seed)
        try:
            validate_payload(name, payload)
        except Exception as exc:  # PayloadError: out of bounds
            raise SpecError("task %r: %s" % (part, exc)) from None
        out.append((Task(name, value, payload), w))
    if not out:
        raise SpecError("empty task spec")
    return out


def parse_priorities(spec: str) -> list[tuple[str | None, float]]:
    out: list[tuple[str | None, float]] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        level, _, weight = part.partition("=")
        level = level.strip().upper()
        if level not in PRIORITIES and level != "NONE":
            raise SpecError("bad priority %r (HIGH, NORMAL, LOW, or NONE to omit the field)" % level)
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise SpecError("bad priority weight in %r" % part) from None
        out.append((None if level == "NONE" else level, w))
    if not out:
        raise SpecError("empty priority spec")
    return out


class Workload:
    """Builds SUBMIT_JOB frames. Without idempotency keys the frames are pre-encoded."""

    def __init__(self, task_spec: str, priority_spec: str, seed: int, keys: bool, max_attempts: int = 0,
                 types: int = 0) -> None:
        self.tasks = declared_tasks(types) if types else parse_tasks(task_spec, seed)
        self.priorities = parse_priorities(priority_spec)
        self.seed = seed
        self.keys = keys
        self.max_attempts = max_attempts
        combos = []
        for task, tw in self.tasks:
            for prio, pw in self.priorities:
                combos.append(((task, prio), tw * pw))
        self._combos, self._cum = _weights(combos)
        self._frames = [encode_frame(self._request(task, prio, None)) for task, prio in self._combos]
        self.spec = ",".join("%s=%g" % (t.label, w) for t, w in self.tasks)

    def _request(self, task: Task, prio: str | None, key: str | None) -> dict[str, Any]:
        req: dict[str, Any] = {"type": "SUBMIT_JOB", "taskType": task.task_type, "payload": task.payload,
                               "maxAttempts": self.max_attempts}
        if prio is not None:
            req["priority"] = prio
        if key is not None:
            req["idempotencyKey"] = key
        return req

    def rng(self, client: int) -> random.Random:
        return random.Random(self.seed * 1_000_003 + client)

    def submit_frame(self, rng: random.Random, client: int, n: int) -> tuple[bytes, str | None]:
        """The n-th submit of ``client``: (frame, idempotency key or None)."""
        i = bisect.bisect_left(self._cum, rng.random() * self._cum[-1])
        if not self.keys:
            return self._frames[i], None
        task, prio = self._combos[i]
        key = "lg-%d-%d-%d" % (self.seed, client, n)
        return encode_frame(self._request(task, prio, key)), key
