"""Pure scheduling policy: effective priority, queued order, worker choice, retry delay.

Nothing here reads a clock; callers pass ``now_millis`` read once per pass, so a
scheduling pass is deterministic and each rule is unit-testable with plain numbers.

Queued order (docs/ARCHITECTURE.md, "Scheduling"): highest *effective* priority first,
then lowest submission sequence. Effective priority is the base level (LOW=0, NORMAL=1,
HIGH=2) plus one per whole ``aging_step_millis`` waited since submission, capped at HIGH.

``QueuedJobs`` keeps one heap per base level ordered by (seq, created). Within one base
level, effective priority never increases with seq (a later submission has waited no
longer), so each heap's head is its best member and the global best is the best of at
most three heads: O(log n) per pick, however deep the queue.
"""

from __future__ import annotations

import heapq
from typing import Callable, Iterable

from jobmesh.protocol.jobs import MAX_LEVEL


def effective_level(base_level: int, created_at_millis: int, now_millis: int, aging_step_millis: int) -> int:
    """Base level raised by one per whole aging step waited, capped at HIGH."""
    waited = now_millis - created_at_millis
    if waited <= 0 or aging_step_millis <= 0:
        return base_level
    return min(MAX_LEVEL, base_level + waited // aging_step_millis)


def queued_sort_key(base_level: int, seq: int, created_at_millis: int, now_millis: int, aging_step_millis: int):
    """Sort key for one queued job: smaller sorts first."""
    return (-effective_level(base_level, created_at_millis, now_millis, aging_step_millis), seq, created_at_millis)


def retry_delay_millis(attempts: int, base_millis: int, cap_millis: int) -> int:
    """Backoff before the next attempt: base * 2^(attempts-1), capped."""
    if attempts < 1:
        attempts = 1
    exponent = min(attempts - 1, 62)
    return min(cap_millis, base_millis * (1 << exponent))


class QueuedJobs:
    """The QUEUED set as three heaps of ``(seq, created_at_millis, job_id)``.

    Removal is lazy: ``discard`` forgets a job id and stale heap entries are skipped
    when they surface, so cancelling a queued job is O(1).
    """

    def __init__(self) -> None:
        self._heaps: list[list[tuple[int, int, str]]] = [[] for _ in range(MAX_LEVEL + 1)]
        self._members: dict[str, int] = {}  # job_id -> base level
        self._stale = 0  # entries of discarded jobs still in the heaps

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._members

    def add(self, job_id: str, base_level: int, seq: int, created_at_millis: int) -> None:
        if job_id in self._members:
            return
        self._members[job_id] = base_level
        heapq.heappush(self._heaps[base_level], (seq, created_at_millis, job_id))

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

    def peek(self, now_millis: int, aging_step_millis: int) -> str | None:
        """The job id that should run next, without removing it."""
        best_key = None
        best_id = None
        for level in range(MAX_LEVEL + 1):
            head = self._head(level)
            if head is None:
                continue
            seq, created, job_id = head
            key = queued_sort_key(level, seq, created, now_millis, aging_step_millis)
            if best_key is None or key < best_key:
                best_key, best_id = key, job_id
        return best_id

    def pop(self, now_millis: int, aging_step_millis: int) -> str | None:
        job_id = self.peek(now_millis, aging_step_millis)
        if job_id is not None:
            level = self._members.pop(job_id)
            heapq.heappop(self._heaps[level])
        return job_id

    def ordered(self, now_millis: int, aging_step_millis: int) -> list[str]:
        """Every queued job id in scheduling order (O(n log n); for tests and tools)."""
        seen: set[str] = set()
        entries: list[tuple[int, int, str]] = []
        for level in range(MAX_LEVEL + 1):
            for e in self._heaps[level]:
                if self._members.get(e[2]) == level and e[2] not in seen:
                    seen.add(e[2])
                    entries.append(e)
        return [
            e[2]
            for e in sorted(
                entries, key=lambda e: queued_sort_key(self._members[e[2]], e[0], e[1], now_millis, aging_step_millis)
            )
        ]


def least_loaded(workers: Iterable, active: Callable[[object], int], capacity: Callable[[object], int]):
    """The worker with free capacity and the fewest active jobs (first wins ties), or None."""
    best = None
    best_active = 0
    for w in workers:
        n = active(w)
        if n < capacity(w) and (best is None or n < best_active):
            best, best_active = w, n
    return best
