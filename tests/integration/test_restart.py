"""Coordinator restart and recovery (ARCHITECTURE.md "Persistence and recovery"; CoordinatorRestartIT).

After a crash (SIGKILL) or a graceful stop (SIGTERM, exit 0) the coordinator restarts on
the same database: every acknowledged job is there; RUNNING jobs are requeued if budget
remains (fresh lease, fresh deadline) or failed with a "restarted" error on their final
attempt; QUEUED, RETRY_WAIT and terminal jobs load as they were; idempotency keys, base
priorities and submission order survive; pre-deadline / pre-priority databases migrate.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid

import pytest

from tests.pg_support import on_both_stores
from tests.support.waiting import assert_stays, wait_until

STOPS = ["kill", "terminate"]


def stop(coord, how: str) -> None:
    if how == "kill":
        coord.kill()
    else:
        assert coord.terminate() == 0, coord.stderr()[-3000:]


@on_both_stores
@pytest.mark.parametrize("how", STOPS)
def test_every_job_state_survives_a_restart(coordinator_factory, peers, how):
    # Given a long retry backoff (so RETRY_WAIT lasts through the restart) and one of each kind of job
    coord = coordinator_factory(retry_base_millis=60_000, retry_cap_millis=60_000)
    client = peers.client(coord)
    w1 = peers.worker(coord, "w-old-1", capacity=1)

    done = client.submit_ok("SHA256", {"text": "a"}, max_attempts=2)             # -> COMPLETED
    a = w1.await_assign()
    w1.complete(a, {"sha256": "x" * 64})
    client.wait_state(done, "COMPLETED")

    cancelled = client.submit_ok("SLEEP", {"durationMillis": 5}, priority="LOW")  # -> CANCELLED (was RUNNING)
    w1.await_assign()
    assert client.cancel(cancelled)["cancelled"] is True
    w1.await_cancel()

    waiting = client.submit_ok("FAIL", {"failUntilAttempt": 9}, max_attempts=3)  # -> RETRY_WAIT
    w1.fail(w1.await_assign(), "first try failed")
    client.wait_state(waiting, "RETRY_WAIT")

    failed = client.submit_ok("FAIL", {"failUntilAttempt": 9}, max_attempts=1)   # -> FAILED
    w1.fail(w1.await_assign(), "only try failed")
    client.wait_state(failed, "FAILED")

    final = client.submit_ok("SLEEP", {"durationMillis": 6}, max_attempts=1)     # RUNNING, final attempt
    final_assign = w1.await_assign()
    assert final_assign["jobId"] == final
    w2 = peers.worker(coord, "w-old-2", capacity=1)
    running = client.submit_ok("SLEEP", {"durationMillis": 7}, max_attempts=3, priority="HIGH")  # RUNNING 1/3
    running_assign = w2.await_assign()
    assert running_assign["jobId"] == running
    q1 = client.submit_ok("WORD_COUNT", {"text": "one"}, priority="LOW")          # QUEUED
    q2 = client.submit_ok("WORD_COUNT", {"text": "two"})                          # QUEUED
    keyed = client.submit_ok("WORD_COUNT", {"text": "keyed"}, idempotencyKey="restart-key")  # QUEUED

    ids = [done, cancelled, waiting, failed, final, running, q1, q2, keyed]
    before = {job_id: client.status(job_id) for job_id in ids}
    assert before[running]["state"] == "RUNNING" and before[final]["state"] == "RUNNING"

    # When the coordinator stops (crash or graceful) and starts again on the same database
    stop(coord, how)
    for p in (w1, w2, client):
        p.close()
    coord.start()
    client = peers.client(coord)
    after = {job_id: client.status(job_id) for job_id in ids}

    # Then terminal, RETRY_WAIT and QUEUED jobs are exactly as they were (a QUEUED job's
    # waiting reason follows the workers: busy before, none connected after)
    for job_id in (done, cancelled, failed, q1, q2, keyed, waiting):
        was, now = dict(before[job_id]), dict(after[job_id])
        if was["state"] == "QUEUED":  # its reason named the workers of the time; none are connected now
            assert was.pop("waitingReason") in ("WORKERS_BUSY", "BEHIND_OTHER_JOBS")
            assert now.pop("waitingReason") == "NO_WORKER"
        assert now == was, (job_id, was, now)

    # And the RUNNING job with budget left is requeued, keeping its history and priority
    r = after[running]
    assert (r["state"], r["attempts"], r["workerId"], r["priority"], r["maxAttempts"]) == (
        "QUEUED", 1, None, "HIGH", 3)
    assert r["createdAtMillis"] == before[running]["createdAtMillis"]

    # And the RUNNING job on its final attempt is FAILED with an error that mentions the restart
    f = after[final]
    assert (f["state"], f["attempts"], f["workerId"], f["result"]) == ("FAILED", 1, None, None)
    assert f["error"] and "restart" in f["error"].lower(), f["error"]

    # And the idempotency key still maps to the same job
    assert client.submit("WORD_COUNT", {"text": "keyed"}, idempotencyKey="restart-key") == {
        "type": "JOB_SUBMITTED", "jobId": keyed}

    # And a new submission gets a new id and sorts after every recovered job of its level
    fresh = client.submit_ok("WORD_COUNT", {"text": "fresh"})
    assert fresh not in ids

    # When a new worker joins
    w3 = peers.worker(coord, "w-new", capacity=1)
    order = []
    for _ in range(5):
        assign = w3.await_assign()
        order.append(assign["jobId"])
        if assign["jobId"] == running:
            # Then the requeued job gets a fresh lease and attempt number 2
            assert assign["attemptId"] not in (running_assign["attemptId"],)
            assert assign["attemptNumber"] == 2
            assert assign["payload"] == {"durationMillis": 7}
        w3.complete(assign, {"ok": True})
    # HIGH first, then NORMAL in submission order (new after recovered), then LOW
    assert order == [running, q2, keyed, fresh, q1]
    assert client.wait_state(running, "COMPLETED")["attempts"] == 2
    # And the RETRY_WAIT job was not run early, the terminal ones never again
    assert client.status(waiting)["state"] == "RETRY_WAIT"
    assert w3.poll_assign(0.2) is None


@on_both_stores
@pytest.mark.parametrize("how", STOPS)
def test_every_acknowledged_submission_survives(coordinator_factory, peers, how):
    # Given a burst of submissions, each acknowledged with JOB_SUBMITTED
    coord = coordinator_factory()
    client = peers.client(coord)
    ids = [client.submit_ok("SLEEP", {"durationMillis": i}) for i in range(40)]

    # When the coordinator stops right after the last acknowledgement and restarts
    stop(coord, how)
    client.close()
    coord.start()
    client = peers.client(coord)

    # Then every acknowledged job is there, QUEUED, with its payload intact (seen through assignment)
    listed = client.list_jobs(limit=1000)["jobs"]
    assert sorted(j["jobId"] for j in listed) == sorted(ids)
    for job_id in ids:
        assert client.status(job_id)["state"] == "QUEUED"
    worker = peers.worker(coord, "w-after", capacity=40)
    payloads = {}
    for _ in ids:
        a = worker.await_assign()
        payloads[a["jobId"]] = a["payload"]["durationMillis"]
    assert payloads == {job_id: i for i, job_id in enumerate(ids)}
    # And jobIds stay unique for the life of the database: new ones never reuse old ones
    new_ids = [client.submit_ok("SLEEP", {"durationMillis": i}) for i in range(40)]
    assert len(set(new_ids)) == 40 and not set(new_ids) & set(ids)


def test_graceful_stop_exits_zero_and_leaves_running_jobs_for_recovery(coordinator_factory, peers):
    # Given a RUNNING job whose worker is still connected when SIGTERM arrives
    coord = coordinator_factory()
    client = peers.client(coord)
    worker = peers.worker(coord, "w-term", capacity=1)
    job_id = client.submit_ok("SLEEP", {"durationMillis": 1}, max_attempts=2)
    first = worker.await_assign()

    # When the coordinator is stopped gracefully
    assert coord.terminate() == 0
    # Then closing the worker's connection on the way out did not consume the attempt as a failure:
    # after restart the job is QUEUED (requeued), not RETRY_WAIT or FAILED
    worker.close()
    client.close()
    coord.start()
    client = peers.client(coord)
    snap = client.status(job_id)
    assert (snap["state"], snap["attempts"]) == ("QUEUED", 1), snap
    w2 = peers.worker(coord, "w-term-2", capacity=1)
    second = w2.await_assign()
    assert second["jobId"] == job_id and second["attemptId"] != first["attemptId"]
    assert second["attemptNumber"] == 2


def test_a_restart_discards_the_old_deadline(coordinator_factory, peers):
    # Given a 1200 ms execution deadline and a RUNNING job
    coord = coordinator_factory(task_timeout_millis=1200)
    client = peers.client(coord)
    worker = peers.worker(coord, "w-dl", capacity=1)
    job_id = client.submit_ok("SLEEP", {"durationMillis": 1}, max_attempts=3)
    first = worker.await_assign()
    t_first = time.monotonic()

    # When the coordinator crashes and restarts after the old deadline has passed
    coord.kill()
    worker.close()
    client.close()
    time.sleep(max(0.0, 1.3 - (time.monotonic() - t_first)))
    coord.start()
    client = peers.client(coord)
    assert client.status(job_id)["state"] == "QUEUED"

    # Then the fresh assignment gets a fresh deadline: it is not revoked straight away
    w2 = peers.worker(coord, "w-dl-2", capacity=1)
    second = w2.await_assign()
    assert second["attemptId"] != first["attemptId"]
    assert w2.poll_cancel(0.8) is None
    assert client.status(job_id)["state"] == "RUNNING"
    # And it is revoked once the fresh deadline passes
    cancel = w2.await_cancel(timeout=3)
    assert cancel["attemptId"] == second["attemptId"]


@on_both_stores
def test_late_result_from_before_the_restart_is_stale(coordinator_factory, peers):
    # Given a RUNNING job whose coordinator crashed and came back
    coord = coordinator_factory()
    client = peers.client(coord)
    worker = peers.worker(coord, "w-pre", capacity=1)
    job_id = client.submit_ok("SLEEP", {"durationMillis": 1}, max_attempts=3)
    old = worker.await_assign()
    coord.kill()
    worker.close()
    client.close()
    coord.start()
    client = peers.client(coord)

    # When the old worker reconnects and reports the pre-restart attempt
    back = peers.worker(coord, "w-pre", capacity=1)
    new = back.await_assign()
    assert new["jobId"] == job_id and new["attemptId"] != old["attemptId"]
    back.complete(old, {"sleptMillis": 999})

    # Then that result is stale: the job is still RUNNING the new attempt
    assert_stays(lambda: client.status(job_id)["state"] == "RUNNING", 0.2, message="still RUNNING")
    back.complete(new, {"sleptMillis": 1})
    assert client.wait_state(job_id, "COMPLETED")["result"] == {"sleptMillis": 1}


# ---- legacy databases ------------------------------------------------------------------------------

# The coordinator's v1 job table (jobmesh/coordinator/store.py), without the columns later
# milestones added: execution_timeout and deadline (lease-deadline PR), priority and seq.
LEGACY_V1 = """
CREATE TABLE jobs (
    job_id TEXT PRIMARY KEY,
    task_type TEXT NOT NULL,
    payload TEXT NOT NULL,
    state TEXT NOT NULL,
    attempts INTEGER NOT NULL,
    max_attempts INTEGER NOT NULL,
    worker_id TEXT,
    attempt_id TEXT,
    result TEXT,
    error TEXT,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL,
    retry_at INTEGER,
    idempotency_key TEXT
)
"""
LEGACY_V2_EXTRA = ["ALTER TABLE jobs ADD COLUMN execution_timeout INTEGER",
                   "ALTER TABLE jobs ADD COLUMN deadline INTEGER"]


def build_legacy_db(path, version: str, now_ms: int) -> dict:
    """Write a pre-priority database by hand; returns the job ids by role."""
    ids = {role: "legacy-%s-%s" % (role, uuid.uuid4().hex[:6]) for role in
           ("q1", "running", "q2", "retry", "done", "keyed")}
    # role -> (state, attempts, max, worker, attempt, result, error, created offset, retry_at, key)
    rows = {
        "q2": ("QUEUED", 0, 3, None, None, None, None, -3000, None, None),
        "done": ("COMPLETED", 1, 3, None, None, {"words": 2}, None, -9000, None, None),
        "q1": ("QUEUED", 0, 3, None, None, None, None, -5000, None, None),
        "retry": ("RETRY_WAIT", 1, 3, None, None, None, "old failure", -2000, now_ms - 1000, None),
        "running": ("RUNNING", 1, 3, "gone-worker", "gone-attempt", None, None, -4000, None, None),
        "keyed": ("QUEUED", 0, 2, None, None, None, None, -1000, None, "legacy-key"),
    }
    db = sqlite3.connect(str(path))
    db.execute(LEGACY_V1)
    if version == "v2":
        for stmt in LEGACY_V2_EXTRA:
            db.execute(stmt)
    # Inserted in an order unrelated to creation time, so row order cannot stand in for it.
    for role, (state, attempts, max_attempts, worker, attempt, result, error, offset, retry_at, key) in rows.items():
        db.execute(
            "INSERT INTO jobs (job_id, task_type, payload, state, attempts, max_attempts, worker_id, attempt_id,"
            " result, error, created_at, updated_at, retry_at, idempotency_key)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (ids[role], "WORD_COUNT", json.dumps({"text": "legacy %s" % role}), state, attempts, max_attempts,
             worker, attempt, json.dumps(result) if result is not None else None, error, now_ms + offset,
             now_ms + offset + 10, retry_at, key))
    db.commit()
    db.close()
    return ids


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_legacy_database_migrates_and_runs(coordinator_factory, peers, tmp_path, version):
    # Given a database written before the deadline/priority milestones
    from tests.support.processes import CoordinatorProc
    db_path = tmp_path / ("legacy-%s.db" % version)
    now_ms = int(time.time() * 1000)
    ids = build_legacy_db(db_path, version, now_ms)

    # When the coordinator starts on it
    coord = CoordinatorProc(tmp_path, db=db_path, name="legacy-%s" % version)
    try:
        coord.start()
        client = peers.client(coord)

        # Then every row loads, at NORMAL priority
        for role, job_id in ids.items():
            snap = client.status(job_id)
            assert snap["priority"] == "NORMAL", snap
            assert snap["taskType"] == "WORD_COUNT"
        assert client.status(ids["done"])["state"] == "COMPLETED"
        assert client.status(ids["done"])["result"] == {"words": 2}
        # and the RUNNING row (its worker long gone) is requeued
        running = client.status(ids["running"])
        assert (running["state"], running["attempts"], running["workerId"]) == ("QUEUED", 1, None)
        # and the legacy idempotency key still resolves
        assert client.submit("WORD_COUNT", {"text": "legacy keyed"}, max_attempts=2,
                             idempotencyKey="legacy-key") == {"type": "JOB_SUBMITTED", "jobId": ids["keyed"]}

        # and the RETRY_WAIT row, already due, is promoted by the sweep, keeping its history
        promoted = client.wait_state(ids["retry"], "QUEUED", timeout=3)
        assert (promoted["attempts"], promoted["error"]) == (1, "old failure")

        # And a new submission sorts after the legacy rows (which share sequence 0)
        fresh = client.submit_ok("WORD_COUNT", {"text": "new"})

        # When a worker joins, everything runs: legacy rows in creation-time order, then the new job
        worker = peers.worker(coord, "w-legacy", capacity=1)
        order = []
        for _ in range(6):
            a = worker.await_assign()
            order.append(a["jobId"])
            worker.complete(a, {"words": 1})
        assert order == [ids["q1"], ids["running"], ids["q2"], ids["retry"], ids["keyed"], fresh], order
        for role in ("q1", "running", "q2", "retry", "keyed"):
            assert client.wait_state(ids[role], "COMPLETED")["priority"] == "NORMAL"
        assert client.status(ids["retry"])["error"] == "old failure"
        assert client.status(ids["running"])["attempts"] == 2
    finally:
        coord.cleanup()


def test_sigint_stops_gracefully_too(coordinator_factory, peers):
    # CONTRACT.md: SIGTERM and SIGINT stop it gracefully (exit 0)
    import signal
    coord = coordinator_factory()
    client = peers.client(coord)
    job_id = client.submit_ok("SLEEP", {"durationMillis": 1})
    coord.proc.send_signal(signal.SIGINT)
    assert coord.proc.wait(10) == 0, coord.stderr()[-3000:]
    client.close()
    coord.start()
    assert peers.client(coord).status(job_id)["state"] == "QUEUED"


@on_both_stores
def test_admission_count_is_rebuilt_on_restart(coordinator_factory, peers):
    # Given --max-active-jobs=3: two active jobs, one RUNNING on its final attempt, one finished
    coord = coordinator_factory(max_active_jobs=3)
    client = peers.client(coord)
    worker = peers.worker(coord, "w-count", capacity=1)
    done = client.submit_ok("SLEEP", {"durationMillis": 1})
    worker.complete(worker.await_assign(), {"sleptMillis": 1})
    client.wait_state(done, "COMPLETED")
    final = client.submit_ok("SLEEP", {"durationMillis": 1}, max_attempts=1)
    worker.await_assign()
    q1 = client.submit_ok("SLEEP", {"durationMillis": 1})
    q2 = client.submit_ok("SLEEP", {"durationMillis": 1})
    assert client.submit("SLEEP", {"durationMillis": 1})["type"] == "SUBMIT_REJECTED"

    # When the coordinator crashes and restarts (the final-attempt job fails on recovery)
    coord.kill()
    worker.close()
    client.close()
    coord.start()
    client = peers.client(coord)
    assert client.status(final)["state"] == "FAILED"

    # Then the active count is the two QUEUED jobs: one more is admitted, the next is rejected
    third = client.submit_ok("SLEEP", {"durationMillis": 1})
    reply = client.submit("SLEEP", {"durationMillis": 1})
    assert reply["type"] == "SUBMIT_REJECTED", reply
    assert (reply["activeCount"], reply["limit"]) == (3, 3)
    assert {j["jobId"] for j in client.list_jobs()["jobs"]} == {done, final, q1, q2, third}


@on_both_stores
def test_recovery_decisions_are_durable(coordinator_factory, peers):
    # Given a job failed by recovery (RUNNING on its final attempt at the crash)
    coord = coordinator_factory()
    client = peers.client(coord)
    worker = peers.worker(coord, "w-dur", capacity=1)
    job_id = client.submit_ok("SLEEP", {"durationMillis": 1}, max_attempts=1)
    worker.await_assign()
    coord.kill()
    worker.close()
    client.close()
    coord.start()
    client = peers.client(coord)
    failed = client.status(job_id)
    assert failed["state"] == "FAILED"
    # When the coordinator crashes again and restarts
    coord.kill()
    client.close()
    coord.start()
    # Then the job is still FAILED with the same error and timestamp: the decision was persisted
    assert peers.client(coord).status(job_id) == failed


@on_both_stores
def test_a_graceful_stop_under_load_answers_or_closes_and_keeps_every_acknowledged_job(
        coordinator_factory, peers):
    # Given 20 clients submitting in pipelined bursts of 10 while the coordinator runs
    import threading

    from jobmesh.protocol.framing import encode_frame
    from tests.support.connections import RawConn

    coord = coordinator_factory()
    acknowledged: list[str] = []
    other: list[dict] = []
    lock = threading.Lock()
    burst = b"".join(encode_frame({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 1}})
                     for _ in range(10))

    def client() -> None:
        conn = RawConn(coord.client_addr)
        try:
            while True:
                conn.send_raw(burst)
                for _ in range(10):
                    reply = conn.recv()
                    if reply is None:
                        return
                    with lock:
                        (acknowledged.append(reply["jobId"]) if reply["type"] == "JOB_SUBMITTED"
                         else other.append(reply))
        except OSError:
            return  # reset by the stopping coordinator
        finally:
            conn.close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(20)]
    for t in threads:
        t.start()
    wait_until(lambda: len(acknowledged) >= 200, timeout=30, message="the load under way")
    # When it is stopped with SIGTERM in the middle of that
    assert coord.terminate() == 0, coord.stderr()[-3000:]
    # Then every client finishes: each request was answered, refused as shutting down,
    # or its connection closed; nothing hangs
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert acknowledged
    assert all(r["type"] == "ERROR" and "shutting down" in r["message"] for r in other), other[:3]
    # And after a restart every acknowledged job is there
    coord.start()
    checker = peers.client(coord)
    missing = [j for j in acknowledged if checker.request({"type": "GET_JOB_STATUS", "jobId": j})["type"] != "JOB_STATUS"]
    assert not missing, "%d of %d acknowledged jobs lost" % (len(missing), len(acknowledged))
    assert len(set(acknowledged)) == len(acknowledged)
