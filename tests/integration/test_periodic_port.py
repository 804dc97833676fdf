"""The Periodic port against the real aio-periodic 1.0.0 Client and Worker (each in its
own asyncio subprocess, tests/periodic_aio_peer.py) and a real coordinator."""

from __future__ import annotations

import socket
import time
from unittest.mock import ANY

import pytest

from jobmesh.periodic import codec as pc
from tests.support.peers import Client
from tests.support.waiting import wait_until
from tests.integration.periodic_support import RawPeriodic, client_ops, closed, job_named, periodic_jobs

pytest.importorskip("aio_periodic")


@pytest.fixture(scope="module")
def coord(module_coordinators):
    """The coordinator with its Periodic port the module's tests share: each test's jobs and
    workers are of funcs of its own, and what a test checks of the job list is of its funcs."""
    return module_coordinators(periodic_port=0)


def test_submit_then_work_done(coord, periodic_peers):
    worker = periodic_peers(coord.periodic_addr, "echo")
    assert client_ops(coord.periodic_addr, ["submit", "echo", "j1", "hi", 0, 10]) == [True]
    seen = worker.next()
    assert (seen["func"], seen["name"], seen["workload"], seen["timeout"]) == ("echo", "j1", "hi", 10)
    wait_until(lambda: job_named(coord, "echo", "j1")["state"] == "COMPLETED", timeout=10)
    job = job_named(coord, "echo", "j1")
    assert job["result"] == {"data": "done:hi"} and job["protocol"] == "periodic"
    assert job["runAtMillis"] is not None
    # the JSON port's snapshot is the same shape for both protocols
    assert Client(coord.client_addr).status(job["jobId"])["name"] == "j1"


def test_sched_at_in_the_future_waits(coord, periodic_peers):
    worker = periodic_peers(coord.periodic_addr, "later")
    at = int(time.time()) + 3
    assert client_ops(coord.periodic_addr, ["submit", "later", "j", "x", at, 0]) == [True]
    assert job_named(coord, "later", "j")["state"] == "SCHEDULED"
    assert worker.none_within(1.5)
    seen = worker.next(10)
    assert seen["name"] == "j" and time.time() >= at - 0.01


def test_resubmitting_a_pending_name_replaces_it(coord, periodic_peers):
    ops = client_ops(coord.periodic_addr, ["submit", "rep", "n", "old", 0, 0], ["submit", "rep", "n", "new", 0, 0],
                     ["status"])
    assert ops[:2] == [True, True]
    assert ops[2]["rep"]["job_count"] == 1  # one job per (func, name)
    worker = periodic_peers(coord.periodic_addr, "rep")
    assert worker.next()["workload"] == "new"
    assert worker.none_within(1.0)
    wait_until(lambda: job_named(coord, "rep", "n")["state"] == "COMPLETED", timeout=10)
    events = Client(coord.client_addr).request({"type": "GET_JOB_EVENTS", "jobId": job_named(coord, "rep", "n")["jobId"]})
    assert "REPLACED" in [e["event"] for e in events["events"]]


def test_work_fail_is_retried_after_a_second(coord, periodic_peers):
    worker = periodic_peers(coord.periodic_addr, "flaky", "fail_once")
    client_ops(coord.periodic_addr, ["submit", "flaky", "f", "w", 0, 0])
    first = time.monotonic()
    worker.next()
    worker.next(10)
    assert time.monotonic() - first >= 0.9
    wait_until(lambda: job_named(coord, "flaky", "f")["state"] == "COMPLETED", timeout=10)


def test_sched_later_puts_the_job_back_with_its_count(coord, periodic_peers):
    worker = periodic_peers(coord.periodic_addr, "sl", "later_once")
    client_ops(coord.periodic_addr, ["submit", "sl", "s", "w", 0, 0])
    assert worker.next()["count"] == 0
    wait_until(lambda: job_named(coord, "sl", "s")["state"] in ("SCHEDULED", "QUEUED", "RUNNING", "COMPLETED"))
    again = worker.next(10)
    assert again["count"] == 1
    wait_until(lambda: job_named(coord, "sl", "s")["state"] == "COMPLETED", timeout=10)


def test_status_text_counts(coord, periodic_peers):
    at = int(time.time()) + 600
    ops = client_ops(coord.periodic_addr, ["submit", "st", "a", "", at, 0], ["submit", "st", "b", "", at + 5, 0],
                     ["status"])
    row = ops[2]["st"]
    assert (row["worker_count"], row["job_count"], row["processing"], row["locked"], row["sched_at"]) == (0, 2, 0, 0, at)


