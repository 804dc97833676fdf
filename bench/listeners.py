"""Listener calls on the core's hot path: how many a JSON job makes, and what they cost.

The job table (``jobmesh/coordinator/table.py``) tells its listeners of every job that
enters (``entered``) or moves (``moved``); for JSON jobs those are the timers, the JSON
part and the client requests. This program drives a real ``CoordinatorCore`` over an
in-memory ``SQLiteStore`` the way the runtime does (``core.apply(event, now)`` for each
mailbox event, ``core.end_batch(now)``, ``store.write(core.take_dirty())``,
``core.take_outbound()``): ``--workers`` sessions of ``--capacity`` slots register, then
jobs go through in batches of one slot each: SUBMIT_JOB requests, the end of the batch
(which assigns them), the commit; then a TASK_RESULT for every TASK_ASSIGN, the end of
the batch, the commit. The clock advances 1 ms per batch.

It prints:

``calls``
    Listener calls per job over its life (submit, assign, complete), counted by wrapping
    every registered listener of the table, by kind and by listener.

``core``
    CPU time per job (``time.process_time``) for ``--jobs`` jobs through
    submit -> assign -> result, a fresh core per repeat, median over ``--repeats``: the
    core alone (apply and end_batch) and with the commits.

``padded``
    The same loop with ``--pad`` extra no-op listeners registered for JSON jobs: the
    extra time per job divided by the extra calls is the cost of one listener call in
    place, cache effects included. Plain and padded runs alternate.

``dispatch``
    The table's dispatch statement (``for listener in ...: listener.moved(job, source,
    target, now)``) timed alone with ``timeit`` over three no-op listeners and over
    none: ns per call and per dispatch; times the dispatches a job makes, in µs per job
    and as a share of the per-job core time.

Figures only, no thresholds.

Usage:
  listeners.py [--jobs=N] [--repeats=R] [--workers=W] [--capacity=K] [--pad=P] [--number=N]
  listeners.py (-h | --help)

Options:
  --jobs=N       jobs per timed repeat [default: 20000]
  --repeats=R    repeats of each timing; medians are printed [default: 7]
  --workers=W    worker sessions [default: 8]
  --capacity=K   slots per worker (a batch is W*K jobs) [default: 32]
  --pad=P        extra no-op listeners for the padded runs [default: 30]
  --number=N     loops per timeit repeat of the dispatch statement [default: 1000000]
  -h --help      show this help
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
import timeit
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from docopt import docopt  # noqa: E402

from jobmesh.config import CoreConfig  # noqa: E402
from jobmesh.coordinator.core import events as ev  # noqa: E402
from jobmesh.coordinator.core.face import CoordinatorCore  # noqa: E402
from jobmesh.protocol import messages as m  # noqa: E402
from jobmesh.protocol.jobs import JobState  # noqa: E402
from jobmesh.store.sqlite import SQLiteStore  # noqa: E402

T0_MILLIS = 1_700_000_000_000


class Conn:
    """A connection as the core sees it: an opaque, hashable handle."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


CLIENT = Conn("client")


class Counting:
    """Wraps a listener: counts each call by kind, then passes it on."""

    def __init__(self, inner: Any, calls: Counter) -> None:
        self.inner = inner
        self.name = type(inner).__name__
        self.calls = calls

    def entered(self, job: Any, now: int) -> None:
        self.calls[(self.name, "entered")] += 1
        self.inner.entered(job, now)

    def moved(self, job: Any, source: JobState, target: JobState, now: int) -> None:
        self.calls[(self.name, "moved %s->%s" % (source.value, target.value))] += 1
        self.inner.moved(job, source, target, now)


class NoOp:
    """A listener that does nothing."""

    def entered(self, job: Any, now: int) -> None:
        pass

    def moved(self, job: Any, source: JobState, target: JobState, now: int) -> None:
        pass


class Driver:
    """A fresh core with registered workers, and the batch loop that moves jobs through."""

    def __init__(self, workers: int, capacity: int, jobs: int) -> None:
        self.commit_s = 0.0
        self.store = SQLiteStore(":memory:")
        self.core = CoordinatorCore(self.store, CoreConfig(max_active_jobs=jobs + workers * capacity + 1))
        self.now = T0_MILLIS
        self.slots = workers * capacity
        self.conns = [Conn("w%d" % i) for i in range(workers)]
        for conn in self.conns:
            self.core.apply(ev.Registered(conn, m.WorkerRegister(conn.name, capacity)), self.now)
        self._batch([])

    def _batch(self, events: list) -> tuple[float, list]:
        """One batch: apply ``events``, end_batch, commit, release; (core seconds, frames out)."""
        t = time.process_time()
        for event in events:
            self.core.apply(event, self.now)
        self.core.end_batch(self.now)
        t_end = time.process_time() - t
        t = time.process_time()
        self.store.write(self.core.take_dirty())
        self.commit_s += time.process_time() - t
        return t_end, self.core.take_outbound()

    def run(self, jobs: int) -> tuple[float, float]:
        """Move ``jobs`` jobs through submit -> assign -> result; (core seconds, commit seconds)."""
        core, slots = self.core, self.slots
        submit = m.SubmitJob(task_type="SLEEP", payload={"durationMillis": 0})
        core_s = 0.0
        self.commit_s = 0.0
        done = 0
        while done < jobs:
            n = min(slots, jobs - done)
            self.now += 1
            spent, out = self._batch([ev.Request(CLIENT, submit) for _ in range(n)])
            core_s += spent
            assigns = [(conn, msg) for conn, msg in out if type(msg) is m.TaskAssign]
            if len(assigns) != n:
                raise SystemExit("expected %d assignments, got %d" % (n, len(assigns)))
            self.now += 1
            results = [ev.Result(conn, m.TaskResult(conn.name, a.job_id, a.attempt_id, True,
                                                    {"sleptMillis": 0})) for conn, a in assigns]
            core_s += self._batch(results)[0]
            done += n
        if core.table.finished_counts[JobState.COMPLETED] != jobs or core.active_count:
            raise SystemExit("not every job completed")
        return core_s, self.commit_s


