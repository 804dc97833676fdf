"""A misbehaving peer costs only its own connection (PROTOCOL.md "Error handling"; MalformedProtocolIT).

Framing and protocol violations (bad length, bad UTF-8/JSON, non-object JSON, missing or
unknown type, wrong field types, EOF inside a frame, a first worker message that is not
WORKER_REGISTER, a bad capacity, a workerId that is not the session's) get a best-effort
ERROR and that connection closes. Meanwhile an already-open client connection and a
registered worker keep working, and the coordinator keeps serving. Well-formed requests
that cannot be served (unknown jobId, invalid payload, bad priority name) get ERROR and
the connection stays open (CONTRACT.md). Every such case runs in the unit tier
(tests/unit/test_port_violations.py, against an in-process coordinator); here one
violation on each port runs against a coordinator process (``module_coordinator``).

Since a bad peer must cost only its own connection, the tests share coordinators: the
process (``module_coordinator``) where workers take part, each test's workers declaring a
task type of their own, and an in-process one (``clients_only``) that no worker ever
joins. The tests that fill a coordinator with work, or measure its latency, get one of
their own, in the test process (``coordinator``: tests/support/inprocess.py).
"""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
import threading
import time

import pytest

from jobmesh.protocol.framing import HEADER, MAX_FRAME, encode_frame
from tests.support.connections import RawConn, read_until_closed
from tests.support.peers import RegistrationRefused, ScriptedWorker
from tests.support.waiting import assert_prompt, baseline, timed, wait_until
from tests.support.malformed import (CLIENT_CASES, FRAMING_CASES, WORKER_CASES, case, client_port_violation, frame_of,
                                     job_ids, make_bystanders, unique, worker_ids, worker_port_violation)

@pytest.fixture(scope="module")
def clients_only(inprocess_coordinator):
    """The coordinator shared by the module's tests in which no worker ever registers."""
    return inprocess_coordinator


@pytest.fixture
def coordinator(inprocess_factory):
    """A coordinator of the test's own (the tests that fill one with work or measure it)."""
    return inprocess_factory()


# ---- one violation on each port against a coordinator process ------------------------------------
# (every case runs in tests/unit/test_port_violations.py, against an in-process coordinator)

@pytest.mark.parametrize("port,case_id", [("worker", "registered-then-non-json"), ("client", "length-over-1MiB")])
def test_a_violation_closes_only_that_connection_in_a_coordinator_process(module_coordinator, peers, port, case_id):
    bystanders = make_bystanders(module_coordinator, peers)
    if port == "worker":
        step, expect_error = case(FRAMING_CASES + WORKER_CASES, case_id)
        worker_port_violation(module_coordinator, peers, bystanders, step, expect_error)
    else:
        step, expect_error = case(FRAMING_CASES + CLIENT_CASES, case_id)
        client_port_violation(module_coordinator, peers, bystanders, step, expect_error)


def test_text_at_the_bound_is_accepted(clients_only, peers):
    client = peers.client(clients_only)
    job_id = client.submit_ok("WORD_COUNT", {"text": "x" * 200_000})
    assert client.status(job_id)["taskType"] == "WORD_COUNT"


def test_idempotency_conflict_keeps_the_connection_open(clients_only, peers):
    client = peers.client(clients_only)
    key = unique("k-conflict")
    job_id = client.submit_ok("SLEEP", {"durationMillis": 1}, idempotencyKey=key)
    reply = client.submit("SLEEP", {"durationMillis": 2}, idempotencyKey=key)
    assert reply["type"] == "ERROR" and reply["message"]
    assert client.status(job_id)["state"] == "QUEUED"


# ---- registration ---------------------------------------------------------------------------------

def test_duplicate_register_of_a_live_id_is_refused(module_coordinator, peers):
    coordinator = module_coordinator
    # Given a live worker session "w-dup" (the one worker for its task type)
    client = peers.client(coordinator)
    task_type = unique("DUP")
    first = peers.worker(coordinator, "w-dup", capacity=1, task_types=[task_type])
    # When a second connection registers the same id
    second = peers.raw(coordinator.worker_addr)
    second.send({"type": "WORKER_REGISTER", "workerId": "w-dup", "capacity": 5})
    # Then it is refused with ERROR and closed
    frames, closed = read_until_closed(second, timeout=5)
    assert [f["type"] for f in frames] == ["ERROR"], frames
    assert closed
    # And the first session is untouched: listed once with its own capacity, still gets work
    items = [w for w in client.workers() if w["workerId"] == "w-dup"]
    assert len(items) == 1 and items[0]["capacity"] == 1
    job_id = client.submit_ok(task_type, {"durationMillis": 1})
    assign = first.await_assign()
    assert assign["jobId"] == job_id
    first.complete(assign, {"sleptMillis": 1})
    assert client.wait_state(job_id, "COMPLETED")["attempts"] == 1