def test_remove_job_and_drop_func(coord):
    at = int(time.time()) + 600
    ops = client_ops(coord.periodic_addr, ["submit", "rm", "a", "", at, 0], ["submit", "rm", "b", "", at, 0],
                     ["remove", "rm", "a"], ["status"], ["drop", "rm"], ["status"])
    assert ops[2] is True and ops[3]["rm"]["job_count"] == 1
    assert ops[4] is True and "rm" not in ops[5]
    assert {j["name"]: j["state"] for j in periodic_jobs(coord) if j["taskType"] == "rm"} == {
        "a": "CANCELLED", "b": "CANCELLED"}


def test_a_worker_killed_mid_job_hands_it_to_another(coord, periodic_peers):
    hung = periodic_peers(coord.periodic_addr, "k", "hang")
    client_ops(coord.periodic_addr, ["submit", "k", "x", "w", 0, 0])
    assert hung.next()["name"] == "x"
    other = periodic_peers(coord.periodic_addr, "k")
    hung.kill()
    assert other.next(10)["name"] == "x"
    wait_until(lambda: job_named(coord, "k", "x")["state"] == "COMPLETED", timeout=10)


def test_restart_keeps_queued_and_scheduled_periodic_jobs(coordinator_factory, periodic_peers):
    coord = coordinator_factory(periodic_port=0)  # of its own: it is stopped and started again
    at = int(time.time()) + 4
    client_ops(coord.periodic_addr, ["submit", "r", "now", "1", 0, 0], ["submit", "r", "soon", "2", at, 0])
    coord.terminate()
    coord.start()
    ops = client_ops(coord.periodic_addr, ["status"])
    assert ops[0]["r"]["job_count"] == 2
    worker = periodic_peers(coord.periodic_addr, "r")
    assert worker.next()["name"] == "now"
    soon = worker.next(10)
    assert soon["name"] == "soon" and time.time() >= at - 0.01
    wait_until(lambda: {j["name"]: j["state"] for j in periodic_jobs(coord)} == {"now": "COMPLETED", "soon": "COMPLETED"},
               timeout=10)


@pytest.mark.parametrize("hostile", [
    b"GET / HTTP/1.1\r\n\r\n",  # bad magic
    pc.encode_handshake(pc.ConnType.CLIENT)[:8] + b"\0\0\0\0" + b"\x01",  # bad CRC
    pc.MAGIC_REQ + (pc.MAX_BODY + 1).to_bytes(4, "big") + b"\0\0\0\0",  # oversized
    pc.encode_frame(b"\x07", pc.MAGIC_REQ),  # unknown handshake type
    pc.encode_handshake(pc.ConnType.WORKER) + pc.encode_frame(b"\0\0\0\x01\x28", pc.MAGIC_REQ),  # command 40
    pc.encode_handshake(pc.ConnType.CLIENT) + pc.encode_frame(b"\0\0\0\x01\x09extra", pc.MAGIC_REQ),  # trailing
], ids=["bad-magic", "bad-crc", "oversized", "bad-handshake", "unknown-command", "trailing-bytes"])
def test_hostile_bytes_close_only_that_connection(coord, hostile):
    good = RawPeriodic(coord.periodic_addr)
    bad = socket.create_connection(coord.periodic_addr, timeout=5)
    bad.sendall(hostile)
    assert closed(bad)
    assert good.conn_id >= 0
    assert good.request(pc.Ping(7)) == pc.Pong(7)
    good.close()
    assert client_ops(coord.periodic_addr, ["ping"]) == [True]


def test_status_lists_a_func_with_zero_counts_until_drop_func(coord, periodic_peers):
    addr = coord.periodic_addr
    # Given a worker of the func, and two jobs it ran
    worker = periodic_peers(addr, "zero")
    assert client_ops(addr, ["submit", "zero", "a", "x", 0, 0], ["run", "zero", "b", "y", 10])[1] == {
        "data": "done:y", "seconds": ANY}
    wait_until(lambda: job_named(coord, "zero", "a")["state"] == "COMPLETED", timeout=10)
    # When the worker leaves, its jobs done
    worker.kill()
    watcher = RawPeriodic(addr)
    wait_until(lambda: watcher.status()["zero"].workers == 0 and watcher.status()["zero"].jobs == 0, timeout=10,
               message="the func's counts at 0")
    # Then an aio-periodic client still finds the func, with zero counts (as periodicd lists it)
    [status] = client_ops(addr, ["status"])
    assert (status["zero"]["worker_count"], status["zero"]["job_count"], status["zero"]["processing"]) == (0, 0, 0)
    # And DROP_FUNC forgets it at once
    assert client_ops(addr, ["drop", "zero"], ["status"])[1].get("zero") is None
    assert "zero" not in watcher.status()
    watcher.close()


