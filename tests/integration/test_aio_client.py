"""jobmesh.aio.AsyncClient against real coordinators and a real worker: every method, many
coroutines on one connection, waits beside other requests, tokens, TLS, address lists, a
coordinator going away, and bad input giving the blocking client's errors.

Each test drives its coroutines with ``asyncio.run``. The stateless tests share one
coordinator and one worker (``shared``); token and TLS tests share another.
"""

from __future__ import annotations

import ast
import asyncio
import re
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest

from jobmesh import auth
from jobmesh.aio import AsyncClient
from jobmesh.client import CoordinatorClient, WaitTimeout
from jobmesh.client.api import submit_request
from jobmesh.errors import ConfigError, CoordinatorUnavailable, InvalidRequest, RequestFailed, RequestTooLarge
from jobmesh.protocol import messages
from jobmesh.protocol.jobs import JobState, Priority
from tests.support.peers import wait_registered
from tests.support.processes import CoordinatorProc, WorkerProc, closed_address
from tests.support.waiting import wait_until
from tests.tls_support import make_certs

LONG = {"durationMillis": 600_000}  # a SLEEP that runs until it is cancelled


@pytest.fixture(scope="module")
def shared(module_coordinator, tmp_path_factory):
    """The module's coordinator, with one real worker attached."""
    worker = WorkerProc(tmp_path_factory.mktemp("aio-worker"), module_coordinator.worker_target, "w-aio",
                        capacity=4).start()
    with CoordinatorClient(module_coordinator.client_target) as client:
        wait_registered(client, ["w-aio"])
    yield module_coordinator
    worker.cleanup()


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """A coordinator with TLS on its ports and an auth file: ``.certs``, ``.token`` (client role)."""
    directory = tmp_path_factory.mktemp("aio-secured")
    certs = make_certs(directory)
    auth_file = directory / "auth.toml"
    token = auth.new_token(str(auth_file), "aio", "client")
    proc = CoordinatorProc(directory, auth_file=auth_file, tls_cert=certs.server, tls_key=certs.server_key)
    proc.start()
    proc.certs, proc.token = certs, token
    yield proc
    proc.cleanup()


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


def count_connections(loop: asyncio.AbstractEventLoop) -> list[int]:
    """Count the connections the loop opens from now on (one entry per connection)."""
    opened: list[int] = []
    create = loop.create_connection

    async def counting(*args: Any, **kwargs: Any) -> Any:
        opened.append(1)
        return await create(*args, **kwargs)

    loop.create_connection = counting  # type: ignore[method-assign]
    return opened


# ---- the methods ----------------------------------------------------------------------


def test_every_method_against_a_real_worker(shared):
    async def main() -> None:
        async with AsyncClient(shared.client_target) as client:
            # Given a job a worker runs, and one scheduled an hour ahead
            done_id = await client.submit("SLEEP", {"durationMillis": 5}, max_attempts=2, priority=Priority.HIGH)
            later_id = await client.submit("SHA256", {"text": "later"}, delay=3600)
            # Then wait returns the finished snapshot, and status agrees
            finished = await client.wait(done_id, timeout=30)
            assert (finished["state"], finished["result"]) == ("COMPLETED", {"sleptMillis": 5})
            assert (finished["maxAttempts"], finished["priority"]) == (2, "HIGH")
            assert await client.status(done_id) == finished
            assert (await client.status(later_id))["state"] == "SCHEDULED"
            # a wait that runs out of time says how the job stood
            with pytest.raises(WaitTimeout) as info:
                await client.wait(later_id, timeout=0.05)
            assert info.value.job["state"] == "SCHEDULED"
            # listings are newest first, filtered, paged
            jobs, cursor = await client.list_jobs(limit=1)
            assert [j["jobId"] for j in jobs] == [later_id] and cursor is not None
            jobs, _ = await client.list_jobs(state=JobState.SCHEDULED, task_type="SHA256")
            assert later_id in [j["jobId"] for j in jobs]
            pages = client.iter_jobs(page_size=1)
            assert [(await anext(pages))["jobId"] for _ in range(2)] == [later_id, done_id]
            # cancel: of a finished job nothing; of a scheduled one, cancelled
            assert await client.cancel(done_id) == (False, finished)
            cancelled, snap = await client.cancel(later_id)
            assert cancelled is True and snap["state"] == "CANCELLED"
            # the rest of the blocking client's methods
            assert [e["event"] for e in await client.events(done_id)][0] == "SUBMITTED"
            assert await client.payload(later_id) == {"text": "later"}
            with pytest.raises(RequestFailed, match="unknown job"):
                await client.payload("no-such-job")
            again = await client.retry(done_id)
            assert (await client.wait(again, timeout=30))["state"] == "COMPLETED"
            assert "w-aio" in [w["workerId"] for w in await client.workers()]
            assert (await client.stats()).submitted >= 3
            purged, _ = await client.purge(3_600_000, dry_run=True)
            assert purged == 0
            reply = await client.request(messages.GetJobStatus(done_id), messages.JobStatus, idempotent=True)
            assert reply.job["jobId"] == done_id

    run(main())


