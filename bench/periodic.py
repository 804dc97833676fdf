"""The Periodic port beside the JSON ports: durable submits/s, e2e jobs/s and the
coordinator's CPU per job, measured in one run on one machine.

Four measurements, each against a fresh coordinator started the same way
(``--db-synchronous=FULL``, so an acknowledged submit is on disk;
``--periodic-port=0 --metrics-port=0 --max-active-jobs=1000000``):

- ``periodic-submit``: ``--clients`` processes of the real aio-periodic 1.0.0 ``Client``
  (``bench/periodic_peer.py``: plain asyncio, never in a gevent process), each keeping
  ``--inflight`` SUBMIT_JOBs in flight on its one connection (unique names), for
  ``--duration`` seconds. They connect first and start together on a signal.
- ``json-submit``: ``bench/loadgen --mode=submit`` attached to the coordinator, with as
  many connections as the Periodic side has submits in flight, for as long.
- ``periodic-e2e``: ``--workers`` aio-periodic ``Worker`` processes (``work(--size)``;
  each task answers ``job.done`` at once) and the same clients submitting ``--jobs``
  jobs in all. aio-periodic's worker sends one GRAB_JOB a second when idle and one
  more per job assigned, so ``--workers`` x ``--size`` x 4 jobs run first, uncounted.
  jobs/s = jobs completed / (last WORK_DONE acknowledged - first submit).
- ``json-e2e``: ``bench/loadgen --mode=e2e --task=sleep0`` with as many workers of
  ``--size`` slots (scripted ones inside the load generator by default), same client
  count and jobs; jobs/s = completed / (last update - first submit). Its checker
  polls GET_JOB_STATUS, about once per job, on the coordinator's CPU.

Per run it prints the rate, the coordinator's CPU per job (user + system from
``/proc/<pid>/stat`` from the start signal until every counted job was acknowledged,
divided by the jobs; for loadgen its ``coord_cpu_us_per_job``, as ``sidebyside.py``
derives it), the cores each side used (the aio-periodic clients report their own CPU,
the workers are read from ``/proc``), how busy the whole machine was (``/proc/stat``:
other processes and the kernel's loopback work too), and from the coordinator's
``/metrics`` (read before and after, never during the load) the group commits and rows
written per job and the share of the time a commit was in progress. ``busy:`` names
what was near its limit: a process above 0.9 of a core, or the machine above 90% of its
cores. A figure measured while the load generator or the machine was saturated is
theirs as much as the coordinator's.

Rounds alternate the measurements (Periodic submit, JSON submit, Periodic e2e, JSON e2e;
then again), since the machine's speed drifts over minutes; the medians of each figure
follow, with every run's value. Every Periodic run checks with ``/metrics`` that each
acknowledged submit created a job (and, e2e, completed); a shortfall is ``lost``. The
exit status is 1 if a measurement failed or lost a job, else 0; figures are not judged.

Usage:
  periodic.py [options]
  periodic.py (-h | --help)

Options:
  --runs=N               rounds; each runs every measurement once [default: 3]
  --clients=C            aio-periodic client processes [default: 4]
  --inflight=I           submits in flight per client process [default: 16]
  --json-clients=N       loadgen connections (default: clients x inflight)
  --duration=S           seconds of submits in the submit measurements [default: 8]
  --jobs=N               jobs per e2e measurement [default: 30000]
  --workers=W            workers in the e2e measurements [default: 2]
  --size=K               concurrency of each worker [default: 32]: aio-periodic's
                         work(K), loadgen's --capacity
  --json-worker-impl=I   loadgen's --worker-impl: builtin or process [default: builtin]
  --only=NAMES           comma-separated subset of periodic-submit, json-submit,
                         periodic-e2e, json-e2e (default: all four)
  --timeout=S            cap on each measurement, seconds [default: 120]
  --out=FILE             write every run and the medians as JSON
  --work-dir=DIR         keep databases and logs here (default: a temp dir, removed)
  -h --help              show this help
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gevent  # noqa: E402
from docopt import docopt  # noqa: E402

from bench import procs  # noqa: E402
from bench.loadgen import _loadavg, _revision  # noqa: E402
from bench.profiles import median  # noqa: E402
from bench.scaling import fmt, print_table  # noqa: E402
from bench.sidebyside import figure  # noqa: E402

MEASUREMENTS = ("periodic-submit", "json-submit", "periodic-e2e", "json-e2e")
COORDINATOR_ARGS = ["--periodic-port=0", "--metrics-port=0", "--max-active-jobs=1000000"]
PERIODIC_ADDR = re.compile(r" periodic=(\S+:\d+)")
METRICS_ADDR = re.compile(r" metrics=(\S+:\d+)")
READY = re.compile(r'"ready": true')
FUNC = "bench"
WARMUP_PER_SLOT = 4
BUSY = 0.9  # a process above this share of a core, or the machine above it, is saturated


STARTED: list[procs.Child] = []  # every child of this run, so that an interrupted run stops them


@dataclass(frozen=True)
class Settings:
    clients: int
    inflight: int
    json_clients: int
    duration: float
    jobs: int
    workers: int
    size: int
    json_worker_impl: str
    timeout: float


# ---- the aio-periodic processes -----------------------------------------------------


def peer(run_dir: Path, name: str, *args: str, lifetime: float) -> procs.Child:
    """One ``bench/periodic_peer.py`` process; it exits by itself after ``lifetime``."""
    child = procs.Child(name, [sys.executable, "-m", "bench.periodic_peer", *args, "--lifetime=%g" % lifetime],
                        run_dir)
    STARTED.append(child)
    return child


def last_json(child: procs.Child, key: str) -> dict[str, Any] | None:
    """The last line of the child's stdout that is a JSON object with ``key``."""
    for line in reversed(procs.tail(child.out_path, 1 << 16).splitlines()):
        if ('"%s"' % key) in line:
            try:
                return json.loads(line)
            except ValueError:
                continue  # a line still being written
    return None