def test_a_connection_declares_at_most_ten_thousand_funcs(coord):
    # Given a worker that declared 10,000 funcs
    worker = RawPeriodic(coord.periodic_addr, pc.ConnType.WORKER)
    for i in range(10_000):
        worker.send(pc.CanDo(worker.next_msgid(), b"many-%d" % i))
    assert {type(worker.reply()) for _ in range(10_000)} == {pc.Success}
    # When it declares one more (CAN_DO or BROADCAST), it is refused with NO_WORKER
    assert worker.request(pc.CanDo(worker.next_msgid(), b"many-more")) == pc.NoWorker(worker.msgid)
    assert worker.request(pc.Broadcast(worker.next_msgid(), b"many-more")) == pc.NoWorker(worker.msgid)
    # Then the connection goes on (one it declared already is fine), and says why in the log
    assert worker.request(pc.CanDo(worker.next_msgid(), b"many-1")) == pc.Success(worker.msgid)
    assert worker.ping() and "many-more" not in RawPeriodic(coord.periodic_addr).status()
    assert "a connection may declare 10000 funcs at most" in coord.stderr()
    worker.close()



def test_worker_list_fits_a_frame_whatever_funcs_a_worker_declares(coord):
    from tests.support.connections import RawConn

    # Given a Periodic worker whose funcs' names alone pass the 1 MiB frame limit
    worker = RawPeriodic(coord.periodic_addr, pc.ConnType.WORKER)
    names = [b"%05d" % i + b"w" * 240 for i in range(5000)]
    worker.send_bytes(b"".join(pc.encode_request(pc.CanDo(i + 1, name)) for i, name in enumerate(names)))
    assert {type(worker.reply()) for _ in names} == {pc.Success}
    # When a client lists the workers
    client = RawConn(coord.client_addr)
    try:
        reply = client.request({"type": "LIST_WORKERS"})
        # Then the list comes, with as many of its funcs as fit and the count of those left out
        assert reply["type"] == "WORKER_LIST", reply
        [item] = [w for w in reply["workers"] if w["taskTypes"] and w["taskTypes"][0].endswith("w" * 240)]
        shown = item["taskTypes"]
        assert shown == sorted(n.decode() for n in names)[:len(shown)] and shown
        assert item["taskTypesOmitted"] == len(names) - len(shown)
    finally:
        client.close()
        worker.close()

def test_funcs_idle_for_the_forget_time_are_forgotten(coordinator_factory, periodic_peers):
    coord = coordinator_factory(periodic_port=0, periodic_forget_idle_millis=300)
    # Given STATUS as it is, and a client's job of a func no worker declares
    watcher = RawPeriodic(coord.periodic_addr)
    watcher.request(pc.SubmitJob(watcher.next_msgid(), pc.Job(b"kept", b"a", b"", int(time.time()) + 600, 0, 0)))
    baseline = watcher.status()
    # When an aio-periodic worker runs a job of its func and leaves, the func goes after its idle time
    worker = periodic_peers(coord.periodic_addr, "brief")
    assert client_ops(coord.periodic_addr, ["run", "brief", "b", "x", 10])[0]["data"] == "done:x"
    worker.kill()
    wait_until(lambda: "brief" not in watcher.status(), timeout=10, message="the idle func forgotten")
    assert "brief" not in client_ops(coord.periodic_addr, ["status"])[0]
    # When workers declare thousands of funcs and leave
    for n in range(3):
        worker = RawPeriodic(coord.periodic_addr, pc.ConnType.WORKER)
        for i in range(1000):
            worker.send(pc.CanDo(worker.next_msgid(), b"gone-%d-%d" % (n, i)))
        worker.send(pc.CanDo(worker.next_msgid(), b"kept"))
        assert {type(worker.reply()) for _ in range(1001)} == {pc.Success}  # every CAN_DO applied
        assert len(watcher.status()) >= len(baseline) + 1000  # this worker's funcs are listed
        worker.close()
    # Then, once they have been idle for --periodic-forget-idle-millis, STATUS is back to what
    # it was: only the func with a job is left, without workers
    wait_until(lambda: watcher.status() == baseline, timeout=10, message="STATUS back to its baseline")
    assert baseline["kept"].workers == 0 and baseline["kept"].jobs == 1
    watcher.close()


