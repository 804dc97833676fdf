"""The client commands as subprocesses: output shapes (text and --json) and every exit code.

Exit codes (CONTRACT.md): 0 ok; 1 job ended FAILED/CANCELLED, submit rejected, or the
coordinator answered ERROR; 2 usage; 3 coordinator unreachable; 4 wait timed out.
"""

from __future__ import annotations

import hashlib
import json
import re
import time

import pytest

from jobmesh.client import CoordinatorClient
from tests.support.cli import run_cli
from tests.support.peers import wait_registered
from tests.support.processes import WorkerProcs, closed_address
from tests.support.waiting import wait_until

SNAPSHOT_FIELDS = {"jobId", "taskType", "state", "attempts", "maxAttempts", "workerId", "result", "error",
                   "createdAtMillis", "updatedAtMillis", "priority", "runAtMillis",
                   "retryAtMillis", "retryOf", "waitingReason", "protocol", "name",
                   "submittedBy", "concurrencyKey", "uniqueKey", "progress", "workflowId", "ref"}
BUILT_INS = ["FAIL", "PRIME_COUNT", "SHA256", "SLEEP", "WORD_COUNT"]


def jm(coord, *args, **kwargs):
    return run_cli(*args, coordinator=coord.client_target, **kwargs)


def json_out(result):
    assert result.stdout.count("\n") == 1, result.stdout  # one document, one line
    return json.loads(result.stdout)


@pytest.fixture
def idle(shared_coordinator):
    """The coordinator without workers the module's tests share: what a test checks of the
    job list is of the jobs it added (``listed_since``)."""
    return shared_coordinator


@pytest.fixture(scope="module")
def live(module_coordinators, tmp_path_factory):
    """A coordinator with one real worker (w-cli, capacity 2) the module's tests share: what a
    test checks of the job list is of the jobs it added (``listed_since``)."""
    coord = module_coordinators()
    workers = WorkerProcs(tmp_path_factory.mktemp("workers"))
    workers.start(coord, "w-cli", capacity=2)
    with CoordinatorClient(*coord.client_addr) as client:
        wait_registered(client, ["w-cli"])
    yield coord
    workers.cleanup()


def job_ids(coord) -> set[str]:
    with CoordinatorClient(*coord.client_addr) as client:
        return {j["jobId"] for j in client.list_jobs(limit=1000)[0]}


def listed_since(coord, before: set[str], *args: str) -> list[dict]:
    """``jobmesh list ARGS --json``, less the jobs in ``before``."""
    return [j for j in json_out(jm(coord, "list", *args, "--json")) if j["jobId"] not in before]


def test_submit_wait_status_list_workers_with_json(live):
    before = job_ids(live)
    # submit prints {"jobId": ...}
    r = jm(live, "submit", "SHA256", '{"text": "hello"}', "--json")
    assert r.returncode == 0, r.stderr
    submitted = json_out(r)
    assert set(submitted) == {"jobId"}
    job_id = submitted["jobId"]

    # wait prints the final snapshot and exits 0 for COMPLETED
    r = jm(live, "wait", job_id, "--timeout-millis=10000", "--json")
    assert r.returncode == 0, r.stderr
    snap = json_out(r)
    assert set(snap) == SNAPSHOT_FIELDS
    assert snap["result"] == {"sha256": hashlib.sha256(b"hello").hexdigest()}

    # status prints the same snapshot
    r = jm(live, "status", job_id, "--json")
    assert r.returncode == 0 and json_out(r) == snap

    # submit --wait --json prints the final snapshot
    r = jm(live, "submit", "WORD_COUNT", '{"text": "a b  c"}', "--wait", "--json", "--priority=HIGH",
           "--max-attempts=2")
    assert r.returncode == 0, r.stderr
    done = json_out(r)
    assert (done["state"], done["result"], done["priority"], done["maxAttempts"]) == (
        "COMPLETED", {"words": 3}, "HIGH", 2)

    # list prints an array of snapshots, newest first; --state and --limit filter
    r = jm(live, "list", "--json")
    assert r.returncode == 0
    listed = json_out(r)
    assert [j["jobId"] for j in listed if j["jobId"] not in before] == [done["jobId"], job_id]
    assert all(set(j) == SNAPSHOT_FIELDS for j in listed)
    assert [j["jobId"] for j in json_out(jm(live, "list", "--json", "--limit=1"))] == [done["jobId"]]
    assert listed_since(live, before, "--state=failed") == []

    # workers prints an array of live workers
    r = jm(live, "workers", "--json")
    assert r.returncode == 0
    (worker,) = json_out(r)
    assert {"workerId", "capacity", "activeJobs", "lastHeartbeatMillis"} <= set(worker)
    assert (worker["workerId"], worker["capacity"]) == ("w-cli", 2)


