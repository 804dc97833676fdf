"""Pure scheduling policy (PROTOCOL.md "priority"; ARCHITECTURE.md "Scheduler", "RetryPolicy").

Plain numbers for time: no clock, no hub. Levels are the protocol's HIGH=2, NORMAL=1, LOW=0.
"""

from __future__ import annotations

import random

import pytest

from jobmesh.coordinator.core import scheduler
from jobmesh.coordinator.core.scheduler import (
    QueuedJobs, effective_level, least_loaded, queued_sort_key, retry_delay_millis,
)

LOW, NORMAL, HIGH = 0, 1, 2
STEP = 60_000


# ---- effective_level ------------------------------------------------------------------


def test_no_aging_without_waiting():
    for level in (LOW, NORMAL, HIGH):
        assert effective_level(level, 5_000, 5_000, STEP) == level


@pytest.mark.parametrize(
    "waited, expected",
    [(0, LOW), (1, LOW), (STEP - 1, LOW), (STEP, NORMAL), (2 * STEP - 1, NORMAL), (2 * STEP, HIGH),
     (3 * STEP, HIGH), (10**12, HIGH)],
)
def test_low_ages_one_level_per_whole_step_and_caps_at_high(waited, expected):
    created = 1_700_000_000_000
    assert effective_level(LOW, created, created + waited, STEP) == expected


def test_normal_reaches_high_after_one_step_and_high_never_exceeds_high():
    assert effective_level(NORMAL, 0, STEP - 1, STEP) == NORMAL
    assert effective_level(NORMAL, 0, STEP, STEP) == HIGH
    assert effective_level(NORMAL, 0, 50 * STEP, STEP) == HIGH
    for waited in (0, STEP, 7 * STEP + 3):
        assert effective_level(HIGH, 0, waited, STEP) == HIGH


def test_clock_behind_submission_time_does_not_age_or_demote():
    assert effective_level(LOW, 10_000, 9_000, STEP) == LOW
    assert effective_level(NORMAL, 10_000, 0, 1) == NORMAL


# ---- retry_delay_millis -------------------------------------------------------------------


@pytest.mark.parametrize("attempts, expected", [(1, 1000), (2, 2000), (3, 4000), (4, 8000), (5, 16_000)])
def test_retry_delay_doubles_from_base(attempts, expected):
    assert retry_delay_millis(attempts, 1000, 30_000) == expected


@pytest.mark.parametrize("attempts", [6, 7, 64, 65, 1000, 10**9, 10**18])
def test_retry_delay_is_capped_even_for_huge_attempt_counts(attempts):
    assert retry_delay_millis(attempts, 1000, 30_000) == 30_000


def test_retry_delay_cap_below_base_wins():
    assert retry_delay_millis(1, 1000, 300) == 300


def test_retry_delay_other_base():
    assert [retry_delay_millis(n, 20, 150) for n in range(1, 6)] == [20, 40, 80, 150, 150]


# ---- QueuedJobs ---------------------------------------------------------------------------


def drain(q: QueuedJobs, now: int, step: int = STEP) -> list[str]:
    out = []
    while True:
        job_id = q.pop(now, step)
        if job_id is None:
            return out
        out.append(job_id)


def test_empty_queue():
    q = QueuedJobs()
    assert len(q) == 0
    assert q.peek(0, STEP) is None
    assert q.pop(0, STEP) is None
    assert q.ordered(0, STEP) == []


def test_high_before_normal_before_low_regardless_of_submission_order():
    q = QueuedJobs()
    q.add("low", LOW, 0, 1)
    q.add("normal", NORMAL, 0, 2)
    q.add("high", HIGH, 0, 3)
    assert q.ordered(0, STEP) == ["high", "normal", "low"]
    assert drain(q, 0) == ["high", "normal", "low"]
    assert len(q) == 0


def test_fifo_by_seq_within_a_level_even_in_the_same_millisecond():
    q = QueuedJobs()
    for seq in (5, 3, 9, 4, 1):
        q.add("n%d" % seq, NORMAL, 1000, seq)
    assert drain(q, 1000) == ["n1", "n3", "n4", "n5", "n9"]


def test_aging_promotes_an_old_low_ahead_of_a_newer_normal():
    q = QueuedJobs()
    q.add("old-low", LOW, 0, 1)          # waited 2 steps at now: effective HIGH
    q.add("new-normal", NORMAL, 2 * STEP, 2)  # waited 0: NORMAL
    assert drain(q, 2 * STEP) == ["old-low", "new-normal"]


