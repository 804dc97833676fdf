"""Address lists (``--coordinator=A,B``, JOBMESH_COORDINATOR) against real coordinators:
a closed port stands for a standby (it opens no job ports, so connecting is refused)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import threading
from types import SimpleNamespace

from jobmesh.client import CoordinatorClient
from jobmesh.protocol.framing import FrameReader
from tests.support.cli import run_cli
from tests.support.connections import RawConn
from tests.support.peers import wait_registered
from tests.support.processes import closed_address
from tests.support.waiting import wait_until


def listed(*targets: str) -> SimpleNamespace:
    """What ``worker_procs.start`` takes: here, a list of worker ports."""
    return SimpleNamespace(worker_target=",".join(targets))


def test_a_worker_and_the_cli_given_a_dead_address_first_use_the_live_one(coordinator, worker_procs):
    # Given a real worker told a closed port first, then the coordinator's worker port
    worker_procs.start(listed(closed_address(), coordinator.worker_target), "w-list")
    # When the CLI, told a closed port first too, submits a job and waits for it
    done = run_cli("submit", "SHA256", '{"text": "abc"}', "--wait", "--json",
                   coordinator="%s,%s" % (closed_address(), coordinator.client_target))
    # Then the worker ran it and the CLI printed its end
    assert done.returncode == 0, done
    job = json.loads(done.stdout)
    assert job["state"] == "COMPLETED" and job["result"] == {"sha256": hashlib.sha256(b"abc").hexdigest()}


def test_jobmesh_coordinator_names_the_addresses_and_a_flag_beats_it(shared_coordinator):
    coordinator = shared_coordinator
    both = "%s,%s" % (closed_address(), coordinator.client_target)
    done = run_cli("submit", "SLEEP", '{"durationMillis": 1}', "--json", env={"JOBMESH_COORDINATOR": both})
    assert done.returncode == 0, done
    job_id = json.loads(done.stdout)["jobId"]
    done = run_cli("status", job_id, "--json", coordinator=coordinator.client_target,
                   env={"JOBMESH_COORDINATOR": closed_address()})
    assert done.returncode == 0 and json.loads(done.stdout)["jobId"] == job_id, done


def test_a_worker_on_a_list_registers_with_the_second_coordinator_when_the_first_dies(coordinator_factory,
                                                                                       worker_procs, tmp_path):
    # Given two coordinators (each on its own database) and a worker given both
    first = coordinator_factory()
    second = coordinator_factory(db=tmp_path / "second.db")
    worker_procs.start(listed(first.worker_target, second.worker_target), "w-move")
    with CoordinatorClient(*first.client_addr, timeout=10) as client:
        wait_registered(client, ["w-move"])
    # When the first dies
    first.kill()
    # Then the worker registers with the second and runs its jobs
    with CoordinatorClient(*second.client_addr, timeout=10) as client:
        wait_registered(client, ["w-move"], timeout=20)
        job_id = client.submit("SLEEP", {"durationMillis": 1})
        assert client.wait(job_id, timeout=20)["state"] == "COMPLETED"


def test_every_address_dead_is_one_line_naming_each_and_exit_3(worker_procs):
    a, b = closed_address(), closed_address()
    done = run_cli("workers", coordinator="%s,%s" % (a, b))
    assert done.returncode == 3, done
    assert done.stderr == ("jobmesh workers: coordinator unreachable: cannot connect to %s: Connection refused; "
                           "%s: Connection refused\n" % (a, b))
    # and a worker says so in one line each round, and keeps trying
    worker = worker_procs.start(listed(a, b), "w-nowhere")
    line = wait_until(lambda: next((l for l in worker.log().splitlines() if "cannot register" in l), None),
                      timeout=20, message="the worker's first failed round")
    assert "coordinator=%s,%s reason='%s: Connection refused; %s: Connection refused'" % (a, b, a, b) in line
    assert worker.proc.poll() is None


def test_a_worker_on_a_list_still_stops_at_a_client_port(coordinator, worker_procs):
    worker = worker_procs.start(listed(closed_address(), coordinator.client_target), "w-lost")
    assert worker.proc.wait(20) == 1  # retrying cannot help: it stops at once
    assert "WORKER_REGISTER belongs on the worker port" in worker.log()


class ReplyLost:
    """A coordinator that dies between committing a submit and replying: it passes the
    first request to ``target`` and closes the connection without the answer."""

    def __init__(self, target):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.target = target
        self.answered: list[dict] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        conn, _ = self.listener.accept()
        with conn:
            request = FrameReader(conn.recv).read_frame()
            upstream = RawConn(self.target)
            self.answered.append(upstream.request(request))
            upstream.close()
        self.listener.close()


def test_a_cli_submit_whose_reply_is_lost_makes_one_job(shared_coordinator):
    # Given a first address that makes the job but loses the reply (a leader killed then)
    coordinator = shared_coordinator
    with CoordinatorClient(*coordinator.client_addr, timeout=10) as client:
        before = [j["jobId"] for j in client.iter_jobs()]
    lost = ReplyLost(coordinator.client_addr)
    # When the CLI submits there, with the coordinator next on its list
    done = run_cli("submit", "SLEEP", '{"durationMillis": 1}', coordinator="%s,%s" % (lost.address,
                                                                                       coordinator.client_target))
    lost.thread.join(10)
    # Then it sends the submit again to the next address, which answers with the same job
    assert done.returncode == 0 and done.stderr == "", done
    [made] = lost.answered
    assert done.stdout == "submitted job %s\n" % made["jobId"]
    with CoordinatorClient(*coordinator.client_addr, timeout=10) as client:
        assert [j["jobId"] for j in client.iter_jobs()] == [made["jobId"]] + before


def test_a_worker_leaves_a_frozen_coordinator_for_the_next_address(coordinator_factory, worker_procs, tmp_path):
    # Given two coordinators (each on its own database) and a worker given both, registered with the first
    first = coordinator_factory()
    second = coordinator_factory(db=tmp_path / "second.db")
    worker = worker_procs.start(listed(first.worker_target, second.worker_target), "w-frozen")
    with CoordinatorClient(*first.client_addr, timeout=10) as client:
        wait_registered(client, ["w-frozen"])
    # (and it has had a heartbeat answered, so the coordinator's silence will count)
    wait_until(lambda: "coordinator answers heartbeats" in worker.err_path.read_text(), timeout=10,
               message="the worker's first heartbeat answered")
    # When the first is frozen: its kernel still takes the worker's heartbeats, nothing answers them
    os.kill(first.proc.pid, signal.SIGSTOP)
    try:
        # Then the worker notices the silence and registers with the second, which runs its jobs
        with CoordinatorClient(*second.client_addr, timeout=10) as client:
            wait_registered(client, ["w-frozen"], timeout=20)
            job_id = client.submit("SLEEP", {"durationMillis": 1})
            assert client.wait(job_id, timeout=20)["state"] == "COMPLETED"
    finally:
        os.kill(first.proc.pid, signal.SIGCONT)
    assert "coordinator silent for" in worker.err_path.read_text()