def test_recurring_schedules(shared):
    async def main() -> None:
        async with AsyncClient(shared.client_target) as client:
            made = await client.schedules.put("aio-hourly", "SHA256", {"text": "tick"}, every=3600, paused=True)
            assert (made["name"], made["everyMillis"], made["paused"]) == ("aio-hourly", 3_600_000, True)
            assert (await client.schedules.resume("aio-hourly"))["paused"] is False
            assert (await client.schedules.pause("aio-hourly"))["paused"] is True
            assert "aio-hourly" in [s["name"] for s in await client.schedules.list()]
            job_id = await client.schedules.trigger("aio-hourly")
            assert (await client.wait(job_id, timeout=30))["state"] == "COMPLETED"
            assert job_id in [j["jobId"] for j in (await client.schedules.get("aio-hourly"))["recentJobs"]]
            times = await client.schedules.preview(cron="0 * * * *", timezone="Europe/Paris", start=0, count=3)
            assert [(t.minute, t.utcoffset()) for t in times] == [(0, timedelta(hours=1))] * 3
            assert (await client.schedules.delete("aio-hourly"))["name"] == "aio-hourly"
            with pytest.raises(RequestFailed):
                await client.schedules.get("aio-hourly")

    run(main())


def test_limits_and_submits_with_keys(shared):
    async def main() -> None:
        async with AsyncClient(shared.client_target) as client:
            # Given WORD_COUNT paused (with a limit of its own), a submit waits for it
            made = await client.limits.put("WORD_COUNT", max_running=2, max_running_per_key=1)
            assert (made["taskType"], made["maxRunning"], made["maxRunningPerKey"], made["paused"]) == (
                "WORD_COUNT", 2, 1, False)
            assert (await client.limits.pause("WORD_COUNT"))["paused"] is True
            job_id = await client.submit("WORD_COUNT", {"text": "a b"}, concurrency_key="acme", unique_key="wc-1")
            # a second submit with the unique key makes nothing and names the first job
            again = await client.send_submit(submit_request("WORD_COUNT", {"text": "a b"}, unique_key="wc-1"))
            assert (again.job_id, again.duplicate) == (job_id, True)
            assert await client.submit("WORD_COUNT", {"text": "a b"}, unique_key="wc-1") == job_id
            snapshot = await client.status(job_id)
            assert (snapshot["concurrencyKey"], snapshot["uniqueKey"]) == ("acme", "wc-1")
            assert (await client.limits.get("WORD_COUNT"))["queued"] == 1
            assert "WORD_COUNT" in [lim["taskType"] for lim in await client.limits.list()]
            # When it is resumed the job runs
            assert (await client.limits.resume("WORD_COUNT"))["paused"] is False
            assert (await client.wait(job_id, timeout=30))["result"] == {"words": 2}
            assert (await client.limits.delete("WORD_COUNT"))["maxRunning"] == 2
            assert (await client.limits.get("WORD_COUNT"))["maxRunning"] is None
            with pytest.raises(TypeError, match="burst must be an int"):
                await client.limits.put("WORD_COUNT", rate_per_second=1, burst=1.5)  # type: ignore[arg-type]

    run(main())


def test_two_hundred_coroutines_share_one_connection(shared):
    async def main() -> None:
        opened = count_connections(asyncio.get_running_loop())
        async with AsyncClient(shared.client_target) as client:
            # When 200 coroutines submit at once, each a job of its own shape
            ids = await asyncio.gather(*(
                client.submit("SHA256", {"text": "c%d" % i}, max_attempts=1 + i % 7, priority="LOW")
                for i in range(200)))
            assert len(set(ids)) == 200
            # Then every one asks for its job's status at once, with unknown ids among them
            asked = [job_id if i % 10 else "no-such-%d" % i for i, job_id in enumerate(ids)]
            answers = await asyncio.gather(*(client.status(job_id) for job_id in asked), return_exceptions=True)
            for i, (job_id, answer) in enumerate(zip(asked, answers)):
                if i % 10 == 0:
                    assert isinstance(answer, RequestFailed) and job_id in answer.message
                else:
                    assert isinstance(answer, dict)
                    assert (answer["jobId"], answer["maxAttempts"], answer["priority"]) == (job_id, 1 + i % 7, "LOW")
        assert len(opened) == 1

    run(main())


