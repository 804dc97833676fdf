"""Restarts that keep running work (CONTRACT.md), with real processes.

A real coordinator on a real SQLite file is killed (SIGKILL) while a real ``jobmesh
worker`` runs a SLEEP; restarted on the same database and worker port with
``--lease-grace-millis``, it lets the worker keep its attempt: the job completes on its
first attempt, under the same attempt id. Without a grace, the seeds' recovery holds:
the attempt is requeued and the worker is told to drop the old one. A coordinator that
stayed up and saw the worker go keeps nothing either. Malformed ``running`` fields are
protocol violations.

A kept lease belongs to the worker that held it: raw sockets with other worker ids, or
with its id and a token that may not run the job's type, name the lease and send a
forged result, and change nothing. A result the worker wrote into a coordinator that
froze and died before applying it is held until acknowledged, and applied after the
restart: the job completes on its first attempt.
"""

from __future__ import annotations

import os
import signal

import pytest

from jobmesh import auth
from jobmesh.client import CoordinatorClient
from tests.support.connections import RawConn
from tests.support.peers import wait_registered
from tests.support.processes import WorkerProc, closed_address
from tests.support.waiting import wait_until
from tests.pg_support import on_both_stores

TASK_MILLIS = 2500


def assigned_attempts(client: CoordinatorClient, job_id: str) -> list[str]:
    return [e["attemptId"] for e in client.events(job_id) if e["event"] == "ASSIGNED"]


def running_job(coordinator_factory, worker_procs, worker_id: str, token: str | None = None,
                worker_flags: tuple[str, ...] = (), millis: int = TASK_MILLIS, **flags):
    """A coordinator and a real worker running a SLEEP's first attempt: (coordinator,
    worker, job id, attempt id). ``token``: the client's (with ``auth_file`` in ``flags``)."""
    coord = coordinator_factory(**flags)
    worker = worker_procs.start(coord, worker_id, capacity=1, extra=worker_flags)
    with CoordinatorClient(*coord.client_addr, token=token) as client:
        wait_registered(client, [worker_id])
        job_id = client.submit("SLEEP", {"durationMillis": millis})
        wait_until(lambda: "task started job=%s" % job_id in worker.log(), timeout=15, message="the task started")
        [attempt_id] = assigned_attempts(client, job_id)
    return coord, worker, job_id, attempt_id


def restart(coord, **flags) -> None:
    """SIGKILL the coordinator, then start it on the same database and worker port."""
    worker_port = coord.worker_addr[1]
    coord.kill()
    coord.flags.update({k.replace("_", "-"): v for k, v in flags.items()})
    coord.start(worker_port=worker_port)


def test_a_killed_coordinator_restarted_with_a_grace_lets_the_worker_keep_its_attempt(coordinator_factory,
                                                                                       worker_procs):
    # Given a real worker running a job's first attempt
    coord, worker, job_id, attempt_id = running_job(coordinator_factory, worker_procs, "w-keep")

    # When the coordinator is killed and restarted on the same database with a grace
    restart(coord, lease_grace_millis=20_000)

    # Then the worker registers again naming its attempt, keeps it, and the job completes
    # on that attempt: attempts 1, the same attempt id, no recovery
    with CoordinatorClient(*coord.client_addr) as client:
        final = client.wait(job_id, timeout=30)
        assert (final["state"], final["attempts"]) == ("COMPLETED", 1), final
        assert final["result"] == {"sleptMillis": TASK_MILLIS}
        assert assigned_attempts(client, job_id) == [attempt_id]
        assert [e["event"] for e in client.events(job_id)] == ["SUBMITTED", "ASSIGNED", "COMPLETED"]
    assert "lease kept job=%s attempt=%s worker=w-keep" % (job_id, attempt_id) in coord.stderr()
    assert "kept=1" in worker.log()


def test_without_a_grace_a_restart_requeues_and_the_worker_drops_the_old_attempt(coordinator_factory,
                                                                                 worker_procs):
    coord, worker, job_id, first = running_job(coordinator_factory, worker_procs, "w-old")

    # When the coordinator restarts with the default (no grace)
    restart(coord)

    # Then the old attempt is recovered (requeued), the worker's claim is answered with a
    # cancel, and the job completes on attempt 2
    with CoordinatorClient(*coord.client_addr) as client:
        final = client.wait(job_id, timeout=30)
        assert (final["state"], final["attempts"]) == ("COMPLETED", 2), final
        names = [e["event"] for e in client.events(job_id)]
        assert names == ["SUBMITTED", "ASSIGNED", "RECOVERED", "ASSIGNED", "COMPLETED"]
        assert assigned_attempts(client, job_id)[0] == first
    wait_until(lambda: "task cancelled job=%s attempt=%s" % (job_id, first) in worker.log(), timeout=10,
               message="the worker dropped the old attempt")