def await_ready(children: list[procs.Child], timeout: float) -> list[dict[str, Any]]:
    for child in children:
        child.wait_for_line(READY, timeout)
    return [last_json(c, "ready") or {} for c in children]


def wait_until(done: Callable[[], bool], children: list[procs.Child], timeout: float, what: str) -> bool:
    """Poll ``done`` every 50 ms (the driver shares the cores it measures, so it polls
    gently); False after ``timeout``; procs.Failed if a child died first."""
    deadline = time.monotonic() + timeout
    while not done():
        for child in children:
            if not child.alive() and child.proc.returncode not in (0, None):
                raise procs.Failed("%s exited rc=%s while waiting for %s:\n%s"
                             % (child.name, child.proc.returncode, what, procs.tail(child.err_path)))
        if time.monotonic() > deadline:
            return False
        gevent.sleep(0.05)
    return True


def client_reports(clients: list[procs.Child], timeout: float) -> list[dict[str, Any]]:
    ok = wait_until(lambda: all(last_json(c, "accepted") for c in clients), clients, timeout, "client reports")
    if not ok:
        raise procs.Failed("aio-periodic clients did not report within %.0f s" % timeout)
    return [last_json(c, "accepted") or {} for c in clients]


def worker_done(workers: list[procs.Child]) -> int:
    return sum((last_json(w, "done") or {}).get("done", 0) for w in workers)


def start_clients(s: Settings, run_dir: Path, addr: str, tag: str, extra: Callable[[int], list[str]]) -> list[procs.Child]:
    """``--clients`` aio-periodic client processes; client i gets ``extra(i)`` too."""
    return [peer(run_dir, "%s-client%d" % (tag, i), "client", addr, "--func=" + FUNC, "--tag=%s%d-" % (tag, i),
                 "--inflight=%d" % s.inflight, *extra(i), lifetime=s.duration + s.timeout + 60)
            for i in range(s.clients)]


def start_signalled(clients: list[procs.Child]) -> None:
    """SIGUSR1 starts every client process's load at about the same moment."""
    for c in clients:
        c.signal(signal.SIGUSR1)


# ---- the coordinator ----------------------------------------------------------------


