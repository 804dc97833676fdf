"""Smoke test of bench/takeover.py at the smallest size (one run, kill -9 only, a few
active jobs) on the session's PostgreSQL: it runs and prints its figures; not how fast."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_takeover_bench_tiny(postgres_server):
    proc = subprocess.run([sys.executable, "-m", "bench.takeover", "--runs=1", "--jobs=20", "--ways=kill",
                           "--pg-url=%s" % postgres_server.url()], cwd=REPO, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("kill         0 active jobs: to listening   median")
    assert lines[4].startswith("kill        20 active jobs: to first job   median")
    assert lines[5].startswith("kill   recovery per 100k active jobs:")