def test_aging_to_an_equal_level_is_broken_by_seq():
    # At now=STEP the LOW job has aged to NORMAL; the NORMAL job has not waited. Equal
    # effective level, so FIFO by seq decides in both submission orders.
    q = QueuedJobs()
    q.add("low", LOW, 0, 1)
    q.add("normal", NORMAL, STEP, 2)
    assert q.ordered(STEP, STEP) == ["low", "normal"]
    assert drain(q, STEP) == ["low", "normal"]

    q = QueuedJobs()
    q.add("normal", NORMAL, 0, 1)
    q.add("low", LOW, 0, 2)
    # LOW aged to NORMAL, NORMAL aged to HIGH: normal still first.
    assert drain(q, STEP) == ["normal", "low"]

    q = QueuedJobs()
    q.add("normal", NORMAL, STEP, 1)  # not aged at now=STEP
    q.add("low", LOW, 0, 2)           # aged to NORMAL: tie; due first (a scheduled job can be), runs first
    assert drain(q, STEP) == ["low", "normal"]
    q = QueuedJobs()
    q.add("normal", NORMAL, STEP, 1)
    q.add("low", LOW, STEP - 1000, 2)   # due within the same step: tie, due first runs first
    assert drain(q, 2 * STEP - 1000) == ["low", "normal"]
    q = QueuedJobs()
    q.add("first", NORMAL, STEP, 1)
    q.add("second", LOW, STEP, 2)       # aged to NORMAL at the same due time: seq 1 first
    assert drain(q, 2 * STEP) == ["first", "second"]


def test_not_yet_aged_low_stays_behind_normal():
    q = QueuedJobs()
    q.add("low", LOW, 0, 1)
    q.add("normal", NORMAL, 10, 2)
    assert drain(q, STEP - 1) == ["normal", "low"]


def test_discard_is_lazy_and_skips_the_job():
    q = QueuedJobs()
    for i, level in enumerate([HIGH, HIGH, NORMAL, LOW, LOW], start=1):
        q.add("j%d" % i, level, i, 0)
    q.discard("j1")      # a head
    q.discard("j4")      # a head of another level
    q.discard("nope")    # unknown: no-op
    assert len(q) == 3
    assert "j1" not in q and "j2" in q
    assert q.ordered(0, STEP) == ["j2", "j3", "j5"]
    assert q.peek(0, STEP) == "j2"
    assert drain(q, 0) == ["j2", "j3", "j5"]


def test_add_is_idempotent():
    q = QueuedJobs()
    q.add("a", NORMAL, 0, 1)
    q.add("a", NORMAL, 0, 1)
    assert len(q) == 1
    assert drain(q, 0) == ["a"]


def test_popped_job_can_be_queued_again_as_a_retry_keeping_its_seq():
    q = QueuedJobs()
    q.add("a", NORMAL, 0, 1)
    q.add("b", NORMAL, 0, 2)
    assert q.pop(0, STEP) == "a"
    q.add("c", NORMAL, 0, 3)
    q.add("a", NORMAL, 0, 1)  # retry: same seq and creation time
    assert drain(q, 0) == ["a", "b", "c"]


def test_discard_then_add_again_lists_the_job_once():
    q = QueuedJobs()
    q.add("a", NORMAL, 0, 1)
    q.add("b", NORMAL, 0, 2)
    q.discard("a")
    q.add("a", NORMAL, 0, 1)
    assert len(q) == 2
    assert q.ordered(0, STEP) == ["a", "b"]
    assert drain(q, 0) == ["a", "b"]


def test_ordered_agrees_with_repeated_pop():
    rng = random.Random(7)
    q = QueuedJobs()
    created = 0
    for seq in range(1, 200):
        created += rng.choice([0, 0, 1, 500, 20_000])
        q.add("j%d" % seq, rng.choice([LOW, NORMAL, HIGH]), created, seq)
    for seq in rng.sample(range(1, 200), 40):
        q.discard("j%d" % seq)
    now = created + 30_000
    expected = q.ordered(now, STEP)
    assert len(expected) == len(q) == 159
    assert q.peek(now, STEP) == expected[0]
    assert drain(q, now) == expected


