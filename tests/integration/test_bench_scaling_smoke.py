"""Smoke tests of bench/scaling.py and bench/prime_count.py, run as subprocesses.

Tiny sizes only: these check that every level runs end to end (coordinators started and
stopped, the stored database built, the load generator attached) and that the printed
tables and the JSON report have their shape, not how fast anything is.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run(args, timeout):
    return subprocess.run([sys.executable] + args, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_scaling_all_levels_tiny(tmp_path):
    # Given tiny sizes, when every level runs, then each reports one row per size (core,
    # e2e) or per database (stored), with positive rates and every job accounted for.
    out = tmp_path / "scaling.json"
    proc = run(["-m", "bench.scaling", "--levels=core,history,e2e,stored", "--sizes=64,128", "--workers=2",
                "--capacity=8", "--rounds=3", "--history=3200", "--task-timeout-millis=100", "--trials=1",
                "--prefill-clients=4", "--stored=3000",
                "--stored-runs=1", "--stored-clients=4", "--stored-duration=0.5",
                "--work-dir=%s" % (tmp_path / "work"), "--out=%s" % out], timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for title in ("\ncore (", "\nhistory (", "\ne2e (", "\nstored ("):
        assert title in proc.stdout
    report = json.loads(out.read_text())
    assert report["loadavg_start"] and report["loadavg_end"]

    core = report["core"]["rows"]
    assert [r["queued"] for r in core] == [64, 128]
    for row in core:
        for key in ("submit_us", "schedule_us", "result_us", "sweep_us", "commit_us"):
            assert row[key] > 0, key
        assert row["depth_at_schedule"] == row["queued"]
    assert set(report["core"]["growth_largest_vs_smallest"]) == {
        "submit_us", "schedule_us", "result_us", "sweep_us", "commit_us"}

    history = report["history"]["rows"]
    assert len(history) == 11
    # It ran in rounds, not for a time: each block completed more, and the last block
    # reached the --history asked for, on a clock that moved forward
    completed = [r["completed"] for r in history]
    assert completed == sorted(set(completed)) and completed[-1] >= 3200, completed
    simulated = [r["simulated_s"] for r in history]
    assert simulated == sorted(simulated) and simulated[-1] > simulated[0], simulated
    # Deadlines of 100 ms at 8,000 assignments/s: the heap holds about 800 entries, not 3,200.
    assert history[-1]["deadline_heap"] < 1200
    assert all(r["schedule_us"] > 0 for r in history)

    e2e = report["e2e"]["rows"]
    assert [r["queued"] for r in e2e] == [64, 128]
    for row in e2e:
        assert row["assign_per_s"] > 0
        assert row["prefill_submits_per_s"] > 0
        assert row["coordinator_rss_queued_kb"] > 0

    stored = report["stored"]
    assert stored["stored_rows"] == 3000
    assert [r["db"] for r in stored["rows"]] == ["empty", "stored"]
    assert all(r["submits_per_s"] > 0 for r in stored["rows"])
    assert stored["ratio_stored_vs_empty"] > 0
    assert stored["recovery_stored"]["active"] == 0
    assert all(r["lost"] == 0 for r in stored["runs"])
    assert (tmp_path / "work" / "stored-3000.db").exists()  # kept for the next run in this work dir


def test_prime_count_tiny(tmp_path):
    out = tmp_path / "prime.json"
    proc = run(["-m", "bench.prime_count", "--limits=1000,100000", "--concurrency=1,2", "--runs=1", "--e2e",
                "--out=%s" % out], timeout=40)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    rows = report["in_process"]
    assert [(r["limit"], r["concurrency"]) for r in rows] == [(1000, 1), (1000, 2), (100000, 1), (100000, 2)]
    assert all(r["correct"] is True and r["wall_s"] > 0 for r in rows)
    assert rows[2]["primes"] == 9592
    assert [(r["limit"], r["concurrency"]) for r in report["e2e"]] == [(1000, 1), (1000, 2), (100000, 1),
                                                                       (100000, 2)]
    assert all(r["correct"] is True for r in report["e2e"])
    assert "ticker late ms" in proc.stdout


def test_scaling_rejects_sizes_below_the_slots():
    # (main itself: the options are checked before anything starts; a SystemExit with a
    # message is a non-zero exit with the message on stderr)
    from bench.scaling import main

    with pytest.raises(SystemExit, match="--workers x --capacity"):
        main(["--levels=core", "--sizes=10", "--workers=2", "--capacity=8"])
