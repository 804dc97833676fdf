"""Limits: what a per-key concurrency limit costs an assignment, and how exact a rate limit is.

``core``
    A real ``CoordinatorCore`` over an in-memory ``SQLiteStore``, driven in process the
    way the runtime does (``core.apply`` for each event, ``core.end_batch``, the commit,
    ``core.take_outbound``; as bench/listeners.py). ``--jobs`` SLEEP jobs over ``--keys``
    concurrency keys (job i has key i mod keys) are queued on workers with ``--keys`` +
    ``--spare-slots`` slots. With the limit (``maxRunningPerKey=1``) every key has one job
    running, so every key is at its limit while spare slots stay free: each round
    completes ``--batch`` running jobs, which frees their keys, and the core assigns the
    next job of each. Without a limit the same rounds complete and assign as many from
    the head of the queue. Printed: core CPU (apply + end_batch, ``time.process_time``)
    per job completed and the next one assigned, over ``--rounds`` rounds, with the limit
    and without; the most running per key seen (it must be 1).

``rate``
    A real coordinator and one ``jobmesh worker`` (built-in SLEEP, 0 ms) as processes.
    ``ratePerSecond=--rate`` is set on SLEEP, more jobs are submitted than the window can
    start, and after ``--window`` seconds every job's ASSIGNED time is read from its
    timeline. Printed: starts in the window; the rate after the burst, (starts - burst) /
    window, against the set rate; the busiest and quietest whole second after the first;
    and the worst excess over the promise "at most burst + rate x t starts in any t
    seconds", over every interval between two starts (0 or less: kept; the timeline's
    times are wall-clock milliseconds, the bucket's core time, so rate x 2 ms is within
    what can be told apart).

Figures only, no thresholds.

Usage:
  limits.py [--parts=PARTS] [--keys=N] [--jobs=N] [--spare-slots=N] [--batch=N] [--rounds=N]
            [--rate=R] [--burst=N] [--window=S] [--run-dir=DIR]
  limits.py (-h | --help)

Options:
  --parts=PARTS      which parts to run, comma-separated: core, rate [default: core,rate]
  --keys=N           concurrency keys, each limited to one running job [default: 10000]
  --jobs=N           queued jobs over the keys [default: 100000]
  --spare-slots=N    worker slots beyond one per key, free while every key is at its
                     limit [default: 10]
  --batch=N          jobs completed (and as many assigned) per round [default: 10]
  --rounds=N         timed rounds [default: 500]
  --rate=R           the rate limit's starts a second [default: 10]
  --burst=N          its burst (default: the rate rounded up)
  --window=S         seconds the rate is measured over [default: 60]
  --run-dir=DIR      where the rate part's database and logs go (default: a temp directory)
  -h --help          show this help
"""

from __future__ import annotations

import gc
import math
import sys
import tempfile
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from docopt import docopt  # noqa: E402

from bench.listeners import CLIENT, T0_MILLIS, Conn  # noqa: E402

from jobmesh.config import CoreConfig  # noqa: E402
from jobmesh.coordinator.core import events as ev  # noqa: E402
from jobmesh.coordinator.core.face import CoordinatorCore  # noqa: E402
from jobmesh.protocol import messages as m  # noqa: E402
from jobmesh.store.sqlite import SQLiteStore  # noqa: E402

SLOTS_PER_WORKER = 1000  # a worker's capacity is at most 1024
SUBMIT_BATCH = 5000  # submits per batch while the queue fills
TASK_TYPE = "SLEEP"


