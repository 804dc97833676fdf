"""Workflows: what a big SUBMIT_WORKFLOW costs, and a wide fan-out/fan-in beside plain jobs.

Two parts, each on its own coordinators (SQLite, ``--db-synchronous=FULL`` as the load
generator's own; an admission limit nothing reaches):

* **submit**: for each size N, ``--runs`` times, a fresh coordinator with no workers gets
  one workflow of N jobs (N-1 SLEEP 0 jobs and a join after all of them) through the
  blocking client: the time from sending the SUBMIT_WORKFLOW to its reply (every job in
  one commit), and the coordinator's RSS (``/proc/PID/status`` VmRSS) before and after.
  The jobs stay QUEUED and WAITING, so the memory is that of the workflow held live.
  Beside it (``plain``), another fresh coordinator gets N plain SLEEP 0 jobs from one
  ``jobmesh.aio.AsyncClient`` (all sent at once, the connection pipelined): the time
  until the last is answered, and the RSS before and after.
* **e2e**: one coordinator and ``--workers`` worker processes (``--capacity`` slots each)
  for every run; rounds alternate ``workflow``: one workflow of ``--width`` SLEEP 0 jobs and
  a join after them all, waited for (WAIT_WORKFLOW), and ``plain``: as many SLEEP 0 jobs
  (width + 1) through ``bench/loadgen --mode=e2e`` attached to the same coordinator, with
  ``--clients`` connections and no workers of its own, so the same workers run both.
  jobs/s is jobs / (the last job's end, its ``updatedAtMillis`` − the first submit), as the
  load generator counts it.

Printed: every run, then the medians. Figures only: nothing is judged (exit status 0
unless the set-up fails).

Usage:
  workflows.py [--sizes=SIZES] [--runs=N] [--width=N] [--rounds=N] [--workers=N] [--capacity=N]
               [--clients=N]
  workflows.py (-h | --help)

Options:
  --sizes=SIZES   workflow sizes of the submit part, jobs, comma-separated [default: 1000,10000]
  --runs=N        submits of each size, each on a fresh coordinator [default: 3]
  --width=N       parallel jobs of the e2e fan-out (plus its join) [default: 9999]
  --rounds=N      e2e rounds, each a workflow and a plain run [default: 3]
  --workers=N     worker processes of the e2e part [default: 4]
  --capacity=N    slots of each worker [default: 32]
  --clients=N     the plain runs' loadgen connections [default: 100]
  -h --help       show this help
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from docopt import docopt

from bench import procs
from jobmesh.aio import AsyncClient
from jobmesh.client import CoordinatorClient

SLEEP0 = {"durationMillis": 0}  # loadgen's default task, sleep0
NO_LIMIT = "--max-active-jobs=100000000"


@dataclass(frozen=True)
class Settings:  # of the e2e part
    width: int
    rounds: int
    workers: int
    capacity: int
    clients: int


def fan_in(size: int) -> list[dict[str, Any]]:
    """``size - 1`` parallel SLEEP 0 jobs and a join after all of them, as job objects."""
    refs = ["p%d" % i for i in range(size - 1)]
    jobs: list[dict[str, Any]] = [{"ref": ref, "taskType": "SLEEP", "payload": SLEEP0} for ref in refs]
    jobs.append({"ref": "join", "taskType": "SLEEP", "payload": SLEEP0, "dependsOn": refs})
    return jobs


def rss_mb(pid: int) -> float:
    return procs.read_status_kb(pid).get("VmRSS", 0) / 1024


def submit_run(run_dir: Path, size: int) -> dict[str, float]:
    """One fresh coordinator, one workflow of ``size`` jobs: submit seconds, RSS before and after."""
    run_dir.mkdir(parents=True)
    coordinator, _, client_addr = procs.start_coordinator(run_dir, run_dir / "bench.db", "FULL",
                                                          [NO_LIMIT, "--log-level=WARNING"])
    try:
        jobs = fan_in(size)
        with CoordinatorClient("%s:%d" % client_addr, timeout=120) as client:
            client.stats()  # connected, and the coordinator past its start
            before = rss_mb(coordinator.pid)
            start = time.perf_counter()
            _, job_ids = client.submit_workflow(jobs)
            took = time.perf_counter() - start
            after = rss_mb(coordinator.pid)
        if len(job_ids) != size:
            raise procs.Failed("the workflow was answered with %d jobs, not %d" % (len(job_ids), size))
    finally:
        coordinator.stop()
    return {"submit_ms": took * 1000, "rss_before_mb": before, "rss_after_mb": after}


def plain_submit_run(run_dir: Path, size: int) -> dict[str, float]:
    """One fresh coordinator, ``size`` plain jobs pipelined on one AsyncClient: seconds, RSS."""
    run_dir.mkdir(parents=True)
    coordinator, _, client_addr = procs.start_coordinator(run_dir, run_dir / "bench.db", "FULL",
                                                          [NO_LIMIT, "--log-level=WARNING"])

    async def submit_all() -> float:
        async with AsyncClient("%s:%d" % client_addr, timeout=120) as client:
            await client.stats()
            nonlocal before
            before = rss_mb(coordinator.pid)
            start = time.perf_counter()
            await asyncio.gather(*(client.submit("SLEEP", SLEEP0) for _ in range(size)))
            return time.perf_counter() - start

    before = 0.0
    try:
        took = asyncio.run(submit_all())
        after = rss_mb(coordinator.pid)
    finally:
        coordinator.stop()
    return {"submit_ms": took * 1000, "rss_before_mb": before, "rss_after_mb": after}


def workflow_e2e(target: str, width: int) -> dict[str, float]:
    """One fan-out of ``width`` and its join, run by the coordinator's workers: jobs/s."""
    jobs = fan_in(width + 1)
    with CoordinatorClient(target, timeout=120) as client:
        first = time.time() * 1000
        workflow_id, job_ids = client.submit_workflow(jobs)
        done = client.wait_workflow(workflow_id, timeout=3600)
        if done["state"] != "COMPLETED":
            raise procs.Failed("the workflow ended %s" % done["state"])
        last = client.status(job_ids["join"])["updatedAtMillis"]
    return {"jobs_per_s": len(jobs) * 1000 / max(last - first, 1)}


