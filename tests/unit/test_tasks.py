"""The task bodies, each checked against an independently computed value. No hub, no sockets."""

from __future__ import annotations

import hashlib
import re
import threading

import pytest

from jobmesh.errors import PayloadError
from jobmesh.worker import tasks


def naive_prime_count(n: int) -> int:
    """Trial division: slow, obviously right, independent of the sieve."""
    return sum(1 for k in range(2, n + 1) if all(k % d for d in range(2, int(k ** 0.5) + 1)))


class NeverCancelled:
    def __init__(self):
        self.waits = []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        return False


def run(task_type, payload, attempt=1):
    return tasks.execute(task_type, payload, attempt, NeverCancelled())


@pytest.mark.parametrize("limit", [2, 3, 4, 5, 10, 11, 97, 100, 101, 1000, 7919, 10_000])
def test_prime_count_matches_trial_division(limit):
    assert tasks.prime_count(limit) == naive_prime_count(limit)


@pytest.mark.parametrize("limit,expected", [(2, 1), (3, 2), (10, 4), (100, 25), (10**6, 78498)])
def test_prime_count_known_values(limit, expected):
    assert run("PRIME_COUNT", {"limit": limit}) == {"primes": expected}


def test_prime_count_pauses_between_slices():
    # The pause hook is what lets heartbeats and cancels through in the worker.
    pauses = []
    assert tasks.prime_count(10**6, pause=lambda: pauses.append(1)) == 78498
    # One pause per sieving prime up to sqrt(10^6) (167 odd primes < 1000) plus the count.
    assert len(pauses) == naive_prime_count(1000) - 1 + 1


def test_prime_count_stops_when_pause_raises():
    class Stop(Exception):
        pass

    calls = []

    def pause():
        calls.append(1)
        if len(calls) == 3:
            raise Stop()

    with pytest.raises(Stop):
        tasks.prime_count(50_000_000, pause=pause)
    assert len(calls) == 3


@pytest.mark.parametrize("text", [
    "", "one", "  leading and trailing  ", "tabs\tand\nnewlines\r\nand\x0bvertical\x0cfeeds",
    "unicode  spaces\u2003here\u00a0too", "punctuation, counts; as-part of words!", "x" * 200_000,
])
def test_word_count_is_runs_of_non_whitespace(text):
    expected = len(re.findall(r"\S+", text))
    assert run("WORD_COUNT", {"text": text}) == {"words": expected}


@pytest.mark.parametrize("text", ["", "hello", "héllo wörld ✓", "a" * 200_000])
def test_sha256_of_utf8(text):
    expected = hashlib.sha256(text.encode("utf-8")).hexdigest()
    result = run("SHA256", {"text": text})
    assert result == {"sha256": expected}
    assert re.fullmatch(r"[0-9a-f]{64}", result["sha256"])


def test_sleep_waits_on_the_cancel_event_with_the_duration():
    cancel = NeverCancelled()
    assert tasks.execute("SLEEP", {"durationMillis": 250}, 1, cancel) == {"sleptMillis": 250}
    assert cancel.waits == [0.25]


def test_sleep_zero():
    assert run("SLEEP", {"durationMillis": 0}) == {"sleptMillis": 0}


def test_sleep_cancelled_raises():
    event = threading.Event()
    event.set()
    with pytest.raises(tasks.TaskCancelled):
        tasks.execute("SLEEP", {"durationMillis": 600_000}, 1, event)


@pytest.mark.parametrize("until,attempt,ok", [(0, 1, True), (1, 1, True), (3, 1, False), (3, 2, False),
                                              (3, 3, True), (3, 4, True), (1000, 999, False)])
def test_fail_until_attempt(until, attempt, ok):
    payload = {"failUntilAttempt": until}
    if ok:
        assert run("FAIL", payload, attempt) == {"attempt": attempt}
    else:
        with pytest.raises(tasks.TaskFailed) as info:
            run("FAIL", payload, attempt)
        assert str(info.value) == "attempt %d failed on purpose (failUntilAttempt=%d)" % (attempt, until)


@pytest.mark.parametrize("task_type,payload", [
    ("SLEEP", {"durationMillis": 600_001}),
    ("SLEEP", {"durationMillis": "5"}),
    ("PRIME_COUNT", {"limit": 1}),
    ("PRIME_COUNT", {"limit": 50_000_001}),
    ("WORD_COUNT", {"text": "x" * 200_001}),
    ("SHA256", {}),
    ("FAIL", {"failUntilAttempt": True}),
    ("EXEC", {"cmd": "rm -rf /"}),
])
def test_invalid_payloads_are_refused_on_the_worker(task_type, payload):
    with pytest.raises(PayloadError):
        run(task_type, payload)


def test_every_task_type_has_a_body():
    from jobmesh.protocol.payloads import TASK_TYPES

    samples = {"SLEEP": {"durationMillis": 0}, "WORD_COUNT": {"text": "a"}, "SHA256": {"text": "a"},
               "PRIME_COUNT": {"limit": 2}, "FAIL": {"failUntilAttempt": 0}}
    assert set(samples) == set(TASK_TYPES)
    for task_type, payload in samples.items():
        assert isinstance(run(task_type, payload), dict)