class Queue:
    """A core with ``jobs`` jobs queued over ``keys`` keys, as many slots as keys plus
    ``spare``, and (``limited``) at most one running job per key."""

    def __init__(self, keys: int, jobs: int, spare: int, limited: bool) -> None:
        self.store = SQLiteStore(":memory:")
        slots = keys + spare
        self.core = CoordinatorCore(self.store, CoreConfig(max_active_jobs=jobs + 1))
        self.now = T0_MILLIS
        self.conns = [Conn("w%d" % i) for i in range(math.ceil(slots / SLOTS_PER_WORKER))]
        for i, conn in enumerate(self.conns):
            capacity = min(SLOTS_PER_WORKER, slots - i * SLOTS_PER_WORKER)
            self.core.apply(ev.Registered(conn, m.WorkerRegister(conn.name, capacity)), self.now)
        if limited:
            reply = self.core.apply(ev.Request(CLIENT, m.LimitPut({"taskType": TASK_TYPE, "maxRunningPerKey": 1})),
                                    self.now)
            if not isinstance(reply, m.Limit):
                raise SystemExit("LIMIT_PUT refused: %r" % (reply,))
        self.key_of: dict[str, str] = {}
        self.running: deque[tuple[Conn, m.TaskAssign]] = deque()
        self.per_key: Counter[str] = Counter()
        self.most_per_key = 0
        self.batch([])
        for start in range(0, jobs, SUBMIT_BATCH):
            self.now += 1
            requests = []
            for i in range(start, min(jobs, start + SUBMIT_BATCH)):
                requests.append(m.SubmitJob(task_type=TASK_TYPE, payload={"durationMillis": 0},
                                            concurrency_key="k%d" % (i % keys)))
            self.batch([ev.Request(CLIENT, request) for request in requests])

    def batch(self, events: list[Any]) -> tuple[float, int]:
        """Apply ``events``, end the batch, commit; (core CPU seconds, jobs assigned)."""
        started = time.process_time()
        replies = [(event, self.core.apply(event, self.now)) for event in events]
        self.core.end_batch(self.now)
        spent = time.process_time() - started
        self.store.write(self.core.take_dirty())
        for event, reply in replies:
            if isinstance(reply, m.JobSubmitted):
                self.key_of[reply.job_id] = event.msg.concurrency_key
        assigned = 0
        for conn, frame in self.core.take_outbound():
            if type(frame) is m.TaskAssign:
                assigned += 1
                self.running.append((conn, frame))
                key = self.key_of[frame.job_id]
                self.per_key[key] += 1
                self.most_per_key = max(self.most_per_key, self.per_key[key])
        return spent, assigned

    def rounds(self, rounds: int, size: int) -> tuple[float, int]:
        """Complete ``size`` running jobs (the longest running first) a round; (core CPU
        seconds, jobs assigned) over ``rounds`` rounds."""
        spent_total, assigned_total = 0.0, 0
        for _ in range(rounds):
            self.now += 1
            results = []
            for _ in range(size):
                conn, assign = self.running.popleft()
                self.per_key[self.key_of[assign.job_id]] -= 1
                results.append(ev.Result(conn, m.TaskResult(conn.name, assign.job_id, assign.attempt_id, True,
                                                            {"sleptMillis": 0})))
            spent, assigned = self.batch(results)
            spent_total += spent
            assigned_total += assigned
        return spent_total, assigned_total


def core_part(opts: dict[str, Any]) -> None:
    keys, jobs, spare, size, rounds = opts["keys"], opts["jobs"], opts["spare"], opts["batch"], opts["rounds"]
    if jobs < keys * 2 or size > keys:
        raise SystemExit("--jobs must be at least twice --keys, and --batch at most --keys")
    print("core: %d jobs queued over %d keys, %d + %d slots, %d rounds of %d completed and assigned"
          % (jobs, keys, keys, spare, rounds, size))
    for limited in (False, True):
        started = time.monotonic()
        queue = Queue(keys, jobs, spare, limited)
        filled = time.monotonic() - started
        gc.collect()
        spent, assigned = queue.rounds(rounds, size)
        what = "maxRunningPerKey=1" if limited else "no limit         "
        print("  %s  %.1f µs CPU per job completed and the next assigned (%d assigned; queue filled in %.1f s;"
              " running %d, most running per key %d)"
              % (what, spent / max(1, assigned) * 1e6, assigned, filled, len(queue.running), queue.most_per_key))


