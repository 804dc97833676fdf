"""One coordinator per database, and storage faults without a crash loop
(docs/FAILURE_MODEL.md, "One coordinator per database" and "Storage faults").

Faults are simulated without mounts: a full disk and a read-only database through the
test-only fault file of tests/support/faulty_store.py (``full`` stops the database from growing
with SQLite's ``max_page_count``, ``readonly`` makes the writer refuse writes with
``query_only``), read by the stores of coordinators started through
tests/support/faulty_coordinator.py (the fixture ``fault``), and a held write lock through a second
connection that keeps ``BEGIN EXCLUSIVE`` past SQLite's busy timeout.
"""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys

import pytest

from jobmesh import auth
from tests.support.faulty_store import ENTRY, FAULT_FILE_ENV
from tests.support.cli import run_cli
from tests.support.processes import CoordinatorProc, child_env
from tests.support.waiting import wait_until
from tests.integration.test_metrics_port import get_json, scrape, value

BIG_TEXT = "x " * 3000  # a few pages a job: a database that cannot grow fails at once


@pytest.fixture
def fault(tmp_path, monkeypatch):
    """Write "full", "readonly" or "" to set or clear the simulated fault, in every
    coordinator the test starts (they run tests/support/faulty_coordinator.py)."""
    path = tmp_path / "storage-fault"
    path.write_text("")
    monkeypatch.setenv(FAULT_FILE_ENV, str(path))
    monkeypatch.setattr(CoordinatorProc, "ENTRY", (ENTRY,))
    return path.write_text


def db_states(db) -> dict[str, tuple[str, int]]:
    with sqlite3.connect(str(db)) as conn:
        return {job_id: (state, attempts) for job_id, state, attempts
                in conn.execute("SELECT job_id, state, attempts FROM jobs")}


def running_job(coord, peers, worker_id: str):
    """A client, a scripted worker and one job RUNNING on it: (client, worker, job id)."""
    client = peers.client(coord)
    worker = peers.worker(coord, worker_id)
    job_id = client.submit_ok("SLEEP", {"durationMillis": 60_000})
    worker.await_assign()
    return client, worker, job_id


def submit_until_refused(client, limit: int = 200) -> tuple[list[str], dict]:
    """Submit big jobs until one is refused; (acknowledged ids, the refusal)."""
    acked = []
    for _ in range(limit):
        reply = client.submit("WORD_COUNT", {"text": BIG_TEXT})
        if reply["type"] != "JOB_SUBMITTED":
            return acked, reply
        acked.append(reply["jobId"])
    raise AssertionError("no submit was refused in %d tries" % limit)


def submit_when_writes_resume(client, timeout: float = 15.0) -> str:
    def attempt():
        reply = client.submit("WORD_COUNT", {"text": "after"})
        if reply["type"] == "ERROR":
            assert reply["message"].startswith("storage unavailable: "), reply
            return None
        return reply["jobId"]

    return wait_until(attempt, timeout=timeout, interval=0.1, message="writes to resume")


# ---- one coordinator per database -----------------------------------------------------


def test_a_second_coordinator_on_the_same_database_exits_1_and_changes_nothing(coordinator_factory, peers):
    # Given a coordinator with a RUNNING job
    coord = coordinator_factory()
    client, worker, job_id = running_job(coord, peers, "w-live")
    assign = worker.assigns[0]
    assert db_states(coord.db)[job_id] == ("RUNNING", 1)

    # When a second coordinator starts on the same database
    proc = run_cli("coordinator", "--worker-port=0", "--client-port=0", "--db=%s" % coord.db)

    # Then it exits 1 with one line naming the holder, without a traceback
    assert proc.returncode == 1
    assert "database in use by pid %d" % coord.proc.pid in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if "ERROR" in line]) == 1, proc.stderr
    assert "recovered" not in proc.stderr
    # And it changed nothing: the job is still RUNNING on disk, and the first one serves on
    assert db_states(coord.db)[job_id] == ("RUNNING", 1)
    worker.complete(assign, {"sleptMillis": 60_000})
    assert client.wait_state(job_id, "COMPLETED")["attempts"] == 1
    assert coord.proc.poll() is None


def test_a_restart_right_after_kill_9_takes_the_lock(coordinator_factory, peers):
    coord = coordinator_factory()
    job_id = peers.client(coord).submit_ok("SLEEP", {"durationMillis": 1})
    coord.kill()
    coord.start()  # the kernel released the dead process's lock
    assert peers.client(coord).status(job_id)["state"] == "QUEUED"


# ---- storage faults ---------------------------------------------------------------------


