"""Smoke test of bench/periodic.py, run as a subprocess.

A tiny run only (a few hundred jobs, one round): it checks that every measurement runs
end to end (coordinators, aio-periodic clients and workers, the load generator started
and stopped) and that both protocols' figures are printed and reported, not how fast
anything is.
"""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MEASUREMENTS = ("periodic-submit", "json-submit", "periodic-e2e", "json-e2e")


def test_periodic_bench_tiny(tmp_path):
    # Given one round of 2 aio-periodic clients x 4 in flight, one worker of 8 slots and
    # 300 e2e jobs, when the bench runs, then all four measurements print a rate and the
    # coordinator's CPU per job, and no job is lost.
    out = tmp_path / "periodic.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.periodic", "--runs=1", "--clients=2", "--inflight=4", "--duration=0.5",
         "--jobs=300", "--workers=1", "--size=8", "--timeout=30", "--out=%s" % out],
        cwd=REPO, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in MEASUREMENTS:
        assert "round 1 %s " % name in proc.stdout, name
    assert "FAILED" not in proc.stdout
    for title in ("submit: medians of 1 runs", "e2e: medians of 1 runs", "submits/s", "jobs/s",
                  "coordinator CPU µs per submit", "coordinator CPU µs per job"):
        assert title in proc.stdout, title

    report = json.loads(out.read_text())
    for name in MEASUREMENTS:
        (run,) = report["runs"][name]
        assert run["rate"] > 0, name
        assert run["coord_us_per_job"] > 0, name
        assert run["lost"] == 0, name
        assert run["rows_per_job"] >= 1, name
        assert report["medians"][name]["rate"] == run["rate"]
    assert report["runs"]["periodic-e2e"][0]["jobs"] == 300
    assert report["runs"]["json-e2e"][0]["jobs"] == 300
    assert report["runs"]["periodic-e2e"][0]["worker_cores"] > 0
    assert report["runs"]["periodic-submit"][0]["gen_cores"] > 0