def count_calls(opts: dict[str, int]) -> tuple[Counter, int]:
    jobs = opts["workers"] * opts["capacity"] * 4
    driver = Driver(opts["workers"], opts["capacity"], jobs)
    calls: Counter = Counter()
    table = driver.core.table
    table._json[:] = [Counting(listener, calls) for listener in table._json]
    table._periodic[:] = [Counting(listener, calls) for listener in table._periodic]
    driver.run(jobs)
    return calls, jobs


def timed(opts: dict[str, int], pad: int) -> tuple[float, float]:
    driver = Driver(opts["workers"], opts["capacity"], opts["jobs"])
    for _ in range(pad):
        driver.core.table.listen(NoOp(), json=True, periodic=False)
    gc.collect()
    return driver.run(opts["jobs"])


def dispatch_ns(listeners: int, number: int, repeats: int) -> float:
    """Median ns of one run of the table's dispatch statement over ``listeners`` no-op listeners."""
    job = object()
    setup_ns = {"J": [type("L%d" % i, (NoOp,), {})() for i in range(listeners)], "P": [], "periodic": False,
                "job": job, "s": JobState.QUEUED, "t": JobState.RUNNING, "now": T0_MILLIS}
    stmt = "for listener in P if periodic else J:\n    listener.moved(job, s, t, now)"
    times = timeit.repeat(stmt, globals=setup_ns, number=number, repeat=repeats)
    return statistics.median(times) / number * 1e9


def main(argv: list[str] | None = None) -> int:
    args = docopt(__doc__, argv=argv)
    opts = {k: int(args["--" + k]) for k in ("jobs", "repeats", "workers", "capacity", "pad", "number")}
    print("listeners: %d jobs per repeat, %d repeats, %d workers x %d slots, Python %s"
          % (opts["jobs"], opts["repeats"], opts["workers"], opts["capacity"], sys.version.split()[0]))

    calls, counted = count_calls(opts)
    total = sum(calls.values())
    per_job = total / counted
    print("\ncalls: %d listener calls for %d jobs = %.2f per job" % (total, counted, per_job))
    for (name, kind), n in sorted(calls.items()):
        print("  %-16s %-28s %.2f per job" % (name, kind, n / counted))

    timed(opts, 0)  # warm-up
    plain_core, plain_commit, padded_core = [], [], []
    for _ in range(opts["repeats"]):  # plain and padded alternate
        core_s, commit_s = timed(opts, 0)
        plain_core.append(core_s / opts["jobs"] * 1e6)
        plain_commit.append(commit_s / opts["jobs"] * 1e6)
        core_s, _ = timed(opts, opts["pad"])
        padded_core.append(core_s / opts["jobs"] * 1e6)
    core_us = statistics.median(plain_core)
    commit_us = statistics.median(plain_commit)
    print("\ncore: CPU µs per job, submit -> assign -> result (median of %d; min..max)" % opts["repeats"])
    print("  core (apply + end_batch)   %.2f  (%.2f..%.2f)" % (core_us, min(plain_core), max(plain_core)))
    print("  commits (in-memory store)  %.2f  (%.2f..%.2f)" % (commit_us, min(plain_commit), max(plain_commit)))
    print("  core + commits             %.2f" % (core_us + commit_us))

    padded_us = statistics.median(padded_core)
    calls_per_pad = per_job / (len({name for name, _kind in calls}) or 1)  # calls one JSON listener gets per job
    extra_calls = opts["pad"] * calls_per_pad
    in_place_ns = (padded_us - core_us) / extra_calls * 1e3
    print("\npadded: %d extra no-op listeners, %.0f extra calls per job" % (opts["pad"], extra_calls))
    print("  core with them             %.2f  (%.2f..%.2f)" % (padded_us, min(padded_core), max(padded_core)))
    print("  ns per listener call, in place: %.0f" % in_place_ns)

    reps = max(opts["repeats"], 5)
    three = dispatch_ns(3, opts["number"], reps)
    none = dispatch_ns(0, opts["number"], reps)
    per_call = (three - none) / 3
    sites = per_job / 3  # dispatches per job (each tells the 3 JSON listeners)
    dispatch_us = sites * three / 1e3
    print("\ndispatch: the table's loop over no-op listeners (timeit, median of %d x %d)" % (reps, opts["number"]))
    print("  over 3 listeners %.1f ns, over none %.1f ns: %.1f ns per call" % (three, none, per_call))
    print("  %.0f dispatches per job x %.1f ns = %.3f µs per job = %.2f%% of the core's %.2f µs per job"
          % (sites, three, dispatch_us, dispatch_us / core_us * 100, core_us))
    print("  by the in-place figure: %.2f calls x %.0f ns = %.3f µs per job = %.2f%%"
          % (per_job, in_place_ns, per_job * in_place_ns / 1e3, per_job * in_place_ns / 1e3 / core_us * 100))
    return 0


if __name__ == "__main__":
    sys.exit(main())