def plain_e2e(target: str, worker_addr: tuple[str, int], pid: int, jobs: int, clients: int, out: Path
              ) -> dict[str, float]:
    """As many plain SLEEP 0 jobs through the load generator, run by the same workers: jobs/s."""
    args = [sys.executable, "-m", "bench.loadgen", "--coordinator=%s" % target,
            "--coordinator-worker=%s:%d" % worker_addr, "--coordinator-pid=%d" % pid, "--mode=e2e",
            "--workers=0", "--clients=%d" % clients, "--jobs=%d" % jobs, "--task=sleep0", "--verify=none",
            "--quiet", "--out=%s" % out]
    done = subprocess.run(args, cwd=procs.REPO_ROOT, env=procs.child_env(), capture_output=True, text=True,
                          timeout=3600)
    if done.returncode != 0:
        raise procs.ChildFailed("loadgen exited rc=%d:\n%s" % (done.returncode, done.stderr[-2000:]))
    return {"jobs_per_s": json.loads(out.read_text())["jobs_per_s"]}


def e2e_rounds(run_dir: Path, o: Settings) -> dict[str, list[dict[str, float]]]:
    run_dir.mkdir(parents=True)
    coordinator, worker_addr, client_addr = procs.start_coordinator(run_dir, run_dir / "bench.db", "FULL",
                                                                    [NO_LIMIT, "--log-level=WARNING"])
    started = [coordinator]
    target = "%s:%d" % client_addr
    runs: dict[str, list[dict[str, float]]] = {"workflow": [], "plain": []}
    try:
        started += [procs.start_worker(run_dir, i, worker_addr, o.capacity, []) for i in range(o.workers)]
        with CoordinatorClient(target, timeout=30) as client:
            deadline = time.monotonic() + 60
            while len(client.workers()) < o.workers:
                if time.monotonic() > deadline:
                    raise procs.Failed("the workers did not register within 60 s")
                time.sleep(0.05)
        for r in range(1, o.rounds + 1):
            for name in runs:
                if name == "workflow":
                    fig = workflow_e2e(target, o.width)
                else:
                    fig = plain_e2e(target, worker_addr, coordinator.pid, o.width + 1, o.clients,
                                    run_dir / ("plain-%d.json" % r))
                runs[name].append(fig)
                print("e2e round %d %-8s %d jobs  jobs/s=%7.0f" % (r, name, o.width + 1, fig["jobs_per_s"]),
                      flush=True)
    finally:
        procs.stop_all(started)
    return runs


def main(argv: list[str] | None = None) -> int:
    args = docopt(__doc__, argv=argv)
    sizes = [int(s) for s in args["--sizes"].split(",")]
    runs_of_size = int(args["--runs"])
    o = Settings(*(int(args["--" + name]) for name in ("width", "rounds", "workers", "capacity", "clients")))
    with tempfile.TemporaryDirectory(prefix="jobmesh-workflows-bench-") as tmp:
        run_dir = Path(tmp)
        submits: dict[tuple[int, str], list[dict[str, float]]] = {}
        for size in sizes:
            for n in range(1, runs_of_size + 1):
                for kind, run in (("workflow", submit_run), ("plain", plain_submit_run)):
                    fig = run(run_dir / ("submit-%s-%d-%d" % (kind, size, n)), size)
                    submits.setdefault((size, kind), []).append(fig)
                    print("submit run %d %-8s %6d jobs  submit_ms=%8.1f  rss_mb before=%6.1f after=%6.1f (+%.1f)" % (
                        n, kind, size, fig["submit_ms"], fig["rss_before_mb"], fig["rss_after_mb"],
                        fig["rss_after_mb"] - fig["rss_before_mb"]), flush=True)
        runs = e2e_rounds(run_dir / "e2e", o)
    print("medians:")
    for (size, kind), figs in submits.items():
        med = {k: statistics.median(f[k] for f in figs) for k in figs[0]}
        print("  submit %-8s %6d jobs  submit_ms=%8.1f  rss_mb before=%6.1f after=%6.1f (+%.1f)" % (
            kind, size, med["submit_ms"], med["rss_before_mb"], med["rss_after_mb"],
            statistics.median(f["rss_after_mb"] - f["rss_before_mb"] for f in figs)))
    for name, figs in runs.items():
        print("  e2e %-8s %d jobs  jobs/s=%7.0f" % (name, o.width + 1, statistics.median(f["jobs_per_s"]
                                                                                       for f in figs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
