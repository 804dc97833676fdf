"""Scaling: does the cost of an operation grow with the queue, or with history?

Four levels, each printed as a table (``--out`` also writes them as JSON):

``core``
    The pure ``CoordinatorCore`` in this process, no sockets, no gevent: for each size N
    it submits N queued jobs, registers ``--workers`` sessions of ``--capacity`` slots,
    then runs ``--rounds`` rounds of a steady state that keeps N jobs queued: apply the
    previous round's results, submit as many new jobs, ``schedule_queued_jobs`` (it fills
    every free slot from a queue N deep), one ``sweep`` with every slot taken, and the
    group commit of the round's rows. Each step is timed with ``perf_counter`` and
    divided by the operations it did; the table shows the median over rounds (µs per
    submit, per assignment, per result, per sweep, per committed row).

``history``
    The same steady state at the first size's depth, run until ``--history`` jobs have
    completed, with the clock advancing as if ``--history-rate`` assignments/s went
    through; the table shows the per-operation medians in eleven blocks along the way,
    with what the core still holds (deadline heap, finished-job cache) and this
    process's RSS. Cost or memory that grows with the jobs already processed shows here.

``e2e``
    A real coordinator (``python -m jobmesh coordinator``, WAL + ``synchronous=FULL``,
    admission limit raised) is filled with N queued jobs by ``--prefill-clients``
    connections while no worker is attached; then ``--workers`` workers attach
    (``--worker-impl=builtin``: the load generator's scripted workers, so the
    coordinator is measured alone; ``process``: ``python -m jobmesh worker``) and drain
    the queue. Assignments/s comes from the time each TASK_ASSIGN reached a scripted
    worker (whole drain, its first tenth while the queue is still about N deep, its last
    tenth); completions/s from the jobs' ``updatedAtMillis`` (between the 10th and 90th
    percentile completion, which ignores worker start-up). Every job is then listed and
    must be COMPLETED. A fresh coordinator per trial; medians over ``--trials``.

``stored``
    A database with ``--stored`` finished (COMPLETED) rows is written directly with
    sqlite3, in the row format of ``jobmesh/store/columns.py`` (ids as the core
    makes them: 8 hex digits of the sequence, 24 random ones; sequence 1..N). Built once
    per run in the work directory and copied for every trial. For each of
    ``--stored-runs`` runs, an empty database and a copy of the big one each get a fresh
    coordinator: start-up time (spawn to its "listening" line), RSS once listening, then
    ``bench/loadgen --mode=submit`` (``--stored-clients`` connections, durable FULL,
    ``--stored-duration`` seconds) attached to it. Recovery alone (open + migrate +
    ``recover()``) is also timed in this process on each database.

Usage:
  scaling.py [options]
  scaling.py (-h | --help)

Options:
  --levels=LIST          core, history, e2e and/or stored, comma-separated
                         [default: core,history,e2e,stored]
  --sizes=LIST           queued jobs per step (core, e2e) [default: 1000,10000,100000]
  --workers=W            worker sessions or connections [default: 8]
  --capacity=K           slots per worker [default: 32]
  --rounds=R             core: measured rounds per size (after 3 warm-up rounds) [default: 30]
  --core-store=KIND      core, history: file (WAL + FULL in the work directory) or memory
                         [default: file]
  --history=N            history: jobs to complete at the first size's depth [default: 1000000]
  --history-rate=R       history: assignments per simulated second [default: 8000]
  --task-timeout-millis=N  core, history: the core's attempt deadline [default: 600000]
  --trials=N             e2e: coordinators per size [default: 3]
  --worker-impl=IMPL     e2e: builtin or process [default: builtin]
  --prefill-clients=C    e2e: connections that fill the queue [default: 50]
  --stored=N             stored: finished rows in the big database [default: 1000000]
  --stored-runs=N        stored: runs of each database, interleaved [default: 3]
  --stored-clients=C     stored: load generator connections [default: 50]
  --stored-duration=S    stored: seconds of submit load per run [default: 10]
  --work-dir=DIR         databases and logs (default: a temp directory, removed at the end);
                         a big database built there earlier is reused
  --out=FILE             also write the results as JSON
  -h --help              show this help
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sqlite3
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
from bench.builtin_worker import BuiltinWorkers  # noqa: E402
from bench.conns import Conn, open_many, raise_fd_limit  # noqa: E402
from bench.drive import Phase, run_clients, submit_client, wait_phase  # noqa: E402
from bench.loadgen import _loadavg, _revision  # noqa: E402
from bench.workload import Workload  # noqa: E402
from jobmesh.coordinator.core.face import CoordinatorCore, CoreConfig  # noqa: E402
from jobmesh.protocol import messages as m  # noqa: E402
from jobmesh.protocol.jobs import JobState, Priority  # noqa: E402
from jobmesh.store.columns import insert_row  # noqa: E402
from jobmesh.store.job import Job  # noqa: E402
from jobmesh.store.sqlite import INSERT_SQL, SQLiteStore  # noqa: E402

LEVELS = ("core", "history", "e2e", "stored")
WARMUP_ROUNDS = 3
PRIORITY_CYCLE = ("NORMAL",) * 4 + ("HIGH",) + ("NORMAL",) * 4 + ("LOW",)  # 1:8:1
T0_MILLIS = 1_700_000_000_000
HEARTBEAT_MILLIS = 2000  # the worker's default --heartbeat-interval-millis
BUILD_CHUNK = 100_000


class Failed(Exception):
    """A level could not be measured; the message says why."""


# ---- small helpers ------------------------------------------------------------------


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def rss_kb(pid: int | None = None) -> int | None:
    return procs.read_status_kb(pid or os.getpid()).get("VmRSS")


def remove_db(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        p = Path(str(path) + suffix)
        if p.exists():
            p.unlink()


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "?"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return "{:,.0f}".format(value)
        return "%.*f" % (digits, value)
    if isinstance(value, int):
        return "{:,}".format(value)
    return str(value)


def print_table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    cells = [header] + [[fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print("\n" + title)
    for i, row in enumerate(cells):
        print("  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


# ---- level 1: the pure core ---------------------------------------------------------


class FakeConn:
    """A worker connection as the core sees it: an opaque, hashable handle."""

    __slots__ = ("worker_id",)

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id


def submit_requests(count: int, start: int) -> list[m.SubmitJob]:
    return [m.SubmitJob(task_type="SLEEP", payload={"durationMillis": 0},
                        priority=PRIORITY_CYCLE[(start + i) % len(PRIORITY_CYCLE)]) for i in range(count)]


class SteadyCore:
    """A ``CoordinatorCore`` kept at a fixed queue depth, one round at a time.

    Set-up submits ``size`` jobs and registers the sessions. Each ``round`` applies the
    previous round's results, submits as many new jobs (so the queue is ``size`` deep
    again), schedules (which fills every slot), sweeps, and commits the round's rows;
    it returns each step's seconds and counts. The clock advances ``step_millis`` per
    round, and every session heartbeats every 2 s of that clock.
    """

    def __init__(self, size: int, opts: dict[str, Any], store: SQLiteStore, step_millis: int = 1) -> None:
        self.size = size
        self.slots = opts["workers"] * opts["capacity"]
        self.store = store
        self.step_millis = step_millis
        self.core = CoordinatorCore(store, CoreConfig(max_active_jobs=size + 2 * self.slots + 1,
                                                      task_timeout_millis=opts["task_timeout_millis"]))
        self.now = T0_MILLIS
        reqs = submit_requests(size, 0)
        t = time.perf_counter()
        for req in reqs:
            self.core.requests.submit_job(self.now, req)
        self.prefill_s = time.perf_counter() - t
        del reqs
        store.write(self.core.take_dirty())
        self.conns = [FakeConn("scaling-w%d" % i) for i in range(opts["workers"])]
        for conn in self.conns:
            self.core.json.on_registered(self.now, conn, m.WorkerRegister(conn.worker_id, opts["capacity"]))
        self.core.take_outbound()
        self.beat_at = self.now
        self.running: list = []
        self.submitted = size
        self.rounds = 0

    def round(self) -> dict[str, float]:
        core = self.core
        self.now += self.step_millis
        if self.now - self.beat_at >= HEARTBEAT_MILLIS:  # as a worker's heartbeat greenlet would
            self.beat_at = self.now
            for conn in self.conns:
                core.json.on_heartbeat(self.now, conn, conn.worker_id)
        results = [(conn, m.TaskResult(conn.worker_id, a.job_id, a.attempt_id, True, {"sleptMillis": 0}))
                   for conn, a in self.running]
        reqs = submit_requests(len(results), self.submitted)
        self.submitted += len(reqs)

        t = time.perf_counter()
        for conn, res in results:
            core.json.on_result(self.now, conn, res)
        t_result = time.perf_counter() - t

        t = time.perf_counter()
        for req in reqs:
            core.requests.submit_job(self.now, req)
        t_submit = time.perf_counter() - t

        depth = len(core.json.queued)
        t = time.perf_counter()
        assigned = core.json.schedule(self.now)
        t_schedule = time.perf_counter() - t
        self.running = [(conn, msg) for conn, msg in core.take_outbound() if isinstance(msg, m.TaskAssign)]
        if assigned != self.slots or len(self.running) != self.slots:
            raise Failed("core N=%d round %d: %d assigned, %d frames, %d slots"
                         % (self.size, self.rounds, assigned, len(self.running), self.slots))

        t = time.perf_counter()
        core.sweep(self.now)  # every slot taken: the periodic pass at this depth
        t_sweep = time.perf_counter() - t

        t = time.perf_counter()
        batch = core.take_dirty()
        inserts, updates = batch.inserts, batch.updates
        self.store.write(batch)
        t_commit = time.perf_counter() - t
        self.rounds += 1
        return {"depth": depth, "assigned": assigned, "results": len(results),
                "schedule": t_schedule / assigned, "sweep": t_sweep,
                "commit": t_commit / (len(inserts) + len(updates)),
                "result": t_result / len(results) if results else None,
                "submit": t_submit / len(reqs) if reqs else None}


STEPS = ("submit", "schedule", "result", "sweep", "commit")


def step_medians(samples: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in STEPS:
        us = sorted(s[key] * 1e6 for s in samples if s[key] is not None)
        out[key + "_us"] = round(statistics.median(us), 3)
        out[key + "_us_p90"] = round(us[int(0.9 * (len(us) - 1))], 3)
    return out


def open_store(opts: dict[str, Any], path: Path) -> SQLiteStore:
    if opts["core_store"] == "memory":
        return SQLiteStore(":memory:")
    remove_db(path)
    return SQLiteStore(str(path), "FULL")


def core_size(size: int, opts: dict[str, Any], work_dir: Path) -> dict[str, Any]:
    path = work_dir / ("core-%d.db" % size)
    store = open_store(opts, path)
    try:
        steady = SteadyCore(size, opts, store)
        for _ in range(WARMUP_ROUNDS):
            steady.round()
        samples = [steady.round() for _ in range(opts["rounds"])]
        out: dict[str, Any] = {
            "queued": size,
            "depth_at_schedule": median([s["depth"] for s in samples]),
            "prefill_submit_us": round(steady.prefill_s / size * 1e6, 2),
            "rows_in_store": store.count(),
            "rounds": opts["rounds"],
            "assignments_per_round": steady.slots,
        }
        out.update(step_medians(samples))
        return out
    finally:
        store.close()
        remove_db(path)


def core_level(opts: dict[str, Any], work_dir: Path) -> dict[str, Any]:
    rows = []
    for size in opts["sizes"]:
        rows.append(core_size(size, opts, work_dir))
    first, last = rows[0], rows[-1]
    growth = {key: ratio(last[key], first[key])
              for key in ("submit_us", "schedule_us", "result_us", "sweep_us", "commit_us")}
    print_table(
        "core (in process, %d sessions x %d slots, %d rounds, %s store): median µs per operation"
        % (opts["workers"], opts["capacity"], opts["rounds"], opts["core_store"]),
        ["queued", "submit", "assign", "result", "sweep", "commit/row", "assign p90", "prefill submit"],
        [[r["queued"], r["submit_us"], r["schedule_us"], r["result_us"], r["sweep_us"], r["commit_us"],
          r["schedule_us_p90"], r["prefill_submit_us"]] for r in rows])
    print("  %s / %s queued: %s" % (fmt(last["queued"]), fmt(first["queued"]),
                                    ", ".join("%s x%s" % (k[:-3], fmt(v)) for k, v in growth.items())))
    return {"rows": rows, "growth_largest_vs_smallest": growth}


def heap_bytes(core: CoordinatorCore, sample: int = 2000) -> int:
    """Estimated bytes held by the deadline heap: list slot, tuple, int, attempt id, and the
    job id when nothing else holds it (the job is neither active nor cached), from a sample."""
    heap = core.timers.deadline_heap
    if not heap:
        return 0
    step = max(1, len(heap) // sample)
    picked = heap[::step]
    total = 0
    for deadline, job_id, attempt_id in picked:
        total += 8 + sys.getsizeof((deadline, job_id, attempt_id)) + sys.getsizeof(deadline) \
            + sys.getsizeof(attempt_id)
        if job_id not in core.table.jobs and job_id not in core.table.finished:
            total += sys.getsizeof(job_id)
    return total * len(heap) // len(picked)


def history_level(opts: dict[str, Any], work_dir: Path) -> dict[str, Any]:
    """The core at a fixed depth while ``--history`` jobs complete, in ten blocks.

    The clock advances as if ``--history-rate`` assignments/s went through, so nothing
    that is kept for a time (deadline entries: ``--task-timeout-millis`` of the core,
    600 s by default) expires early or late.
    """
    size = opts["sizes"][0]
    path = work_dir / "history.db"
    store = open_store(opts, path)
    try:
        slots = opts["workers"] * opts["capacity"]
        step = max(1, round(slots * 1000 / opts["history_rate"]))
        steady = SteadyCore(size, opts, store, step_millis=step)
        for _ in range(WARMUP_ROUNDS):
            steady.round()
        blocks = 10
        per_block = max(1, opts["history"] // slots // blocks)
        rows = []
        for b in range(blocks + 1):
            samples = [steady.round() for _ in range(per_block if b else min(per_block, opts["rounds"]))]
            core = steady.core
            rows.append(dict(step_medians(samples), completed=(steady.rounds - 1) * slots,
                             simulated_s=round((steady.now - T0_MILLIS) / 1000, 1),
                             deadline_heap=len(core.timers.deadline_heap),
                             deadline_heap_mb=round(heap_bytes(core) / 1e6, 1), due_heap=len(core.timers.due_heap),
                             finished_cache=len(core.table.finished), active=core.active_count,
                             rss_kb=rss_kb()))
        print_table(
            "history (in process, %s queued, %d sessions x %d slots, clock at %s assignments/s, task timeout "
            "%s ms, %s store)" % (fmt(size), opts["workers"], opts["capacity"], fmt(opts["history_rate"]),
                                  fmt(opts["task_timeout_millis"]), opts["core_store"]),
            ["completed", "sim s", "submit", "assign", "result", "sweep", "commit/row", "deadline heap",
             "heap MB", "finished", "RSS MB"],
            [[r["completed"], r["simulated_s"], r["submit_us"], r["schedule_us"], r["result_us"], r["sweep_us"],
              r["commit_us"], r["deadline_heap"], r["deadline_heap_mb"], r["finished_cache"], r["rss_kb"] / 1024]
             for r in rows])
        first, last = rows[0], rows[-1]
        growth = {key: ratio(last[key], first[key]) for key in ("submit_us", "schedule_us", "result_us",
                                                                 "sweep_us", "commit_us")}
        print("  after %s / at the start: %s; RSS %+.0f MB" % (
            fmt(last["completed"]), ", ".join("%s x%s" % (k[:-3], fmt(v)) for k, v in growth.items()),
            (last["rss_kb"] - first["rss_kb"]) / 1024))
        return {"rows": rows, "queued": size, "growth_last_vs_first": growth}
    finally:
        store.close()
        remove_db(path)


# ---- level 2: end to end ------------------------------------------------------------


def list_all(conn: Conn, deadline: float, state: str | None = None) -> list[dict[str, Any]]:
    jobs: list[dict[str, Any]] = []
    cursor = None
    while True:
        if time.monotonic() > deadline:
            raise Failed("listing the jobs took too long")
        req: dict[str, Any] = {"type": "LIST_JOBS", "limit": 1000}
        if state is not None:
            req["state"] = state
        if cursor is not None:
            req["cursor"] = cursor
        reply = conn.request_obj(req)
        if reply.get("type") != "JOB_LIST":
            raise Failed("LIST_JOBS answered %r" % reply)
        jobs.extend(reply.get("jobs", []))
        cursor = reply.get("nextCursor")
        if not cursor:
            return jobs


def none_in(conn: Conn, state: str) -> bool:
    reply = conn.request_obj({"type": "LIST_JOBS", "limit": 1, "state": state})
    return reply.get("type") == "JOB_LIST" and not reply.get("jobs") and not reply.get("nextCursor")


def windows(times: list[float], scale: float) -> dict[str, float | None]:
    """Rates over a sorted list of event times: whole, first tenth, last tenth, p10..p90."""
    n = len(times)

    def rate(i: int, j: int) -> float | None:
        span = (times[j] - times[i]) / scale
        return round((j - i) / span, 1) if j > i and span > 0 else None

    tenth = max(1, n // 10)
    return {"whole": rate(0, n - 1), "first_tenth": rate(0, tenth), "last_tenth": rate(n - 1 - tenth, n - 1),
            "p10_p90": rate(n // 10, (9 * n) // 10)}


def e2e_trial(size: int, opts: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    db = run_dir / ("e2e-%d.db" % size)
    remove_db(db)
    extra = ["--max-active-jobs=%d" % max(1_000_000, 2 * size)]
    coordinator, worker_addr, client_addr = procs.start_coordinator(run_dir, db, "FULL", extra)
    children = [coordinator]
    builtin = None
    load = _loadavg()
    try:
        gevent.sleep(0.2)
        rss_started = rss_kb(coordinator.pid)
        # Fill the queue with nobody attached.
        phase = Phase("prefill", size)
        conns = open_many(client_addr, opts["prefill_clients"], 500, phase.errors)
        greenlets = run_clients(conns, submit_client, phase, Workload("sleep0", "NORMAL", 1, False))
        wait_phase(greenlets, phase, 120 + size / 500, gevent.event.Event())
        for c in conns:
            c.close()
        if phase.accepted != size:
            raise Failed("e2e N=%d: %d of %d submits accepted (%s)" % (size, phase.accepted, size,
                                                                      dict(phase.errors)))
        rss_queued = rss_kb(coordinator.pid)
        probe = Conn.open(client_addr)
        cpu0 = procs.cpu_seconds(coordinator.pid)
        t0 = time.monotonic()
        if opts["worker_impl"] == "builtin":
            builtin = BuiltinWorkers(worker_addr, opts["workers"], opts["capacity"])
            builtin.start()
        else:
            for i in range(opts["workers"]):
                children.append(procs.start_worker(run_dir, i, worker_addr, opts["capacity"], []))
        deadline = t0 + 60 + size / 500
        while not (none_in(probe, "QUEUED") and none_in(probe, "RUNNING")):
            if time.monotonic() > deadline:
                raise Failed("e2e N=%d: the queue did not drain in time" % size)
            for child in children[1:]:
                if not child.alive():
                    raise Failed("%s exited: %s" % (child.name, procs.tail(child.err_path)))
            gevent.sleep(0.02)
        cpu = (procs.cpu_seconds(coordinator.pid) or 0) - (cpu0 or 0)
        wall = time.monotonic() - t0
        jobs = list_all(probe, time.monotonic() + 60 + size / 1000)
        probe.close()
        states: dict[str, int] = {}
        for job in jobs:
            states[job["state"]] = states.get(job["state"], 0) + 1
        if len(jobs) != size or states.get("COMPLETED") != size:
            raise Failed("e2e N=%d: listed %d jobs, states %s" % (size, len(jobs), states))
        done = sorted(job["updatedAtMillis"] for job in jobs)
        out: dict[str, Any] = {
            "queued": size, "prefill_submits_per_s": round(phase.submit_rate(), 1),
            "coordinator_rss_queued_kb": rss_queued,
            "rss_per_queued_job_b": round((rss_queued - rss_started) * 1024 / size) if rss_queued and rss_started
            else None,
            "completions_per_s": windows(done, 1000.0),
            "drain_wall_s": round(wall, 3), "coordinator_cores": round(cpu / wall, 2) if wall else None,
            "loadavg": load,
        }
        if builtin is not None:
            assigned = builtin.assigned_at
            if len(assigned) != size:
                raise Failed("e2e N=%d: %d assignments for %d jobs" % (size, len(assigned), size))
            # The first workers x capacity assignments fill empty slots at registration; every
            # later one waited for a result, so the drain rate is counted from there.
            slots = opts["workers"] * opts["capacity"]
            out["assignments_per_s"] = windows(assigned[slots - 1:] if size > 2 * slots else assigned, 1.0)
        return out
    finally:
        if builtin is not None:
            builtin.stop()
        procs.stop_all(children)
        remove_db(db)


def e2e_level(opts: dict[str, Any], work_dir: Path) -> dict[str, Any]:
    per_size: dict[int, list[dict[str, Any]]] = {size: [] for size in opts["sizes"]}
    for trial in range(opts["trials"]):
        for size in opts["sizes"]:  # interleaved, so a busy spell spreads over every size
            per_size[size].append(e2e_trial(size, opts, work_dir))
    rows = []
    for size, trials in per_size.items():
        def med(*path: str) -> float | None:
            vals = []
            for t in trials:
                v: Any = t
                for p in path:
                    v = v.get(p) if isinstance(v, dict) else None
                vals.append(v)
            return median(vals)

        rows.append({
            "queued": size, "trials": len(trials),
            "assign_per_s": med("assignments_per_s", "whole"),
            "assign_per_s_first_tenth": med("assignments_per_s", "first_tenth"),
            "assign_per_s_last_tenth": med("assignments_per_s", "last_tenth"),
            "complete_per_s_p10_p90": med("completions_per_s", "p10_p90"),
            "complete_per_s_whole": med("completions_per_s", "whole"),
            "prefill_submits_per_s": med("prefill_submits_per_s"),
            "coordinator_rss_queued_kb": med("coordinator_rss_queued_kb"),
            "rss_per_queued_job_b": med("rss_per_queued_job_b"),
            "coordinator_cores": med("coordinator_cores"),
            "loadavg_1m": [t["loadavg"][0] if t["loadavg"] else None for t in trials],
            "runs": trials,
        })
    first, last = rows[0], rows[-1]
    key = "assign_per_s" if opts["worker_impl"] == "builtin" else "complete_per_s_p10_p90"
    print_table(
        "e2e (real coordinator, WAL + FULL; %d %s workers x %d slots; medians of %d trials)"
        % (opts["workers"], opts["worker_impl"], opts["capacity"], opts["trials"]),
        ["queued", "assign/s", "first 10%", "last 10%", "done/s p10-p90", "prefill/s", "RSS MB", "B/queued job",
         "coord cores", "load 1m"],
        [[r["queued"], r["assign_per_s"], r["assign_per_s_first_tenth"], r["assign_per_s_last_tenth"],
          r["complete_per_s_p10_p90"], r["prefill_submits_per_s"],
          r["coordinator_rss_queued_kb"] / 1024 if r["coordinator_rss_queued_kb"] else None,
          r["rss_per_queued_job_b"], r["coordinator_cores"], "/".join(fmt(x) for x in r["loadavg_1m"])] for r in rows])
    growth = ratio(last[key], first[key])
    versus = {r["queued"]: ratio(last[key], r[key]) for r in rows[:-1]}
    print("  %s at %s queued / at %s" % (key, fmt(last["queued"]), ", ".join(
        "%s: %s" % (fmt(n), fmt(v, 3)) for n, v in versus.items())))
    return {"rows": rows, "rate_largest_vs_smallest": growth, "rate_largest_vs": versus, "rate_key": key}


# ---- level 3: a million stored jobs -------------------------------------------------


def build_stored_db(path: Path, rows: int, seed: int = 1) -> float:
    """Write ``rows`` COMPLETED jobs (sequence 1..rows) straight into a new database."""
    remove_db(path)
    t = time.perf_counter()
    SQLiteStore(str(path), "OFF").close()  # the schema and indexes, exactly as the coordinator makes them
    conn = sqlite3.connect(str(path), isolation_level=None)
    conn.execute("PRAGMA synchronous=OFF")
    conn.execute("PRAGMA cache_size=-262144")
    rng = random.Random(seed)
    base = T0_MILLIS - rows - 3_600_000

    def chunk(lo: int, hi: int):
        for seq in range(lo, hi):
            created = base + seq
            yield insert_row(Job(
                job_id="%08x%024x" % (seq, rng.getrandbits(96)), seq=seq, task_type="SLEEP",
                payload={"durationMillis": 0}, max_attempts=3, priority=Priority.NORMAL, created_at=created,
                state=JobState.COMPLETED, attempts=1, result={"sleptMillis": 0}, updated_at=created + 1,
                execution_timeout=600_000))

    try:
        for lo in range(1, rows + 1, BUILD_CHUNK):
            conn.execute("BEGIN")
            conn.executemany(INSERT_SQL, chunk(lo, min(rows + 1, lo + BUILD_CHUNK)))
            conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    return time.perf_counter() - t


def stored_db(work_dir: Path, rows: int) -> tuple[Path, float | None]:
    """The big database, built once per work directory (None: reused, not built)."""
    path = work_dir / ("stored-%d.db" % rows)
    marker = Path(str(path) + ".complete")
    if path.exists() and marker.exists():
        return path, None
    marker.unlink(missing_ok=True)
    seconds = build_stored_db(path, rows)
    marker.write_text("%d rows\n" % rows)
    return path, seconds


def recovery_in_process(path: Path) -> dict[str, Any]:
    """Open + migrate + recover, as the coordinator does before it listens."""
    t = time.perf_counter()
    store = SQLiteStore(str(path), "FULL")
    t_open = time.perf_counter() - t
    try:
        core = CoordinatorCore(store, CoreConfig())
        t = time.perf_counter()
        core.recover(int(time.time() * 1000))
        t_recover = time.perf_counter() - t
        return {"open_s": round(t_open, 4), "recover_s": round(t_recover, 4), "active": core.active_count,
                "next_seq": core.table.next_seq}
    finally:
        store.close()


def stored_run(kind: str, run: int, master: Path | None, opts: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    db = run_dir / ("stored-run%d-%s.db" % (run, kind))
    remove_db(db)
    if master is not None:
        shutil.copyfile(master, db)
    out: dict[str, Any] = {"db": kind, "run": run, "loadavg": _loadavg()}
    if master is not None:
        out["recovery"] = recovery_in_process(db)
    t = time.monotonic()
    coordinator, _, client_addr = procs.start_coordinator(
        run_dir, db, "FULL", ["--max-active-jobs=1000000"], timeout=120, poll=0.005)
    out["startup_s"] = round(time.monotonic() - t, 3)
    report = run_dir / ("stored-run%d-%s.json" % (run, kind))
    children = [coordinator]
    try:
        gevent.sleep(0.3)
        out["rss_started_kb"] = rss_kb(coordinator.pid)
        args = [sys.executable, "-m", "bench.loadgen", "--coordinator=%s:%d" % client_addr,
                "--coordinator-pid=%d" % coordinator.pid, "--mode=submit",
                "--clients=%d" % opts["stored_clients"], "--duration=%g" % opts["stored_duration"],
                "--verify=status", "--quiet", "--out=%s" % report]
        loadgen = procs.Child("loadgen-run%d-%s" % (run, kind), args, run_dir)
        children.append(loadgen)
        rc = loadgen.proc.wait(timeout=opts["stored_duration"] + 180)
        if rc != 0 or not report.exists():
            raise Failed("loadgen on the %s database exited %s:\n%s" % (kind, rc, procs.tail(loadgen.err_path)))
        rep = json.loads(report.read_text())
        out.update({
            "submits_per_s": rep["submits_per_s"], "submit_p50_ms": rep["submit_latency_ms"]["p50"],
            "submit_p99_ms": rep["submit_latency_ms"]["p99"], "submitted": rep["submitted"],
            "lost": rep["lost"], "errors": rep["errors"], "coordinator_peak_rss_kb": rep["coordinator_peak_rss_kb"],
            "coordinator_cores": (rep.get("cpu_cores_used") or {}).get("coordinator"),
        })
        return out
    finally:
        procs.stop_all(children)
        remove_db(db)


def stored_level(opts: dict[str, Any], work_dir: Path) -> dict[str, Any]:
    master, build_s = stored_db(work_dir, opts["stored"])
    out: dict[str, Any] = {"stored_rows": opts["stored"], "build_s": round(build_s, 2) if build_s else None,
                           "db_bytes": master.stat().st_size, "recovery_empty": None, "runs": []}
    empty = work_dir / "recovery-empty.db"
    remove_db(empty)
    out["recovery_empty"] = recovery_in_process(empty)
    remove_db(empty)
    for run in range(1, opts["stored_runs"] + 1):
        for kind in ("empty", "stored"):  # interleaved, in the same run
            out["runs"].append(stored_run(kind, run, master if kind == "stored" else None, opts, work_dir))
    rows = []
    for kind in ("empty", "stored"):
        runs = [r for r in out["runs"] if r["db"] == kind]
        row = {"db": kind}
        for key in ("submits_per_s", "submit_p50_ms", "submit_p99_ms", "startup_s", "rss_started_kb",
                    "coordinator_peak_rss_kb", "coordinator_cores"):
            row[key] = median([r.get(key) for r in runs])
        row["submits_per_s_runs"] = [r.get("submits_per_s") for r in runs]
        row["loadavg_1m"] = [r["loadavg"][0] if r["loadavg"] else None for r in runs]
        rows.append(row)
    out["rows"] = rows
    out["ratio_stored_vs_empty"] = ratio(rows[1]["submits_per_s"], rows[0]["submits_per_s"])
    pairs = [ratio(s.get("submits_per_s"), e.get("submits_per_s"))
             for e, s in zip(out["runs"][0::2], out["runs"][1::2])]
    out["ratio_per_run"] = pairs
    recov = [r["recovery"] for r in out["runs"] if "recovery" in r]
    out["recovery_stored"] = {k: median([r[k] for r in recov]) for k in ("open_s", "recover_s", "active")}
    print_table(
        "stored (%s COMPLETED rows, %.0f MB, built in %s s; %d runs of each, %d clients x %g s, WAL + FULL)"
        % (fmt(opts["stored"]), out["db_bytes"] / 1e6, fmt(out["build_s"]) if build_s else "(reused)",
           opts["stored_runs"], opts["stored_clients"], opts["stored_duration"]),
        ["db", "submits/s", "runs", "p50 ms", "p99 ms", "start-up s", "RSS started MB", "peak RSS MB",
         "coord cores", "load 1m"],
        [[r["db"], r["submits_per_s"], "/".join(fmt(x) for x in r["submits_per_s_runs"]), r["submit_p50_ms"],
          r["submit_p99_ms"], r["startup_s"], (r["rss_started_kb"] or 0) / 1024,
          (r["coordinator_peak_rss_kb"] or 0) / 1024, r["coordinator_cores"],
          "/".join(fmt(x) for x in r["loadavg_1m"])] for r in rows])
    print("  submits/s stored / empty = %s (per run: %s); target >= 0.8"
          % (fmt(out["ratio_stored_vs_empty"], 3), ", ".join(fmt(x, 3) for x in pairs)))
    print("  recovery in process: empty open %.4f s + recover %.4f s; stored open %.4f s + recover %.4f s, "
          "active jobs loaded %d" % (out["recovery_empty"]["open_s"], out["recovery_empty"]["recover_s"],
                                     out["recovery_stored"]["open_s"], out["recovery_stored"]["recover_s"],
                                     out["recovery_stored"]["active"]))
    return out


# ---- main -----------------------------------------------------------------------------


def parse(argv: list[str] | None) -> dict[str, Any]:
    a = docopt(__doc__, argv=argv)
    levels = [x.strip() for x in a["--levels"].split(",") if x.strip()]
    bad = [x for x in levels if x not in LEVELS]
    if bad or not levels:
        raise SystemExit("scaling: unknown level(s) %s (%s)" % (", ".join(bad), ", ".join(LEVELS)))
    try:
        opts = {
            "levels": levels,
            "sizes": [int(x) for x in a["--sizes"].split(",") if x.strip()],
            "workers": int(a["--workers"]), "capacity": int(a["--capacity"]), "rounds": int(a["--rounds"]),
            "core_store": a["--core-store"], "trials": int(a["--trials"]), "worker_impl": a["--worker-impl"],
            "prefill_clients": int(a["--prefill-clients"]), "stored": int(a["--stored"]),
            "stored_runs": int(a["--stored-runs"]), "stored_clients": int(a["--stored-clients"]),
            "stored_duration": float(a["--stored-duration"]), "history": int(a["--history"]),
            "history_rate": float(a["--history-rate"]),
            "task_timeout_millis": int(a["--task-timeout-millis"]), "work_dir": a["--work-dir"], "out": a["--out"],
        }
    except ValueError as exc:
        raise SystemExit("scaling: %s" % exc) from None
    if opts["core_store"] not in ("file", "memory") or opts["worker_impl"] not in ("builtin", "process"):
        raise SystemExit("scaling: --core-store is file or memory, --worker-impl builtin or process")
    if not opts["sizes"] or min(opts["sizes"]) < 1 or opts["rounds"] < 1 or opts["trials"] < 1 \
            or opts["stored_runs"] < 1 or opts["stored"] < 1:
        raise SystemExit("scaling: sizes, rounds, trials, runs and --stored must be positive")
    if opts["history"] < 1 or opts["history_rate"] <= 0:
        raise SystemExit("scaling: --history and --history-rate must be positive")
    if ("core" in levels or "history" in levels) and min(opts["sizes"]) < opts["workers"] * opts["capacity"]:
        raise SystemExit("scaling: the core level needs every size >= --workers x --capacity (%d), to keep "
                         "every slot busy" % (opts["workers"] * opts["capacity"]))
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    raise_fd_limit()
    if opts["work_dir"]:
        work_dir = Path(opts["work_dir"]).resolve()
        work_dir.mkdir(parents=True, exist_ok=True)
    else:
        work_dir = Path(tempfile.mkdtemp(prefix="jobmesh-scaling-"))
    result: dict[str, Any] = {"revision": _revision(), "cpus": os.cpu_count(), "loadavg_start": _loadavg(),
                              "options": {k: v for k, v in opts.items() if k not in ("out", "work_dir")}}
    print("scaling: revision %s, load average %s" % (result["revision"], result["loadavg_start"]))
    rc = 0
    try:
        for level in opts["levels"]:
            t = time.monotonic()
            try:
                fn = {"core": core_level, "history": history_level, "e2e": e2e_level, "stored": stored_level}[level]
                result[level] = fn(opts, work_dir)
                result[level]["seconds"] = round(time.monotonic() - t, 1)
            except (Failed, procs.ChildFailed, OSError) as exc:
                print("scaling: level %s failed: %s" % (level, exc), file=sys.stderr)
                result[level] = {"error": str(exc)}
                rc = 1
    finally:
        if not opts["work_dir"]:
            shutil.rmtree(work_dir, ignore_errors=True)
    result["loadavg_end"] = _loadavg()
    print("\nload average at the end: %s" % result["loadavg_end"])
    if opts["out"]:
        Path(opts["out"]).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
