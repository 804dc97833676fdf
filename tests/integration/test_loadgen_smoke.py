"""Smoke tests of the load generator and the echo baseline, run as subprocesses.

Tiny loads only: these check that the tools start their children, drive them, verify
every job with the coordinator and write the report, not how fast anything is.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import pg_support

REPO = Path(__file__).resolve().parents[2]
REPORT_KEYS = ("submits_per_s", "jobs_per_s", "submit_latency_ms", "connections", "lost", "errors",
               "rejected", "coordinator_peak_rss_kb")


def run(args, timeout=60):
    return subprocess.run([sys.executable] + args, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("impl", ["builtin", "process"])
def test_loadgen_e2e_small(tmp_path, impl):
    # Given a fresh coordinator and one worker, when 20 clients submit 200 SLEEP 0 jobs
    # and wait for them, then every job completes exactly once and the report says so.
    out = tmp_path / "r.json"
    proc = run(["-m", "bench.loadgen", "--clients=20", "--jobs=200", "--mode=e2e", "--workers=1",
                "--worker-impl=%s" % impl, "--quiet", "--timeout=30", "--drain-timeout=30",
                "--out=%s" % out], timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    for key in REPORT_KEYS:
        assert key in report, key
    for key in ("p50", "p90", "p99", "max"):
        assert key in report["submit_latency_ms"]
    assert report["lost"] == 0
    assert report["duplicates"] == 0
    assert report["submitted"] == 200
    assert report["completed"] == 200
    assert report["connections"] == 20
    assert report["verify"]["listed"] == 200
    assert report["coordinator_peak_rss_kb"] > 0
    cpu = report["cpu_cores_used"]
    assert 0 <= cpu["coordinator_hub"] <= cpu["coordinator"]  # the hub thread: a share of the process
    assert "jobs/s=" in proc.stdout


def test_loadgen_runs_its_coordinator_on_a_throwaway_postgresql(tmp_path):
    # With --postgres the coordinator it starts keeps the jobs in a server of its own,
    # stopped at the end; every job is verified as on SQLite.
    reason = pg_support.unavailable()
    if reason is not None:
        pytest.skip("PostgreSQL tests SKIPPED: " + reason)
    out = tmp_path / "r.json"
    proc = run(["-m", "bench.loadgen", "--postgres", "--clients=10", "--jobs=100", "--mode=e2e", "--workers=1",
                "--worker-impl=builtin", "--quiet", "--timeout=30", "--drain-timeout=30", "--out=%s" % out], timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["store"] == "postgres"
    assert report["completed"] == 100 and report["lost"] == 0 and report["duplicates"] == 0
    assert report["verify"]["listed"] == 100


def test_loadgen_declared_types(tmp_path):
    # Given 3 scripted workers declaring 2 of 4 types each, when 20 clients submit 200
    # jobs of the types T0..T3, then every job completes, each type was assigned, and
    # no worker got a type it did not declare.
    out = tmp_path / "r.json"
    proc = run(["-m", "bench.loadgen", "--clients=20", "--jobs=200", "--mode=e2e", "--workers=3",
                "--worker-impl=builtin", "--types=4", "--types-per-worker=2", "--quiet", "--timeout=30",
                "--drain-timeout=30", "--out=%s" % out], timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["lost"] == 0 and report["duplicates"] == 0
    assert report["completed"] == 200
    assert report["verify"]["states"] == {"COMPLETED": 200}
    assert set(report["assigned_by_type"]) == {"T0", "T1", "T2", "T3"}
    assert sum(report["assigned_by_type"].values()) == 200
    assert report["errors"].get("misrouted", 0) == 0
    assert "declared task types: 4, 2 per worker" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--types=4", "--types-per-worker=2", "--workers=2", "--worker-impl=builtin"], "undeclared"),
    (["--types=2", "--workers=2"], "--worker-impl=builtin"),
    (["--types-per-worker=2"], "goes with --types"),
])
def test_loadgen_types_usage_errors(args, message):
    proc = run(["-m", "bench.loadgen", "--mode=e2e", "--jobs=10"] + args, timeout=30)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_loadgen_usage_error():
    proc = run(["-m", "bench.loadgen", "--mode=nonsense"], timeout=30)
    assert proc.returncode == 2
    assert "--mode" in proc.stderr


def test_loadgen_script_runs_from_any_cwd(tmp_path):
    proc = subprocess.run([str(REPO / "bench" / "loadgen"), "--help"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "--coordinator=HOST:PORT" in proc.stdout


def test_echo_baseline_small(tmp_path):
    out = tmp_path / "echo.json"
    proc = run([str(REPO / "bench" / "echo_baseline.py"), "--connections=5", "--requests=500",
                "--out=%s" % out], timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["round_trips"] == 500
    assert report["round_trips_per_s"] > 0
    assert report["errors"] == {}
    assert "round trips/s" in proc.stdout


def test_loadgen_against_a_tls_coordinator_with_tokens(tmp_path):
    # The options for measuring TLS and tokens given by hand: the coordinator gets the
    # certificate flags and the auth file, the worker process the CA and the worker token,
    # the clients --tls-ca and the client token; a tiny run checks that it all connects.
    from jobmesh.auth import new_token
    from tests.tls_support import make_certs

    certs = make_certs(tmp_path / "certs")
    auth_file = tmp_path / "auth.toml"
    client_token, worker_token = tmp_path / "client.token", tmp_path / "worker.token"
    client_token.write_text(new_token(str(auth_file), "bench-client", "client"))
    worker_token.write_text(new_token(str(auth_file), "bench-worker", "worker"))
    out = tmp_path / "r.json"
    proc = run(["-m", "bench.loadgen", "--clients=5", "--jobs=50", "--mode=e2e", "--workers=1",
                "--worker-impl=process", "--quiet", "--timeout=30", "--drain-timeout=30",
                "--coordinator-arg=--tls-cert=%s" % certs.server, "--coordinator-arg=--tls-key=%s" % certs.server_key,
                "--coordinator-arg=--auth-file=%s" % auth_file, "--worker-arg=--tls-ca=%s" % certs.ca,
                "--tls-ca=%s" % certs.ca, "--token-file=%s" % client_token, "--worker-token-file=%s" % worker_token,
                "--out=%s" % out], timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["completed"] == 50 and report["lost"] == 0 and report["connections"] == 5
    assert report["tls"] and report["tokens"]


def test_loadgen_makes_its_own_certificate_and_tokens(tmp_path):
    # --tls and --auth: the load generator makes a CA, a certificate, an auth file and a
    # client and a worker token, and its coordinator asks for all of them; submit mode
    # with a scripted worker (which connects with TLS and a worker token too)
    out, run_dir = tmp_path / "r.json", tmp_path / "run"
    proc = run(["-m", "bench.loadgen", "--clients=5", "--jobs=100", "--mode=submit", "--workers=1",
                "--worker-impl=builtin", "--tls", "--auth", "--quiet", "--timeout=30", "--drain-timeout=30",
                "--run-dir=%s" % run_dir, "--out=%s" % out], timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["submitted"] == 100 and report["completed"] == 100 and report["lost"] == 0
    assert report["errors"] == {} and report["tls"] and report["tokens"]
    log = (run_dir / "coordinator.err").read_text()
    assert "tokens on: auth file" in log and " tls=on" in log
    assert (run_dir / "client.token").stat().st_mode & 0o077 == 0


@pytest.mark.parametrize("args, message", [
    (["--tls", "--tls-ca=ca.pem"], "not both"),
    (["--auth", "--token-file=t"], "not both"),
    (["--auth", "--coordinator=127.0.0.1:1"], "a coordinator it starts"),
])
def test_loadgen_security_usage_errors(args, message):
    from bench.loadgen import UsageError, parse_args

    with pytest.raises(UsageError, match=message):
        parse_args(["--mode=submit", "--jobs=10"] + args)
