"""Pure scheduling policy: effective priority, queued order, worker choice, retry delay.

Nothing here reads a clock; callers pass ``now_millis`` read once per pass, so a
scheduling pass is deterministic and each rule is unit-testable with plain numbers.

Queued order (docs/ARCHITECTURE.md, "Scheduling"): highest *effective* priority first,
then the earliest time the job became due, then the lowest submission sequence.
Effective priority is the base level (LOW=0, NORMAL=1, HIGH=2) plus one per whole
``aging_step_millis`` waited since the job became due (its submission, or its run-at
time if later), capped at HIGH.

``QueuedJobs`` keeps one heap per base level ordered by (due time, seq). Within one base
level, effective priority never increases along that order (a job due later has waited
no longer), so each heap's head is its best member and the best job is the best of at
most three heads: O(log n) per pick, however deep the queue.

``TypedQueues`` keeps one ``QueuedJobs`` per task type, so that a job no free worker can
run never holds back one that a free worker can run (no head-of-line blocking): a pick
compares only the heads of the types some free worker declared.

A type with a limit (``limits.py``) has a ``KeyedJobs`` instead: one ``QueuedJobs`` per
concurrency key, and per base level a heap of the heads of the keys that may start a
job, so that a key at its limit never holds back another key. The limit is its ``Gate``:
a closed gate (paused, at maxRunning, no rate token) holds the whole type in O(1); a key
found closed when its head comes up is set aside (its heap entries go stale) until the
gate's owner says it may start again (``unblock``), so a pick never scans blocked keys.
"""

from __future__ import annotations

import heapq
from typing import Callable, Container, Iterable, Protocol, TypeVar

from jobmesh.protocol.jobs import MAX_LEVEL

W = TypeVar("W")
QueueKey = tuple[int, int, int]


