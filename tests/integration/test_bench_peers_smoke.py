"""Smoke test of bench/peers.py, run as subprocesses.

One tiny round (a few dozen jobs, one worker process) of jobmesh and of each peer whose
package and ``redis-server`` are on this machine: it checks that the bench starts and
stops every system, drives it through its own client, reads every result back and
prints the table, not how fast anything is. A peer that cannot run here is skipped
with the reason. The systems are split over two bench processes that run at once
(each starts its own Redis and coordinator), which halves the wall time of the
start-ups and shutdowns that dominate a round this small.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.peer_apps import SYSTEMS
from bench.peers import why_not

REPO = Path(__file__).resolve().parents[2]
# One system per package: the variants (celery-late, rq) differ only in settings.
MEASURED = ("jobmesh", "celery", "rq-simple", "dramatiq", "huey")
TINY = ["--runs=1", "--jobs=24", "--submit-jobs=24", "--clients=3", "--client-procs=1", "--workers=1",
        "--timeout=30"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """Run the bench over every system that can run here; (its stdout, its JSON report)."""
    tmp = tmp_path_factory.mktemp("peers")
    runnable = [name for name in MEASURED if why_not(SYSTEMS[name]) is None]
    groups = [g for g in (runnable[0::2], runnable[1::2]) if g]
    running = []
    for i, group in enumerate(groups):
        out = tmp / ("peers%d.json" % i)
        proc = subprocess.Popen([sys.executable, "-m", "bench.peers", "--systems=" + ",".join(group), *TINY,
                                 "--out=%s" % out], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, stdin=subprocess.DEVNULL)
        running.append((proc, out))
    stdout, runs = "", {}
    for proc, out in running:
        try:
            text, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.terminate()  # the bench stops its own children on SIGTERM
            text, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, text
        stdout += text
        runs.update(json.loads(out.read_text())["runs"])
    return stdout, runs


@pytest.mark.parametrize("system", MEASURED)
def test_tiny_round_reads_every_result_back(bench, system):
    # Given one round of 24 jobs from 3 submitters with one worker process, when the bench
    # measures the system e2e and submit-only, then every job submitted was read back
    # completed (e2e) or is held queued (submit), and the table has the system's row.
    why = why_not(SYSTEMS[system])
    if why:
        pytest.skip("bench/peers cannot measure %s on this machine: %s" % (system, why))
    stdout, runs = bench
    (e2e,) = runs[system]["e2e"]
    (submit,) = runs[system]["submit"]
    assert "error" not in e2e and "error" not in submit, (e2e, submit)
    assert e2e["accepted"] == e2e["completed"] == 24 and e2e["lost"] == 0
    assert e2e["jobs_per_s"] > 0 and e2e["errors"] == {}
    assert submit["accepted"] == submit["held"] == 24 and submit["lost"] == 0
    assert submit["submits_per_s"] > 0 and submit["errors"] == {}
    assert "round 1 %-12s e2e" % system in stdout and "round 1 %-12s submit" % system in stdout
    assert "medians of 1 runs" in stdout
