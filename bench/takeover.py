"""Takeover time: a standby coordinator taking over from a leader on one PostgreSQL database.

    python -m bench.takeover [--runs=10] [--jobs=100000] [--db-session-timeout-millis=2000]
                             [--pg-url=postgresql://...]

For each way the leader goes (``kill``: SIGKILL; ``freeze``: SIGSTOP, then SIGCONT once
the standby leads, and the old leader must exit 75) and for 0 and ``--jobs`` active jobs,
each run starts a fresh database, a leader and a standby (fixed ports, so the worker can
be given both addresses), and one worker on both addresses. The active jobs are
SCHEDULED a day ahead: recovery loads every one of them, and none competes with the
probe job. Then it measures, from the instant the leader is killed or frozen:

* ``listening``: until the standby prints its listening line;
* ``first job``: until the first job submitted after that line (WORD_COUNT, through the client
  port of the new leader) has completed. After a freeze the worker leaves the frozen
  leader once three heartbeat intervals (500 ms here) pass without its HEARTBEAT_ACK.

It prints the median (and min / max) of ``--runs`` runs of each, and the recovery time
per 100k active jobs: the difference of the medians of ``listening`` with and without
the active jobs, scaled to 100k. Without ``--pg-url`` it starts a throwaway server
(``bench/pgserver.py``: Debian's postgresql package) and makes one database per run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

from bench.pgserver import PostgresServer, free_port
from jobmesh.client.api import CoordinatorClient
from jobmesh.protocol.framing import FrameReader, encode_frame

REPO_ROOT = Path(__file__).resolve().parent.parent
LISTENING = "jobmesh coordinator listening"
STANDING_BY = "jobmesh coordinator standing by"
EXIT_LEADERSHIP_LOST = 75
FILL_CONNECTIONS = 4
PIPELINE = 256
DAY_MILLIS = 24 * 3600 * 1000
POLL = 0.002  # how often the output files are looked at (s): the resolution of the figures
START_TIMEOUT = 600.0
HEARD = 1.0  # seconds between the worker's first job and the kill or freeze


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class Proc:
    """A child process with its stdout and stderr in files of ``run_dir``."""

    def __init__(self, name: str, argv: list[str], run_dir: Path) -> None:
        self.out = run_dir / (name + ".out")
        self.err = run_dir / (name + ".err")
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=child_env(),
                                         cwd=str(REPO_ROOT))

    def printed(self, text: str) -> bool:
        return text in self.out.read_text(errors="replace")

    def await_line(self, text: str, timeout: float = START_TIMEOUT) -> float:
        """Wait until stdout holds ``text``; the monotonic time it was seen."""
        deadline = time.monotonic() + timeout
        while not self.printed(text):
            if self.proc.poll() is not None:
                raise RuntimeError("%s exited rc=%s: %s" % (self.out.stem, self.proc.returncode,
                                                             self.err.read_text(errors="replace")[-2000:]))
            if time.monotonic() > deadline:
                raise RuntimeError("%s did not print %r within %.0f s" % (self.out.stem, text, timeout))
            time.sleep(POLL)
        return time.monotonic()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def coordinator(name: str, url: str, ports: tuple[int, int], args: argparse.Namespace, run_dir: Path) -> Proc:
    return Proc(name, [sys.executable, "-m", "jobmesh", "coordinator", "--db=%s" % url,
                       "--worker-port=%d" % ports[0], "--client-port=%d" % ports[1],
                       "--max-active-jobs=%d" % (args.jobs + 10_000), "--heartbeat-timeout-millis=2000",
                       "--db-session-timeout-millis=%d" % args.db_session_timeout_millis,
                       "--log-level=WARNING"], run_dir)


def fill(client_port: int, jobs: int) -> None:
    """Submit ``jobs`` WORD_COUNT jobs SCHEDULED a day ahead, pipelined over a few connections."""
    run_at = int(time.time() * 1000) + DAY_MILLIS
    frame = encode_frame({"type": "SUBMIT_JOB", "taskType": "WORD_COUNT", "payload": {"text": "later"}, "runAtMillis": run_at})
    errors: list[str] = []

    def one(count: int) -> None:
        with socket.create_connection(("127.0.0.1", client_port), 10) as sock:
            reader = FrameReader(sock.recv)
            while count:
                n = min(PIPELINE, count)
                sock.sendall(frame * n)
                for _ in range(n):
                    reply = reader.read_frame()
                    if reply is None or reply.get("type") != "JOB_SUBMITTED":
                        errors.append(repr(reply))
                        return
                count -= n

    share = [jobs // FILL_CONNECTIONS + (1 if i < jobs % FILL_CONNECTIONS else 0) for i in range(FILL_CONNECTIONS)]
    threads = [threading.Thread(target=one, args=(n,)) for n in share if n]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("a submit was not accepted: %s" % errors[0])


def one_run(way: str, jobs: int, url: str, args: argparse.Namespace, run_dir: Path) -> tuple[float, float]:
    """(seconds to the listening line, seconds to the first job completed) after the leader goes."""
    ports_a = (free_port(), free_port())
    ports_b = (free_port(), free_port())
    procs: list[Proc] = []
    try:
        leader = coordinator("leader", url, ports_a, args, run_dir)
        procs.append(leader)
        leader.await_line(LISTENING)
        standby = coordinator("standby", url, ports_b, args, run_dir)
        procs.append(standby)
        standby.await_line(STANDING_BY)
        if jobs:
            fill(ports_a[1], jobs)
        worker = Proc("worker", [sys.executable, "-m", "jobmesh", "worker", "--capacity=4",
                                 "--coordinator=127.0.0.1:%d,127.0.0.1:%d" % (ports_a[0], ports_b[0]),
                                 "--heartbeat-interval-millis=500", "--log-level=WARNING"], run_dir)
        procs.append(worker)
        with CoordinatorClient("127.0.0.1:%d" % ports_a[1], timeout=60) as client:
            client.wait(client.submit("WORD_COUNT", {"text": "warm"}), timeout=60)  # the worker is registered
        time.sleep(HEARD)  # and has had heartbeats answered: only then does it judge the leader by its silence
        started = time.monotonic()
        leader.proc.send_signal(signal.SIGKILL if way == "kill" else signal.SIGSTOP)
        listening = standby.await_line(LISTENING) - started
        with CoordinatorClient("127.0.0.1:%d" % ports_b[1], timeout=60) as client:
            client.wait(client.submit("WORD_COUNT", {"text": "probe"}), timeout=120)
        first = time.monotonic() - started
        if way == "freeze":
            leader.proc.send_signal(signal.SIGCONT)
            rc = leader.proc.wait(60)
            if rc != EXIT_LEADERSHIP_LOST:
                raise RuntimeError("the thawed leader exited %s, not %d" % (rc, EXIT_LEADERSHIP_LOST))
        return listening, first
    finally:
        for proc in reversed(procs):
            proc.stop()


def summary(values: list[float]) -> str:
    return "median %7.3f s  (min %.3f, max %.3f, n=%d)" % (statistics.median(values), min(values), max(values),
                                                          len(values))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.takeover", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per figure (the median is printed)")
    parser.add_argument("--jobs", type=int, default=100_000, help="active jobs in the loaded runs")
    parser.add_argument("--db-session-timeout-millis", type=int, default=2000,
                        help="the coordinators' session timeout: bounds the takeover after a freeze")
    parser.add_argument("--pg-url", help="a PostgreSQL server to use (one new database per run is made in it)")
    parser.add_argument("--ways", default="kill,freeze", help="kill, freeze or both")
    args = parser.parse_args(argv)
    server = None
    if args.pg_url is None:
        server = PostgresServer(durable=True).start()
    run_dir = Path(tempfile.mkdtemp(prefix="jobmesh-takeover-"))
    n = 0

    def fresh_database() -> str:
        nonlocal n
        n += 1
        if server is not None:
            return server.database("takeover")
        import psycopg

        name = "jobmesh_takeover_%d_%d" % (os.getpid(), n)
        with psycopg.connect(args.pg_url, autocommit=True) as conn:
            conn.execute(("CREATE DATABASE %s" % name).encode())
        return urllib.parse.urlunsplit(urllib.parse.urlsplit(args.pg_url)._replace(path="/" + name))

    try:
        print("takeover: %d runs each, %d active jobs in the loaded runs, session timeout %d ms"
              % (args.runs, args.jobs, args.db_session_timeout_millis), flush=True)
        medians: dict[tuple[str, int], float] = {}
        for way in [w.strip() for w in args.ways.split(",") if w.strip()]:
            for jobs in (0, args.jobs):
                listening, first = [], []
                for _ in range(args.runs):
                    a, b = one_run(way, jobs, fresh_database(), args, run_dir)
                    listening.append(a)
                    first.append(b)
                medians[way, jobs] = statistics.median(listening)
                print("%-6s %7d active jobs: to listening   %s" % (way, jobs, summary(listening)), flush=True)
                print("%-6s %7d active jobs: to first job   %s" % (way, jobs, summary(first)), flush=True)
        for way in [w for w in ("kill", "freeze") if (w, 0) in medians]:
            if args.jobs:
                per = (medians[way, args.jobs] - medians[way, 0]) * 100_000 / args.jobs
                print("%-6s recovery per 100k active jobs: %.3f s" % (way, per), flush=True)
    finally:
        if server is not None:
            server.stop()
    shutil.rmtree(run_dir, ignore_errors=True)  # kept when a run failed: its logs are there
    return 0


if __name__ == "__main__":
    sys.exit(main())
