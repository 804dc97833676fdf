"""Recurring schedules at scale: fire lag, and the coordinator CPU schedules cost.

Three runs, each on a fresh coordinator (``--db-synchronous=FULL``, its own database,
``--sweep-interval-millis`` as given: fires happen at sweeps, like due SCHEDULED jobs):

``idle``
    No schedule: the coordinator's CPU per second doing nothing (timers, the sweep).

``active``
    ``--schedules`` schedules with ``everyMillis=--every-millis``, ``overlap=allow`` (so
    every fire time makes a job, although no worker runs them), put in pipelined
    SCHEDULE_PUT requests. After ``--warmup`` seconds, the coordinator's CPU per second
    over ``--seconds``, minus the idle run's, is the schedules' cost; the fire lag of
    every job made in the measured window is ``createdAtMillis - scheduledFor``
    (p50, p99, max), and fires/s is how many there were per second.

``paused``
    ``--paused`` paused schedules: the CPU per second they cost over ``--seconds``
    (it should be the idle run's: a paused schedule is not on the fire heap).

Jobs pile up in the active run (10,000 schedules make 10,000 jobs a second; the
coordinator is started with ``--max-active-jobs=100000000``), so keep ``--seconds``
short there. Figures only, no thresholds.

Usage:
  schedules.py [--schedules=N] [--paused=P] [--seconds=S] [--warmup=W] [--every-millis=M]
               [--sweep-interval-millis=I] [--run-dir=DIR]
  schedules.py (-h | --help)

Options:
  --schedules=N               active schedules [default: 10000]
  --paused=P                  paused schedules, in the paused run [default: 100000]
  --seconds=S                 measured seconds of each run [default: 10]
  --warmup=W                  seconds between the last put and the measurement [default: 3]
  --every-millis=M            the active schedules' interval [default: 1000]
  --sweep-interval-millis=I   the coordinator's sweep period [default: 500]
  --run-dir=DIR               where the databases and logs go (default: a temp directory)
  -h --help                   show this help
"""

from __future__ import annotations

import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from docopt import docopt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.procs import cpu_seconds, start_coordinator, stop_all  # noqa: E402
from jobmesh.client.api import CoordinatorClient  # noqa: E402
from jobmesh.protocol import messages as m  # noqa: E402
from jobmesh.protocol.framing import FrameReader, encode_frame  # noqa: E402

PIPELINE = 512  # SCHEDULE_PUTs in flight on the set-up connection


def put_all(addr: tuple[str, int], definitions: list[dict[str, Any]]) -> None:
    """SCHEDULE_PUT every definition, ``PIPELINE`` in flight (the core commits each batch
    of them once, so set-up does not pay one fsync per schedule)."""
    sock = socket.create_connection(addr, timeout=60)
    reader = FrameReader(sock.recv)
    try:
        for start in range(0, len(definitions), PIPELINE):
            chunk = definitions[start:start + PIPELINE]
            sock.sendall(b"".join(encode_frame(m.SchedulePut(d).to_wire()) for d in chunk))
            for _ in chunk:
                reply = reader.read_frame()
                if reply is None or reply.get("type") != "SCHEDULE":
                    raise SystemExit("a SCHEDULE_PUT failed: %r" % (reply,))
    finally:
        sock.close()


def cpu_per_second(pid: int, seconds: float) -> float:
    before, at = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    after, end = cpu_seconds(pid), time.monotonic()
    assert before is not None and after is not None, "the coordinator exited"
    return (after - before) / (end - at)


def quantile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def run(run_dir: Path, name: str, sweep: int, definitions: list[dict[str, Any]], warmup: float,
        seconds: float) -> dict[str, Any]:
    where = run_dir / name
    where.mkdir(parents=True, exist_ok=True)
    child, _worker, client_addr = start_coordinator(
        where, where / "bench.db", "FULL",
        ["--sweep-interval-millis=%d" % sweep, "--max-active-jobs=100000000", "--log-level=WARNING"])
    try:
        started = time.monotonic()
        if definitions:
            put_all(client_addr, definitions)
        put_seconds = time.monotonic() - started
        time.sleep(warmup)
        window_start = int(time.time() * 1000)
        cpu = cpu_per_second(child.pid, seconds)
        window_end = int(time.time() * 1000)
        lags: list[int] = []
        if definitions and not definitions[0].get("paused"):
            with CoordinatorClient("%s:%d" % client_addr, timeout=120) as client:
                for job in client.iter_jobs(page_size=1000):
                    if job["createdAtMillis"] < window_start:
                        break
                    if job.get("scheduledFor") is not None and job["createdAtMillis"] <= window_end:
                        lags.append(job["createdAtMillis"] - job["scheduledFor"])
        return {"cpu": cpu, "put_seconds": put_seconds, "lags": lags, "window": (window_end - window_start) / 1000}
    finally:
        stop_all([child])


def main(argv: list[str]) -> int:
    args = docopt(__doc__, argv=argv)
    n, paused = int(args["--schedules"]), int(args["--paused"])
    seconds, warmup = float(args["--seconds"]), float(args["--warmup"])
    every, sweep = int(args["--every-millis"]), int(args["--sweep-interval-millis"])
    run_dir = Path(args["--run-dir"] or tempfile.mkdtemp(prefix="jobmesh-bench-schedules-"))
    template = {"taskType": "SLEEP", "payload": {"durationMillis": 0}, "overlap": "allow"}
    idle = run(run_dir, "idle", sweep, [], warmup, seconds)
    print("idle     coordinator CPU %.3f s/s" % idle["cpu"])
    active = run(run_dir, "active", sweep,
                 [dict(template, name="s%06d" % i, everyMillis=every) for i in range(n)], warmup, seconds)
    lags = active["lags"]
    if lags:
        print("active   %d schedules every %d ms (put in %.1f s): %.0f fires/s, fire lag p50 %.0f ms, p99 %.0f ms,"
              " max %d ms; coordinator CPU %.3f s/s (%.3f s/s above idle, %.1f us per fire)"
              % (n, every, active["put_seconds"], len(lags) / active["window"], statistics.median(lags),
                 quantile(lags, 0.99), max(lags), active["cpu"], active["cpu"] - idle["cpu"],
                 1e6 * (active["cpu"] - idle["cpu"]) / max(1.0, len(lags) / active["window"])))
    else:
        print("active   %d schedules: no fire in the measured window" % n)
    quiet = run(run_dir, "paused", sweep,
                [dict(template, name="p%06d" % i, everyMillis=every, paused=True) for i in range(paused)], warmup,
                seconds)
    print("paused   %d paused schedules (put in %.1f s): coordinator CPU %.3f s/s (%+.3f s/s against idle)"
          % (paused, quiet["put_seconds"], quiet["cpu"], quiet["cpu"] - idle["cpu"]))
    print("run dir  %s" % run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
