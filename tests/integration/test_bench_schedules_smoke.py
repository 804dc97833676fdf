"""Smoke test of bench/schedules.py at tiny sizes: every run starts and stops its
coordinator and prints its line; not how fast anything is."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_schedules_bench_tiny(tmp_path):
    # (the measured window, 0.8 s to 1.8 s after the puts, holds the first fire, due at 1 s
    # and made at the next sweep, every 100 ms)
    proc = subprocess.run([sys.executable, "bench/schedules.py", "--schedules=20", "--paused=50", "--seconds=1",
                           "--warmup=0.8", "--sweep-interval-millis=100", "--run-dir=%s" % tmp_path], cwd=REPO,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("idle ")
    assert lines[1].startswith("active   20 schedules every 1000 ms") and "fire lag p50" in lines[1]
    assert lines[2].startswith("paused   50 paused schedules")
