"""A misbehaving peer costs only its own connection (PROTOCOL.md "Error handling";
MalformedProtocolIT), case by case, against a real coordinator in the test process.

Every framing and protocol violation, and every well-formed request that cannot be served,
of ``tests/support/malformed.py`` runs here against one ``InProcessCoordinator`` the module
shares: the runtime's ``Coordinator`` with its real ports on 127.0.0.1 and a temp SQLite
file, run by a hub on a thread of its own (no process start per case). A violation gets a
best-effort ERROR and closes that connection, while an already-open client connection and
a registered worker (each test's own, with a task type of its own) keep working and new
connections are accepted; an unservable request gets ERROR and its connection stays open.
tests/integration/test_malformed_peers.py runs one of each against a coordinator process.
"""

from __future__ import annotations

import pytest

from jobmesh.protocol.framing import HEADER, MAX_FRAME, RECV_SIZE, encode_frame
from tests.support.connections import read_until_closed
from tests.support.malformed import (CLIENT_CASES, FRAMING_CASES, UNSERVABLE, WORKER_CASES, client_port_violation,
                                     make_bystanders, unservable_request, worker_port_violation)


@pytest.fixture
def bystanders(inprocess_coordinator, peers):
    return make_bystanders(inprocess_coordinator, peers)


@pytest.mark.parametrize("case,step,expect_error", FRAMING_CASES + WORKER_CASES,
                         ids=[c[0] for c in FRAMING_CASES + WORKER_CASES])
def test_worker_port_violation_closes_only_that_connection(inprocess_coordinator, peers, bystanders, case, step,
                                                           expect_error):
    worker_port_violation(inprocess_coordinator, peers, bystanders, step, expect_error)


@pytest.mark.parametrize("case,step,expect_error", FRAMING_CASES + CLIENT_CASES,
                         ids=[c[0] for c in FRAMING_CASES + CLIENT_CASES])
def test_client_port_violation_closes_only_that_connection(inprocess_coordinator, peers, bystanders, case, step,
                                                           expect_error):
    client_port_violation(inprocess_coordinator, peers, bystanders, step, expect_error)


@pytest.mark.parametrize("case,request_", UNSERVABLE, ids=[c[0] for c in UNSERVABLE])
def test_unservable_request_gets_error_and_the_connection_stays_open(inprocess_coordinator, peers, case, request_):
    unservable_request(inprocess_coordinator, peers, request_)


def test_requests_read_together_are_answered_in_order_before_the_bad_header_after_them(inprocess_coordinator, peers):
    # One send: requests, a large submit (more than one read of the port's buffer), and a
    # header announcing more than a frame may hold; the peer then waits, sending nothing.
    bad = peers.raw(inprocess_coordinator.client_addr)
    text = "word " * 30_000
    data = (encode_frame({"type": "LIST_WORKERS"}) * 3
            + encode_frame({"type": "SUBMIT_JOB", "taskType": "WORD_COUNT", "payload": {"text": text}})
            + encode_frame({"type": "LIST_WORKERS"}) + HEADER.pack(MAX_FRAME + 1))
    assert len(data) > 2 * RECV_SIZE
    bad.send_raw(data)
    frames, closed = read_until_closed(bad, timeout=5)
    assert closed
    assert [f["type"] for f in frames] == ["WORKER_LIST"] * 3 + ["JOB_SUBMITTED", "WORKER_LIST", "ERROR"], frames
    assert "invalid frame length" in frames[-1]["message"]
    client = peers.client(inprocess_coordinator)
    assert client.status(frames[3]["jobId"])["state"] == "QUEUED"