def test_a_pending_wait_holds_up_no_other_request(shared):
    async def main() -> None:
        async with AsyncClient(shared.client_target) as client:
            # Given two waits pending on jobs that are not due for an hour
            first, second = [await client.submit("SLEEP", {"durationMillis": 1}, delay=3600) for _ in range(2)]
            waits = [asyncio.ensure_future(client.wait(job_id)) for job_id in (first, second)]
            await wait_pending(client, 2)
            # Then the client's other requests are answered meanwhile
            other = await client.submit("SHA256", {"text": "beside a wait"})
            assert (await client.status(first))["state"] == "SCHEDULED"
            assert await client.wait(other, timeout=30)
            assert not any(w.done() for w in waits)
            # and each wait ends when its own job does, in any order
            await client.cancel(second)
            assert (await waits[1])["state"] == "CANCELLED"
            assert not waits[0].done()
            await client.cancel(first)
            assert (await waits[0])["state"] == "CANCELLED"
            # A cancelled wait leaves the client working
            third = await client.submit("SLEEP", {"durationMillis": 1}, delay=3600)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(client.wait(third), 0.05)
            await client.cancel(third)
            assert (await client.wait(third, timeout=30))["state"] == "CANCELLED"

    run(main())


async def wait_pending(client: AsyncClient, count: int) -> None:
    """Until the coordinator holds at least ``count`` pending waits."""
    while (await client.stats()).waits < count:
        await asyncio.sleep(0.01)


# ---- the same errors ------------------------------------------------------------------

BAD_CALLS: list[tuple[str, tuple, dict]] = [
    ("submit", ("SHA256", [1]), {}),
    ("submit", ("SHA256", {"text": "a"}), {"priority": 2}),
    ("submit", ("SHA256", {"text": "a"}), {"idempotency_key": 123}),
    ("submit", ("SHA256", {"text": "a"}), {"max_attempts": "3"}),
    ("submit", (None, {"text": "a"}), {}),
    ("submit", ("SHA256", {"text": "\ud800"}), {}),
    ("submit", ("SHA256", {"text": "x" * (1 << 20)}), {}),
    ("submit", ("SHA256", {"text": "a"}), {"run_at": datetime(2030, 1, 1)}),
    ("submit", ("SHA256", {"text": "a"}), {"delay": 1, "run_at": 1}),
    ("submit", ("PRIME_COUNT", {"limit": 1}), {}),
    ("submit", ("NOPE", {}), {}),
    ("submit", ("SHA256", {"text": "other"}), {"idempotency_key": "aio-key"}),
    ("status", ("no-such-job",), {}),
    ("cancel", ("no-such-job",), {}),
    ("events", ("no-such-job",), {}),
    ("retry", ("no-such-job",), {}),
    ("purge", (-1,), {}),
    ("list_jobs", (0,), {}),
]


def test_bad_input_gives_the_blocking_clients_errors(shared):
    with CoordinatorClient(shared.client_target) as blocking:
        blocking.submit("SHA256", {"text": "a"}, idempotency_key="aio-key")
        expected = [caught(lambda: getattr(blocking, name)(*args, **kwargs)) for name, args, kwargs in BAD_CALLS]

    async def main() -> list[BaseException]:
        async with AsyncClient(shared.client_target) as client:
            got = [await caught_async(lambda: getattr(client, name)(*args, **kwargs))
                   for name, args, kwargs in BAD_CALLS]
            assert (await client.status(await client.submit("SHA256", {"text": "b"})))["state"]
            return got

    got = run(main())
    assert [(type(e), str(e)) for e in got] == [(type(e), str(e)) for e in expected]
    kinds = {type(e) for e in got}
    assert {TypeError, ValueError, InvalidRequest, RequestTooLarge, RequestFailed} <= kinds


def caught(call: Callable[[], Any]) -> BaseException:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - compared by the caller
        return exc
    raise AssertionError("no error")


async def caught_async(call: Callable[[], Awaitable[Any]]) -> BaseException:
    try:
        await call()
    except Exception as exc:  # noqa: BLE001 - compared by the caller
        return exc
    raise AssertionError("no error")


def test_the_requests_after_a_refusal_that_closed_the_connection_go_on_a_fresh_one(shared, monkeypatch):
    # Given requests the library does not catch (as from an older library), which the
    # coordinator refuses as a protocol violation, closing the connection
    monkeypatch.setattr(messages.SubmitJob, "check_types", lambda self: None)

    async def main() -> None:
        async with AsyncClient(shared.client_target) as client:
            first = await client.submit("SHA256", {"text": "a"})
            with pytest.raises(RequestFailed, match="payload"):
                await client.submit("SHA256", [1])  # type: ignore[arg-type]
            # Then the next writes, sent at once, all succeed on a fresh connection
            more = await asyncio.gather(*(client.submit("SHA256", {"text": str(i)}) for i in range(5)))
            assert [j["jobId"] for j in (await client.list_jobs(limit=6))[0]] == more[::-1] + [first]

    run(main())