def assert_degraded_then_resumes(coord, client, acked, refusal, reason, make_healthy, peers):
    """The shared checks: the refusal, reads, the log, nothing lost, writes resume."""
    assert refusal == {"type": "ERROR", "message": "storage unavailable: %s" % reason}
    # Reads still work, for every acknowledged job
    for job_id in acked:
        assert client.status(job_id)["jobId"] == job_id
    assert client.list_jobs(limit=5)["type"] == "JOB_LIST"
    # Writes keep answering the storage error while the fault lasts; the process stays up
    again = client.submit("WORD_COUNT", {"text": BIG_TEXT})
    assert again == refusal
    assert coord.proc.poll() is None
    log = coord.stderr()
    assert log.count("ERROR jobmesh.coordinator.shell.runtime: storage unavailable") == 1, log[-3000:]
    assert "Traceback" not in log

    # When the fault is removed, writes resume by themselves
    make_healthy()
    resumed = submit_when_writes_resume(client)
    wait_until(lambda: "writes resumed" in coord.stderr(), message="the resume logged")
    assert coord.stderr().count("writes resumed") == 1

    # And nothing acknowledged was lost: on disk, and after a restart
    on_disk = db_states(coord.db)
    assert set(acked) | {resumed} <= set(on_disk)
    assert coord.terminate() == 0
    coord.start()
    client = peers.client(coord)
    listed = set()
    cursor = None
    while True:
        page = client.list_jobs(limit=1000, **({"cursor": cursor} if cursor else {}))
        listed.update(j["jobId"] for j in page["jobs"])
        cursor = page["nextCursor"]
        if cursor is None:
            break
    assert set(acked) | {resumed} <= listed


def test_a_full_disk_refuses_writes_serves_reads_and_resumes(coordinator_factory, peers, fault):
    # Given a coordinator with a worker running one acknowledged job
    coord = coordinator_factory()
    client, worker, running = running_job(coord, peers, "w-full")

    # When the disk fills up
    fault("full")
    acked, refusal = submit_until_refused(client)

    # Then the worker's connection is closed (its lease died with the discarded memory),
    # the running job is requeued, and the rest is the shared story
    assert worker.wait_closed(5)
    assert client.status(running)["state"] == "QUEUED"
    assert_degraded_then_resumes(coord, client, [running] + acked, refusal, "disk full", lambda: fault(""), peers)


def test_a_held_write_lock_refuses_writes_serves_reads_and_resumes(coordinator_factory, peers):
    # Given an acknowledged job
    coord = coordinator_factory()
    client = peers.client(coord)
    kept = client.submit_ok("SLEEP", {"durationMillis": 1})
    # When another process holds the write lock past SQLite's busy timeout (5 s)
    blocker = sqlite3.connect(str(coord.db), isolation_level=None, timeout=0)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        refusal = client.submit("SLEEP", {"durationMillis": 2})
        assert_degraded_then_resumes(coord, client, [kept], refusal, "database is locked",
                                     lambda: blocker.execute("ROLLBACK"), peers)
    finally:
        if blocker.in_transaction:
            blocker.execute("ROLLBACK")
        blocker.close()


def test_a_read_only_database_refuses_writes_serves_reads_and_resumes(coordinator_factory, peers, fault):
    coord = coordinator_factory()
    client = peers.client(coord)
    kept = client.submit_ok("SLEEP", {"durationMillis": 1})
    fault("readonly")
    refusal = client.submit("SLEEP", {"durationMillis": 2})
    assert_degraded_then_resumes(coord, client, [kept], refusal, "database is read-only", lambda: fault(""), peers)


def test_start_on_a_read_only_database_is_a_degraded_start(coordinator_factory, peers, fault):
    # Given a database left with a RUNNING job by a crash
    coord = coordinator_factory()
    _, _, running = running_job(coord, peers, "w-ro")
    coord.kill()
    # When the coordinator starts on it while it is read-only
    fault("readonly")
    coord.start()
    client = peers.client(coord)
    # Then it starts, says so once, serves reads (recovery's view), and refuses writes
    assert "storage unavailable (at start): database is read-only" in coord.stderr()
    assert client.status(running)["state"] == "QUEUED"
    assert db_states(coord.db)[running] == ("RUNNING", 1)  # recovery's rows wait for storage
    refusal = client.submit("SLEEP", {"durationMillis": 2})
    assert_degraded_then_resumes(coord, client, [running], refusal, "database is read-only", lambda: fault(""),
                                 peers)
    assert db_states(coord.db)[running][0] == "QUEUED"


def storage_available(coord) -> tuple[float, object]:
    """The gauge on /metrics, and its key in /api/summary."""
    return value(scrape(coord), "jobmesh_storage_available"), get_json(coord.metrics_url + "/api/summary")[1][
        "storageAvailable"]