class Coordinator:
    """A fresh coordinator with the Periodic and metrics ports open."""

    def __init__(self, run_dir: Path) -> None:
        self.child, worker, client = procs.start_coordinator(run_dir, run_dir / "bench.db", "FULL",
                                                             COORDINATOR_ARGS)
        STARTED.append(self.child)
        self.worker, self.client = "%s:%d" % worker, "%s:%d" % client
        line = procs.tail(self.child.out_path, 1 << 16)
        periodic, metrics = PERIODIC_ADDR.search(line), METRICS_ADDR.search(line)
        if not periodic or not metrics:
            self.child.stop(5)
            raise procs.Failed("the coordinator's listening line has no periodic= or metrics=: %r" % line)
        self.periodic = periodic.group(1)
        self.metrics = metrics.group(1)

    def counters(self) -> dict[str, float]:
        """Counters from /metrics: jobs created and completed, stale results, retries,
        group commits and the job rows they wrote. Read outside the measured window
        (before the start signal and after the last job), so the scrape costs nothing
        measured."""
        with urllib.request.urlopen("http://%s/metrics" % self.metrics, timeout=10) as reply:
            text = reply.read().decode()
        out = {}
        for key, name in COUNTERS.items():
            match = re.search(r"^%s (\S+)$" % re.escape(name), text, re.M)
            out[key] = float(match.group(1)) if match else float("nan")
        return out


COUNTERS = {
    "created": "jobmesh_jobs_submitted_total",
    "completed": 'jobmesh_jobs_finished_total{state="COMPLETED"}',
    "stale": "jobmesh_stale_results_total",
    "retries": "jobmesh_retries_total",
    "commits": "jobmesh_commit_seconds_count",
    "commit_s": "jobmesh_commit_seconds_sum",
    "commit_rows": "jobmesh_commit_batch_rows_sum",
}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def commit_figures(counted: dict[str, float], jobs: int, span: float | None) -> dict[str, Any]:
    """Group commits and rows written per job, the durable work each protocol costs, and
    the share of the measured time a commit was in progress: commits are serial, and
    the core applies no new batch while one runs, so a share near 1 means the commit
    loop, not the CPU, sets the pace."""
    if not jobs:
        return {}
    out = {"commits_per_1000_jobs": counted["commits"] / jobs * 1000, "rows_per_job": counted["commit_rows"] / jobs}
    if span:
        out["commit_share"] = counted["commit_s"] / span
    return out


# ---- the measurements ---------------------------------------------------------------


