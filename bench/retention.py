"""Does the database stop growing under a steady load with a short retention?

Starts a coordinator with ``--retain-finished-millis`` (short), then pushes jobs through
it in chunks with the load generator (e2e, scripted in-process workers, no
verification: purged jobs cannot be verified), and after each chunk prints the database
file size (main file + WAL), the rows in the jobs table and the bytes of their
timelines, and the coordinator's RSS. Under a steady load the rows settle at about rate × retention and the
file and RSS stop growing once SQLite reuses the pages purged rows freed. Prints figures;
asserts nothing.

Usage:
  retention.py [--jobs=N] [--chunk=N] [--retain-millis=N] [--clients=C]
  retention.py (-h | --help)

Options:
  --jobs=N           jobs in all [default: 2000000]
  --chunk=N          jobs per load-generator run (one line each) [default: 100000]
  --retain-millis=N  the coordinator's --retain-finished-millis [default: 2000]
  --clients=C        client connections [default: 200]
  -h --help          show this help
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gevent import monkey

if __name__ == "__main__":
    monkey.patch_all()

from docopt import docopt  # noqa: E402

from bench import procs  # noqa: E402


def file_mb(db: Path) -> float:
    total = 0
    for suffix in ("", "-wal"):
        path = Path(str(db) + suffix)
        if path.exists():
            total += path.stat().st_size
    return total / 1e6


def rows(db: Path) -> tuple[int, int]:
    conn = sqlite3.connect("file:%s?mode=ro" % db, uri=True, timeout=10)
    try:
        jobs, events = conn.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(events)), 0) FROM jobs").fetchone()
    finally:
        conn.close()
    return jobs, events


def main(argv: list[str] | None = None) -> int:
    args = docopt(__doc__, argv=argv)
    total, chunk = int(args["--jobs"]), int(args["--chunk"])
    run_dir = Path(tempfile.mkdtemp(prefix="jobmesh-retention-"))
    db = run_dir / "retention.db"
    coord, worker_addr, client_addr = procs.start_coordinator(
        run_dir, db, "FULL", ["--retain-finished-millis=%s" % args["--retain-millis"],
                              "--max-active-jobs=1000000", "--log-level=WARNING"])
    print("run dir %s, retention %s ms, %d jobs in chunks of %d" % (run_dir, args["--retain-millis"], total, chunk))
    print("%10s %10s %10s %12s %12s %10s" % ("jobs done", "jobs/s", "file MB", "rows", "event bytes", "RSS MB"))
    done = 0
    try:
        while done < total:
            started = time.monotonic()
            proc = subprocess.run(
                [sys.executable, "-m", "bench.loadgen", "--coordinator=%s:%d" % client_addr,
                 "--coordinator-worker=%s:%d" % worker_addr, "--coordinator-pid=%d" % coord.pid,
                 "--mode=e2e", "--worker-impl=builtin", "--workers=4", "--clients=%s" % args["--clients"],
                 "--jobs=%d" % chunk, "--task=sleep0", "--verify=none", "--timeout=600", "--drain-timeout=600"],
                cwd=str(procs.REPO_ROOT), env=procs.child_env(), capture_output=True, text=True)
            if proc.returncode != 0:
                print("loadgen failed (rc %d): %s" % (proc.returncode, proc.stderr[-2000:]))
                return 1
            done += chunk
            rate = chunk / (time.monotonic() - started)
            jobs, events = rows(db)
            rss = procs.read_status_kb(coord.pid).get("VmRSS", 0) / 1024
            print("%10d %10.0f %10.1f %12d %12d %10.1f" % (done, rate, file_mb(db), jobs, events, rss), flush=True)
    finally:
        procs.stop_all([coord])
    return 0


if __name__ == "__main__":
    sys.exit(main())
