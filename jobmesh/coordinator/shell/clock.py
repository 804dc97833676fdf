"""The coordinator's clocks.

``now_millis`` is the core's time: monotonic milliseconds, anchored so that it reads as
epoch milliseconds when the process starts. Every duration (heartbeat timeouts, attempt
deadlines, retry backoff, arrival stamps) is measured on it, so a step of the wall clock
cannot declare healthy workers dead or postpone a retry. ``wall_millis`` is the wall
clock, for the instants people give or read (createdAtMillis, runAtMillis, retry times in
snapshots); the core is told the difference (``CoordinatorCore.observe_wall``).
"""

from __future__ import annotations

import time

monotonic = time.monotonic  # raw stamps on hot paths (arrival times), turned to core time by core_millis
_ANCHOR = int(time.time() * 1000) - int(time.monotonic() * 1000)


def now_millis() -> int:
    """Monotonic milliseconds, equal to the wall clock at start-up."""
    return _ANCHOR + int(time.monotonic() * 1000)


def core_millis(stamp: float) -> int:
    """Core time of a ``monotonic()`` stamp."""
    return _ANCHOR + int(stamp * 1000)


def wall_millis() -> int:
    return int(time.time() * 1000)