def test_an_id_can_register_again_after_its_session_ended(module_coordinator, peers):
    coordinator = module_coordinator
    client = peers.client(coordinator)
    first = peers.worker(coordinator, "w-again", capacity=1)
    first.close()
    wait_until(lambda: "w-again" not in worker_ids(client), timeout=3, message="session removed after close")
    again = peers.worker(coordinator, "w-again", capacity=2)
    assert [(w["workerId"], w["capacity"]) for w in client.workers() if w["workerId"] == "w-again"] == [("w-again", 2)]
    assert not again.closed.is_set()


def test_scripted_worker_raises_on_refusal(module_coordinator, peers):
    w = ScriptedWorker(module_coordinator.worker_addr, worker_id="w-zero", capacity=0)
    try:
        with pytest.raises(RegistrationRefused) as info:
            w.register()
        assert info.value.reply["type"] == "ERROR"
    finally:
        w.close()


@pytest.mark.parametrize("capacity", [1, 1024])
def test_capacity_bounds_are_inclusive(module_coordinator, peers, capacity):
    client = peers.client(module_coordinator)
    worker_id = unique("w-cap")
    peers.worker(module_coordinator, worker_id, capacity=capacity)
    assert [(w["workerId"], w["capacity"]) for w in client.workers() if w["workerId"] == worker_id] == [
        (worker_id, capacity)]


# ---- forward compatibility and framing on a healthy connection ------------------------------------

def test_unknown_fields_are_ignored_on_both_ports(module_coordinator, peers):
    coordinator = module_coordinator
    # Given a worker (the one worker for its task type) whose every message carries extra fields
    client = peers.client(coordinator)
    task_type = unique("FWD")
    w = peers.raw(coordinator.worker_addr)
    w.send({"type": "WORKER_REGISTER", "workerId": "w-fwd", "capacity": 1, "taskTypes": [task_type], "v": 1,
            "labels": {"zone": "a"}})
    assert w.recv()["type"] == "WORKER_REGISTERED"
    w.send({"type": "HEARTBEAT", "workerId": "w-fwd", "load": [0.1, 0.2]})
    # When a client submits with extra fields too
    reply = client.request({"type": "SUBMIT_JOB", "taskType": task_type, "payload": {"durationMillis": 1},
                            "maxAttempts": 1, "v": 1, "trace": {"id": "t"}})
    assert reply["type"] == "JOB_SUBMITTED"
    job_id = reply["jobId"]
    # Then everything works as if they were absent
    assign = w.recv()
    assert assign["type"] == "TASK_ASSIGN" and assign["jobId"] == job_id
    w.send({"type": "TASK_RESULT", "workerId": "w-fwd", "jobId": job_id, "attemptId": assign["attemptId"],
            "success": True, "result": {"sleptMillis": 1}, "error": None, "durationMillis": 3})
    done = client.wait_state(job_id, "COMPLETED")
    assert done["result"] == {"sleptMillis": 1}
    status = client.request({"type": "GET_JOB_STATUS", "jobId": job_id, "verbose": True})
    assert status["type"] == "JOB_STATUS" and status["job"]["jobId"] == job_id
    assert client.request({"type": "LIST_WORKERS", "extra": 1})["type"] == "WORKER_LIST"
    assert client.request({"type": "LIST_JOBS", "sort": "asc"})["type"] == "JOB_LIST"


def test_a_frame_split_into_single_bytes_is_assembled(clients_only, peers):
    conn = peers.raw(clients_only.client_addr)
    data = encode_frame({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 1}})
    for i in range(len(data)):
        conn.send_raw(data[i:i + 1])
        if i % 7 == 0:
            time.sleep(0.001)
    reply = conn.recv()
    assert reply["type"] == "JOB_SUBMITTED"


