"""Waiting in tests: poll until something holds (``wait_until``) or check that it keeps
holding (``assert_stays``), both bounded; and latency judged against a baseline measured
in the same test (``assert_prompt``), never against a fixed number of milliseconds."""

from __future__ import annotations

import time


def wait_until(predicate, timeout=10.0, interval=0.01, message="condition", sleep=time.sleep):
    """Poll ``predicate`` until it returns a truthy value (returned) or fail after timeout.

    ``sleep`` pauses between polls: ``gevent.sleep`` in a test that runs greenlets in its
    own process, so they get to run while it waits.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("timed out after %.1fs waiting for %s" % (timeout, message))
        sleep(interval)


# A request beside hostile peers may take this many times its baseline (the same request,
# measured in the same test before they arrived), or LATENCY_FLOOR seconds if that is
# longer: on loopback a baseline is a fraction of a millisecond, and a machine that runs
# the test slowly is slow for both. A peer that blocks the others costs them seconds, or
# their whole timeout.
LATENCY_FACTOR = 100
LATENCY_FLOOR = 1.0


def timed(fn):
    """``(fn(), seconds it took)``."""
    started = time.monotonic()
    value = fn()
    return value, time.monotonic() - started


def baseline(fn, n: int = 10) -> float:
    """The median of ``n`` timed calls of ``fn``, in seconds."""
    return sorted(timed(fn)[1] for _ in range(n))[n // 2]


def latency_limit(base: float) -> float:
    return max(LATENCY_FLOOR, LATENCY_FACTOR * base)


def assert_prompt(seconds: float, base: float, what: str = "the request") -> None:
    """Fail if ``seconds`` is over ``latency_limit(base)``."""
    limit = latency_limit(base)
    assert seconds < limit, "%s took %.3f s: over %.3f s (baseline %.2f ms)" % (what, seconds, limit, base * 1000)


def assert_stays(predicate, duration: float, interval: float = 0.02, message: str = "condition"):
    """Fail if ``predicate`` is ever falsy during ``duration`` seconds (a bounded negative check)."""
    deadline = time.monotonic() + duration
    while True:
        value = predicate()
        if not value:
            raise AssertionError("%s stopped holding" % message)
        if time.monotonic() > deadline:
            return value
        time.sleep(interval)