def test_human_output(live):
    r = jm(live, "submit", "SLEEP", '{"durationMillis": 1}', "--wait")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("submitted job ")
    job_id = lines[0].split()[-1]
    assert "state     COMPLETED" in r.stdout
    assert 'result    {"sleptMillis": 1}' in r.stdout

    r = jm(live, "status", job_id)
    assert r.returncode == 0
    assert r.stdout.splitlines()[0] == "job       %s" % job_id
    assert "attempts  1 of 3" in r.stdout
    assert re.search(r"^created   (just now|\d+s ago) \(\d{4}-\d\d-\d\d ", r.stdout, re.M)

    r = jm(live, "list", "--limit=1")  # (the newest job: this test's)
    header, row = r.stdout.splitlines()
    assert header.split() == ["JOB", "TYPE", "STATE", "PRIORITY", "ATTEMPTS", "WORKER", "UPDATED"]
    assert row.split()[:5] == [job_id, "SLEEP", "COMPLETED", "NORMAL", "1/3"]

    r = jm(live, "workers")
    header, row = r.stdout.splitlines()
    assert header.split() == ["WORKER", "CAPACITY", "ACTIVE", "LAST", "HEARTBEAT", "TYPES"]
    assert row.split()[:3] == ["w-cli", "2", "0"]


def test_payload_from_stdin(live):
    r = jm(live, "submit", "PRIME_COUNT", "-", "--wait", "--json", stdin='{"limit": 100}\n')
    assert r.returncode == 0, r.stderr
    assert json_out(r)["result"] == {"primes": 25}


def test_failed_job_exits_1(live):
    r = jm(live, "submit", "FAIL", '{"failUntilAttempt": 9}', "--max-attempts=1", "--wait", "--json")
    assert r.returncode == 1
    snap = json_out(r)
    assert snap["state"] == "FAILED"
    assert "FAILED" in r.stderr and "attempt 1 failed on purpose" in r.stderr
    r = jm(live, "wait", snap["jobId"])
    assert r.returncode == 1 and "state     FAILED" in r.stdout


def test_cancel_wait_timeout_and_errors_without_workers(idle):
    coordinator = idle
    # Given no worker, a job stays QUEUED
    job_id = json_out(jm(coordinator, "submit", "SLEEP", '{"durationMillis": 5}', "--json"))["jobId"]

    # wait times out: exit 4, the snapshot as it stood
    r = jm(coordinator, "wait", job_id, "--timeout-millis=150", "--json")
    assert r.returncode == 4
    assert json_out(r)["state"] == "QUEUED"
    assert "timed out" in r.stderr
    r = jm(coordinator, "submit", "SLEEP", '{"durationMillis": 5}', "--wait", "--timeout-millis=100")
    assert r.returncode == 4 and "state     QUEUED" in r.stdout

    # cancel: the snapshot with "cancelled"; a second cancel reports the job as it is
    r = jm(coordinator, "cancel", job_id, "--json")
    assert r.returncode == 0, r.stderr
    doc = json_out(r)
    assert doc["cancelled"] is True and doc["state"] == "CANCELLED"
    assert set(doc) == SNAPSHOT_FIELDS | {"cancelled"}
    r = jm(coordinator, "cancel", job_id)
    assert r.returncode == 0
    assert "already CANCELLED" in r.stdout
    assert json_out(jm(coordinator, "cancel", job_id, "--json"))["cancelled"] is False

    # wait on a cancelled job exits 1
    r = jm(coordinator, "wait", job_id, "--json")
    assert r.returncode == 1 and json_out(r)["state"] == "CANCELLED"

    # the coordinator answering ERROR exits 1 with its reason on stderr
    for args in (("status", "no-such-job"), ("cancel", "no-such-job"), ("wait", "no-such-job"),
                 ("submit", "NOT_A_TASK", "{}"), ("submit", "SLEEP", '{"durationMillis": -1}')):
        r = jm(coordinator, *args)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert r.stdout == "" and r.stderr.startswith("jobmesh %s: the coordinator refused: " % args[0]), args


def test_idempotency_key_returns_the_same_job(idle):
    coordinator, before = idle, job_ids(idle)

    def submit():
        r = jm(coordinator, "submit", "SHA256", '{"text": "once"}', "--idempotency-key=k-1", "--json")
        assert r.returncode == 0, r.stderr
        return json_out(r)["jobId"]

    first = submit()
    assert submit() == first
    assert [j["jobId"] for j in listed_since(coordinator, before)] == [first]


