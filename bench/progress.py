"""Progress reports beside a normal load: the coordinator's CPU per job with and without
tasks that call ``ctx.progress`` 10,000 times a second.

Each run starts a fresh coordinator (SQLite, ``--db-synchronous=FULL``, a metrics port)
and one worker process with ``--tasks=bench.progress_tasks`` and ``--capacity=R``, then
submits R ``REPORT`` jobs, each holding one of that worker's slots for the whole run
(so the normal load never runs there), and waits until all R run. Then the load
generator, attached to that coordinator, starts its own worker processes and runs its
e2e load (``LOADGEN_ARG``s; by default 200 clients, 4 workers, 10,000 sleep0 jobs)
and measures the coordinator's CPU over it. Last, the REPORT jobs are cancelled and
write how many calls they made; /metrics says how many TASK_PROGRESS frames arrived.

Runs alternate: ``quiet`` (the REPORT jobs call nothing) and ``reporting`` (each calls
``ctx.progress`` ``--rate`` times a second), ``--runs`` times each. Printed: each run's
coordinator CPU per job (µs), jobs/s, the calls per second the reporters made and the
TASK_PROGRESS frames per second the coordinator got; then the medians. Figures only.

Usage:
  progress.py [--runs=N] [--reporters=R] [--rate=CALLS] [--run-dir=DIR] [--] [LOADGEN_ARG...]
  progress.py (-h | --help)

Options:
  --runs=N          runs of each kind [default: 3]
  --reporters=R     REPORT jobs running beside the load [default: 1]
  --rate=CALLS      ctx.progress calls a second of each reporting job [default: 10000]
  --run-dir=DIR     where the databases, logs and reports go (default: a temp directory)
  -h --help         show this help
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from docopt import docopt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.procs import REPO_ROOT, child_env, start_coordinator, start_worker, stop_all, tail  # noqa: E402
from jobmesh.client.api import CoordinatorClient  # noqa: E402

DEFAULT_LOAD = ["--mode=e2e", "--clients=200", "--workers=4", "--jobs=10000", "--task=sleep0"]
METRICS = re.compile(r" metrics=(\S+):(\d+)")


def counter(metrics: str, name: str) -> float:
    with urllib.request.urlopen(metrics + "/metrics", timeout=10) as response:
        found = re.search(r"^%s (\S+)$" % re.escape(name), response.read().decode(), re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def wait_for(check: Any, what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise SystemExit("timed out waiting for %s" % what)


def run(where: Path, reporters: int, rate: int, load: list[str]) -> dict[str, Any]:
    where.mkdir(parents=True)
    coord, worker_addr, client_addr = start_coordinator(where, where / "bench.db", "FULL",
                                                        ["--metrics-port=0", "--log-level=WARNING"])
    children = [coord]
    try:
        host, port = METRICS.search(wait_for(lambda: METRICS.search(tail(coord.out_path)) and tail(coord.out_path),
                                             "the metrics port")).groups()
        metrics = "http://%s:%s" % (host, port)
        children.append(start_worker(where, 0, worker_addr, reporters, ["--tasks=bench.progress_tasks"]))
        with CoordinatorClient("%s:%d" % client_addr, timeout=30) as client:
            wait_for(lambda: client.workers(), "the reporters' worker")
            jobs = [client.submit("REPORT", {"rate": rate, "out": str(where / ("report-%d.json" % i))},
                                  max_attempts=1) for i in range(reporters)]
            wait_for(lambda: all(client.status(j)["state"] == "RUNNING" for j in jobs), "the REPORT jobs running")
            report_path = where / "loadgen.json"
            proc = subprocess.run([sys.executable, "-m", "bench.loadgen", "--coordinator=%s:%d" % client_addr,
                                   "--coordinator-worker=%s:%d" % worker_addr, "--coordinator-pid=%d" % coord.pid,
                                   "--out=%s" % report_path, "--quiet", *load],
                                  cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                raise SystemExit("loadgen failed (%d): %s" % (proc.returncode, proc.stderr[-2000:]))
            for job_id in jobs:
                client.cancel(job_id)
        made = [json.loads(p.read_text()) for p in
                wait_for(lambda: [p for p in where.glob("report-*.json")] if len(list(where.glob("report-*.json")))
                         == reporters else None, "the REPORT jobs' counts")]
        frames = counter(metrics, "jobmesh_progress_reports_total") + counter(metrics,
                                                                              "jobmesh_progress_dropped_total")
    finally:
        stop_all(children)
    report = json.loads(report_path.read_text())
    cores, wall, completed = report["cpu_cores_used"]["coordinator"], report["measured_s"], report["completed"]
    seconds = max(m["seconds"] for m in made)
    return {"coord_cpu_us_per_job": cores * wall / completed * 1e6, "jobs_per_s": report["jobs_per_s"],
            "calls_per_s": sum(m["calls"] for m in made) / seconds, "frames_per_s": frames / seconds}


def main(argv: list[str]) -> int:
    args = docopt(__doc__, argv=argv)
    runs, reporters, rate = int(args["--runs"]), int(args["--reporters"]), int(args["--rate"])
    load = args["LOADGEN_ARG"] or DEFAULT_LOAD
    run_dir = Path(args["--run-dir"] or tempfile.mkdtemp(prefix="jobmesh-bench-progress-"))
    print("load: %s; %d REPORT job(s), %d calls/s each while reporting" % (" ".join(load), reporters, rate))
    results: dict[str, list[dict[str, Any]]] = {"quiet": [], "reporting": []}
    for i in range(runs):
        for kind, calls in (("quiet", 0), ("reporting", rate)):
            got = run(run_dir / ("%s-%d" % (kind, i)), reporters, calls, load)
            results[kind].append(got)
            print("%-9s run %d: coordinator %.1f us/job, %.0f jobs/s, %.0f progress calls/s, %.1f frames/s"
                  % (kind, i + 1, got["coord_cpu_us_per_job"], got["jobs_per_s"], got["calls_per_s"],
                     got["frames_per_s"]), flush=True)
    for kind, got in results.items():
        print("%-9s median: coordinator %.1f us/job, %.0f jobs/s, %.0f progress calls/s, %.1f frames/s"
              % (kind, *(statistics.median(g[k] for g in got)
                         for k in ("coord_cpu_us_per_job", "jobs_per_s", "calls_per_s", "frames_per_s"))))
    print("run dir  %s" % run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
