"""AsyncClient against a misbehaving peer (``tests.support.scripted_server.ScriptedServer``, stdlib threads):
replies that never come, make no sense or come unasked, connections closed mid-request,
each costing only that connection, with the blocking client's errors."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys

import pytest

from jobmesh.aio import AsyncClient
from jobmesh.client.api import CoordinatorClient
from jobmesh.errors import CoordinatorUnavailable, SubmitRejected
from jobmesh.protocol.framing import encode_frame
from tests.support.scripted_server import CLOSE, Delayed, HANG, ScriptedServer

SNAP = {"jobId": "j-1", "taskType": "SLEEP", "state": "QUEUED", "attempts": 0, "maxAttempts": 3,
        "workerId": None, "result": None, "error": None, "createdAtMillis": 1, "updatedAtMillis": 1,
        "priority": "NORMAL"}
STATUS = {"type": "JOB_STATUS", "job": SNAP}


@pytest.fixture
def scripted():
    """``server = scripted(*steps)``: a ScriptedServer, closed at teardown."""
    servers: list[ScriptedServer] = []

    def make(*steps):
        servers.append(ScriptedServer(steps))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def on(server: ScriptedServer, **kwargs) -> AsyncClient:
    return AsyncClient("127.0.0.1:%d" % server.port, **kwargs)


def test_a_reply_that_never_comes_is_unavailable_and_a_cancel_is_not_sent_again(scripted):
    server = scripted(HANG)

    async def main() -> None:
        async with on(server, timeout=0.2) as client:
            with pytest.raises(CoordinatorUnavailable, match="no reply") as info:
                await client.cancel("j-1")
            assert type(info.value) is CoordinatorUnavailable

    asyncio.run(main())
    assert [r["type"] for r in server.requests] == ["CANCEL_JOB"]


@pytest.mark.parametrize("reply, says", [
    (b"\x00\x00\x00\x03abc", "not valid JSON"),
    ({"type": "WORKER_LIST", "workers": []}, "unexpected WORKER_LIST reply to GET_JOB_STATUS"),
    (encode_frame(STATUS) + encode_frame(STATUS), None),  # one reply too many: asked for by nobody
])
def test_a_reply_that_makes_no_sense_costs_its_connection(scripted, reply, says):
    server = scripted(reply, STATUS)

    async def main() -> None:
        async with on(server) as client:
            if says is None:
                assert await client.status("j-1") == SNAP
            else:
                with pytest.raises(CoordinatorUnavailable, match=says) as info:
                    await client.status("j-1")
                assert type(info.value) is CoordinatorUnavailable
            assert await client.status("j-1") == SNAP

    asyncio.run(main())
    assert server.connections == 2


def test_a_submit_whose_connection_closes_is_not_sent_again_but_a_read_is(scripted):
    server = scripted(STATUS, CLOSE, STATUS, CLOSE, {"type": "JOB_SUBMITTED", "jobId": "j-2"})

    async def main() -> None:
        async with on(server) as client:
            assert await client.status("j-1") == SNAP
            assert await client.status("j-1") == SNAP  # its connection closed: sent again
            with pytest.raises(CoordinatorUnavailable):
                await client.submit("SLEEP", {"durationMillis": 1})
            assert await client.submit("SLEEP", {"durationMillis": 1}) == "j-2"

    asyncio.run(main())
    assert [r["type"] for r in server.requests] == ["GET_JOB_STATUS"] * 3 + ["SUBMIT_JOB"] * 2
    assert server.connections == 3


def test_submit_retries_resubmit_a_retryable_rejection_only(scripted):
    rejected = {"type": "SUBMIT_REJECTED", "reason": "full", "activeCount": 1, "limit": 1, "retryable": True}
    server = scripted(rejected, rejected, {"type": "JOB_SUBMITTED", "jobId": "j-3"}, rejected,
                      dict(rejected, retryable=False))

    async def main() -> None:
        async with on(server) as client:
            assert await client.submit("SLEEP", {"durationMillis": 1}, submit_retries=5) == "j-3"
            with pytest.raises(SubmitRejected) as info:
                await client.submit("SLEEP", {"durationMillis": 1})
            assert (info.value.active_count, info.value.limit, info.value.retryable) == (1, 1, True)
            with pytest.raises(SubmitRejected):
                await client.submit("SLEEP", {"durationMillis": 1}, submit_retries=5)

    asyncio.run(main())
    assert len(server.requests) == 5


def test_both_clients_submit_take_the_same_arguments_and_send_the_same_request(scripted):
    assert inspect.signature(AsyncClient.submit).parameters.keys() == \
        inspect.signature(CoordinatorClient.submit).parameters.keys()
    options = dict(timeout_millis=5000, result_ttl_millis=60_000, concurrency_key="acme", unique_key="r:1")
    server = scripted({"type": "JOB_SUBMITTED", "jobId": "j-1"}, {"type": "JOB_SUBMITTED", "jobId": "j-2"})

    async def main() -> str:
        async with on(server) as client:
            return await client.submit("SLEEP", {"durationMillis": 1}, **options)

    assert asyncio.run(main()) == "j-1"
    with CoordinatorClient("127.0.0.1:%d" % server.port) as client:
        assert client.submit("SLEEP", {"durationMillis": 1}, **options) == "j-2"
    sent, again = server.requests
    assert sent == again
    assert (sent["timeoutMillis"], sent["resultTtlMillis"], sent["concurrencyKey"], sent["uniqueKey"]) == (
        5000, 60_000, "acme", "r:1")


def test_the_reply_timeout_of_a_wait_covers_the_wait(scripted):
    done = dict(SNAP, state="COMPLETED", result={})
    server = scripted(Delayed(0.5, {"type": "JOB_STATUS", "job": done}))

    async def main() -> None:
        async with on(server, timeout=0.2) as client:
            assert await client.wait("j-1", timeout=5) == done

    asyncio.run(main())
    [request] = server.requests
    assert request["type"] == "WAIT_JOB" and 4900 <= request["timeoutMillis"] <= 5000


def test_importing_it_brings_in_no_gevent():
    # It runs inside an asyncio application: gevent (and its patching) stays out.
    code = "import sys, jobmesh.aio; print(sorted(m for m in sys.modules if m.split('.')[0] == 'gevent'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
