"""The in-process coordinator host (tests/support/inprocess.py) that other tests stand on:
it serves the real ports from a hub thread, logs as its own thread, stops cleanly (its
ports closed, its database released for a restart), and leaves the test process unpatched."""

from __future__ import annotations

import socket

import gevent.monkey
import pytest

from tests.support.peers import Client
from tests.support.inprocess import InProcessCoordinator


def test_it_serves_logs_stops_and_restarts_on_its_database(tmp_path):
    host = InProcessCoordinator(tmp_path).start()
    try:
        # It serves the client port, and its core answers a call made on its hub
        client = Client(host.client_addr)
        job_id = client.submit_ok("SLEEP", {"durationMillis": 1})
        assert host.running()
        assert host.call(lambda coordinator: coordinator.core.active_count) == 1
        assert "listening worker=" in host.log()
        client.close()
    finally:
        host.stop()
    # Once stopped, its ports are closed and the process is as unpatched as before
    assert not host.running()
    with pytest.raises(OSError):
        socket.create_connection(host.client_addr, timeout=2).close()
    assert not gevent.monkey.is_anything_patched()
    # And a new start on the same database finds the job it acknowledged
    again = InProcessCoordinator(tmp_path).start()
    try:
        client = Client(again.client_addr)
        assert client.status(job_id)["state"] == "QUEUED"
        # (each logs its own lines only)
        assert "recovered" in again.log() and again.log().count("listening worker=") == 1
        assert host.log().count("listening worker=") == 1
        client.close()
    finally:
        again.stop()


def test_a_start_that_fails_raises_its_error(tmp_path):
    # A database path in a directory that does not exist cannot be opened
    host = InProcessCoordinator(tmp_path, db=str(tmp_path / "missing" / "x.db"))
    with pytest.raises(Exception) as info:
        host.start()
    assert "missing" in str(info.value)
    assert not host.running()