def test_a_coordinator_that_saw_the_worker_go_keeps_nothing(coordinator_factory, worker_procs):
    # Given a real worker running a job, on a coordinator that never restarts
    coord, worker, job_id, first = running_job(coordinator_factory, worker_procs, "w-lost",
                                               lease_grace_millis=20_000)
    with CoordinatorClient(*coord.client_addr) as client:
        # When the worker falls silent long enough to be presumed dead (its lease revoked)
        os.kill(worker.proc.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: "WORKER_LOST" in [e["event"] for e in client.events(job_id)], timeout=15,
                       message="the lease revoked")
        finally:
            os.kill(worker.proc.pid, signal.SIGCONT)

        # Then registering again it keeps nothing: its attempt is cancelled, the job runs again
        final = client.wait(job_id, timeout=30)
        assert (final["state"], final["attempts"]) == ("COMPLETED", 2), final
        assert assigned_attempts(client, job_id)[0] == first
    wait_until(lambda: "task cancelled job=%s attempt=%s" % (job_id, first) in worker.log(), timeout=10,
               message="the worker dropped the revoked attempt")


@pytest.mark.parametrize("running", [
    "not a list", [1], [{"jobId": "j"}], [{"jobId": "j", "attemptId": 7}], [["j", "j.1"]],
    [{"jobId": "j", "attemptId": "j.1"}] * 1025,
])
def test_a_malformed_running_field_is_a_protocol_violation(shared_coordinator, running):
    conn = RawConn(shared_coordinator.worker_addr)
    try:
        conn.send({"type": "WORKER_REGISTER", "workerId": "w-bad", "capacity": 1, "running": running})
        reply = conn.recv()
        assert reply["type"] == "ERROR" and "running" in reply["message"], reply
        assert conn.is_closed()
    finally:
        conn.close()


# ---- a kept lease belongs to the worker that held it ---------------------------------------


def attacker(coord, token: str, worker_id: str, task_types: list[str], running: list[dict] | None) -> RawConn:
    """A raw worker connection: AUTH with ``token``, then WORKER_REGISTER, answered."""
    conn = RawConn(coord.worker_addr)
    assert conn.request({"type": "AUTH", "token": token})["type"] == "AUTH_OK"
    frame = {"type": "WORKER_REGISTER", "workerId": worker_id, "capacity": 4, "taskTypes": task_types}
    if running is not None:
        frame["running"] = running
    assert conn.request(frame) == {"type": "WORKER_REGISTERED", "workerId": worker_id}
    return conn


def gone(coord, worker_id: str) -> bool:
    """Whether the coordinator ended ``worker_id``'s session (closed, or presumed dead)."""
    log = coord.stderr()
    return "worker disconnected worker=%s " % worker_id in log or "worker presumed dead worker=%s " % worker_id in log


def forged_result(worker_id: str, job_id: str, attempt_id: str) -> dict:
    return {"type": "TASK_RESULT", "workerId": worker_id, "jobId": job_id, "attemptId": attempt_id,
            "success": True, "result": {"forged": True}, "error": None}


