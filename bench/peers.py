"""jobmesh beside Celery, RQ, Dramatiq and huey on Redis: one workload, one machine, one run.

Each measurement starts its system from nothing, drives it, and stops it (by pid):

- jobmesh: a coordinator with its defaults (an SQLite file in WAL mode with
  ``synchronous=FULL``: an acknowledged submit is on disk) and, for e2e, ``--workers``
  ``jobmesh worker`` processes of ``--jobmesh-capacity`` slots (the worker's default, 4).
- a peer: its own ``redis-server`` on a free loopback port with a fresh directory,
  ``--redis=aof`` (``appendonly yes``, ``appendfsync everysec``: a write reaches the disk
  within a second), ``--redis=shipped`` (redis-server's own defaults: no append-only
  file, RDB snapshots) or ``--redis=always`` (``appendfsync always``: an fsync before each
  reply, as durable as jobmesh's default), and, for e2e, its workers as its documentation recommends for
  production (``bench/peer_apps.py`` says which settings each system runs with).

Two measurements per system:

- ``e2e``: ``--clients`` submitters spread over ``--client-procs`` client processes
  (``bench/peer_client.py``, gevent, each system's own Python client) submit ``--jobs``
  no-op jobs in a closed loop while the workers run them; then the client processes read
  every result back. jobs/s = results in / (latest completion time the results carry -
  first submit). RQ's default worker forks a process per job: it runs ``--forking-jobs``.
  The workers first run ``2 x --workers`` jobs, uncounted, so that all are up.
- ``submit``: the same submitters, no workers, ``--submit-jobs`` jobs. submits/s =
  accepted / (last reply - first submit).

``lost`` = jobs accepted - results in (e2e), or accepted - jobs the system holds
queued afterwards (submit). Rounds alternate the systems (``--runs``, default 3), since
the machine's speed drifts over minutes; then a table of the medians. The exit status
is 1 if a measurement failed or lost a job, else 0; figures are not judged. A system
that cannot run here (its package is not installed, no ``redis-server``) is skipped
with the reason.

Usage:
  peers.py [options]
  peers.py (-h | --help)

Options:
  --systems=NAMES      comma-separated, of jobmesh, celery, celery-late, rq, rq-simple,
                       dramatiq, huey [default: jobmesh,celery,celery-late,rq,rq-simple,dramatiq,huey]
  --modes=MODES        e2e, submit or both [default: e2e,submit]
  --runs=N             rounds [default: 3]
  --jobs=N             jobs per e2e measurement [default: 10000]
  --forking-jobs=N     jobs per e2e measurement of a worker that forks per job [default: 1000]
  --submit-jobs=N      jobs per submit measurement [default: 10000]
  --clients=C          concurrent submitters in all [default: 100]
  --client-procs=P     client processes the submitters are spread over [default: 2]
  --workers=W          worker processes [default: 8]
  --jobmesh-capacity=K  slots of each jobmesh worker process [default: 4]
  --redis=CONFIG       aof (appendonly yes, appendfsync everysec), shipped (no flags)
                       or always (appendonly yes, appendfsync always) [default: aof]
  --timeout=S          cap on each phase of a measurement, seconds [default: 120]
  --out=FILE           write every run and the medians as JSON
  --work-dir=DIR       keep the databases and logs here (default: a temp dir, removed)
  -h --help            show this help
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gevent  # noqa: E402
from docopt import docopt  # noqa: E402

from bench import procs  # noqa: E402
from bench.loadgen import _loadavg, _revision  # noqa: E402
from bench.peer_apps import SYSTEMS, URL_ENV, System  # noqa: E402
from bench.periodic import cell, last_json, wait_until  # noqa: E402
from bench.pgserver import free_port  # noqa: E402
from bench.scaling import fmt, print_table  # noqa: E402

MODES = ("e2e", "submit")
REDIS_CONFIGS = {
    "aof": ["--appendonly", "yes", "--appendfsync", "everysec"],
    "shipped": [],
    "always": ["--appendonly", "yes", "--appendfsync", "always"],
}
REDIS_READY = "Ready to accept connections"
STARTED: list[procs.Child] = []  # every child of this run, so that an interrupted run stops them


@dataclass(frozen=True)
class Settings:
    jobs: int
    forking_jobs: int
    submit_jobs: int
    clients: int
    client_procs: int
    workers: int
    jobmesh_capacity: int
    redis: str
    timeout: float


def redis_missing() -> str | None:
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (Debian: apt-get install redis-server)"
    return None


def why_not(system: System) -> str | None:
    """Why ``system`` cannot be measured on this machine (None: it can)."""
    return system.missing() or (None if system.name == "jobmesh" else redis_missing())


# ---- starting the systems ----------------------------------------------------------------------


def child(name: str, args: list[str], run_dir: Path) -> procs.Child:
    started = procs.Child(name, args, run_dir)
    STARTED.append(started)
    return started


def logged(children: list[procs.Child], text: str) -> int:
    """How many times ``text`` appears in the children's stdout and stderr."""
    return sum(procs.tail(p, 1 << 20).count(text) for c in children for p in (c.out_path, c.err_path))