# ---- addresses, a coordinator going away, tokens and TLS ------------------------------


def test_an_address_list_whose_first_address_is_dead(shared):
    async def main() -> None:
        async with AsyncClient([closed_address(), shared.client_target]) as client:
            job_id = await client.submit("SHA256", {"text": "second address"})
            assert (await client.wait(job_id, timeout=30))["state"] == "COMPLETED"
            assert "%s:%d" % (client.host, client.port) == shared.client_target
        with pytest.raises(CoordinatorUnavailable, match="Connection refused"):
            async with AsyncClient([closed_address(), closed_address()]) as client:
                await client.status("any")

    run(main())
    with pytest.raises(ValueError, match="HOST:PORT"):
        AsyncClient("127.0.0.1:notaport")


def test_a_coordinator_going_away_and_coming_back(coordinator):
    worker_port, client_port = coordinator.worker_addr[1], coordinator.client_addr[1]

    async def main() -> None:
        rides = AsyncClient(coordinator.client_target)
        gives_up = AsyncClient(coordinator.client_target, failover_timeout=0.2)
        try:
            # Given a wait pending on a job not due for an hour, and a connection in use
            job_id = await rides.submit("SLEEP", {"durationMillis": 1}, delay=3600)
            waiting = asyncio.ensure_future(rides.wait(job_id))
            await wait_pending(rides, 1)
            assert (await gives_up.status(job_id))["state"] == "SCHEDULED"
            # When the coordinator dies, a submit and a read fail with the public error
            coordinator.kill()
            for call in (lambda: gives_up.submit("SHA256", {"text": "lost"}), lambda: gives_up.status(job_id)):
                with pytest.raises(CoordinatorUnavailable) as info:
                    await call()
                assert type(info.value) is CoordinatorUnavailable
            # Then once it is back on its port, the same clients work, and the wait,
            # sent again, ends when the job does
            await asyncio.to_thread(coordinator.start, worker_port=worker_port, client_port=client_port)
            assert (await gives_up.status(job_id))["state"] == "SCHEDULED"
            await wait_pending(rides, 1)
            await rides.cancel(job_id)
            assert (await waiting)["state"] == "CANCELLED"
        finally:
            await rides.close()
            await gives_up.close()

    run(main())


def test_a_token(secured):
    async def main() -> None:
        tls = {"tls_ca": str(secured.certs.ca)}
        async with AsyncClient(secured.client_target, secured.token, **tls) as client:
            job_id = await client.submit("SHA256", {"text": "with a token"})
            assert (await client.status(job_id))["submittedBy"] == "aio"
        for token, says in ((None, "authentication required"), ("wrong", "authentication failed")):
            async with AsyncClient(secured.client_target, token, **tls) as client:
                with pytest.raises(RequestFailed, match=says):
                    await client.status(job_id)

    run(main())


def test_tls(secured):
    async def main() -> None:
        certs = secured.certs
        async with AsyncClient(secured.client_target, secured.token, tls_ca=str(certs.ca)) as client:
            # many requests at once over one TLS connection
            ids = await asyncio.gather(*(client.submit("SHA256", {"text": str(i)}) for i in range(50)))
            assert [s["jobId"] for s in await asyncio.gather(*map(client.status, ids))] == ids
        async with AsyncClient(secured.client_target, secured.token, tls_ca=str(certs.stranger_ca)) as client:
            with pytest.raises(CoordinatorUnavailable, match="certificate"):
                await client.status(ids[0])
        async with AsyncClient(secured.client_target, secured.token) as plaintext:
            with pytest.raises(CoordinatorUnavailable):
                await plaintext.status(ids[0])

    run(main())
    with pytest.raises(ConfigError, match="cannot read"):
        AsyncClient("127.0.0.1:1", tls_ca="/no/such/ca.pem")


def test_a_client_made_outside_a_loop_serves_one_loop_after_another(shared):
    client = AsyncClient(shared.client_target)
    job_id = run(client.submit("SHA256", {"text": "first loop"}))
    assert run(client.status(job_id))["jobId"] == job_id
    run(client.close())
    assert wait_until(lambda: run(client.status(job_id))["state"] == "COMPLETED", timeout=30)


def test_the_readme_examples(shared, capsys):
    # The asyncio script runs as written (against this coordinator); the FastAPI service,
    # whose packages are not installed here, is at least Python.
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## From asyncio"):]
    script, service = re.findall(r"```python\n(.*?)```", section, re.S)[:2]
    exec(compile(script.replace("127.0.0.1:7071", shared.client_target), "README.md", "exec"), {})
    assert capsys.readouterr().out.startswith("100 jobs submitted\nCOMPLETED {'sha256': ")
    ast.parse(service)