class Window:
    """CPU seconds used between ``__init__`` and ``close()``: by each of ``pids`` (read
    from /proc, so they must outlive the window) and by the whole machine."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.t0 = time.monotonic()
        self.cpu0 = [procs.cpu_seconds(p) or 0.0 for p in pids]
        self.machine0 = procs.machine_cpu_seconds() or 0.0

    def close(self) -> None:
        self.cpu = [(procs.cpu_seconds(p) or 0.0) - c0 for p, c0 in zip(self.pids, self.cpu0)]
        self.machine_cores = ((procs.machine_cpu_seconds() or 0.0) - self.machine0) / (time.monotonic() - self.t0)


def span_of(reports: list[dict[str, Any]]) -> tuple[float, float]:
    """(first submit, last acknowledged submit) over the client processes (one clock)."""
    firsts = [r["first_send"] for r in reports if r.get("first_send")]
    lasts = [r["last_reply"] for r in reports if r.get("last_reply")]
    if not firsts or not lasts:
        raise procs.Failed("no submit was acknowledged: %s" % reports)
    return min(firsts), max(lasts)


def merged_latency(reports: list[dict[str, Any]]) -> dict[str, float | None]:
    """p50 as the median of the processes' p50s, p99 as their maximum (every process
    makes about the same number of submits)."""
    lats = [r["latency_ms"] for r in reports if r.get("latency_ms")]
    return {"p50": median([x["p50"] for x in lats]), "p99": max((x["p99"] for x in lats), default=None)}


def client_figures(reports: list[dict[str, Any]], span: float) -> dict[str, Any]:
    cores = [r["cpu_s"] / span for r in reports]
    lat = merged_latency(reports)
    return {"gen_cores": round(sum(cores), 2), "gen_max_process_cores": round(max(cores), 2),
            "p50_ms": lat["p50"], "p99_ms": lat["p99"],
            "errors": sum(sum(r["errors"].values()) for r in reports),
            "refused": sum(r["refused"] for r in reports)}


def periodic_submit(s: Settings, run_dir: Path) -> dict[str, Any]:
    coord = Coordinator(run_dir)
    children = [coord.child]
    try:
        clients = start_clients(s, run_dir, coord.periodic, "s", lambda i: ["--duration=%g" % s.duration])
        children += clients
        await_ready(clients, 30)
        before = coord.counters()
        window = Window([coord.child.pid])
        start_signalled(clients)
        reports = client_reports(clients, s.duration + s.timeout)
        window.close()
        counted = delta(before, coord.counters())
        first, last = span_of(reports)
        span, cpu = last - first, window.cpu[0]
        accepted = sum(r["accepted"] for r in reports)
        row = {"rate": accepted / span, "jobs": accepted, "coord_us_per_job": cpu / accepted * 1e6,
               "coord_cores": cpu / span, "machine_cores": window.machine_cores, "measured_s": span,
               "lost": int(max(accepted - counted["created"], 0)),
               "unacknowledged": int(max(counted["created"] - accepted, 0))}
        row.update(client_figures(reports, span))
        row.update(commit_figures(counted, accepted, span))
        return row
    finally:
        procs.stop_all(children)


def periodic_e2e(s: Settings, run_dir: Path) -> dict[str, Any]:
    coord = Coordinator(run_dir)
    children = [coord.child]
    try:
        workers = [peer(run_dir, "e-worker%d" % i, "worker", coord.periodic, "--func=" + FUNC, "--size=%d" % s.size,
                        lifetime=s.duration + s.timeout + 120) for i in range(s.workers)]
        children += workers
        await_ready(workers, 30)
        warmup = -(-s.workers * s.size * WARMUP_PER_SLOT // s.clients)
        shares = [s.jobs // s.clients + (1 if i < s.jobs % s.clients else 0) for i in range(s.clients)]
        clients = start_clients(s, run_dir, coord.periodic, "e",
                                lambda i: ["--jobs=%d" % shares[i], "--warmup=%d" % warmup])
        children += clients
        warmed = sum(r.get("warmup", 0) for r in await_ready(clients, 60))
        if not wait_until(lambda: worker_done(workers) >= warmed, workers, 60, "the warm-up jobs"):
            raise procs.Failed("%d of the warm-up's %d jobs completed within 60 s" % (worker_done(workers), warmed))
        done0 = worker_done(workers)
        before = coord.counters()
        window = Window([coord.child.pid] + [w.pid for w in workers])
        start_signalled(clients)
        reports = client_reports(clients, s.timeout)
        accepted = sum(r["accepted"] for r in reports)
        drained = wait_until(lambda: worker_done(workers) - done0 >= accepted, workers, s.timeout, "completions")
        window.close()
        completed = worker_done(workers) - done0
        first, _ = span_of(reports)
        span = max((last_json(w, "done") or {}).get("last") or 0.0 for w in workers) - first
        cpu, wcpu = window.cpu[0], window.cpu[1:]
        counted = delta(before, coord.counters())
        row = {"rate": completed / span, "jobs": completed, "submitted": accepted,
               "coord_us_per_job": cpu / completed * 1e6 if completed else None, "coord_cores": cpu / span,
               "worker_cores": sum(wcpu) / span, "worker_max_process_cores": max(wcpu) / span,
               "machine_cores": window.machine_cores, "measured_s": span, "drained": drained,
               "lost": int(max(accepted - min(counted["created"], counted["completed"]), 0)),
               "stale_results": int(counted["stale"]), "retries": int(counted["retries"])}
        row.update(client_figures(reports, span))
        row.update(commit_figures(counted, completed, span))
        return row
    finally:
        procs.stop_all(children)


def json_run(s: Settings, run_dir: Path, mode: str) -> dict[str, Any]:
    """One ``bench/loadgen`` run, attached to a coordinator started as the Periodic
    runs' are (same flags, same start-up path, /metrics read the same way)."""
    coord = Coordinator(run_dir)
    try:
        before = coord.counters()
        rep, rc = loadgen(s, run_dir, mode, coord)
        counted = delta(before, coord.counters())
    finally:
        coord.child.stop(15)
    cores = rep.get("cpu_cores_used") or {}
    jobs = rep["completed" if mode == "e2e" else "submitted"]
    row = {"rate": rep["jobs_per_s" if mode == "e2e" else "submits_per_s"], "jobs": jobs,
           "coord_us_per_job": figure(rep, "coord_cpu_us_per_job"), "coord_cores": cores.get("coordinator"),
           "gen_cores": cores.get("loadgen"), "gen_max_process_cores": cores.get("loadgen"),
           "worker_cores": cores.get("workers"), "machine_cores": cores.get("machine"),
           "measured_s": rep.get("measured_s"),
           "p50_ms": rep["submit_latency_ms"]["p50"], "p99_ms": rep["submit_latency_ms"]["p99"],
           "lost": rep["lost"] + rep["duplicates"], "errors": sum(rep["errors"].values()),
           "refused": rep["rejected"], "loadgen_rc": rc}
    if mode == "e2e":
        row["submitted"] = rep["submitted"]
    row.update(commit_figures(counted, jobs, rep.get("measured_s")))
    return row