def start_redis(s: Settings, run_dir: Path) -> tuple[procs.Child, str]:
    data = run_dir / "redis"
    data.mkdir()
    port = free_port()
    server = child("redis", ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
                             *REDIS_CONFIGS[s.redis]], run_dir)
    if not wait_until(lambda: logged([server], REDIS_READY) > 0, [server], 30, "redis-server"):
        server.stop(5)
        raise procs.Failed("redis-server did not start within 30 s:\n%s" % procs.tail(server.out_path))
    return server, "redis://127.0.0.1:%d/0" % port


def start_jobmesh(s: Settings, run_dir: Path, mode: str) -> tuple[procs.Child, str, list[procs.Child]]:
    coordinator, worker_addr, client_addr = procs.start_coordinator(run_dir, run_dir / "jobmesh.db", None, [])
    STARTED.append(coordinator)
    workers = [procs.start_worker(run_dir, i, worker_addr, s.jobmesh_capacity, [])
               for i in range(s.workers if mode == "e2e" else 0)]
    STARTED.extend(workers)
    return coordinator, "%s:%d" % client_addr, workers


def start_peer(system: System, s: Settings, run_dir: Path, mode: str) -> tuple[procs.Child, str, list[procs.Child]]:
    server, url = start_redis(s, run_dir)
    os.environ[URL_ENV] = url  # the workers build their apps from it (procs.child_env copies os.environ)
    commands = system.workers(s.workers, url) if mode == "e2e" else []
    return server, url, [child("%s-worker%d" % (system.name, i), args, run_dir) for i, args in enumerate(commands)]


# ---- one measurement -----------------------------------------------------------------------------


def measure_one(system: System, mode: str, s: Settings, run_dir: Path) -> dict[str, Any]:
    """Start the system, its workers and the client processes at once (a client's warm-up
    waits for the workers), wait until all are ready, start the submits, collect."""
    if system.name == "jobmesh":
        server, url, workers = start_jobmesh(s, run_dir, mode)
    else:
        server, url, workers = start_peer(system, s, run_dir, mode)
    clients: list[procs.Child] = []
    try:
        jobs = s.submit_jobs if mode == "submit" else s.forking_jobs if system.forks_per_job else s.jobs
        clients = start_clients(system, mode, s, run_dir, url, jobs)
        if workers and not wait_until(lambda: system.ready(url, workers, s.workers), workers, 60,
                                      "%s workers" % system.name):
            raise procs.Failed("%s: the workers were not ready within 60 s:\n%s" % (
                system.name, procs.tail(workers[0].err_path)))
        if not wait_until(lambda: all(last_json(c, "ready") for c in clients), clients + workers, 90,
                          "the client processes"):
            raise procs.Failed("the client processes were not ready within 90 s:\n%s" % procs.tail(clients[0].err_path))
        cpu0 = procs.cpu_seconds(server.pid) or 0.0
        machine0, t0 = procs.machine_cpu_seconds() or 0.0, time.monotonic()
        for c in clients:
            c.signal(signal.SIGUSR1)
        if not wait_until(lambda: all(last_json(c, "accepted") for c in clients), clients, 2 * s.timeout + 30,
                          "the client reports"):
            raise procs.Failed("the client processes did not report within %.0f s" % (2 * s.timeout + 30))
        elapsed = time.monotonic() - t0
        server_cpu = (procs.cpu_seconds(server.pid) or 0.0) - cpu0
        machine = ((procs.machine_cpu_seconds() or 0.0) - machine0) / elapsed
        reports = [last_json(c, "accepted") or {} for c in clients]
        row = figures(reports, mode)
        if mode == "submit":
            row["held"] = held(system, url)
            row["lost"] = max(row["accepted"] - row["held"], 0)
        row.update(server_cores=server_cpu / elapsed, machine_cores=machine, jobs=jobs)
        return row
    finally:
        procs.stop_all(clients + workers)
        procs.stop_all([server])


