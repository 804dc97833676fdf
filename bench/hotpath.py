"""Microseconds of the hot path's pieces, in process: what a job costs the coordinator
apart from its sockets.

    python bench/hotpath.py [--repeat=5]

Run it from a tree (a checkout or a ``git archive`` export, with ``PYTHONPATH`` set to
it) to measure that tree's code; run two trees alternately to compare them. Each figure is
the median of ``--repeat`` timings, in µs per operation:

* ``decode SUBMIT_JOB``, ``decode TASK_RESULT``: a wire dict to its message;
* ``encode JOB_SUBMITTED``, ``encode TASK_ASSIGN``: a message to its frame;
* ``timeline fragment``: one ASSIGNED event (it names the worker) in its stored form;
* ``row insert``, ``row update``: one job's row written by ``SQLiteStore.write`` in
  256-row batches, on a file with ``synchronous=OFF`` (the fsync left out), the rows
  encoded beforehand;
* ``core submit``: a SUBMIT_JOB through a real ``CoordinatorCore`` over an in-memory
  store (``apply``, then every 20 submits ``end_batch`` and ``take_dirty``), with the
  cyclic collector off while it runs (every job stays in memory, so when a collection
  falls in the run depends on the heap, and its cost is measured on its own:
  docs/PERFORMANCE.md).
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import sys
import tempfile
import time
import timeit
from typing import Any, Callable

from jobmesh.config import CoreConfig
from jobmesh.coordinator.core import events as ev
from jobmesh.coordinator.core.face import CoordinatorCore
from jobmesh.protocol import messages as m
from jobmesh.protocol.framing import encode_frame
from jobmesh.protocol.jobs import JobState, Priority
from jobmesh.store.base import Batch
from jobmesh.store.columns import event_fragment, insert_row, update_row
from jobmesh.store.job import Job
from jobmesh.store.sqlite import SQLiteStore

JOB_ID = "0000001a1234567890abcdef12345678"
BATCH_ROWS = 256


def per_call(call: Callable[[], Any], number: int) -> float:
    return timeit.timeit(call, number=number) / number * 1e6


def _job(seq: int) -> Job:
    return Job("%08x%024x" % (seq, random.getrandbits(96)), seq, "SLEEP", {"durationMillis": 0}, 3,
               Priority.NORMAL, 1_700_000_000_000, payload_json='{"durationMillis":0}',
               events='[1700000000000,"S"]', event_count=1)


def row_writes(directory: str) -> tuple[float, float]:
    """(µs per inserted row, µs per updated row), 10 batches of BATCH_ROWS each."""
    store = SQLiteStore(os.path.join(tempfile.mkdtemp(dir=directory), "rows.db"), "OFF")
    seq = 0
    inserting = updating = 0.0
    for _ in range(10):
        jobs = []
        for _ in range(BATCH_ROWS):
            seq += 1
            jobs.append(_job(seq))
        rows = Batch([insert_row(job) for job in jobs], [])
        started = time.perf_counter()
        store.write(rows)
        inserting += time.perf_counter() - started
        for job in jobs:
            job.state, job.attempts, job.worker_id = JobState.RUNNING, 1, "worker-1"
            job.attempt_id = job.job_id + ".1"
            job.events += ',[5,"A",1,"worker-1"]'
        rows = Batch([], [update_row(job) for job in jobs])
        started = time.perf_counter()
        store.write(rows)
        updating += time.perf_counter() - started
    store.close()
    return inserting / (10 * BATCH_ROWS) * 1e6, updating / (10 * BATCH_ROWS) * 1e6


class _Conn:
    inbox = None


def core_submits(count: int = 20_000) -> float:
    core = CoordinatorCore(SQLiteStore(":memory:"), CoreConfig(max_active_jobs=10 * count))
    req = m.decode({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 0}, "maxAttempts": 3},
                   m.CLIENT_PORT_REQUESTS)
    events = [ev.Request(_Conn(), req) for _ in range(count)]  # type: ignore[arg-type]
    gc.collect()
    gc.disable()
    try:
        started = time.perf_counter()
        for i, event in enumerate(events):
            core.apply(event, 1000 + i)
            if i % 20 == 19:
                core.end_batch(1000 + i)
                core.take_dirty()
                core.take_outbound()
        return (time.perf_counter() - started) / count * 1e6
    finally:
        gc.enable()


def main(argv: list[str]) -> int:
    repeat = 5
    for arg in argv:
        if arg.startswith("--repeat="):
            repeat = int(arg.split("=", 1)[1])
        else:
            print(__doc__.strip())
            return 2 if arg not in ("-h", "--help") else 0
    submit = {"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 0}, "maxAttempts": 3}
    result = {"type": "TASK_RESULT", "workerId": "worker-1", "jobId": JOB_ID, "attemptId": JOB_ID + ".1",
              "success": True, "result": {}}
    submitted = m.JobSubmitted(JOB_ID)
    assign = m.TaskAssign(JOB_ID, JOB_ID + ".1", 1, "SLEEP", {"durationMillis": 0})
    figures: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as directory:
        for _ in range(repeat):
            runs = {
                "decode SUBMIT_JOB": per_call(lambda: m.decode(submit, m.CLIENT_PORT_REQUESTS), 100_000),
                "decode TASK_RESULT": per_call(lambda: m.decode(result, m.WORKER_PORT_REQUESTS), 100_000),
                "encode JOB_SUBMITTED": per_call(lambda: encode_frame(submitted.to_wire()), 100_000),
                "encode TASK_ASSIGN": per_call(lambda: encode_frame(assign.to_wire()), 100_000),
                "timeline fragment": per_call(
                    lambda: event_fragment(1_700_000_000_000, 1_700_000_000_005, "ASSIGNED", 1, "worker-1", None,
                                           None), 100_000),
            }
            runs["row insert"], runs["row update"] = row_writes(directory)
            runs["core submit"] = core_submits()
            for name, value in runs.items():
                figures.setdefault(name, []).append(value)
    print("µs per operation, median of %d (every run after the slash)" % repeat)
    for name, values in figures.items():
        print("  %-22s %7.2f  (%s)" % (name, statistics.median(values), " / ".join("%.2f" % v for v in values)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
