"""The five task bodies, as plain functions that yield cooperatively.

Each returns the result object the contract names (docs/PROTOCOL.md, "Task types") or
raises ``TaskFailed`` for a failed attempt whose reason goes into TASK_RESULT.error.
They never touch sockets. Long-running bodies cooperate with cancellation:

- SLEEP waits on the attempt's cancel event, so a cancel wakes it at once;
- PRIME_COUNT calls ``pause()`` between sieve slices (``gevent.idle`` in the worker), so
  heartbeats and TASK_CANCEL get through and killing the greenlet stops it within a slice
  (docs/PERFORMANCE.md, "PRIME_COUNT"). Unit tests pass ``pause=lambda: None`` and need no hub.

The payload is assumed valid (``execute`` re-validates it first).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Callable, Protocol

from jobmesh.protocol.payloads import validate_payload


class TaskFailed(Exception):
    """The attempt failed; ``str(exc)`` is the error reported to the coordinator."""


class TaskCancelled(Exception):
    """The attempt was cancelled while it ran; it reports nothing."""


class CancelEvent(Protocol):
    def wait(self, timeout: float | None = None) -> bool: ...


def sleep_task(duration_millis: int, cancel: CancelEvent) -> dict[str, Any]:
    """Sleep ``duration_millis``; raise ``TaskCancelled`` as soon as ``cancel`` is set."""
    if cancel.wait(timeout=duration_millis / 1000.0):
        raise TaskCancelled("cancelled during sleep")
    return {"sleptMillis": duration_millis}


def word_count(text: str) -> dict[str, Any]:
    """Words are maximal runs of non-whitespace."""
    return {"words": len(text.split())}


def sha256_task(text: str) -> dict[str, Any]:
    return {"sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}


def prime_count(limit: int, pause: Callable[[], Any] = lambda: None) -> int:
    """The number of primes <= ``limit``.

    An odd-only sieve in a bytearray: index i stands for 2*i+1. Each prime's multiples are
    struck out by one slice assignment (a C loop; the longest, p=3 at 50,000,000, takes
    about 20 ms), and ``pause()`` runs before each one. At 50,000,000 that is about 900
    pauses, 25 MB and 0.2-0.4 s.
    """
    if limit < 2:
        return 0
    size = (limit + 1) // 2
    sieve = bytearray(b"\x01") * size
    sieve[0] = 0  # 1 is not prime
    for i in range(1, (math.isqrt(limit) - 1) // 2 + 1):
        if sieve[i]:
            pause()
            p = 2 * i + 1
            start = p * p // 2
            sieve[start::p] = bytes(len(range(start, size, p)))
    pause()
    return sieve.count(1) + 1  # and the even prime 2


def fail_task(fail_until_attempt: int, attempt_number: int) -> dict[str, Any]:
    """Fail while ``attempt_number < fail_until_attempt``, then succeed."""
    if attempt_number < fail_until_attempt:
        raise TaskFailed(
            "attempt %d failed on purpose (failUntilAttempt=%d)" % (attempt_number, fail_until_attempt)
        )
    return {"attempt": attempt_number}


def execute(
    task_type: str,
    payload: dict[str, Any],
    attempt_number: int,
    cancel: CancelEvent,
    pause: Callable[[], Any] = lambda: None,
) -> dict[str, Any]:
    """Run one attempt and return its result object.

    Raises ``PayloadError`` for an invalid payload (the worker does not trust the wire),
    ``TaskFailed`` for a failed attempt and ``TaskCancelled`` when cancelled.
    """
    validate_payload(task_type, payload)
    if task_type == "SLEEP":
        return sleep_task(payload["durationMillis"], cancel)
    if task_type == "WORD_COUNT":
        return word_count(payload["text"])
    if task_type == "SHA256":
        return sha256_task(payload["text"])
    if task_type == "PRIME_COUNT":
        return {"primes": prime_count(payload["limit"], pause)}
    if task_type == "FAIL":
        return fail_task(payload["failUntilAttempt"], attempt_number)
    # validate_payload knows every task type; reaching here means the two tables disagree.
    raise AssertionError("no task body for %r" % task_type)