def loadgen(s: Settings, run_dir: Path, mode: str, coord: Coordinator) -> tuple[dict[str, Any], int | None]:
    """Run ``bench/loadgen`` against ``coord``; its JSON report and exit status."""
    out = run_dir / "loadgen.json"
    args = [sys.executable, "-m", "bench.loadgen", "--mode=%s" % mode, "--clients=%d" % s.json_clients,
            "--coordinator=%s" % coord.client, "--coordinator-worker=%s" % coord.worker,
            "--coordinator-pid=%d" % coord.child.pid, "--quiet", "--out=%s" % out,
            "--run-dir=%s" % (run_dir / "loadgen"), "--timeout=%g" % s.timeout, "--drain-timeout=%g" % s.timeout]
    if mode == "submit":
        args += ["--duration=%g" % s.duration, "--workers=0"]
    else:
        args += ["--jobs=%d" % s.jobs, "--task=sleep0", "--workers=%d" % s.workers, "--capacity=%d" % s.size,
                 "--worker-impl=%s" % s.json_worker_impl]
    child = procs.Child("loadgen-%s" % mode, args, run_dir)
    STARTED.append(child)
    try:
        rc: int | None = child.proc.wait(timeout=s.duration + 2 * s.timeout + 120)
    except procs.subprocess.TimeoutExpired:
        rc = None  # stopped below; it writes its report as it goes
    finally:
        child.stop(15)
    if not out.exists():
        raise procs.Failed("loadgen --mode=%s exited rc=%s without a report:\n%s" % (mode, rc, procs.tail(child.err_path)))
    return json.loads(out.read_text()), rc


# ---- what was busy, the table ---------------------------------------------------------


def busy(row: dict[str, Any], cpus: int) -> list[str]:
    """Which of our processes used most of a core during the run, and whether the
    machine's cores were all in use (by anyone, the kernel's loopback work included):
    what limited the figure. ``other_cores`` is what the machine used beyond the
    processes measured."""
    out = []
    if (row.get("coord_cores") or 0) >= BUSY:
        out.append("coordinator")
    if (row.get("gen_max_process_cores") or 0) >= BUSY:
        out.append("load generator")
    if (row.get("worker_max_process_cores") or 0) >= BUSY:
        out.append("a worker")
    ours = sum(row.get(k) or 0 for k in ("coord_cores", "gen_cores", "worker_cores"))
    machine = row.get("machine_cores")
    if machine is not None:
        row["other_cores"] = max(machine - ours, 0.0)
        if machine >= BUSY * cpus:
            out.append("machine (%.2f of %d cores)" % (machine, cpus))
    return out


