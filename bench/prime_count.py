"""PRIME_COUNT timing: the worker's task body at the payload's bounds.

In process, as the worker runs it: ``jobmesh.worker.tasks.execute("PRIME_COUNT", ...)``
in a greenlet, with ``pause=gevent.idle`` between sieve slices (what
``jobmesh/worker/agent.py`` passes), one at a time and ``4`` at once in one gevent
process (a worker of capacity 4). A 10 ms ticker greenlet runs alongside and records
how late it fires: that is how late a heartbeat or a TASK_CANCEL would be handled while
the sieves run. Each result is checked against the known prime counts.

With ``--e2e`` it also starts a coordinator and one worker process
(``--capacity=4``), submits the same jobs over the client port and times each from
SUBMIT_JOB to the COMPLETED state the coordinator reports (its ``updatedAtMillis``
minus ``createdAtMillis``; the status is polled every 10 ms).

Usage:
  prime_count.py [--limits=LIST] [--concurrency=LIST] [--runs=N] [--e2e] [--out=FILE]
  prime_count.py (-h | --help)

Options:
  --limits=LIST        limits to count primes up to [default: 1000000,10000000,50000000]
  --concurrency=LIST   sieves running at once [default: 1,4]
  --runs=N             runs of each (limit, concurrency); the median is reported [default: 3]
  --e2e                also time the same jobs through a real coordinator and worker
  --out=FILE           also write the results as JSON
  -h --help            show this help
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gevent  # noqa: E402
import gevent.event  # noqa: E402
from docopt import docopt  # noqa: E402

from bench import procs  # noqa: E402
from bench.conns import Conn  # noqa: E402
from bench.drive import TERMINAL, status_frame  # noqa: E402
from bench.loadgen import _loadavg, _revision  # noqa: E402
from jobmesh.worker import tasks  # noqa: E402

# pi(x): OEIS A000720 and the payload's upper bound (50,000,000 -> 3,001,134).
KNOWN = {10: 4, 100: 25, 1000: 168, 10_000: 1229, 100_000: 9592, 1_000_000: 78498, 10_000_000: 664_579,
         50_000_000: 3_001_134}
TICK = 0.010


class Ticker:
    """A greenlet due every ``TICK`` s; ``max_late_ms`` is its worst lateness."""

    def __init__(self) -> None:
        self.max_late_ms = 0.0
        self.ticks = 0
        self._g = gevent.spawn(self._run)

    def _run(self) -> None:
        due = time.perf_counter() + TICK
        while True:
            gevent.sleep(max(0.0, due - time.perf_counter()))
            late = (time.perf_counter() - due) * 1000
            self.max_late_ms = max(self.max_late_ms, late)
            self.ticks += 1
            due = max(due + TICK, time.perf_counter())

    def stop(self) -> None:
        self._g.kill()


def one_body(limit: int) -> tuple[int, float]:
    t = time.perf_counter()
    result = tasks.execute("PRIME_COUNT", {"limit": limit}, 1, gevent.event.Event(), gevent.idle)
    return result["primes"], time.perf_counter() - t


def in_process(limit: int, concurrency: int) -> dict[str, Any]:
    ticker = Ticker()
    gevent.sleep(TICK * 2)
    t = time.perf_counter()
    greenlets = [gevent.spawn(one_body, limit) for _ in range(concurrency)]
    gevent.joinall(greenlets, raise_error=True)
    wall = time.perf_counter() - t
    ticker.stop()
    results = [g.value for g in greenlets]
    return {"wall_s": wall, "task_s": [round(r[1], 4) for r in results], "primes": [r[0] for r in results],
            "ticker_max_late_ms": round(ticker.max_late_ms, 2)}


def e2e(limits: list[int], concurrency: list[int], runs: int) -> list[dict[str, Any]]:
    run_dir = Path(tempfile.mkdtemp(prefix="jobmesh-prime-"))
    coordinator, worker_addr, client_addr = procs.start_coordinator(run_dir, run_dir / "prime.db", "FULL", [])
    children = [coordinator]
    try:
        capacity = max(concurrency)
        children.append(procs.start_worker(run_dir, 0, worker_addr, capacity, []))
        conn = Conn.open(client_addr)
        deadline = time.monotonic() + 30
        while not conn.request_obj({"type": "LIST_WORKERS"}).get("workers"):
            if time.monotonic() > deadline or not children[1].alive():
                raise procs.ChildFailed("the worker did not register:\n%s" % procs.tail(children[1].err_path))
            gevent.sleep(0.05)
        out = []
        for limit in limits:
            for conc in concurrency:
                walls, spans, primes = [], [], []
                for _ in range(runs):
                    t = time.perf_counter()
                    ids = []
                    for _ in range(conc):
                        reply = conn.request_obj({"type": "SUBMIT_JOB", "taskType": "PRIME_COUNT",
                                                  "payload": {"limit": limit}, "maxAttempts": 1})
                        if reply.get("type") != "JOB_SUBMITTED":
                            raise procs.ChildFailed("submit refused: %r" % reply)
                        ids.append(reply["jobId"])
                    jobs = {}
                    deadline = time.monotonic() + 300
                    while len(jobs) < len(ids):
                        for job_id in ids:
                            if job_id not in jobs:
                                job = conn.request(status_frame(job_id))["job"]
                                if job["state"] in TERMINAL:
                                    jobs[job_id] = job
                        if time.monotonic() > deadline:
                            raise procs.ChildFailed("PRIME_COUNT %d did not finish within 300 s" % limit)
                        gevent.sleep(0.01)
                    walls.append(time.perf_counter() - t)
                    spans.append(max(j["updatedAtMillis"] - j["createdAtMillis"] for j in jobs.values()) / 1000)
                    primes.extend((j.get("result") or {}).get("primes") for j in jobs.values())
                    if any(j["state"] != "COMPLETED" for j in jobs.values()):
                        raise procs.ChildFailed("PRIME_COUNT %d: %r" % (limit, list(jobs.values())))
                out.append({"limit": limit, "concurrency": conc, "e2e_s": round(statistics.median(walls), 4),
                            "coordinator_span_s": round(statistics.median(spans), 4),
                            "runs_s": [round(w, 4) for w in walls], "correct": check(limit, primes)})
        conn.close()
        return out
    finally:
        procs.stop_all(children)
        shutil.rmtree(run_dir, ignore_errors=True)


def check(limit: int, primes: list[int]) -> bool | None:
    expected = KNOWN.get(limit)
    if expected is None:
        return None
    return all(p == expected for p in primes)


def parse_list(text: str) -> list[int]:
    try:
        values = [int(float(x)) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit("prime_count: expected a comma-separated list of numbers, got %r" % text) from None
    if not values or min(values) < 1:
        raise SystemExit("prime_count: values must be positive")
    return values


def main(argv: list[str] | None = None) -> int:
    args = docopt(__doc__, argv=argv)
    limits = parse_list(args["--limits"])
    concurrency = parse_list(args["--concurrency"])
    runs = parse_list(args["--runs"])[0]
    bad = [n for n in limits if not 2 <= n <= 50_000_000]
    if bad:
        raise SystemExit("prime_count: PRIME_COUNT limits are 2..50,000,000, got %s" % bad)
    result: dict[str, Any] = {"revision": _revision(), "loadavg_start": _loadavg(), "cpus": os.cpu_count(),
                              "runs": runs, "in_process": []}
    print("prime_count: revision %s, load average %s, %d runs each, pause=gevent.idle"
          % (result["revision"], result["loadavg_start"], runs))
    ok = True
    print("\n  %12s %5s %10s %10s %10s %14s %8s" % ("limit", "conc", "wall s", "min s", "max s", "ticker late ms",
                                                   "correct"))
    for limit in limits:
        for conc in concurrency:
            samples = [in_process(limit, conc) for _ in range(runs)]
            walls = [s["wall_s"] for s in samples]
            primes = [p for s in samples for p in s["primes"]]
            correct = check(limit, primes)
            ok = ok and correct is not False
            row = {"limit": limit, "concurrency": conc, "wall_s": round(statistics.median(walls), 4),
                   "wall_s_runs": [round(w, 4) for w in walls], "primes": primes[0], "correct": correct,
                   "ticker_max_late_ms": round(statistics.median([s["ticker_max_late_ms"] for s in samples]), 2),
                   "ticker_max_late_ms_worst": max(s["ticker_max_late_ms"] for s in samples)}
            result["in_process"].append(row)
            print("  %12s %5d %10.3f %10.3f %10.3f %14.1f %8s" % (
                "{:,}".format(limit), conc, row["wall_s"], min(walls), max(walls), row["ticker_max_late_ms"],
                {True: "yes", False: "NO", None: "-"}[correct]))
    result["peak_rss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print("\n  peak RSS of this process: %.0f MB" % (result["peak_rss_kb"] / 1024))
    if args["--e2e"]:
        result["e2e"] = e2e(limits, concurrency, runs)
        print("\n  through a coordinator and one worker process (capacity %d), median of %d:" % (max(concurrency),
                                                                                              runs))
        print("  %12s %5s %10s %18s %8s" % ("limit", "jobs", "e2e s", "created->done s", "correct"))
        for row in result["e2e"]:
            ok = ok and row["correct"] is not False
            print("  %12s %5d %10.3f %18.3f %8s" % ("{:,}".format(row["limit"]), row["concurrency"], row["e2e_s"],
                                                    row["coordinator_span_s"],
                                                    {True: "yes", False: "NO", None: "-"}[row["correct"]]))
    result["loadavg_end"] = _loadavg()
    print("\n  load average at the end: %s" % result["loadavg_end"])
    if args["--out"]:
        Path(args["--out"]).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