@pytest.mark.parametrize("seed", range(25))
def test_pop_sequence_matches_brute_force_sort_model(seed):
    """Interleaved submissions, cancels, retries and pops at an advancing clock.

    The clock only moves forward, so creation times grow with seq (as in the core, which
    stamps both at submission); retries re-enter with their original seq and time.
    """
    rng = random.Random(seed)
    step = rng.choice([1, 7, 100, STEP])
    q = QueuedJobs()
    model: dict[str, tuple[int, int, int]] = {}  # job -> (level, seq, created)
    known: dict[str, tuple[int, int, int]] = {}
    popped: set[str] = set()  # assigned jobs that may come back as retries
    now = rng.randrange(0, 10**6)
    seq = 0
    for _ in range(400):
        now += rng.choice([0, 0, 1, step // 2 + 1, step, 3 * step])
        op = rng.random()
        if op < 0.45:
            seq += 1
            job = "j%d" % seq
            known[job] = (rng.choice([LOW, NORMAL, HIGH]), seq, now)
            model[job] = known[job]
            level, s_, c_ = known[job]
            q.add(job, level, c_, s_)
        elif op < 0.55 and model:
            job = rng.choice(sorted(model))
            q.discard(job)  # a cancel: never queued again
            del model[job]
        elif op < 0.65:
            if popped:
                job = rng.choice(sorted(popped))
                popped.discard(job)
                model[job] = known[job]
                level, s_, c_ = known[job]
                q.add(job, level, c_, s_)
        else:
            got = q.pop(now, step)
            if not model:
                assert got is None
                continue
            best = min(model, key=lambda j: queued_sort_key(model[j][0], model[j][2], model[j][1], now, step))
            assert got == best, (seed, now, step)
            del model[got]
            popped.add(got)
        assert len(q) == len(model)
    final = sorted(model, key=lambda j: queued_sort_key(model[j][0], model[j][2], model[j][1], now, step))
    assert q.ordered(now, step) == final
    assert drain(q, now, step) == final


@pytest.mark.parametrize("seed", range(10))
def test_pop_sequence_matches_sort_for_random_static_queue(seed):
    rng = random.Random(1000 + seed)
    step = rng.choice([10, 1000, STEP])
    jobs = []
    created = rng.randrange(10**6)
    for seq in range(1, rng.randrange(1, 120)):
        created += rng.choice([0, 1, step // 3, step])
        jobs.append(("j%d" % seq, rng.choice([LOW, NORMAL, HIGH]), seq, created))
    q = QueuedJobs()
    for name, level, seq_, created_ in rng.sample(jobs, len(jobs)):  # insertion order must not matter
        q.add(name, level, created_, seq_)
    now = created + rng.randrange(0, 3 * step)
    expected = [j[0] for j in sorted(jobs, key=lambda j: queued_sort_key(j[1], j[3], j[2], now, step))]
    assert drain(q, now, step) == expected


def test_queue_order_stays_fifo_when_the_wall_clock_steps_back():
    # The queues are keyed by core time (monotonic), so a wall-clock step back cannot put
    # a later submission ahead of an earlier one.
    from jobmesh.coordinator.core.face import CoordinatorCore, CoreConfig
    from jobmesh.protocol import messages as m
    from jobmesh.store.sqlite import SQLiteStore

    core = CoordinatorCore(SQLiteStore(":memory:"), CoreConfig())
    first = core.requests.submit_job(5000, m.SubmitJob("SLEEP", {"durationMillis": 0}, priority="LOW")).job_id
    core.observe_wall(5001, 5001 - 3_600_000)  # the wall clock steps back an hour
    second = core.requests.submit_job(5002, m.SubmitJob("SLEEP", {"durationMillis": 0}, priority="LOW")).job_id
    assert core.table.jobs[second].created_at < core.table.jobs[first].created_at  # the instants follow the wall
    assert core.json.queued.pop_best(5002 + STEP, STEP, {"SLEEP"}) == (first, "SLEEP")


# ---- least_loaded -----------------------------------------------------------------------


class W:
    def __init__(self, name: str, active: int, capacity: int) -> None:
        self.name, self.active, self.capacity = name, active, capacity

    def __repr__(self) -> str:
        return "W(%s %d/%d)" % (self.name, self.active, self.capacity)


def pick(workers):
    return least_loaded(workers, lambda w: w.active, lambda w: w.capacity)


def test_least_loaded_picks_fewest_active():
    ws = [W("a", 3, 8), W("b", 1, 8), W("c", 2, 8)]
    assert pick(ws).name == "b"


def test_least_loaded_counts_active_not_free_slots():
    # b has more free slots but more active jobs: fewest active wins.
    ws = [W("a", 1, 2), W("b", 2, 100)]
    assert pick(ws).name == "a"


def test_least_loaded_first_wins_ties():
    ws = [W("a", 2, 4), W("b", 1, 4), W("c", 1, 4), W("d", 1, 4)]
    assert pick(ws).name == "b"
    assert pick([W("x", 0, 1), W("y", 0, 1)]).name == "x"


def test_least_loaded_skips_full_workers():
    ws = [W("full", 0, 0), W("also-full", 4, 4), W("room", 3, 4)]
    assert pick(ws).name == "room"


def test_least_loaded_none_when_all_full_or_no_workers():
    assert pick([W("a", 4, 4), W("b", 1, 1)]) is None
    assert pick([]) is None
    assert pick(iter(())) is None


def test_least_loaded_works_on_a_generator():
    ws = [W("a", 2, 4), W("b", 0, 4)]
    assert pick(w for w in ws).name == "b"


def test_module_has_no_clock():
    import inspect

    source = inspect.getsource(scheduler)
    assert "import time" not in source and "gevent" not in source


def test_discarded_entries_do_not_pile_up_while_nothing_drains_the_queue():
    # Given a queue that no worker drains, where clients submit and cancel over and over
    q = QueuedJobs()
    q.add("keep", NORMAL, 0, 0)
    for seq in range(1, 20_001):
        q.add("j%d" % seq, NORMAL, 0, seq)
        q.discard("j%d" % seq)
    # Then the heaps hold about what is queued, not everything ever submitted
    assert len(q) == 1
    assert sum(len(h) for h in q._heaps) < 2_100
    assert q.pop(0, STEP) == "keep"


# ---- KeyedJobs: a limited type's queue, per concurrency key behind its gate ----------------------


class CountingGate:
    """A gate whose closed keys are ``closed``; counts how often a key is asked about."""

    def __init__(self, closed: set) -> None:
        self.closed = closed
        self.asked = 0
        self.shut = False

    def open(self, now_millis: int) -> bool:
        return not self.shut

    def key_open(self, key: str, now_millis: int) -> bool:
        self.asked += 1
        return key not in self.closed


def test_keyed_jobs_never_scan_blocked_keys_again():
    from jobmesh.coordinator.core.scheduler import KeyedJobs

    # Given 100,000 queued jobs over 10,000 keys, 9,990 of which are at their limit
    keys = ["k%d" % i for i in range(10_000)]
    gate = CountingGate(set(keys[10:]))
    queue = KeyedJobs(gate)
    seq = 0
    for n in range(10):
        for key in keys:
            seq += 1
            queue.add("j%d" % seq, 1, seq, seq, key)
    # When jobs are picked: the first pass sets each blocked key aside once, as it comes up
    picked = []
    for _ in range(10):
        best = queue.best(0, 60_000)
        assert best is not None
        queue.remove_head(best[1])
        picked.append(best[1])
    assert picked == ["j%d" % i for i in range(1, 11)]  # the ten open keys' first jobs, FIFO
    best = queue.best(0, 60_000)  # the next pick meets every blocked key once, and sets it aside
    assert best is not None and best[1] == "j10001"
    queue.remove_head(best[1])
    assert gate.asked == 10 + 9_990 + 1
    first_pass = gate.asked
    # Then once set aside they are not asked about again: each later pick asks of one key
    for n in range(20):
        best = queue.best(0, 60_000)
        assert best is not None
        queue.remove_head(best[1])
    assert gate.asked - first_pass == 20
    # ... a key that opens again competes again, in FIFO order, at the cost of its heads
    gate.closed.discard("k5000")
    queue.unblock("k5000")
    asked = gate.asked
    assert queue.best(0, 60_000)[1] == "j5001"
    assert gate.asked - asked == 1
    # ... and a closed gate holds the whole type without looking at any key
    gate.shut = True
    asked = gate.asked
    assert queue.best(0, 60_000) is None and gate.asked == asked


def test_keyed_jobs_order_by_priority_and_aging_across_keys_and_forget_cancelled_jobs():
    from jobmesh.coordinator.core.scheduler import KeyedJobs

    queue = KeyedJobs(CountingGate(set()))
    queue.add("low-a", 0, 0, 1, "a")
    queue.add("normal-b", 1, 10, 2, "b")
    queue.add("high-none", 2, 20, 3, None)
    queue.add("normal-a", 1, 30, 4, "a")
    queue.discard("high-none")
    assert len(queue) == 3 and "high-none" not in queue
    assert queue.best(40, 60_000)[1] == "normal-b"
    # the LOW job aged into HIGH after two aging steps: it goes first
    assert queue.best(120_000, 60_000)[1] == "low-a"