@on_both_stores
def test_a_kept_lease_is_kept_only_for_its_worker_and_a_type_it_may_run(coordinator_factory, worker_procs,
                                                                        tmp_path):
    # Given tokens: bill's worker token, and two others, one limited to etl.* types
    path = tmp_path / "auth.toml"
    admin = auth.new_token(str(path), "admin", "admin")
    tokens = {name: auth.new_token(str(path), name, "worker", types)
              for name, types in (("bill", None), ("eve", None), ("mallory", ("etl.*",)))}
    token_file = tmp_path / "bill.token"
    token_file.write_text(tokens["bill"] + "\n")
    # and worker bill-1 running a job's first attempt, frozen while its coordinator is
    # killed and restarted with a grace: the job waits on its lease for bill-1
    coord, worker, job_id, attempt_id = running_job(coordinator_factory, worker_procs, "bill-1", token=admin,
                                                    worker_flags=("--token-file=%s" % token_file,),
                                                    millis=1500, auth_file=path)
    os.kill(worker.proc.pid, signal.SIGSTOP)
    try:
        restart(coord, lease_grace_millis=30_000)
        lease = [{"jobId": job_id, "attemptId": attempt_id}]
        opened = []
        try:
            # When others name the lease: another id with a token limited to other types,
            # another id with a token that may run SLEEP, and bill-1's own id with the
            # limited token (a type that session does not declare)
            for name, worker_id, types in (("mallory", "mallory-1", ["etl.load"]), ("eve", "eve-1", ["SLEEP"]),
                                           ("mallory", "bill-1", ["etl.load"])):
                conn = attacker(coord, tokens[name], worker_id, types, lease)
                opened.append(conn)
                # Then each is told to drop it, and its forged result is not applied
                assert conn.recv() == {"type": "TASK_CANCEL", "jobId": job_id, "attemptId": attempt_id}
                conn.send(forged_result(worker_id, job_id, attempt_id))
                wait_until(lambda: coord.stderr().count("stale result dropped job=%s" % job_id) == len(opened),
                           timeout=10, message="the forged result dropped")
                conn.close()
                wait_until(lambda: gone(coord, worker_id), timeout=10, message="the attacker gone")
            # and bill-1's id with the limited token sends a result without naming the lease
            conn = attacker(coord, tokens["mallory"], "bill-1", ["etl.load"], None)
            opened.append(conn)
            conn.send(forged_result("bill-1", job_id, attempt_id))
            wait_until(lambda: coord.stderr().count("stale result dropped job=%s" % job_id) == len(opened),
                       timeout=10, message="the forged result dropped")
            conn.close()
            with CoordinatorClient(*coord.client_addr, token=admin) as client:
                job = client.status(job_id)
                assert (job["state"], job["attempts"], job["workerId"]) == ("RUNNING", 1, "bill-1"), job
        finally:
            for conn in opened:
                conn.close()
        assert "lease kept" not in coord.stderr()
    finally:
        os.kill(worker.proc.pid, signal.SIGCONT)

    # And bill-1, back, keeps its lease and completes the job with its own result
    with CoordinatorClient(*coord.client_addr, token=admin) as client:
        final = client.wait(job_id, timeout=30)
        assert (final["state"], final["attempts"], final["result"]) == ("COMPLETED", 1, {"sleptMillis": 1500}), final
        assert assigned_attempts(client, job_id) == [attempt_id]
    assert "lease kept job=%s attempt=%s worker=bill-1" % (job_id, attempt_id) in coord.stderr()
    assert "task cancelled job=%s" % job_id not in worker.log()


# ---- a result written into a coordinator that froze, then died ------------------------------


def test_a_result_the_coordinator_never_applied_is_applied_after_the_restart(coordinator_factory, tmp_path):
    # Given a real worker with a second address (so it leaves a coordinator that falls
    # silent, and asks for its results to be acknowledged), on a coordinator with a grace
    coord = coordinator_factory(lease_grace_millis=30_000, heartbeat_timeout_millis=5000)
    worker = WorkerProc(tmp_path, "%s,%s" % (coord.worker_target, closed_address()), "w-held", capacity=1,
                        heartbeat_millis=1000).start()
    try:
        wait_until(lambda: "coordinator answers heartbeats" in worker.log(), timeout=30,
                   message="heartbeats answered")
        with CoordinatorClient(*coord.client_addr) as client:
            job_id = client.submit("SLEEP", {"durationMillis": 300})
            wait_until(lambda: "task started job=%s" % job_id in worker.log(), timeout=15, message="the task started")
            [attempt_id] = assigned_attempts(client, job_id)
        # When the coordinator freezes while the task runs: the result goes into the frozen
        # process's socket, the worker leaves it (three silent heartbeats), and it dies
        os.kill(coord.proc.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: "coordinator silent" in worker.log(), timeout=30, message="the worker left")
            log = worker.log()
            assert log.index("task finished job=%s" % job_id) < log.index("coordinator silent"), "finished late"
        finally:
            restart(coord, lease_grace_millis=30_000)

        # Then the worker names the result it still holds, and sends it again: the job
        # completes on its first attempt, nothing runs twice
        with CoordinatorClient(*coord.client_addr) as client:
            final = client.wait(job_id, timeout=30)
            assert (final["state"], final["attempts"], final["result"]) == ("COMPLETED", 1, {"sleptMillis": 300})
            assert [e["event"] for e in client.events(job_id)] == ["SUBMITTED", "ASSIGNED", "COMPLETED"]
        assert "lease kept job=%s attempt=%s worker=w-held" % (job_id, attempt_id) in coord.stderr()
        assert worker.count("task started job=%s" % job_id) == 1
    finally:
        worker.cleanup()
