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