def start_clients(system: System, mode: str, s: Settings, run_dir: Path, url: str, jobs: int) -> list[procs.Child]:
    out = []
    for i in range(s.client_procs):
        share = jobs // s.client_procs + (1 if i < jobs % s.client_procs else 0)
        clients = s.clients // s.client_procs + (1 if i < s.clients % s.client_procs else 0)
        warmup = 2 * s.workers if mode == "e2e" and i == 0 else 0
        out.append(child("client%d" % i, [
            sys.executable, "-m", "bench.peer_client", system.name, "--url=%s" % url, "--mode=%s" % mode,
            "--clients=%d" % max(clients, 1), "--jobs=%d" % share, "--warmup=%d" % warmup,
            "--drain-timeout=%g" % s.timeout, "--wait-signal"], run_dir))
    return out


def figures(reports: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """One measurement's figures from its client processes' reports (one wall clock)."""
    accepted = sum(r["accepted"] for r in reports)
    first = min((r["first_send"] for r in reports if r.get("first_send")), default=None)
    last = max((r["last_reply"] for r in reports if r.get("last_reply")), default=None)
    if not accepted or first is None or last is None:
        raise procs.Failed("no submit was accepted: %s" % reports)
    errors: dict[str, int] = {}
    for r in reports:
        for kind, n in r.get("errors", {}).items():
            errors[kind] = errors.get(kind, 0) + n
    row: dict[str, Any] = {"accepted": accepted, "submits_per_s": accepted / (last - first), "errors": errors,
                           "client_cores": sum(r["submit_cpu_s"] for r in reports) / (last - first)}
    if mode == "e2e":
        completed = sum(r["completed"] for r in reports)
        done = max((r["last_done"] for r in reports if r.get("last_done")), default=None)
        row.update(completed=completed, lost=accepted - completed,
                   jobs_per_s=completed / (done - first) if done else None)
    return row


def held(system: System, url: str) -> int:
    """How many jobs the system holds queued (the submit measurement ran no worker)."""
    client = system.client(url)
    try:
        return client.queued()
    finally:
        client.close()


# ---- the table -----------------------------------------------------------------------------------


def run_line(rnd: int, name: str, mode: str, row: dict[str, Any]) -> str:
    head = "round %d %-12s %-6s load %s" % (rnd, name, mode, row["load"])
    if "error" in row:
        return "%s: FAILED %s" % (head, row["error"])
    rate = ("jobs/s=%s " % fmt(row["jobs_per_s"], 0)) if mode == "e2e" else ""
    return ("%s %5.1fs: %ssubmits/s=%s accepted=%d lost=%d errors=%s server_cores=%s client_cores=%s "
            "machine_cores=%s" % (head, row["seconds"], rate, fmt(row["submits_per_s"], 0), row["accepted"],
                                  row["lost"], row["errors"] or 0, fmt(row["server_cores"]), fmt(row["client_cores"]),
                                  fmt(row["machine_cores"])))


def print_medians(results: dict[str, dict[str, list[dict[str, Any]]]], runs: int,
                  skipped: dict[str, str]) -> dict[str, dict[str, float | None]]:
    medians: dict[str, dict[str, float | None]] = {}
    rows = []
    for name, by_mode in results.items():
        e2e_med, e2e_cell = cell(by_mode.get("e2e", []), "jobs_per_s", 0)
        sub_med, sub_cell = cell(by_mode.get("submit", []), "submits_per_s", 0)
        medians[name] = {"jobs_per_s": e2e_med, "submits_per_s": sub_med}
        all_runs = [r for rs in by_mode.values() for r in rs]
        lost = sum(r.get("lost", 0) for r in all_runs if "error" not in r)
        failed = sum(1 for r in all_runs if "error" in r)
        rows.append([name, e2e_cell, sub_cell, "%d%s" % (lost, " (%d failed)" % failed if failed else "")])
    print_table("medians of %d runs (every run in order)" % runs,
                ["system", "e2e jobs/s", "submits/s", "lost"], rows)
    base = medians.get("jobmesh", {})
    for name, med in medians.items():
        if name != "jobmesh" and base.get("jobs_per_s") and med.get("jobs_per_s"):
            print("  jobmesh / %s: e2e %.2fx%s" % (name, base["jobs_per_s"] / med["jobs_per_s"],
                                                   ", submits %.2fx" % (base["submits_per_s"] / med["submits_per_s"])
                                                   if base.get("submits_per_s") and med.get("submits_per_s") else ""))
    for name, why in skipped.items():
        print("  skipped %s: %s" % (name, why))
    return medians


# ---- the driver ------------------------------------------------------------------------------------


def settings(args: dict[str, Any]) -> Settings:
    s = Settings(jobs=int(args["--jobs"]), forking_jobs=int(args["--forking-jobs"]),
                 submit_jobs=int(args["--submit-jobs"]), clients=int(args["--clients"]),
                 client_procs=int(args["--client-procs"]), workers=int(args["--workers"]),
                 jobmesh_capacity=int(args["--jobmesh-capacity"]), redis=args["--redis"],
                 timeout=float(args["--timeout"]))
    if min(s.jobs, s.forking_jobs, s.submit_jobs, s.clients, s.client_procs, s.workers, s.jobmesh_capacity) < 1:
        raise SystemExit("peers: counts must be at least 1")
    if s.redis not in REDIS_CONFIGS:
        raise SystemExit("peers: --redis is %s" % ", ".join(REDIS_CONFIGS))
    if s.timeout <= 0:
        raise SystemExit("peers: --timeout must be above 0")
    return s


def names(arg: str, known: tuple[str, ...] | list[str], what: str) -> list[str]:
    out = [n.strip() for n in arg.split(",") if n.strip()]
    unknown = [n for n in out if n not in known]
    if unknown or not out:
        raise SystemExit("peers: unknown %s %s (known: %s)" % (what, ", ".join(unknown) or "(none)", ", ".join(known)))
    return out


def measure(system: System, mode: str, s: Settings, run_dir: Path) -> dict[str, Any]:
    run_dir.mkdir(parents=True)
    load = " ".join("%.2f" % x for x in _loadavg() or [])
    t0 = time.monotonic()
    try:
        row = measure_one(system, mode, s, run_dir)
    except Exception as exc:  # noqa: BLE001 - any system's own errors too: the run failed, the bench goes on
        return {"load": load, "error": ("%s: %s" % (type(exc).__name__, exc)).strip()[-1500:]}
    row.update(load=load, seconds=round(time.monotonic() - t0, 1))
    return row


def main(argv: list[str] | None = None) -> int:
    args = docopt(__doc__, argv=argv)
    s = settings(args)
    runs = int(args["--runs"])
    modes = names(args["--modes"], MODES, "mode")
    wanted = names(args["--systems"], list(SYSTEMS), "system")
    skipped = {n: why for n in wanted if (why := why_not(SYSTEMS[n]))}
    systems = [SYSTEMS[n] for n in wanted if n not in skipped]
    work_dir = Path(args["--work-dir"] or tempfile.mkdtemp(prefix="jobmesh-peers-")).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        gevent.signal_handler(sig, procs.stop_on_interrupt, "peers", STARTED, work_dir, bool(args["--work-dir"]))
    revision = _revision()
    print("peers: revision %s, %s cpus, %d rounds of %s; %d submitters in %d processes, %d worker processes; "
          "e2e %d jobs (%d forking), submit %d jobs; redis %s; load %s" % (
              revision, os.cpu_count(), runs, ", ".join(s.name for s in systems) or "nothing", s.clients,
              s.client_procs, s.workers, s.jobs, s.forking_jobs, s.submit_jobs, s.redis, _loadavg()))
    for name, why in skipped.items():
        print("skipped %s: %s" % (name, why))
    sys.stdout.flush()
    results: dict[str, dict[str, list[dict[str, Any]]]] = {sy.name: {m: [] for m in modes} for sy in systems}
    try:
        for rnd in range(1, runs + 1):
            for system in systems:
                for mode in modes:
                    row = measure(system, mode, s, work_dir / ("round%d-%s-%s" % (rnd, system.name, mode)))
                    results[system.name][mode].append(row)
                    print(run_line(rnd, system.name, mode, row))
                    sys.stdout.flush()
    finally:
        if not args["--work-dir"]:
            shutil.rmtree(work_dir, ignore_errors=True)
    medians = print_medians(results, runs, skipped)
    print("\nload average at the end: %s" % _loadavg())
    if args["--out"]:
        Path(args["--out"]).write_text(json.dumps(
            {"revision": revision, "cpus": os.cpu_count(), "settings": s.__dict__, "runs": results,
             "medians": medians, "skipped": skipped}, indent=2, sort_keys=True) + "\n")
    failed = any("error" in r or r.get("lost") for by_mode in results.values() for rs in by_mode.values() for r in rs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