def test_several_frames_in_one_write_each_get_a_reply(clients_only, peers):
    conn = peers.raw(clients_only.client_addr)
    conn.send_raw(b"".join(encode_frame({"type": "LIST_WORKERS"}) for _ in range(5)))
    assert [conn.recv()["type"] for _ in range(5)] == ["WORKER_LIST"] * 5


def test_clean_close_between_frames_is_harmless(clients_only, peers):
    coordinator = clients_only
    client = peers.client(coordinator)
    for _ in range(5):
        c = RawConn(coordinator.client_addr)
        assert c.request({"type": "LIST_WORKERS"})["type"] == "WORKER_LIST"
        c.close()
        w = RawConn(coordinator.worker_addr)
        w.close()
    assert client.workers() == []


def test_a_submission_too_big_to_assign_does_not_wedge_a_worker(coordinator, peers):
    # Given a live worker with room for two tasks
    client = peers.client(coordinator)
    worker = peers.worker(coordinator, "w-victim", capacity=2)
    # When a client submits a valid SLEEP whose payload carries an (ignored) extra field so large that
    # the SUBMIT_JOB frame fits in 1 MiB but a TASK_ASSIGN carrying the payload would not
    pad = "p" * (MAX_FRAME - 150)
    reply = client.submit("SLEEP", {"durationMillis": 1, "pad": pad})
    # Then the coordinator either refuses it (ERROR, connection open) or accepts it...
    assert reply["type"] in ("JOB_SUBMITTED", "ERROR"), reply
    # ...but no reply and no frame to the worker may exceed the frame limit, and the worker's session
    # must keep working: a normal job submitted next is assigned to it and completes
    job_id = client.submit_ok("SLEEP", {"durationMillis": 2})
    deadline = time.monotonic() + 3
    got = None
    while time.monotonic() < deadline and got is None:
        a = worker.poll_assign(0.1)
        if a is not None and a["jobId"] == job_id:
            got = a
    assert got is not None, "the worker received no further work after the oversized job (session wedged)"
    worker.complete(got, {"sleptMillis": 2})
    assert client.wait_state(job_id, "COMPLETED")["attempts"] == 1
    assert worker.bad_frames == []
    assert not worker.closed.is_set()


