"""Durable submits/s of one ``jobmesh.aio.AsyncClient`` shared by many coroutines, beside
the load generator's submit figure with as many connections, against one coordinator.

    python -m bench.aio_submit [--rounds=5] [--seconds=10] [--submitters=200]

It starts a coordinator (SQLite, ``--db-synchronous=FULL`` as the load generator's own,
no workers, an admission limit no round reaches), then alternates, round by round:

* ``loadgen``: ``bench/loadgen --mode=submit --clients=N --duration=S`` attached to it:
  N connections, each a closed loop of SUBMIT_JOB → reply (gevent, one process);
* ``aio``: one AsyncClient in this process with N coroutines, each a closed loop of
  ``await client.submit(...)`` (the same SLEEP 0 job), for S seconds: every request on
  one pipelined connection.

Each run prints submits/s and the coordinator's CPU per submit (µs, from
``/proc/PID/stat``); ``aio`` also its own process's CPU per submit, the client side.
Then the medians. The machine's speed drifts, so only runs of the same round compare
closely; the figures are not judged (exit status 0 unless the set-up fails).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import procs
from jobmesh.aio import AsyncClient

PAYLOAD = {"durationMillis": 0}  # loadgen's default task, sleep0


async def aio_submits(target: str, submitters: int, seconds: float) -> tuple[int, float]:
    """Submits made by ``submitters`` coroutines on one client in ``seconds``, and the seconds taken."""
    async with AsyncClient(target) as client:
        await client.submit("SLEEP", PAYLOAD)  # connected before the clock starts
        end = time.monotonic() + seconds
        counts = [0] * submitters

        async def submitter(index: int) -> None:
            while time.monotonic() < end:
                await client.submit("SLEEP", PAYLOAD)
                counts[index] += 1

        start = time.monotonic()
        await asyncio.gather(*(submitter(i) for i in range(submitters)))
        return sum(counts), time.monotonic() - start


def run_aio(target: str, pid: int, submitters: int, seconds: float) -> dict[str, float]:
    cpu, mine = procs.cpu_seconds(pid), time.process_time()
    count, took = asyncio.run(aio_submits(target, submitters, seconds))
    mine = time.process_time() - mine
    return {"submits_per_s": count / took, "coord_us": per_submit(procs.cpu_seconds(pid), cpu, count),
            "client_us": mine * 1e6 / count if count else 0.0}


def run_loadgen(target: str, pid: int, clients: int, seconds: float, out: Path) -> dict[str, float]:
    args = [sys.executable, "-m", "bench.loadgen", "--coordinator=%s" % target, "--coordinator-pid=%d" % pid,
            "--mode=submit", "--clients=%d" % clients, "--duration=%g" % seconds, "--verify=none", "--quiet",
            "--out=%s" % out]
    cpu = procs.cpu_seconds(pid)
    done = subprocess.run(args, cwd=procs.REPO_ROOT, env=procs.child_env(), capture_output=True, text=True,
                          timeout=seconds + 120)
    if done.returncode != 0:
        raise procs.ChildFailed("loadgen exited rc=%d:\n%s" % (done.returncode, done.stderr[-2000:]))
    report = json.loads(out.read_text())
    # The coordinator's CPU over the whole loadgen run (its connects too): a little high.
    return {"submits_per_s": report["submits_per_s"],
            "coord_us": per_submit(procs.cpu_seconds(pid), cpu, report["submitted"])}


def per_submit(after: float | None, before: float | None, count: int) -> float:
    return (after - before) * 1e6 / count if after is not None and before is not None and count else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each run")
    parser.add_argument("--submitters", type=int, default=200, help="coroutines, and loadgen connections")
    o = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="jobmesh-aio-bench-") as tmp:
        run_dir = Path(tmp)
        coordinator, _, client_addr = procs.start_coordinator(
            run_dir, run_dir / "bench.db", "FULL", ["--max-active-jobs=100000000"])
        target = "%s:%d" % client_addr
        runs: dict[str, list[dict[str, float]]] = {"loadgen": [], "aio": []}
        try:
            for r in range(1, o.rounds + 1):
                for name in runs:
                    if name == "loadgen":
                        fig = run_loadgen(target, coordinator.pid, o.submitters, o.seconds, run_dir / ("lg%d.json" % r))
                    else:
                        fig = run_aio(target, coordinator.pid, o.submitters, o.seconds)
                    runs[name].append(fig)
                    print("round %d %-7s submits/s=%7.0f coordinator_us/submit=%5.1f%s" % (
                        r, name, fig["submits_per_s"], fig["coord_us"],
                        " client_us/submit=%.1f" % fig["client_us"] if "client_us" in fig else ""), flush=True)
        finally:
            coordinator.stop()
    print("medians over %d rounds, %d %s, %gs each:" % (o.rounds, o.submitters, "submitters", o.seconds))
    for name, figs in runs.items():
        print("  %-7s submits/s=%7.0f coordinator_us/submit=%5.1f" % (
            name, statistics.median(f["submits_per_s"] for f in figs), statistics.median(f["coord_us"] for f in figs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
