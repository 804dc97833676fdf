"""Smoke test of bench/workflows.py at a tiny size: both parts run and print their figures;
not how fast anything is."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_workflows_bench_tiny():
    proc = subprocess.run([sys.executable, "-m", "bench.workflows", "--sizes=20", "--runs=1", "--width=30",
                           "--rounds=1", "--workers=1", "--capacity=4", "--clients=4"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for kind in ("workflow", "plain"):
        assert re.search(r"^  submit %s +20 jobs  submit_ms= *[\d.]+  rss_mb before= *[\d.]+ after= *[\d.]+" % kind,
                         proc.stdout, re.M), proc.stdout
    for name in ("workflow", "plain"):
        rate = re.search(r"^  e2e %s +31 jobs  jobs/s= *(\d+)" % name, proc.stdout, re.M)
        assert rate and int(rate.group(1)) > 0, proc.stdout
