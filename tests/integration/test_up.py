"""``jobmesh up`` as a subprocess: starts, runs jobs, restarts workers, stops cleanly.

Child pids are read from up's log ("worker started ... pid=N", "coordinator_pid=N") so
the test can check none is left behind and kill any that would be, by pid.
"""

from __future__ import annotations

import os
import re
import signal

import pytest

from jobmesh.client import CoordinatorClient
from tests.support.cli import UpProc, assert_all_gone
from tests.support.peers import wait_registered
from tests.support.processes import alive
from tests.support.waiting import wait_until


@pytest.mark.parametrize("how", ["SIGTERM to up", "SIGINT to the process group (Ctrl-C)"])
def test_up_runs_jobs_and_stops_cleanly(start_up, how):
    # Given jobmesh up with two workers
    up = start_up("--workers=2", "--capacity=2", new_session=how.startswith("SIGINT"))
    with CoordinatorClient(*up.client_addr) as client:
        wait_registered(client, ["local-1", "local-2"])

        # When a job is submitted, it runs
        job_id = client.submit("PRIME_COUNT", {"limit": 100_000})
        assert client.wait(job_id, timeout=10)["result"] == {"primes": 9592}
    assert len(up.worker_pids()) == 2
    # the workers beat often enough for the unit's --heartbeat-timeout-millis=1500
    assert "presumed dead" not in up.log()

    # Then a stop signal ends everything with exit 0 and no child left
    if how.startswith("SIGTERM"):
        up.proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(up.proc.pid, signal.SIGINT)
    assert up.proc.wait(12) == 0, up.log()
    assert_all_gone(up)
    # and a clean stop is quiet: no socket error, nothing above INFO
    assert "Errno" not in up.log() and "Traceback" not in up.log(), up.log()
    assert not [line for line in up.log().splitlines() if " WARNING " in line or " ERROR " in line], up.log()


def test_up_on_a_database_in_use_says_the_coordinator_exit_code(tmp_path, coordinator_factory):
    # Given a coordinator holding the database up is given
    coordinator_factory(db=tmp_path / "up.db")
    up = UpProc(tmp_path, "--workers=1")
    try:
        assert up.proc.wait(30) == 1
        assert "coordinator did not start rc=1" in up.log(), up.log()
    finally:
        up.cleanup()


def test_up_restarts_a_dead_worker(start_up):
    up = start_up("--workers=1", "--capacity=1")
    with CoordinatorClient(*up.client_addr) as client:
        wait_registered(client, ["local-1"])
        first = up.worker_pids()["local-1"]

        # When the worker is killed
        os.kill(first, signal.SIGKILL)

        # Then up starts a new one under the same id, which runs new work
        wait_until(lambda: up.worker_pids()["local-1"] != first, timeout=10, message="worker restarted")
        assert "worker exited worker=local-1" in up.log()
        wait_registered(client, ["local-1"])
        job_id = client.submit("SHA256", {"text": "again"})
        assert client.wait(job_id, timeout=10)["state"] == "COMPLETED"
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(12) == 0
    assert_all_gone(up)


def test_up_restarts_a_dead_coordinator_and_the_running_job_keeps_its_first_attempt(start_up):
    # Given up (its coordinator keeps leases for a grace) with a worker running a job
    up = start_up("--workers=1", "--capacity=1", "--lease-grace-millis=20000")
    with CoordinatorClient(*up.client_addr) as client:
        wait_registered(client, ["local-1"])
        job_id = client.submit("SLEEP", {"durationMillis": 2500})
        wait_until(lambda: client.status(job_id)["state"] == "RUNNING", timeout=10, message="the job running")
    worker = up.worker_pids()["local-1"]
    first = up.coordinator_pid()

    # When its coordinator is killed
    os.kill(first, signal.SIGKILL)

    # Then up starts it again, on the same client port, and the job completes on its first attempt
    restarted = int(wait_until(lambda: re.search(r"coordinator restarted pid=(\d+)", up.log()), timeout=20,
                               message="the coordinator restarted")[1])
    up.seen_pids.add(restarted)
    assert "coordinator exited pid=%d" % first in up.log()
    wait_until(lambda: up.out_path.read_text().count("jobmesh coordinator listening") == 2, timeout=20,
               message="the restarted coordinator listening")
    with CoordinatorClient(*up.client_addr) as client:
        final = client.wait(job_id, timeout=30)
        assert (final["state"], final["attempts"]) == ("COMPLETED", 1), final
        assert [e["event"] for e in client.events(job_id)] == ["SUBMITTED", "ASSIGNED", "COMPLETED"]
    assert up.worker_pids()["local-1"] == worker  # the worker rode it out
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(15) == 0, up.log()
    assert_all_gone(up)


def test_children_stop_when_up_itself_is_killed(start_up):
    # Given a running unit
    up = start_up("--workers=2", "--capacity=1")
    with CoordinatorClient(*up.client_addr) as client:
        wait_registered(client, ["local-1", "local-2"])
    pids = set(up.worker_pids().values()) | {up.coordinator_pid()}

    # When up dies without a chance to clean up
    up.proc.kill()
    up.proc.wait(5)

    # Then the kernel's parent-death signal stops every child anyway (Linux)
    wait_until(lambda: not any(alive(pid) for pid in pids), timeout=10, message="children gone")
