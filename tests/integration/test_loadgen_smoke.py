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


def check_report(report, proc, jobs, clients):
    """The report of a load generator run that lost nothing: every job submitted once and
    completed once, verified with the coordinator, and the figures printed."""
    for key in REPORT_KEYS:
        assert key in report, key
    for key in ("p50", "p90", "p99", "max"):
        assert key in report["submit_latency_ms"]
    assert report["lost"] == 0 and report["duplicates"] == 0 and report["errors"] == {}
    assert report["submitted"] == jobs and report["completed"] == jobs
    assert report["connections"] == clients
    assert report["verify"]["listed"] == jobs
    assert report["verify"]["states"] == {"COMPLETED": jobs}
    assert report["coordinator_peak_rss_kb"] > 0
    cpu = report["cpu_cores_used"]
    assert 0 <= cpu["coordinator_hub"] <= cpu["coordinator"]  # the hub thread: a share of the process
    assert "jobs/s=" in proc.stdout


def test_loadgen_end_to_end_on_a_throwaway_postgresql_with_declared_types_own_certificate_and_tokens(tmp_path):
    # Given a coordinator on a fresh database of a PostgreSQL server of the load generator's
    # own (--postgres, stopped at the end), 3 scripted workers declaring 2 of 4 types each,
    # and --tls and --auth (the load generator makes a CA, a certificate, an auth file and a
    # client and a worker token, and its coordinator asks for all of them; the scripted
    # workers connect with TLS and the worker token), when 5 clients submit 60 jobs of the
    # types T0..T3 end to end and wait for them, then every job completes exactly once, each
    # type was assigned, and no worker got a type it did not declare.
    reason = pg_support.unavailable()
    if reason is not None:
        pytest.skip("PostgreSQL tests SKIPPED: " + reason)
    out, run_dir = tmp_path / "r.json", tmp_path / "run"
    proc = run(["-m", "bench.loadgen", "--postgres", "--clients=5", "--jobs=60", "--mode=e2e", "--workers=3",
                "--worker-impl=builtin", "--types=4", "--types-per-worker=2", "--tls", "--auth", "--quiet",
                "--timeout=30", "--drain-timeout=30", "--run-dir=%s" % run_dir, "--out=%s" % out], timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    check_report(report, proc, jobs=60, clients=5)
    assert report["store"] == "postgres"
    assert set(report["assigned_by_type"]) == {"T0", "T1", "T2", "T3"}
    assert sum(report["assigned_by_type"].values()) == 60
    assert report["errors"].get("misrouted", 0) == 0
    assert "declared task types: 4, 2 per worker" in proc.stdout
    assert report["tls"] and report["tokens"]
    log = (run_dir / "coordinator.err").read_text()
    assert "tokens on: auth file" in log and " tls=on" in log
    assert (run_dir / "client.token").stat().st_mode & 0o077 == 0


def test_loadgen_worker_processes_with_tls_and_tokens_by_hand(tmp_path):
    # The options for measuring TLS and tokens given by hand: the coordinator gets the
    # certificate flags and the auth file, the worker process (a real `jobmesh worker`) the
    # CA and the worker token, the clients --tls-ca and the client token. When 5 clients
    # submit 50 jobs end to end and wait for them, every job completes exactly once.
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
    check_report(report, proc, jobs=50, clients=5)
    assert report["tls"] and report["tokens"]


@pytest.mark.parametrize("args, message", [
    (["--types=4", "--types-per-worker=2", "--workers=2", "--worker-impl=builtin"], "undeclared"),
    (["--types=2", "--workers=2"], "--worker-impl=builtin"),
    (["--types-per-worker=2"], "goes with --types"),
    (["--mode=nonsense"], "--mode"),
])
def test_loadgen_usage_errors(capsys, args, message):
    # (main itself: the usage is checked before anything starts; bench/loadgen.py's entry is
    # sys.exit(main()), which the runs above go through)
    from bench.loadgen import main

    assert main(["--mode=e2e", "--jobs=10"] + args) == 2
    assert message in capsys.readouterr().err


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


@pytest.mark.parametrize("args, message", [
    (["--tls", "--tls-ca=ca.pem"], "not both"),
    (["--auth", "--token-file=t"], "not both"),
    (["--auth", "--coordinator=127.0.0.1:1"], "a coordinator it starts"),
])
def test_loadgen_security_usage_errors(args, message):
    from bench.loadgen import UsageError, parse_args

    with pytest.raises(UsageError, match=message):
        parse_args(["--mode=submit", "--jobs=10"] + args)