def test_every_command_names_the_worker_that_ran_a_finished_job(live):
    # submit --wait prints the finished job with the worker of its last attempt
    r = jm(live, "submit", "SHA256", '{"text": "who ran me"}', "--wait")
    assert r.returncode == 0, r.stderr
    assert "worker    w-cli (attempt 1)" in r.stdout.splitlines(), r.stdout
    job_id = r.stdout.split()[2]  # "submitted job ID"
    r = jm(live, "submit", "SHA256", '{"text": "who ran me too"}', "--wait", "--json")
    other = json_out(r)
    assert other["workerId"] is None  # the snapshot names a worker only while RUNNING
    # ... and so do status, wait, cancel and list
    for command in ("status", "wait", "cancel"):
        r = jm(live, command, job_id)
        assert r.returncode == 0, r.stderr
        assert "worker    w-cli (attempt 1)" in r.stdout.splitlines(), (command, r.stdout)
    r = jm(live, "list", "--type=SHA256")
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines()[1:]]
    assert [row[5] for row in rows if row[0] in (job_id, other["jobId"])] == ["w-cli", "w-cli"], r.stdout


def test_a_repeated_keyed_submit_says_the_job_was_already_there(idle):
    coordinator, before = idle, job_ids(idle)
    args = ("submit", "SHA256", '{"text": "once"}', "--idempotency-key=k-2")
    r = jm(coordinator, *args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("submitted job "), r.stdout
    job_id = r.stdout.split()[2]
    # the coordinator's clock must move past the job's creation for the repeat to tell
    wait_until(lambda: coordinator_millis(coordinator) > json_out(jm(coordinator, "status", job_id, "--json"))[
        "createdAtMillis"], message="a millisecond to pass")
    r = jm(coordinator, *args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("job %s was already submitted with idempotency key 'k-2' at " % job_id), r.stdout
    assert r.stdout.endswith(" (QUEUED); no new job\n"), r.stdout
    assert [j["jobId"] for j in listed_since(coordinator, before)] == [job_id]


def coordinator_millis(coord) -> int:
    with CoordinatorClient(*coord.client_addr) as client:
        return client.stats().at_millis


def test_rejected_submit_exits_1(coordinator_factory):
    coord = coordinator_factory(max_active_jobs=1)
    assert jm(coord, "submit", "SLEEP", '{"durationMillis": 5}').returncode == 0
    r = jm(coord, "submit", "SLEEP", '{"durationMillis": 5}')
    assert r.returncode == 1
    assert "rejected" in r.stderr and "--submit-retries" in r.stderr
    r = jm(coord, "submit", "SLEEP", '{"durationMillis": 5}', "--submit-retries=2")
    assert r.returncode == 1 and "rejected" in r.stderr


@pytest.mark.parametrize("args", [
    ("submit", "SLEEP", "{not json"),
    ("submit", "SLEEP", "[1, 2]"),
    ("submit", "SLEEP", "{}", "--priority=URGENT"),
    ("submit", "SLEEP", "{}", "--max-attempts=lots"),
    ("submit",),
    ("status",),
    ("list", "--state=DONE"),
    ("list", "--limit=0"),
    ("wait", "j", "--timeout-millis=-5"),
    ("status", "j", "--coordinator=nowhere"),
    ("frobnicate",),
    ("list", "--state=SOON"),
    ("submit", "SLEEP", "{}", "--run-at=garbage"),
])
def test_usage_errors_exit_2(args):
    # Usage is checked before anything is sent: no coordinator needed
    r = run_cli(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.strip()
    assert r.stdout == ""


@pytest.mark.parametrize("flags", [
    ("--run-at=garbage",),
    ("--run-at=2026-12-24T25:00:00Z",),
    ("--run-at=-5",),
    ("--delay-millis=-1",),
    ("--delay-millis=5", "--run-at=2026-12-24T18:00:00Z"),
])
def test_schedule_flag_errors_exit_2_with_one_line_before_connecting(flags):
    # Nothing listens there: had the command connected, it would have exited 3.
    r = run_cli("submit", "SLEEP", '{"durationMillis": 1}', *flags, coordinator=closed_address())
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("jobmesh submit: "), r.stderr


# ---- these need the coordinator side of task types and scheduled jobs (CONTRACT.md) ----------


def test_list_type_returns_only_jobs_of_that_type(idle):
    coordinator, before = idle, job_ids(idle)
    ids = {}
    for task, payload in (("SLEEP", '{"durationMillis": 5}'), ("SHA256", '{"text": "x"}'),
                          ("SLEEP", '{"durationMillis": 6}')):
        ids.setdefault(task, []).append(json_out(jm(coordinator, "submit", task, payload, "--json"))["jobId"])
    for flag in ("--type=SLEEP", "--type=sleep"):
        listed = json_out(jm(coordinator, "list", flag, "--json"))
        assert {j["taskType"] for j in listed} == {"SLEEP"}, flag
        assert [j["jobId"] for j in listed if j["jobId"] not in before] == ids["SLEEP"][::-1], flag
    assert [j["jobId"] for j in listed_since(coordinator, before, "--type=SHA256")] == ids["SHA256"]
    assert listed_since(coordinator, before, "--type=WORD_COUNT") == []
    r = jm(coordinator, "list", "--type=SLEEP", "--limit=1")
    assert r.returncode == 0 and r.stdout.splitlines()[1].split()[:2] == [ids["SLEEP"][-1], "SLEEP"]


def test_delayed_submit_is_scheduled_listed_shown_and_cancellable(idle):
    coordinator, earlier = idle, job_ids(idle)
    before = int(time.time() * 1000)
    r = jm(coordinator, "submit", "SLEEP", '{"durationMillis": 1}', "--delay-millis=600000", "--json")
    after = int(time.time() * 1000)
    assert r.returncode == 0, r.stderr
    job_id = json_out(r)["jobId"]
    snap = json_out(jm(coordinator, "status", job_id, "--json"))
    assert snap["state"] == "SCHEDULED"
    assert before + 600000 <= snap["runAtMillis"] <= after + 600000
    assert [j["jobId"] for j in listed_since(coordinator, earlier, "--state=SCHEDULED")] == [job_id]
    assert listed_since(coordinator, earlier, "--state=QUEUED") == []
    r = jm(coordinator, "status", job_id)
    assert "state     SCHEDULED" in r.stdout
    assert re.search(r"^runs at   in (9|10)m \(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", r.stdout, re.M), r.stdout
    doc = json_out(jm(coordinator, "cancel", job_id, "--json"))
    assert (doc["cancelled"], doc["state"]) == (True, "CANCELLED")


def test_run_at_names_a_time_and_an_unscheduled_job_has_none(idle):
    coordinator = idle
    r = jm(coordinator, "submit", "SLEEP", '{"durationMillis": 1}', "--run-at=2099-01-01T00:00:00Z", "--json")
    snap = json_out(jm(coordinator, "status", json_out(r)["jobId"], "--json"))
    assert (snap["state"], snap["runAtMillis"]) == ("SCHEDULED", 4070908800000)
    plain = json_out(jm(coordinator, "submit", "SLEEP", '{"durationMillis": 1}', "--json"))["jobId"]
    assert json_out(jm(coordinator, "status", plain, "--json"))["runAtMillis"] is None
    assert "runs at" not in jm(coordinator, "status", plain).stdout


def test_scheduled_jobs_run_once_due(live):
    r = jm(live, "submit", "SLEEP", '{"durationMillis": 1}', "--delay-millis=300", "--wait", "--json")
    assert r.returncode == 0, r.stderr
    snap = json_out(r)
    assert snap["state"] == "COMPLETED" and snap["runAtMillis"] is not None
    assert snap["updatedAtMillis"] >= snap["createdAtMillis"] + 300
    r = jm(live, "submit", "SLEEP", '{"durationMillis": 1}', "--run-at=2020-01-01T00:00:00Z", "--wait", "--json")
    assert r.returncode == 0, r.stderr
    assert json_out(r)["state"] == "COMPLETED"


def test_workers_show_their_task_types(live):
    (worker,) = json_out(jm(live, "workers", "--json"))
    assert sorted(worker["taskTypes"]) == BUILT_INS
    header, row = jm(live, "workers").stdout.splitlines()
    assert sorted(row.split()[-1].split(",")) == BUILT_INS




@pytest.mark.parametrize("args", [
    ("submit", "SLEEP", '{"durationMillis": 1}'), ("status", "j"), ("list",), ("workers",), ("cancel", "j"),
    ("wait", "j"),
])
def test_unreachable_coordinator_exits_3(args):
    r = run_cli(*args, "--json", coordinator=closed_address())
    assert r.returncode == 3
    assert "unreachable" in r.stderr
    assert r.stdout == ""