def run_line(rnd: int, name: str, row: dict[str, Any]) -> str:
    if "error" in row:
        return "round %d %-16s load %s: FAILED %s" % (rnd, name, row["load"], row["error"])
    per = "job" if name.endswith("e2e") else "submit"
    return ("round %d %-16s load %s %5.1fs: %s/s=%s coord_us/%s=%s coord_cores=%s gen_cores=%s (busiest process %s)"
            "%s machine_cores=%s (others %s) p50/p99_ms=%s/%s %ss=%s lost=%s errors=%s refused=%s busy: %s" % (
                rnd, name, row["load"], row["seconds"], "jobs" if per == "job" else "submits", fmt(row["rate"], 0),
                per, fmt(row["coord_us_per_job"], 1), fmt(row["coord_cores"]), fmt(row["gen_cores"]),
                fmt(row["gen_max_process_cores"]),
                " worker_cores=%s" % fmt(row["worker_cores"]) if row.get("worker_cores") is not None else "",
                fmt(row.get("machine_cores")), fmt(row.get("other_cores")),
                fmt(row["p50_ms"]), fmt(row["p99_ms"]), per, fmt(row["jobs"]), row["lost"], row["errors"],
                row["refused"], ", ".join(row["busy"]) or "nothing"))


FIGURES = [  # (label, key, digits, whether a Periodic / JSON ratio means something)
    ("{per}s/s", "rate", 0, True),
    ("coordinator CPU µs per {per}", "coord_us_per_job", 1, True),
    ("coordinator cores", "coord_cores", 2, False),
    ("load generator cores, all processes", "gen_cores", 2, False),
    ("load generator cores, busiest process", "gen_max_process_cores", 2, False),
    ("worker process cores", "worker_cores", 2, False),
    ("machine cores busy (everyone, kernel too)", "machine_cores", 2, False),
    ("  of which not the processes above", "other_cores", 2, False),
    ("group commits per 1000 {per}s", "commits_per_1000_jobs", 1, True),
    ("job rows written per {per}", "rows_per_job", 2, True),
    ("share of the time in a commit", "commit_share", 2, False),
    ("submit p50 ms", "p50_ms", 2, True),
    ("submit p99 ms", "p99_ms", 2, True),
]
NOTES = {
    "submit": "JSON: one load generator process (gevent), one connection per submit in flight; Periodic: "
              "aio-periodic processes, several submits in flight on each connection.",
    "e2e": "JSON: the load generator's cores include its scripted workers (--json-worker-impl=builtin) and its "
           "checker, whose GET_JOB_STATUS polls (about one per job) the coordinator's CPU per job includes.",
}


def cell(rows: list[dict[str, Any]], key: str, digits: int) -> tuple[float | None, str]:
    """The median and every run's value in order: 'median (a / b / c)'."""
    values = [r.get(key) if "error" not in r else None for r in rows]
    med = median(values)
    if all(v is None for v in values):
        return None, "-"
    return med, "%s (%s)" % (fmt(med, digits), " / ".join(fmt(v, digits) for v in values))


def print_medians(results: dict[str, list[dict[str, Any]]], runs: int) -> dict[str, dict[str, float | None]]:
    medians: dict[str, dict[str, float | None]] = {}
    for kind, per in (("submit", "submit"), ("e2e", "job")):
        names = ["periodic-" + kind, "json-" + kind]
        if not any(results.get(n) for n in names):
            continue
        rows = []
        for label, key, digits, with_ratio in FIGURES:
            p_med, p_cell = cell(results.get(names[0], []), key, digits)
            j_med, j_cell = cell(results.get(names[1], []), key, digits)
            medians.setdefault(names[0], {})[key] = p_med
            medians.setdefault(names[1], {})[key] = j_med
            if p_med is None and j_med is None:
                continue
            ratio = "%.2f" % (p_med / j_med) if with_ratio and p_med is not None and j_med else ""
            rows.append([label.format(per=per), p_cell, j_cell, ratio])
        print_table("%s: medians of %d runs (every run in order)" % (kind, runs),
                    ["figure", "Periodic", "JSON", "Periodic / JSON"], rows)
        print("  " + NOTES[kind])
        for name in names:
            tally: dict[str, int] = {}
            for row in results.get(name, []):
                for what in row.get("busy", []):
                    what = what.split(" (")[0]
                    tally[what] = tally.get(what, 0) + 1
            print("  %s busy: %s" % (name, ", ".join("%s in %d of %d runs" % (w, n, len(results[name]))
                                                     for w, n in tally.items()) or "nothing near a full core"))
    return medians