def test_worker_ids_are_one_namespace_across_the_ports(coord, periodic_peers):
    from tests.support.peers import RegistrationRefused, ScriptedWorker

    # Given an aio-periodic worker running a job, on WORKER_LIST as a Periodic session
    periodic_peers(coord.periodic_addr, "ids", "hang")
    assert client_ops(coord.periodic_addr, ["submit", "ids", "a", "x", 0, 0]) == [True]
    wait_until(lambda: job_named(coord, "ids", "a")["state"] == "RUNNING", timeout=10)
    held = job_named(coord, "ids", "a")["workerId"]
    # When a JSON worker registers under that session's id
    impostor = ScriptedWorker(coord.worker_addr, held)
    with pytest.raises(RegistrationRefused) as refused:
        impostor.register()
    impostor.close()
    # Then it is refused with a clear ERROR, and WORKER_LIST still shows one worker of that id
    assert refused.value.reply == {"type": "ERROR", "message": "worker id '%s' belongs to a live Periodic worker "
                                   "session" % held}
    assert [w["protocol"] for w in Client(coord.client_addr).workers() if w["workerId"] == held] == ["periodic"]
    # And a Periodic session never takes the id of a live JSON worker
    taken = "periodic-%d" % (int(held.rsplit("-", 1)[1]) + 1)
    json_worker = ScriptedWorker(coord.worker_addr, taken)
    json_worker.register()
    later = RawPeriodic(coord.periodic_addr, pc.ConnType.WORKER)
    assert later.request(pc.CanDo(later.next_msgid(), b"ids-later")) == pc.Success(later.msgid)
    ids = [w["workerId"] for w in Client(coord.client_addr).workers()]
    assert ids.count(taken) == 1 and len(ids) == len(set(ids))
    later.close()
    json_worker.close()


def test_a_funcs_jobs_obey_the_limit_and_the_pause_of_its_name(coord, periodic_peers):
    # Given an aio-periodic worker with room for three jobs of func plim, limited to one running
    worker = periodic_peers(coord.periodic_addr, "plim", "hang", 3)
    client = Client(coord.client_addr)
    put = client.request({"type": "LIMIT_PUT", "limit": {"taskType": "plim", "maxRunning": 1}})
    assert (put["type"], put["limit"]["maxRunning"]) == ("LIMIT", 1), put
    # When two jobs of it are submitted on the Periodic port
    assert client_ops(coord.periodic_addr, ["submit", "plim", "a", "x", 0, 0], ["submit", "plim", "b", "x", 0, 0]) \
        == [True, True]
    # Then one runs and the other waits on the limit, as the limit's counts say
    first = worker.next()["name"]
    held = "b" if first == "a" else "a"
    wait_until(lambda: job_named(coord, "plim", held).get("waitingReason") == "CONCURRENCY_LIMIT",
               message="the second plim job held by the limit")
    assert job_named(coord, "plim", first)["state"] == "RUNNING"
    got = client.request({"type": "LIMIT_GET", "taskType": "plim"})["limit"]
    assert (got["running"], got["queued"]) == (1, 1), got
    # And while the func is paused, raising its limit starts nothing; resuming starts the held job
    assert client.request({"type": "TYPE_PAUSE", "taskType": "plim"})["limit"]["paused"] is True
    raised = client.request({"type": "LIMIT_PUT", "limit": {"taskType": "plim", "maxRunning": 2}})["limit"]
    assert (raised["maxRunning"], raised["paused"]) == (2, True)
    assert job_named(coord, "plim", held)["waitingReason"] == "TYPE_PAUSED"
    assert client.request({"type": "TYPE_RESUME", "taskType": "plim"})["limit"]["paused"] is False
    assert worker.next()["name"] == held
    wait_until(lambda: job_named(coord, "plim", held)["state"] == "RUNNING", message="the held plim job running")
    assert client.request({"type": "LIMIT_DELETE", "taskType": "plim"})["limit"]["running"] == 2
