"""Seeing inside, end to end: ``events``, ``retry``, ``purge``, ``status``'s waiting words and
``top`` as subprocesses against a real coordinator and real workers, and ``--log-format=json``
on the coordinator, a worker and ``up`` (every stderr line is one JSON object)."""

from __future__ import annotations

import itertools
import json
import signal
import time

import pytest

from jobmesh.client import CoordinatorClient
from tests.pg_support import on_both_stores
from tests.support.cli import run_cli
from tests.support.peers import wait_no_worker, wait_registered
from tests.support.waiting import wait_until
from tests.integration.test_cli import jm


def json_lines(text: str) -> list[dict]:
    """Every line of ``text`` parsed as one JSON object (fails on the first that is not)."""
    objs = []
    for line in text.splitlines():
        try:
            objs.append(json.loads(line))
        except ValueError:
            raise AssertionError("not a JSON line: %r\n--- all of it:\n%s" % (line, text)) from None
        assert set(objs[-1]) >= {"ts", "level", "logger", "message"}, line
    return objs


def finished_job(coord, *submit_args) -> str:
    r = jm(coord, "submit", *submit_args, "--wait", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["jobId"]


WORKER_NUMBERS = itertools.count(1)


@pytest.fixture
def shared_live(shared_on_store, worker_procs):
    """``(coordinator, worker_id)``: the module's shared coordinator with one real worker of
    the test's own, the only live one while the test runs."""
    with CoordinatorClient(*shared_on_store.client_addr) as client:
        wait_no_worker(client)
        worker = worker_procs.start(shared_on_store, "w-cli-%d" % next(WORKER_NUMBERS), capacity=2)
        wait_registered(client, [worker.worker_id])
    return shared_on_store, worker.worker_id


# ---- need the coordinator side (GET_JOB_EVENTS, RETRY_JOB, PURGE_JOBS, waitingReason) ----------


def test_events_of_a_job_that_failed_once(shared_live):
    live, worker_id = shared_live
    # Given a job whose first attempt fails and second completes
    job_id = finished_job(live, "FAIL", '{"failUntilAttempt": 2}')

    # When its events are asked for as JSON
    r = jm(live, "events", job_id, "--json")
    assert r.returncode == 0, r.stderr
    events = json.loads(r.stdout)

    # Then they tell the story, oldest first, with the attempt's worker on each assignment
    names = [e["event"] for e in events]
    assert names == ["SUBMITTED", "ASSIGNED", "ATTEMPT_FAILED", "RETRY_WAIT", "QUEUED", "ASSIGNED", "COMPLETED"]
    assert [e["atMillis"] for e in events] == sorted(e["atMillis"] for e in events)
    assigned = [e for e in events if e["event"] == "ASSIGNED"]
    assert [(e["attempt"], e["workerId"]) for e in assigned] == [(1, worker_id), (2, worker_id)]
    assert isinstance(next(e for e in events if e["event"] == "RETRY_WAIT")["retryAtMillis"], int)

    # And the table reads the same, starting at +0.000s
    r = jm(live, "events", job_id)
    assert r.returncode == 0, r.stderr
    header, *rows = r.stdout.splitlines()
    assert header.split()[:3] == ["AT", "TIME", "EVENT"]
    assert rows[0].startswith("+0.000s ") and "SUBMITTED" in rows[0]
    assert len(rows) == len(events) and worker_id in rows[-1] and "COMPLETED" in rows[-1]


def test_events_of_an_unknown_job_exits_1(shared_coordinator):
    r = jm(shared_coordinator, "events", "no-such-job")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("jobmesh events: the coordinator refused: ")


@on_both_stores
def test_retry_a_finished_job(shared_live):
    live, _ = shared_live
    old = finished_job(live, "SHA256", '{"text": "again"}', "--priority=HIGH", "--max-attempts=2")
    r = jm(live, "retry", old, "--json")
    assert r.returncode == 0, r.stderr
    reply = json.loads(r.stdout)
    assert reply["retryOf"] == old and reply["jobId"] != old
    new = json.loads(jm(live, "wait", reply["jobId"], "--timeout-millis=10000", "--json").stdout)
    assert (new["state"], new["taskType"], new["priority"], new["maxAttempts"], new["retryOf"]) == (
        "COMPLETED", "SHA256", "HIGH", 2, old)

    r = jm(live, "retry", old)
    assert r.returncode == 0 and r.stdout.startswith("submitted job ") and r.stdout.endswith("(retry of %s)\n" % old)
    r = jm(live, "status", r.stdout.split()[2])
    assert "retry of  %s" % old in r.stdout


def test_retry_of_an_unfinished_or_unknown_job_exits_1(shared_coordinator):
    # (no worker is live on the shared coordinator: the job stays queued)
    with CoordinatorClient(*shared_coordinator.client_addr) as client:
        wait_no_worker(client)
    queued = json.loads(jm(shared_coordinator, "submit", "SLEEP", '{"durationMillis": 1}', "--json").stdout)["jobId"]
    for job_id in (queued, "no-such-job"):
        r = jm(shared_coordinator, "retry", job_id)
        assert r.returncode == 1 and r.stdout == "" and "refused" in r.stderr


@on_both_stores
def test_purge_deletes_finished_jobs_only(live):
    done = [finished_job(live, "WORD_COUNT", '{"text": "a b"}') for _ in range(3)]
    r = jm(live, "purge", "--older-than=7d", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["purged"] == 0
    time.sleep(0.01)  # the jobs must age past 1 ms: time passing is what --older-than measures
    r = jm(live, "purge", "--older-than=1")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "purged 3 finished jobs last updated more than 1 ago\n"
    for job_id in done:
        assert jm(live, "status", job_id).returncode == 1


def test_purge_dry_run_counts_and_deletes_nothing(live):
    done = [finished_job(live, "WORD_COUNT", '{"text": "a b"}') for _ in range(3)]
    time.sleep(0.01)  # the jobs must age past 1 ms: time passing is what --older-than measures
    r = jm(live, "purge", "--older-than=1", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "would purge 3 finished jobs last updated more than 1 ago (nothing deleted)\n"
    r = jm(live, "purge", "--older-than=0", "--dry-run", "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == {"wouldPurge": 3, "more": False, "olderThanMillis": 0}
    with CoordinatorClient(*live.client_addr) as client:
        assert client.purge(0, limit=2, dry_run=True) == (2, True)
        for job_id in done:
            assert client.status(job_id)["state"] == "COMPLETED"


def test_status_says_why_a_job_waits(coordinator, worker_procs):
    # Given no worker at all
    waiting = json.loads(jm(coordinator, "submit", "SHA256", '{"text": "x"}', "--json").stdout)["jobId"]
    r = jm(coordinator, "status", waiting)
    assert "waiting   no worker is connected\n" in r.stdout, r.stdout

    # Given one worker with one slot, busy with a long job
    worker_procs.start(coordinator, "w-busy", capacity=1)
    with CoordinatorClient(*coordinator.client_addr) as client:
        wait_registered(client, ["w-busy"])
        client.wait(waiting, timeout=10)
        long_job = client.submit("SLEEP", {"durationMillis": 30_000})
        wait_until(lambda: client.status(long_job)["state"] == "RUNNING", message="the long job runs")
        behind = client.submit("SHA256", {"text": "y"})
        r = jm(coordinator, "status", behind)
        assert "waiting   the one worker that runs SHA256 is busy (1/1 slots)\n" in r.stdout, r.stdout
        client.cancel(long_job)


# ---- work with any coordinator -----------------------------------------------------------------


def test_top_two_refreshes(live):
    finished_job(live, "SHA256", '{"text": "top"}')
    r = jm(live, "top", "--iterations=2", "--interval-millis=50")
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout  # into a pipe: no screen codes, plain frames one after the other
    frames = r.stdout.split("jobmesh top ")
    assert frames[0] == "" and len(frames) == 3
    assert "Traceback" not in r.stderr and r.stderr == ""
    for text in frames[1:]:
        assert "jobs      queued 0  scheduled 0  running 0  retry_wait 0" in text
        assert "w-cli" in text and "workers   1 live" in text


def test_top_without_a_coordinator_exits_3():
    r = run_cli("top", "--iterations=1", coordinator="127.0.0.1:1")
    assert r.returncode == 3 and r.stdout == ""
    assert r.stderr.startswith("jobmesh top: coordinator unreachable: ") and "Traceback" not in r.stderr


def test_log_format_json_on_coordinator_and_worker(coordinator_factory, worker_procs):
    # Given a coordinator and a worker that log JSON
    coord = coordinator_factory(log_format="json")
    worker = worker_procs.start(coord, "w-json", capacity=1, extra=("--log-format=json",))
    with CoordinatorClient(*coord.client_addr) as client:
        wait_registered(client, ["w-json"])
        # When a job fails an attempt (logged with its jobId) and then completes
        job_id = client.submit("FAIL", {"failUntilAttempt": 2})
        assert client.wait(job_id, timeout=10)["state"] == "COMPLETED"
    assert coord.terminate() == 0 and worker.terminate() == 0

    # Then the listening line on stdout is as ever, and every stderr line is a JSON object
    assert coord.stdout().startswith("jobmesh coordinator listening worker=")
    coord_lines = json_lines(coord.stderr())
    worker_lines = json_lines(worker.log())
    assert any(o["message"].startswith("recovered ") for o in coord_lines)  # start-up included
    retry = [o for o in coord_lines if o["message"].startswith("retry ")]
    assert retry and retry[0]["jobId"] == job_id and retry[0]["level"] == "INFO"
    assert any(o.get("workerId") == "w-json" for o in coord_lines)
    assert any(o.get("jobId") == job_id and o.get("attemptId") for o in worker_lines)
    assert any(o["message"].startswith("worker stopped") for o in worker_lines)


def test_log_format_json_start_up_error(tmp_path):
    # A database path that cannot be opened is logged as JSON, and the exit is non-zero
    r = run_cli("coordinator", "--worker-port=0", "--client-port=0", "--log-format=json",
                "--db=%s" % (tmp_path / "missing-dir" / "j.db"))
    assert r.returncode != 0
    objs = json_lines(r.stderr)
    assert objs and objs[-1]["level"] == "ERROR"


def test_up_passes_log_format_json_on(start_up):  # noqa: F811
    up = start_up("--workers=1", "--log-format=json")
    with CoordinatorClient(*up.client_addr) as client:
        wait_registered(client, ["local-1"])
        assert client.wait(client.submit("SHA256", {"text": "up"}), timeout=10)["state"] == "COMPLETED"
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(12) == 0
    objs = json_lines(up.log())  # up's own lines, its coordinator's and its worker's
    loggers = {o["logger"] for o in objs}
    assert {"jobmesh.up", "jobmesh.coordinator.shell.runtime", "jobmesh.worker.agent"} <= loggers