def effective_level(base_level: int, due_at_millis: int, now_millis: int, aging_step_millis: int) -> int:
    """Base level raised by one per whole aging step waited since the job became due, capped at HIGH."""
    waited = now_millis - due_at_millis
    if waited <= 0 or aging_step_millis <= 0:
        return base_level
    return min(MAX_LEVEL, base_level + waited // aging_step_millis)


def queued_sort_key(base_level: int, due_at_millis: int, seq: int, now_millis: int, aging_step_millis: int) -> QueueKey:
    """Sort key for one queued job: smaller sorts first."""
    return (-effective_level(base_level, due_at_millis, now_millis, aging_step_millis), due_at_millis, seq)


def retry_delay_millis(attempts: int, base_millis: int, cap_millis: int) -> int:
    """Backoff before the next attempt: base * 2^(attempts-1), capped."""
    if attempts < 1:
        attempts = 1
    exponent = min(attempts - 1, 62)
    return min(cap_millis, base_millis * (1 << exponent))


class QueuedJobs:
    """The QUEUED jobs of one task type as three heaps of ``(due_at, seq, job_id)``.

    Removal is lazy: ``discard`` forgets a job id and stale heap entries are skipped
    when they surface, so cancelling a queued job is O(1).
    """

    def __init__(self) -> None:
        self._heaps: list[list[tuple[int, int, str]]] = [[] for _ in range(MAX_LEVEL + 1)]
        self._members: dict[str, int] = {}  # job_id -> base level
        self._stale = 0  # entries of discarded jobs still in the heaps

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._members

    def add(self, job_id: str, base_level: int, due_at_millis: int, seq: int, key: str | None = None) -> None:
        if job_id in self._members:
            return
        self._members[job_id] = base_level
        heapq.heappush(self._heaps[base_level], (due_at_millis, seq, job_id))

    def discard(self, job_id: str) -> None:
        if self._members.pop(job_id, None) is not None:
            self._stale += 1
            if self._stale > len(self._members) + 1024:
                self._compact()

    def _compact(self) -> None:
        """Rebuild the heaps without entries of discarded jobs (they would otherwise stay
        until they reach the head, which never happens while no worker drains the queue)."""
        for level, heap in enumerate(self._heaps):
            live = [e for e in heap if self._members.get(e[2]) == level]
            heapq.heapify(live)
            self._heaps[level] = live
        self._stale = 0

    def _head(self, level: int) -> tuple[int, int, str] | None:
        heap = self._heaps[level]
        while heap:
            entry = heap[0]
            if self._members.get(entry[2]) == level:
                return entry
            heapq.heappop(heap)  # stale: cancelled or already assigned
            if self._stale:
                self._stale -= 1
        return None

    def best(self, now_millis: int, aging_step_millis: int) -> tuple[QueueKey, str] | None:
        """(sort key, job id) of the job that should run next, without removing it."""
        best: tuple[QueueKey, str] | None = None
        for level in range(MAX_LEVEL + 1):
            head = self._head(level)
            if head is None:
                continue
            due_at, seq, job_id = head
            key = queued_sort_key(level, due_at, seq, now_millis, aging_step_millis)
            if best is None or key < best[0]:
                best = (key, job_id)
        return best

    def peek(self, now_millis: int, aging_step_millis: int) -> str | None:
        """The job id that should run next, without removing it."""
        found = self.best(now_millis, aging_step_millis)
        return None if found is None else found[1]

    def pop(self, now_millis: int, aging_step_millis: int) -> str | None:
        job_id = self.peek(now_millis, aging_step_millis)
        if job_id is not None:
            self.remove_head(job_id)
        return job_id

    def remove_head(self, job_id: str) -> None:
        """Remove ``job_id``, which ``best``/``peek`` just returned (so it heads its heap)."""
        level = self._members.pop(job_id)
        heapq.heappop(self._heaps[level])

    def entries(self) -> list[tuple[int, int, int, str]]:
        """(base level, due_at, seq, job id) of every member (O(n); for tests and tools)."""
        seen: set[str] = set()
        out = []
        for level in range(MAX_LEVEL + 1):
            for due_at, seq, job_id in self._heaps[level]:
                if self._members.get(job_id) == level and job_id not in seen:
                    seen.add(job_id)
                    out.append((level, due_at, seq, job_id))
        return out

    def ordered(self, now_millis: int, aging_step_millis: int) -> list[str]:
        """Every queued job id in scheduling order (O(n log n); for tests and tools)."""
        return _in_order(self.entries(), now_millis, aging_step_millis)


class Gate(Protocol):
    """A type's limit, as the queue of its jobs asks it."""

    def open(self, now_millis: int) -> bool:
        """Whether a job of the type may start now (not paused, below maxRunning, a rate token)."""

    def key_open(self, key: str, now_millis: int) -> bool:
        """Whether a job with this concurrency key may start now (below maxRunningPerKey, a key token)."""


_Head = tuple[int, int, str, "str | None"]  # (due_at, seq, job id, key) of a key's head at one level


class KeyedJobs:
    """The QUEUED jobs of one limited task type, one ``QueuedJobs`` per concurrency key
    (None: the jobs without one), behind the type's ``Gate``. Same interface as ``QueuedJobs``.

    Per base level, ``_heads`` holds an entry for the head of every key not set aside;
    an entry is current while its job heads its key at that level and the key is not set
    aside; others are skipped (and dropped) when they surface. The best job is then the
    best of at most three current entries, as in ``QueuedJobs``: priority, aging and FIFO
    order hold across keys exactly as within one queue."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self._by_key: dict[str | None, QueuedJobs] = {}
        self._key_of: dict[str, str | None] = {}  # job id -> its key
        self._blocked: set[str] = set()  # keys set aside until ``unblock``
        self._heads: list[list[_Head]] = [[] for _ in range(MAX_LEVEL + 1)]

    def __len__(self) -> int:
        return len(self._key_of)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._key_of

    def _push_head(self, key: str | None, level: int) -> None:
        queue = self._by_key.get(key)
        head = None if queue is None else queue._head(level)
        if head is not None:
            heapq.heappush(self._heads[level], (head[0], head[1], head[2], key))
            if len(self._heads[level]) > 2 * len(self._by_key) + 1024:
                self._compact(level)

    def _compact(self, level: int) -> None:
        """Rebuild one level's heap from the current heads (cancels leave stale entries)."""
        heap = []
        for key, queue in self._by_key.items():
            head = queue._head(level)
            if head is not None and key not in self._blocked:
                heap.append((head[0], head[1], head[2], key))
        heapq.heapify(heap)
        self._heads[level] = heap

    def add(self, job_id: str, base_level: int, due_at_millis: int, seq: int, key: str | None = None) -> None:
        if job_id in self._key_of:
            return
        queue = self._by_key.get(key)
        if queue is None:
            queue = self._by_key[key] = QueuedJobs()
        queue.add(job_id, base_level, due_at_millis, seq)
        self._key_of[job_id] = key
        if key not in self._blocked and queue._head(base_level) == (due_at_millis, seq, job_id):
            heapq.heappush(self._heads[base_level], (due_at_millis, seq, job_id, key))

    def discard(self, job_id: str) -> None:
        if job_id not in self._key_of:
            return
        key = self._key_of.pop(job_id)
        queue = self._by_key[key]
        level = queue._members.get(job_id, 0)
        queue.discard(job_id)
        if not len(queue):
            del self._by_key[key]
            self._blocked.discard(key)
        elif key not in self._blocked:
            self._push_head(key, level)  # the key's new head at that level, if it was the head

    def _current(self, level: int) -> _Head | None:
        heap = self._heads[level]
        while heap:
            entry = heap[0]
            key = entry[3]
            queue = self._by_key.get(key)
            if queue is not None and key not in self._blocked:
                head = queue._head(level)
                if head is not None and head[2] == entry[2]:
                    return entry
            heapq.heappop(heap)
        return None

    def best(self, now_millis: int, aging_step_millis: int) -> tuple[QueueKey, str] | None:
        """(sort key, job id) of the job that should run next among those the limit lets
        start now, without removing it; None while the gate is closed."""
        gate = self.gate
        if not gate.open(now_millis):
            return None
        while True:
            best: tuple[QueueKey, str, str | None] | None = None
            for level in range(MAX_LEVEL + 1):
                entry = self._current(level)
                if entry is None:
                    continue
                key = queued_sort_key(level, entry[0], entry[1], now_millis, aging_step_millis)
                if best is None or key < best[0]:
                    best = (key, entry[2], entry[3])
            if best is None:
                return None
            found_key = best[2]
            if found_key is None or gate.key_open(found_key, now_millis):
                return best[0], best[1]
            self._blocked.add(found_key)  # set aside: its entries go stale until ``unblock``

    def remove_head(self, job_id: str) -> None:
        """Remove ``job_id``, which ``best`` just returned."""
        key = self._key_of.pop(job_id)
        queue = self._by_key[key]
        level = queue._members[job_id]
        queue.remove_head(job_id)
        heapq.heappop(self._heads[level])  # its entry: the current head of that level
        if not len(queue):
            del self._by_key[key]
        else:
            self._push_head(key, level)

    def unblock(self, key: str) -> None:
        """The key may start a job again: its heads compete again."""
        if key in self._blocked:
            self._blocked.discard(key)
            for level in range(MAX_LEVEL + 1):
                self._push_head(key, level)

    def unblock_all(self) -> None:
        """The limit changed: every key set aside competes again (O(keys set aside))."""
        for key in list(self._blocked):
            self.unblock(key)

    def entries(self) -> list[tuple[int, int, int, str]]:
        return [e for queue in self._by_key.values() for e in queue.entries()]

    def keys(self) -> list[tuple[str | None, int]]:
        """(key, queued jobs) of every key with queued jobs (for figures)."""
        return [(key, len(queue)) for key, queue in self._by_key.items()]


def _in_order(entries: list[tuple[int, int, int, str]], now_millis: int, aging_step_millis: int) -> list[str]:
    entries = sorted(entries, key=lambda e: queued_sort_key(e[0], e[1], e[2], now_millis, aging_step_millis))
    return [e[3] for e in entries]


class TypedQueues:
    """All QUEUED jobs: one ``QueuedJobs`` per task type, and each job's type.

    A type's queue exists only while it has members, so a pick looks at the types that
    have queued jobs, never at every type ever seen.
    """

    def __init__(self) -> None:
        self._by_type: dict[str, QueuedJobs | KeyedJobs] = {}
        self._type_of: dict[str, str] = {}
        self._gates: dict[str, Gate] = {}  # the limited types: their jobs queue in a KeyedJobs

    def __len__(self) -> int:
        return len(self._type_of)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._type_of

    def add(self, job_id: str, task_type: str, base_level: int, due_at_millis: int, seq: int,
            key: str | None = None) -> None:
        if job_id in self._type_of:
            return
        queue = self._by_type.get(task_type)
        if queue is None:
            queue = self._by_type[task_type] = self._new_queue(task_type)
        queue.add(job_id, base_level, due_at_millis, seq, key)
        self._type_of[job_id] = task_type

    def _new_queue(self, task_type: str) -> QueuedJobs | KeyedJobs:
        gate = self._gates.get(task_type)
        return QueuedJobs() if gate is None else KeyedJobs(gate)

    def set_gate(self, task_type: str, gate: Gate | None, key_of: Callable[[str], str | None]) -> None:
        """The type got a limit (``gate``), lost it (None) or its limit changed: its queued
        jobs are queued again behind it (``key_of``: a queued job's concurrency key), or
        for a changed limit only its keys set aside compete again."""
        old = self._by_type.get(task_type)
        if gate is not None and type(old) is KeyedJobs and old.gate is gate:
            old.unblock_all()
            return
        if gate is None:
            self._gates.pop(task_type, None)
        else:
            self._gates[task_type] = gate
        old = self._by_type.pop(task_type, None)
        if old is None:
            return
        queue = self._by_type[task_type] = self._new_queue(task_type)
        for level, due_at, seq, job_id in old.entries():
            queue.add(job_id, level, due_at, seq, key_of(job_id))

    def unblock(self, task_type: str, key: str) -> None:
        """A key of a limited type may start a job again."""
        queue = self._by_type.get(task_type)
        if type(queue) is KeyedJobs:
            queue.unblock(key)

    def discard(self, job_id: str) -> None:
        task_type = self._type_of.pop(job_id, None)
        if task_type is None:
            return
        queue = self._by_type[task_type]
        queue.discard(job_id)
        if not len(queue):
            del self._by_type[task_type]

    def types(self) -> list[str]:
        """The task types that have queued jobs."""
        return list(self._by_type)

    def depth(self, task_type: str) -> int:
        queue = self._by_type.get(task_type)
        return 0 if queue is None else len(queue)

    def pop_best(self, now_millis: int, aging_step_millis: int, runnable: Container[str]) -> tuple[str, str] | None:
        """Remove and return (job id, task type) of the best queued job whose type is in
        ``runnable``; None if there is none. O(types with queued jobs + log n)."""
        best: tuple[QueueKey, str, str] | None = None
        for task_type, queue in self._by_type.items():
            if task_type not in runnable:
                continue
            found = queue.best(now_millis, aging_step_millis)
            if found is not None and (best is None or found[0] < best[0]):
                best = (found[0], found[1], task_type)
        if best is None:
            return None
        _key, job_id, task_type = best
        queue = self._by_type[task_type]
        queue.remove_head(job_id)
        del self._type_of[job_id]
        if not len(queue):
            del self._by_type[task_type]
        return job_id, task_type

    def ordered(self, now_millis: int, aging_step_millis: int) -> list[str]:
        """Every queued job id in scheduling order, all types together (for tests and tools)."""
        entries = [e for queue in self._by_type.values() for e in queue.entries()]
        return _in_order(entries, now_millis, aging_step_millis)


def least_loaded(workers: Iterable[W], active: Callable[[W], int], capacity: Callable[[W], int]) -> W | None:
    """The worker with free capacity and the fewest active jobs (first wins ties), or None."""
    best = None
    best_active = 0
    for w in workers:
        n = active(w)
        if n < capacity(w) and (best is None or n < best_active):
            best, best_active = w, n
    return best
