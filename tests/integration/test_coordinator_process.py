"""The coordinator as a command: start-up errors, the listening line, signals, logs."""

import socket
import sqlite3

import pytest

from tests.support.cli import run_cli
from tests.support.connections import RawConn
from tests.support.waiting import wait_until


def test_unopenable_database_is_a_one_line_error(tmp_path):
    # Given a database path in a directory that does not exist
    proc = run_cli("coordinator", "--worker-port=0", "--client-port=0", "--db=%s" % (tmp_path / "no" / "x.db"))
    # Then it exits 1 and says which file, without a traceback
    assert proc.returncode == 1
    assert "cannot open the database" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_corrupt_database_is_refused(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is not a sqlite database, only some words " * 20)
    proc = run_cli("coordinator", "--worker-port=0", "--client-port=0", "--db=%s" % bad)
    assert proc.returncode == 1
    assert "not a database" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_port_in_use_is_reported(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        proc = run_cli("coordinator", "--worker-port=%d" % port, "--client-port=0", "--db=%s" % (tmp_path / "x.db"))
        assert proc.returncode == 1
        assert "cannot start" in proc.stderr
        assert "Traceback" not in proc.stderr
    finally:
        taken.close()


def test_bad_flag_values_are_usage_errors(tmp_path):
    for flag in ("--worker-port=http", "--sweep-interval-millis=0", "--max-active-jobs=-1", "--db-synchronous=SOMETIMES"):
        proc = run_cli("coordinator", flag, "--db=%s" % (tmp_path / "x.db"))
        assert proc.returncode == 2, (flag, proc.stderr)
        assert flag.split("=")[0] in proc.stderr


def test_db_synchronous_with_a_postgresql_url_is_refused_naming_the_flag_and_where_it_came_from():
    # SQLite's setting would change nothing on PostgreSQL: refused before any connection
    # is tried (nothing listens on port 1), as a one-line usage error.
    url = "--db=postgresql://jobmesh@127.0.0.1:1/jobs"
    given = run_cli("coordinator", url, "--db-synchronous=NORMAL")
    from_env = run_cli("up", url, env={"JOBMESH_DB_SYNCHRONOUS": "FULL"})
    for proc in (given, from_env):
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "--db-synchronous" in lines[0] and "PostgreSQL" in lines[0], lines
    assert "JOBMESH_DB_SYNCHRONOUS" in from_env.stderr


def test_periodic_port_opens_and_is_on_the_listening_line(coordinator_factory):
    coord = coordinator_factory(periodic_port=0)
    assert coord.periodic_addr is not None and coord.periodic_addr[1] > 0
    line = coord.out_path.read_text()
    assert line.index(" client=") < line.index(" periodic=")


def test_graceful_stop_keeps_running_jobs_running_in_the_database(coordinator_factory, tmp_path):
    # Given a job assigned to a worker
    coord = coordinator_factory()
    client = RawConn(coord.client_addr)
    worker = RawConn(coord.worker_addr)
    worker.send({"type": "WORKER_REGISTER", "workerId": "w1", "capacity": 1})
    assert worker.recv()["type"] == "WORKER_REGISTERED"
    job_id = client.request({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 1}})["jobId"]
    assert worker.recv()["type"] == "TASK_ASSIGN"
    # When the coordinator is stopped with SIGTERM
    assert coord.terminate() == 0
    # Then no shutdown transition was written: the row is RUNNING, as after a crash
    with sqlite3.connect(str(coord.db)) as db:
        (state,) = db.execute("SELECT state FROM jobs WHERE job_id=?", (job_id,)).fetchone()
    assert state == "RUNNING"
    assert "stopped" in coord.stderr()
    client.close()
    worker.close()


@pytest.fixture
def coordinator(shared_coordinator):
    """The coordinator the module's tests share: each test's workers have ids of their own
    and run only a task type of their own."""
    return shared_coordinator


def test_logs_say_what_happened(coordinator):
    client = RawConn(coordinator.client_addr)
    worker = RawConn(coordinator.worker_addr)
    worker.send({"type": "WORKER_REGISTER", "workerId": "w-log", "capacity": 1})
    assert worker.recv()["type"] == "WORKER_REGISTERED"
    client.send_raw(b"\x00\x00\x00\x03abc")
    assert client.is_closed()
    worker.close()
    text = wait_until(lambda: (lambda t: t if "worker disconnected worker=w-log" in t else None)(coordinator.stderr()),
                      message="disconnect logged")
    assert "worker registered worker=w-log capacity=1" in text
    assert "protocol violation on client port" in text
    assert "recovered db=" in text


def test_lone_surrogates_cannot_reach_the_database(coordinator):
    # Given a client and a worker whose texts smuggle lone UTF-16 surrogates via \u escapes
    import struct

    def frame(text: bytes) -> bytes:
        return struct.pack(">I", len(text)) + text

    bad_client = RawConn(coordinator.client_addr)
    bad_client.send_raw(frame(b'{"type":"SUBMIT_JOB","taskType":"SLEEP","payload":{"durationMillis":1},'
                              b'"idempotencyKey":"k\\ud800"}'))
    reply = bad_client.recv()
    assert reply["type"] == "ERROR" and "surrogate" in reply["message"]
    assert bad_client.is_closed()
    bad_worker = RawConn(coordinator.worker_addr)
    bad_worker.send_raw(frame(b'{"type":"WORKER_REGISTER","workerId":"w\\udc00","capacity":1}'))
    assert bad_worker.recv()["type"] == "ERROR"
    assert bad_worker.is_closed()
    # Then the coordinator is still alive and durable work goes on
    client = RawConn(coordinator.client_addr)
    worker = RawConn(coordinator.worker_addr)
    worker.send({"type": "WORKER_REGISTER", "workerId": "w-ok", "capacity": 1, "taskTypes": ["SURROGATES"]})
    assert worker.recv()["type"] == "WORKER_REGISTERED"
    job_id = client.request({"type": "SUBMIT_JOB", "taskType": "SURROGATES", "payload": {"durationMillis": 1},
                             "idempotencyKey": "emoji-\U0001F600"})["jobId"]
    assign = worker.recv()
    worker.send({"type": "TASK_RESULT", "workerId": "w-ok", "jobId": job_id, "attemptId": assign["attemptId"],
                 "success": True, "result": {"sleptMillis": 1}})
    done = wait_until(lambda: (lambda j: j if j["state"] == "COMPLETED" else None)(
        client.request({"type": "GET_JOB_STATUS", "jobId": job_id})["job"]), message="job completed")
    assert done["result"] == {"sleptMillis": 1}
    assert coordinator.proc.poll() is None