def rate_part(opts: dict[str, Any]) -> None:
    from bench.procs import start_coordinator, start_worker, stop_all
    from jobmesh.client.api import CoordinatorClient

    rate, window = opts["rate"], opts["window"]
    burst = opts["burst"] if opts["burst"] is not None else max(1, math.ceil(rate))
    run_dir = Path(opts["run_dir"] or tempfile.mkdtemp(prefix="jobmesh-bench-limits-"))
    coordinator, worker_addr, client_addr = start_coordinator(run_dir, run_dir / "limits.db", "NORMAL",
                                                              ["--log-level=WARNING"])
    children = [coordinator]
    try:
        children.append(start_worker(run_dir, 0, worker_addr, 64, []))
        with CoordinatorClient("%s:%d" % client_addr, timeout=60) as client:
            deadline = time.monotonic() + 30
            while not client.workers():
                if time.monotonic() > deadline:
                    raise SystemExit("the worker did not register")
                time.sleep(0.05)
            client.limits.put(TASK_TYPE, rate_per_second=rate, burst=burst)
            count = burst + math.ceil(rate * window * 1.2) + 10
            start = client.stats().at_millis
            ids = [client.submit(TASK_TYPE, {"durationMillis": 0}) for _ in range(count)]
            time.sleep(max(0.0, start / 1000 + window - time.time()))  # the window, on the coordinator's clock
            end = start + int(window * 1000)
            starts = sorted(e["atMillis"] for job_id in ids for e in client.events(job_id)
                            if e.get("event") == "ASSIGNED" and start <= e["atMillis"] <= end)
        report_rate(starts, rate, burst, window, start)
    finally:
        stop_all(children)


def report_rate(starts: list[int], rate: float, burst: int, window: float, start: int) -> None:
    print("rate: ratePerSecond=%g, burst %d, over %g s" % (rate, burst, window))
    if not starts:
        print("  no start in the window")
        return
    per_second = Counter((t - start) // 1000 for t in starts)
    whole = [per_second.get(s, 0) for s in range(1, int(window))]
    # The worst excess over burst + rate x t, over every interval [t_i, t_j] between two
    # starts: max over j of (j - rate t_j) - min over i <= j of (i - rate t_i), + 1 - burst.
    worst, lowest = -math.inf, math.inf
    for j, t in enumerate(starts):
        lowest = min(lowest, j - rate * t / 1000)
        worst = max(worst, (j - rate * t / 1000) - lowest + 1 - burst)
    print("  %d starts: %.3f a second after the burst, against %g set (%+.2f%%)"
          % (len(starts), (len(starts) - burst) / window, rate, ((len(starts) - burst) / window / rate - 1) * 100))
    if whole:
        print("  whole seconds after the first: busiest %d starts, quietest %d" % (max(whole), min(whole)))
    # The timeline's times are the wall clock's (core time plus its drift, rounded to the
    # millisecond), the bucket's core time: they may differ by a millisecond either way.
    print("  worst excess over burst + rate x t in any interval: %.3f starts (kept when at most %.3f, what"
          " the timeline's 1 ms either way against core time allows)" % (worst, rate * 2 / 1000))


def main(argv: list[str] | None = None) -> int:
    args = docopt(__doc__, argv=argv)
    parts = {p.strip() for p in args["--parts"].split(",") if p.strip()}
    if not parts <= {"core", "rate"}:
        raise SystemExit("--parts: core and/or rate, got %r" % args["--parts"])
    opts = {"keys": int(args["--keys"]), "jobs": int(args["--jobs"]), "spare": int(args["--spare-slots"]),
            "batch": int(args["--batch"]), "rounds": int(args["--rounds"]), "rate": float(args["--rate"]),
            "burst": None if args["--burst"] is None else int(args["--burst"]), "window": float(args["--window"]),
            "run_dir": args["--run-dir"]}
    print("limits: Python %s" % sys.version.split()[0])
    if "core" in parts:
        core_part(opts)
    if "rate" in parts:
        rate_part(opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
