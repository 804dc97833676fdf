"""A log-linear latency histogram (HdrHistogram-style), in microseconds.

Values below 256 µs have their own bucket; above that, every power of two is split into
128 equal sub-buckets, so a reported percentile is within 0.8% of the true value (it is
the bucket's upper edge, never an underestimate). Recording is O(1) and allocation-free
once a bucket exists; histograms merge by adding counts. The maximum and the sum are
kept exactly.
"""

from __future__ import annotations

SUB_BITS = 7                 # 128 sub-buckets per power of two
LINEAR = 1 << (SUB_BITS + 1)  # 256 exact one-microsecond buckets


def _index(us: int) -> int:
    if us < LINEAR:
        return us
    shift = us.bit_length() - (SUB_BITS + 1)
    return LINEAR + (shift - 1) * (1 << SUB_BITS) + ((us >> shift) - (1 << SUB_BITS))


def _upper_edge(index: int) -> int:
    """The largest value (µs) that falls into bucket ``index``."""
    if index < LINEAR:
        return index
    shift = (index - LINEAR) // (1 << SUB_BITS) + 1
    sub = (index - LINEAR) % (1 << SUB_BITS) + (1 << SUB_BITS)
    return ((sub + 1) << shift) - 1


class Histogram:
    __slots__ = ("counts", "count", "total_us", "max_us", "min_us")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.count = 0
        self.total_us = 0
        self.max_us = 0
        self.min_us = 0

    def record(self, seconds: float) -> None:
        """Record one latency given in seconds (as from ``time.perf_counter`` differences)."""
        us = int(seconds * 1_000_000)
        if us < 0:
            us = 0
        i = _index(us)
        counts = self.counts
        counts[i] = counts.get(i, 0) + 1
        if self.count == 0 or us < self.min_us:
            self.min_us = us
        self.count += 1
        self.total_us += us
        if us > self.max_us:
            self.max_us = us

    def merge(self, other: "Histogram") -> None:
        for i, n in other.counts.items():
            self.counts[i] = self.counts.get(i, 0) + n
        if other.count and (self.count == 0 or other.min_us < self.min_us):
            self.min_us = other.min_us
        self.count += other.count
        self.total_us += other.total_us
        self.max_us = max(self.max_us, other.max_us)

    def percentile_us(self, pct: float) -> int:
        """The value (µs) at or below which ``pct`` percent of the recordings fall."""
        if not self.count:
            return 0
        rank = max(1, int(round(pct / 100.0 * self.count + 0.4999999)))
        seen = 0
        for i in sorted(self.counts):
            seen += self.counts[i]
            if seen >= rank:
                return min(_upper_edge(i), self.max_us)
        return self.max_us

    def summary_ms(self) -> dict[str, float | int]:
        """p50/p90/p99/p999/max/mean in milliseconds (3 decimals) plus the count."""
        def ms(us: float) -> float:
            return round(us / 1000.0, 3)

        return {
            "p50": ms(self.percentile_us(50)),
            "p90": ms(self.percentile_us(90)),
            "p99": ms(self.percentile_us(99)),
            "p999": ms(self.percentile_us(99.9)),
            "max": ms(self.max_us),
            "mean": ms(self.total_us / self.count) if self.count else 0.0,
            "count": self.count,
        }
