"""The coordinator process's housekeeping, apart from its connections and its core: the
open-files limit, the policy of Python's cyclic collector, and the plain histograms the
runtime keeps for the metrics port (commit times, batch sizes)."""

from __future__ import annotations

import gc
import logging
import resource
import time
from bisect import bisect_left

log = logging.getLogger(__name__)


def raise_fd_limit() -> int:
    """Raise the soft open-files limit to the hard one; returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 65536)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, hard, exc)
    return soft


# Net allocations of tracked objects before an automatic collection of the youngest
# generation (CPython's default: 700). Under load the coordinator reached 700 every
# millisecond or so, and each such collection walked what its batch still held; from its
# first tick on, the policy's own collection each ``freeze_seconds`` does that work, once
# per surviving object (docs/PERFORMANCE.md, "Coordinator CPU per job").
YOUNG_THRESHOLD = 100_000


class CollectorPolicy:
    """Keeps Python's cyclic collector from scanning the whole working set.

    Every active job is a tracked object, so under a growing queue each full collection
    walks hundreds of thousands of them: a pause of ~100 ms for every request in flight
    (docs/PERFORMANCE.md, the update at 8fe2c39). Every ``freeze_seconds`` the young
    generations are collected and everything that survives is moved to the permanent
    generation, which collections skip; reference counting still frees those objects
    when they are dropped. What it cannot free is a reference cycle that became garbage
    after being frozen, so every ``thaw_seconds`` the permanent generation is released
    and collected once. The first tick raises the youngest generation's threshold to
    ``YOUNG_THRESHOLD``: between ticks, garbage cycles wait for the next one.
    """

    def __init__(self, freeze_seconds: float = 1.0, thaw_seconds: float = 600.0) -> None:
        self.freeze_seconds = freeze_seconds
        self.thaw_seconds = thaw_seconds
        now = time.monotonic()
        self._next_freeze = now + freeze_seconds
        self._next_thaw = now + thaw_seconds
        self._ticked = False

    def tick(self, now: float) -> None:
        if not self._ticked:
            self._ticked = True
            gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])
        if now >= self._next_thaw:
            self._next_thaw = now + self.thaw_seconds
            gc.unfreeze()
            gc.collect()
        if now >= self._next_freeze:
            self._next_freeze = now + self.freeze_seconds
            gc.collect(1)
            gc.freeze()


class Histogram:
    """Plain histogram bucket counts for the metrics port: no lock, O(log buckets) per
    observation. ``counts[i]`` counts values <= ``bounds[i]`` and > the bound before it;
    the last count is everything above the last bound (Prometheus's ``+Inf``)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


COMMIT_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
