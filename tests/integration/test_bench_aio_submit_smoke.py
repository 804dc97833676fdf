"""Smoke test of bench/aio_submit.py at a tiny size: its coordinator starts, one loadgen run
and one AsyncClient run each submit and report; not how fast anything is."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_aio_submit_bench_tiny():
    proc = subprocess.run([sys.executable, "-m", "bench.aio_submit", "--rounds=1", "--seconds=0.3", "--submitters=10"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("loadgen", "aio"):
        rate = re.search(r"^  %s +submits/s= *(\d+)" % name, proc.stdout, re.M)
        assert rate and int(rate.group(1)) > 0, proc.stdout
