"""Restarts that keep running work (CONTRACT.md), with real processes.

A real coordinator on a real SQLite file is killed (SIGKILL) while a real ``jobmesh
worker`` runs a SLEEP; restarted on the same database and worker port with
``--lease-grace-millis``, it lets the worker keep its attempt: the job completes on its
first attempt, under the same attempt id. Without a grace, the seeds' recovery holds:
the attempt is requeued and the worker is told to drop the old one. A coordinator that
stayed up and saw the worker go keeps nothing either. Malformed ``running`` fields are
protocol violations.
"""

from __future__ import annotations

import os
import signal

import pytest

from jobmesh.client import CoordinatorClient
from tests.helpers import RawConn, wait_registered, wait_until

TASK_MILLIS = 2500


def assigned_attempts(client: CoordinatorClient, job_id: str) -> list[str]:
    return [e["attemptId"] for e in client.events(job_id) if e["event"] == "ASSIGNED"]


def running_job(coordinator_factory, worker_procs, worker_id: str, **flags):
    """A coordinator and a real worker running a SLEEP's first attempt: (coordinator,
    worker, job id, attempt id)."""
    coord = coordinator_factory(**flags)
    worker = worker_procs.start(coord, worker_id, capacity=1)
    with CoordinatorClient(*coord.client_addr) as client:
        wait_registered(client, [worker_id])
        job_id = client.submit("SLEEP", {"durationMillis": TASK_MILLIS})
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
def test_a_malformed_running_field_is_a_protocol_violation(coordinator, running):
    conn = RawConn(coordinator.worker_addr)
    try:
        conn.send({"type": "WORKER_REGISTER", "workerId": "w-bad", "capacity": 1, "running": running})
        reply = conn.recv()
        assert reply["type"] == "ERROR" and "running" in reply["message"], reply
        assert conn.is_closed()
    finally:
        conn.close()
