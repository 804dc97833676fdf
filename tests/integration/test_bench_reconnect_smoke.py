"""Smoke test of bench/reconnect.py at a tiny size: each variant starts its coordinator,
sets its worker connections up twice (TLS, AUTH, WORKER_REGISTER) and reports; not how
fast anything is."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_reconnect_bench_tiny(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "bench/reconnect.py", "--workers=20", "--runs=1",
                           "--variants=plain,tls+tokens", "--run-dir=%s" % tmp_path, "--out=%s" % out],
                          cwd=REPO, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    for variant in ("plain", "tls+tokens"):
        [run] = report["runs"][variant]
        assert run["first_registered"] == 20 and run["listed_after_close"] == 0, run
        assert run["reconnected"] == 20 and run["registered"] == 20 and run["errors"] == {}, run
        assert run["coordinator_us_per_setup"] > 0
    assert "tls+tokens / plain coordinator CPU per set-up" in proc.stdout
    assert "tokens on: auth file" in (tmp_path / "tls-tokens-1" / "coordinator.err").read_text()