def test_an_outage_costs_one_reload_however_many_writes_come(coordinator_factory, peers, fault):
    # Given a coordinator holding many active jobs (no worker: they stay QUEUED)
    coord = coordinator_factory(metrics_port=0)
    client = peers.client(coord)
    acked = [client.submit_ok("SLEEP", {"durationMillis": 1}) for _ in range(300)]
    assert storage_available(coord) == (1, 1)
    reloads = coord.stderr().count("recovered db=")  # the start's recovery

    # When the disk fills up and clients go on writing: submits, cancels, Periodic-free retries
    fault("full")
    more, refusal = submit_until_refused(client)
    acked += more
    for job_id in acked[:200]:
        assert client.submit("WORD_COUNT", {"text": BIG_TEXT}) == refusal
        assert client.cancel(job_id) == refusal

    # Then the outage cost one reload of the active jobs, not one per refused write; reads
    # are served and the gauge says storage is unavailable
    assert coord.stderr().count("recovered db=") == reloads + 1
    assert storage_available(coord) == (0, 0)
    assert {client.status(job_id)["state"] for job_id in acked} == {"QUEUED"}

    # When storage works again, the probe notices: the gauge is 1, writes apply, and
    # nothing acknowledged was lost
    fault("")
    wait_until(lambda: storage_available(coord) == (1, 1), timeout=15, message="the gauge back at 1")
    resumed = submit_when_writes_resume(client)
    assert client.cancel(acked[0])["cancelled"] is True
    states = db_states(coord.db)
    assert {states[job_id][0] for job_id in acked[1:] + [resumed]} == {"QUEUED"}
    assert states[acked[0]][0] == "CANCELLED"
    assert coord.stderr().count("recovered db=") == reloads + 1
    assert coord.stderr().count("writes resumed") == 1


def test_a_forbidden_request_during_an_outage_is_answered_forbidden(coordinator_factory, peers, fault, tmp_path):
    # Given a coordinator with tokens, a client and a reader connected
    path = str(tmp_path / "auth.toml")
    tokens = {role: auth.new_token(path, role, role) for role in ("client", "reader")}
    coord = coordinator_factory(auth_file=path)
    conns = {}
    for role, token in tokens.items():
        conns[role] = peers.raw(coord.client_addr)
        assert conns[role].request({"type": "AUTH", "token": token})["type"] == "AUTH_OK"

    # When the disk fills up
    fault("full")

    def refused():
        reply = conns["client"].request({"type": "SUBMIT_JOB", "taskType": "WORD_COUNT", "payload": {"text": BIG_TEXT}})
        return reply if reply["type"] == "ERROR" else None

    assert wait_until(refused, message="a refused submit")["message"].startswith("storage unavailable: ")

    # Then a request the token may not make is still refused as forbidden (not as a
    # storage error, which a client may take for a reason to retry)
    reply = conns["reader"].request({"type": "SUBMIT_JOB", "taskType": "WORD_COUNT", "payload": {"text": "a"}})
    assert reply["type"] == "ERROR" and reply["message"].startswith("forbidden: "), reply
    assert conns["reader"].request({"type": "LIST_JOBS", "limit": 1})["type"] == "JOB_LIST"


SCHEDULES = """
[nightly]
cron = "0 3 * * *"
task_type = "SLEEP"
payload = { durationMillis = 1 }
"""


def test_a_schedules_file_sighup_during_an_outage_is_not_applied_and_costs_no_reload(coordinator_factory, peers,
                                                                                      fault, tmp_path):
    # Given a coordinator with a schedules file, and storage that has failed
    path = tmp_path / "schedules.toml"
    path.write_text(SCHEDULES)
    coord = coordinator_factory(schedules=str(path))
    client = peers.client(coord)
    reloads = coord.stderr().count("recovered db=")
    fault("readonly")
    assert client.submit("WORD_COUNT", {"text": "a"})["message"].startswith("storage unavailable: ")
    assert coord.stderr().count("recovered db=") == reloads + 1

    # When the file changes and SIGHUP arrives during the outage
    path.write_text(SCHEDULES.replace("nightly", "hourly").replace("0 3", "0 *"))
    coord.proc.send_signal(signal.SIGHUP)

    # Then it is not applied, says so, and costs no second reload
    wait_until(lambda: "schedules file not applied" in coord.stderr(), message="the refusal logged")
    assert "storage unavailable" in coord.stderr().split("schedules file not applied")[1].splitlines()[0]
    assert coord.stderr().count("recovered db=") == reloads + 1
    assert [s["name"] for s in client.request({"type": "SCHEDULE_LIST"})["schedules"]] == ["nightly"]

    # And once storage works, the next SIGHUP applies it
    fault("")
    submit_when_writes_resume(client)
    coord.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: [s["name"] for s in client.request({"type": "SCHEDULE_LIST"})["schedules"]] == ["hourly"],
               message="the file applied")


def test_start_on_a_full_disk_with_a_new_database_is_a_one_line_error(tmp_path, fault):
    fault("full")
    env = child_env()
    env.pop("GEVENT_MONITOR_THREAD_ENABLE", None)  # its warnings would muddy stderr checks
    proc = subprocess.run([sys.executable, ENTRY, "coordinator", "--worker-port=0", "--client-port=0",
                           "--db=%s" % (tmp_path / "new.db")], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=20, env=env)
    assert proc.returncode == 1
    assert "cannot open the database" in proc.stderr and "full" in proc.stderr
    assert "Traceback" not in proc.stderr
