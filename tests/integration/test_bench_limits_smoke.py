"""Smoke test of bench/limits.py at tiny sizes: both parts run end to end and print their
lines (the core part's limit held every key to one running job); not how fast anything is."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_limits_bench_tiny(tmp_path):
    proc = subprocess.run([sys.executable, "bench/limits.py", "--keys=50", "--jobs=200", "--rounds=5", "--batch=5",
                           "--rate=20", "--window=1", "--run-dir=%s" % tmp_path], cwd=REPO, capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    (unlimited,) = [line for line in lines if line.startswith("  no limit")]
    (limited,) = [line for line in lines if line.startswith("  maxRunningPerKey=1")]
    assert "(25 assigned;" in unlimited and "(25 assigned;" in limited
    assert limited.endswith("most running per key 1)")
    assert any(line.startswith("rate: ratePerSecond=20, burst 20, over 1 s") for line in lines)
    (excess,) = [line for line in lines if "worst excess over burst + rate x t" in line]
    # kept, within the timeline's millisecond either way against core time (20 x 2 ms)
    assert float(excess.split(": ")[1].split()[0]) <= 0.04 + 1e-9