@pytest.mark.parametrize("token", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_in_a_payload_creates_no_job(clients_only, peers, token):
    # NaN/Infinity are not JSON. Whether the coordinator treats the frame as non-JSON (ERROR and close)
    # or as an invalid payload (ERROR, connection open), it must answer ERROR and create nothing.
    coordinator = clients_only
    client = peers.client(coordinator)
    before = job_ids(client)
    bad = peers.raw(coordinator.client_addr)
    bad.send_raw(frame_of(b'{"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 1, "x": '
                          + token + b"}}"))
    reply = bad.recv()
    assert reply is not None and reply["type"] == "ERROR", reply
    assert job_ids(client) == before
    assert client.workers() == []


# ---- slow and stalled peers cost only themselves --------------------------------------------------

def test_a_stalled_partial_frame_blocks_nobody(coordinator, peers):
    # Given a client's submit latency measured first (jobs delayed out of the way)
    client = peers.client(coordinator)
    base = baseline(lambda: client.submit_ok("SLEEP", {"durationMillis": 1}, delayMillis=10 ** 9))
    # and peers that sent half a header / half a frame on each port and then went quiet
    stalled = [peers.raw(coordinator.client_addr), peers.raw(coordinator.worker_addr),
               peers.raw(coordinator.client_addr)]
    stalled[0].send_raw(b"\x00\x00")
    stalled[1].send_raw(HEADER.pack(50) + b'{"type": "WORKER_')
    stalled[2].send_raw(HEADER.pack(50))
    # Then everyone else is served promptly
    worker = peers.worker(coordinator, "w-prompt", capacity=1)
    job_id, elapsed = timed(lambda: client.submit_ok("SLEEP", {"durationMillis": 1}))
    assert_prompt(elapsed, base, "a submit beside stalled peers")
    worker.complete(worker.await_assign(timeout=2), {"sleptMillis": 1})
    assert client.wait_state(job_id, "COMPLETED", timeout=2)


def test_a_client_that_never_reads_its_replies_blocks_nobody(coordinator, peers):
    # Given 300 jobs, so that every full LIST_JOBS reply is large
    client = peers.client(coordinator)
    for start in range(0, 300, 100):
        for i in range(100):
            client.conn.send({"type": "SUBMIT_JOB", "taskType": "WORD_COUNT", "payload": {"text": "w %d" % i}})
        for _ in range(100):
            assert client.conn.recv()["type"] == "JOB_SUBMITTED"
    # and another client's latencies measured before anything hostile happens
    other = peers.client(coordinator)
    base_list = baseline(other.workers)
    base_submit = baseline(lambda: other.submit_ok("SLEEP", {"durationMillis": 1}, delayMillis=10 ** 9))
    # When a client pipelines many large requests and never reads a reply (its buffers fill up)
    hog = peers.raw(coordinator.client_addr)
    hog.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    request = encode_frame({"type": "LIST_JOBS", "limit": 1000})
    hog.sock.settimeout(2)
    sent = 0
    try:
        for _ in range(400):
            hog.send_raw(request)
            sent += 1
    except (socket.timeout, TimeoutError, OSError):
        pass  # its own send buffer filled up too: the coordinator stopped reading from it
    # Then other clients and workers are still served promptly
    worker = peers.worker(coordinator, "w-unblocked", capacity=1)
    _, elapsed = timed(other.workers)
    assert_prompt(elapsed, base_list, "LIST_WORKERS beside a client that never reads")
    job_id, elapsed = timed(lambda: other.submit_ok("SLEEP", {"durationMillis": 1}))
    assert_prompt(elapsed, base_submit, "a submit beside a client that never reads")
    assign = worker.await_assign(timeout=5)
    worker.complete(assign, {"sleptMillis": 1})
    assert other.wait_state(assign["jobId"], "COMPLETED", timeout=3)


def unread(sock: socket.socket) -> int:
    """Bytes that arrived on ``sock`` and are not read yet (FIONREAD)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def test_a_slow_reader_gets_every_large_reply_in_order_once_it_reads(coordinator, peers):
    # Given 300 jobs, so that each full LIST_JOBS reply is tens of kilobytes
    client = peers.client(coordinator)
    for i in range(300):
        client.conn.send({"type": "SUBMIT_JOB", "taskType": "WORD_COUNT", "payload": {"text": "w %d" % i}})
    ids = [client.conn.recv()["jobId"] for _ in range(300)]
    # When a client pipelines more large requests than its socket buffers hold, reading
    # nothing until all are sent (a thread sends, since the coordinator stops reading
    # from it while its replies wait)
    # (about 11 MB of replies in all, more than both sockets' buffers hold).
    slow = peers.raw(coordinator.client_addr)
    n = 120
    requests = [encode_frame({"type": "LIST_JOBS", "limit": 1000})] * (n - 1)
    requests.append(encode_frame({"type": "GET_JOB_STATUS", "jobId": ids[7]}))
    sender = threading.Thread(target=lambda: slow.send_raw(b"".join(requests)), daemon=True)
    sender.start()
    # (the coordinator has replies waiting for it: its receive buffer holds unread bytes)
    wait_until(lambda: unread(slow.sock) >= 16384, message="replies waiting to be read")
    # Then, once it reads, every reply arrives whole and in request order
    replies = [slow.recv() for _ in range(n)]
    sender.join(5)
    assert not sender.is_alive()
    assert [r["type"] for r in replies] == ["JOB_LIST"] * (n - 1) + ["JOB_STATUS"]
    for r in replies[:-1]:
        assert [j["jobId"] for j in r["jobs"]] == ids[::-1]
    assert replies[-1]["job"]["jobId"] == ids[7]
    # And the connection keeps working
    assert slow.request({"type": "LIST_WORKERS"})["type"] == "WORKER_LIST"


def test_clients_that_reset_with_replies_pending_cost_only_themselves(coordinator, peers):
    # Given clients that pipeline submits and reset their connection (RST) at once,
    # before any reply can be written
    tokens = []
    for c in range(20):
        conn = RawConn(coordinator.client_addr)
        frames = []
        for i in range(30):
            token = "reset %d %d" % (c, i)
            tokens.append(token)
            frames.append(encode_frame({"type": "SUBMIT_JOB", "taskType": "WORD_COUNT",
                                        "payload": {"text": token}, "idempotencyKey": token}))
        conn.send_raw(b"".join(frames))
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
    # Then the coordinator keeps serving others, and every submit it read exists exactly
    # once: resubmitting each key finds the same job or creates it now
    client = peers.client(coordinator)
    assert client.request({"type": "LIST_WORKERS"})["type"] == "WORKER_LIST"
    ids = set()
    for token in tokens:
        ids.add(client.submit_ok("WORD_COUNT", {"text": token}, idempotencyKey=token))
    assert len(ids) == len(tokens)
    listed = client.request({"type": "LIST_JOBS", "limit": 1000})
    assert len({j["jobId"] for j in listed["jobs"]}) == len(tokens)


def test_a_worker_that_never_reads_blocks_nobody(coordinator, peers):
    # Given a client's latencies measured first (its baseline jobs delayed out of the way)
    other = peers.client(coordinator)
    base_list = baseline(lambda: other.list_jobs(limit=10))
    base_submit = baseline(lambda: other.submit_ok("SLEEP", {"durationMillis": 1}, delayMillis=10 ** 9))
    # and a registered worker with a large capacity that heartbeats but never reads its socket
    hog = peers.raw(coordinator.worker_addr)
    hog.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    hog.send({"type": "WORKER_REGISTER", "workerId": "w-deaf", "capacity": 1024})
    assert hog.recv()["type"] == "WORKER_REGISTERED"
    import threading
    stop = threading.Event()

    def beat():
        while not stop.wait(0.1):
            try:
                hog.send({"type": "HEARTBEAT", "workerId": "w-deaf"})
            except OSError:
                return

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        # When many large assignments are pushed at it (about 40 MB of TASK_ASSIGN frames)
        client = peers.client(coordinator)
        text = "z" * 200_000
        for start in range(0, 200, 50):
            for i in range(50):
                client.conn.send({"type": "SUBMIT_JOB", "taskType": "SHA256", "payload": {"text": text}})
            for _ in range(50):
                assert client.conn.recv()["type"] == "JOB_SUBMITTED"
        # Then clients are still answered promptly
        for _ in range(5):
            _, elapsed = timed(lambda: other.list_jobs(limit=10))
            assert_prompt(elapsed, base_list, "LIST_JOBS beside a worker that never reads")
        _, elapsed = timed(lambda: other.submit_ok("SLEEP", {"durationMillis": 1}))
        assert_prompt(elapsed, base_submit, "a submit beside a worker that never reads")
        # And the deaf worker, holding more unsent output than the bound, was closed: its
        # attempts are lost with it and wait for another worker, none of them gone
        wait_until(lambda: not any(w["workerId"] == "w-deaf" for w in other.workers()), timeout=10,
                   message="the deaf worker closed")
        jobs = other.list_jobs(limit=1000)["jobs"]
        assert len(jobs) == 211 and all(j["state"] in ("QUEUED", "RETRY_WAIT", "FAILED") for j in jobs
                                        if j["taskType"] == "SHA256")
    finally:
        stop.set()
        beater.join(2)


def test_a_client_that_half_closes_still_gets_every_reply(clients_only, peers):
    coordinator = clients_only
    # Given a client that pipelines more requests than the per-connection limit, then
    # closes its sending side without reading anything yet
    conn = peers.raw(coordinator.client_addr)
    n = 150
    conn.send_raw(b"".join(
        encode_frame({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": i}})
        for i in range(n)))
    conn.sock.shutdown(socket.SHUT_WR)
    # Then every request is answered, in order, before the coordinator closes
    replies = [conn.recv() for _ in range(n)]
    assert [r["type"] for r in replies] == ["JOB_SUBMITTED"] * n
    assert len({r["jobId"] for r in replies}) == n
    assert conn.recv() is None  # then a clean close
    client = peers.client(coordinator)
    assert all(client.status(r["jobId"])["state"] == "QUEUED" for r in replies)


def test_a_violation_after_pipelined_requests_is_answered_after_them(clients_only, peers):
    # Given valid requests followed by a malformed frame, all in one write
    conn = peers.raw(clients_only.client_addr)
    good = [encode_frame({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 1}})
            for _ in range(3)]
    conn.send_raw(b"".join(good) + frame_of(b"{not json"))
    # Then the valid ones are answered first, then the ERROR, then the connection closes
    replies = [conn.recv() for _ in range(4)]
    assert [r["type"] for r in replies] == ["JOB_SUBMITTED"] * 3 + ["ERROR"]
    assert "JSON" in replies[3]["message"]
    assert conn.recv() is None  # then a clean close