# ---- the driver -------------------------------------------------------------------------


def settings(args: dict[str, Any]) -> Settings:
    clients, inflight = int(args["--clients"]), int(args["--inflight"])
    s = Settings(clients=clients, inflight=inflight,
                 json_clients=int(args["--json-clients"]) if args["--json-clients"] else clients * inflight,
                 duration=float(args["--duration"]), jobs=int(args["--jobs"]), workers=int(args["--workers"]),
                 size=int(args["--size"]), json_worker_impl=args["--json-worker-impl"],
                 timeout=float(args["--timeout"]))
    if min(s.clients, s.inflight, s.json_clients, s.jobs, s.workers, s.size) < 1 or s.duration <= 0:
        raise SystemExit("periodic: counts must be at least 1 and --duration above 0")
    if s.json_worker_impl not in ("builtin", "process"):
        raise SystemExit("periodic: --json-worker-impl is builtin or process")
    return s


MEASURE: dict[str, Callable[[Settings, Path], dict[str, Any]]] = {
    "periodic-submit": periodic_submit,
    "json-submit": lambda s, d: json_run(s, d, "submit"),
    "periodic-e2e": periodic_e2e,
    "json-e2e": lambda s, d: json_run(s, d, "e2e"),
}


def measure(name: str, s: Settings, run_dir: Path) -> dict[str, Any]:
    run_dir.mkdir(parents=True)
    load = " ".join("%.2f" % x for x in _loadavg() or [])
    t0 = time.monotonic()
    try:
        row = MEASURE[name](s, run_dir)
    except (procs.Failed, procs.ChildFailed, OSError) as exc:
        return {"load": load, "error": str(exc).strip()[-1500:]}
    row.update(load=load, seconds=round(time.monotonic() - t0, 1))
    row["busy"] = busy(row, os.cpu_count() or 1)
    return row


def main(argv: list[str] | None = None) -> int:
    args = docopt(__doc__, argv=argv)
    s = settings(args)
    runs = int(args["--runs"])
    names = [n.strip() for n in args["--only"].split(",")] if args["--only"] else list(MEASUREMENTS)
    unknown = [n for n in names if n not in MEASUREMENTS]
    if unknown:
        raise SystemExit("periodic: unknown measurement(s) %s (known: %s)" % (", ".join(unknown), ", ".join(MEASUREMENTS)))
    work_dir = Path(args["--work-dir"] or tempfile.mkdtemp(prefix="jobmesh-periodic-")).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        gevent.signal_handler(sig, procs.stop_on_interrupt, "periodic", STARTED, work_dir, bool(args["--work-dir"]))
    revision = _revision()
    print("periodic vs JSON: revision %s, %s cpus, %d rounds; Periodic: %d client processes x %d in flight, "
          "%d workers x %d; JSON: %d connections, %d %s workers x %d; submit runs %gs, e2e %d jobs; load %s" % (
              revision, os.cpu_count(), runs, s.clients, s.inflight, s.workers, s.size, s.json_clients, s.workers,
              s.json_worker_impl, s.size, s.duration, s.jobs, _loadavg()))
    sys.stdout.flush()
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    try:
        for rnd in range(1, runs + 1):
            for name in names:
                row = measure(name, s, work_dir / ("round%d-%s" % (rnd, name)))
                results[name].append(row)
                print(run_line(rnd, name, row))
                sys.stdout.flush()
    finally:
        if not args["--work-dir"]:
            shutil.rmtree(work_dir, ignore_errors=True)
    medians = print_medians(results, runs)
    print("\nload average at the end: %s" % _loadavg())
    if args["--out"]:
        Path(args["--out"]).write_text(json.dumps(
            {"revision": revision, "cpus": os.cpu_count(), "settings": s.__dict__, "runs": results,
             "medians": medians}, indent=2, sort_keys=True) + "\n")
    failed = any("error" in r or r.get("lost") for rows in results.values() for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
