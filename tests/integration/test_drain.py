"""Graceful drain (docs/FAILURE_MODEL.md, "Stopping things on purpose"): a stop signal
assigns nothing more and lets running attempts finish for up to --drain-millis; a
second signal stops at once."""

from __future__ import annotations

import os
import signal
import sqlite3
import time

from jobmesh.client import CoordinatorClient
from tests.support.cli import assert_all_gone
from tests.support.peers import wait_registered
from tests.support.waiting import wait_until


def db_job(db, job_id: str) -> tuple[str, int]:
    with sqlite3.connect(str(db)) as conn:
        return conn.execute("SELECT state, attempts FROM jobs WHERE job_id=?", (job_id,)).fetchone()


def running_sleep(up, millis: int) -> str:
    with CoordinatorClient(*up.client_addr) as client:
        wait_registered(client, ["local-1"])
        job_id = client.submit("SLEEP", {"durationMillis": millis})
        wait_until(lambda: client.status(job_id)["state"] == "RUNNING", message="job running")
    return job_id


def test_ctrl_c_lets_the_running_attempt_finish_before_up_exits(start_up, tmp_path):
    # Given jobmesh up (default --drain-millis=10000) running a 1.5 s SLEEP
    up = start_up("--workers=1", "--capacity=1", new_session=True)
    job_id = running_sleep(up, 1500)
    # When Ctrl-C reaches up's process group
    os.killpg(up.proc.pid, signal.SIGINT)
    # Then up exits 0 only after the job completed on its first attempt
    assert up.proc.wait(15) == 0, up.log()[-3000:]
    assert db_job(tmp_path / "up.db", job_id) == ("COMPLETED", 1)
    assert "drained: no attempt is running" in up.log()
    assert_all_gone(up)


def test_a_second_ctrl_c_during_the_drain_stops_at_once(start_up, tmp_path):
    up = start_up("--workers=1", "--capacity=1", new_session=True)
    job_id = running_sleep(up, 8000)
    os.killpg(up.proc.pid, signal.SIGINT)
    wait_until(lambda: "draining: no new assignments" in up.log(), message="the drain started")
    os.killpg(up.proc.pid, signal.SIGINT)
    assert up.proc.wait(10) == 0, up.log()[-3000:]
    # up did not wait for the attempt, which ends well within the drain time: it stays
    # RUNNING on disk, for recovery to requeue, and the drain neither ended nor timed out
    assert db_job(tmp_path / "up.db", job_id) == ("RUNNING", 1)
    assert "drained: no attempt is running" not in up.log()
    assert "drain time passed" not in up.log()
    assert_all_gone(up)


def test_coordinator_drain_assigns_nothing_new_and_waits_for_the_running_attempt(coordinator_factory, peers):
    # Given a coordinator with --drain-millis and a worker running one job
    coord = coordinator_factory(drain_millis=10_000)
    client = peers.client(coord)
    worker = peers.worker(coord, "w-drain", capacity=2)
    first = client.submit_ok("SLEEP", {"durationMillis": 1})
    assign = worker.await_assign()
    # When it is told to stop
    coord.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "draining: no new assignments" in coord.stderr(), message="the drain started")
    # Then it still answers, but a new job is not assigned although the worker has room
    later = client.submit_ok("SLEEP", {"durationMillis": 1})
    assert worker.poll_assign(0.3) is None
    assert coord.proc.poll() is None
    # And once the running attempt reports, it stops (exit 0) with the job COMPLETED
    worker.complete(assign, {"sleptMillis": 1})
    assert coord.proc.wait(10) == 0
    assert db_job(coord.db, first) == ("COMPLETED", 1)
    assert db_job(coord.db, later) == ("QUEUED", 0)


def test_coordinator_drain_ends_when_its_time_passes(coordinator_factory, peers):
    coord = coordinator_factory(drain_millis=300)
    client = peers.client(coord)
    worker = peers.worker(coord, "w-slow")
    job_id = client.submit_ok("SLEEP", {"durationMillis": 60_000})
    worker.await_assign()
    began = time.monotonic()
    coord.proc.send_signal(signal.SIGTERM)
    assert coord.proc.wait(10) == 0
    assert time.monotonic() - began >= 0.3  # the drain time, not less
    # It stopped when the drain time passed, not when the minute-long attempt ended
    assert "drain time passed with 1 attempts still running" in coord.stderr()
    assert db_job(coord.db, job_id) == ("RUNNING", 1)
