"""CoordinatorClient against a real coordinator: every method, the error tree, retries, threads."""

from __future__ import annotations

import threading

import pytest

from jobmesh.client import CoordinatorClient, WaitTimeout
from jobmesh.errors import CoordinatorUnavailable, RequestFailed, SubmitRejected
from jobmesh.protocol import messages
from jobmesh.protocol.jobs import JobState, Priority


@pytest.fixture
def coordinator(shared_coordinator):
    """The coordinator the module's tests share: no worker ever joins it, and a test checks
    only the jobs it added (``added_since``). A test that starts a worker, lists every job or
    restarts the coordinator has one of its own."""
    return shared_coordinator


def job_ids(client) -> set[str]:
    return {j["jobId"] for j in client.iter_jobs()}


def added_since(client, before: set[str]) -> list[str]:
    """The ids of the jobs not in ``before``, newest first."""
    return [j["jobId"] for j in client.iter_jobs() if j["jobId"] not in before]


def test_submit_status_wait_cancel(coordinator_factory, worker_procs):
    coordinator = coordinator_factory()  # of its own: a real worker joins, and the worker list is checked
    with CoordinatorClient(*coordinator.client_addr) as client:
        # Given a queued job (no worker yet)
        job_id = client.submit("SLEEP", {"durationMillis": 10}, max_attempts=2, priority=Priority.HIGH)
        job = client.status(job_id)
        assert (job["jobId"], job["state"], job["maxAttempts"], job["priority"]) == (job_id, "QUEUED", 2, "HIGH")
        # wait times out with the snapshot as it stood
        with pytest.raises(WaitTimeout) as info:
            client.wait(job_id, timeout=0.1)
        assert info.value.job["state"] == "QUEUED"

        # When a worker arrives, the job completes
        worker_procs.start(coordinator, "w-api", capacity=2)
        assert client.wait(job_id, timeout=10)["result"] == {"sleptMillis": 10}
        assert [w["workerId"] for w in client.workers()] == ["w-api"]

        # cancel of a finished job changes nothing; of a running one cancels it
        assert client.cancel(job_id) == (False, client.status(job_id))
        long_id = client.submit("SLEEP", {"durationMillis": 600_000})
        cancelled, snap = client.cancel(long_id)
        assert cancelled is True and snap["state"] == "CANCELLED"
        assert client.wait(long_id, timeout=1)["state"] == "CANCELLED"


def test_list_pages_and_filters(coordinator_factory):
    coordinator = coordinator_factory()  # of its own: the pages are of every job
    with CoordinatorClient(*coordinator.client_addr) as client:
        ids = [client.submit("SHA256", {"text": str(i)}) for i in range(7)]
        client.cancel(ids[0])
        jobs, cursor = client.list_jobs(limit=3)
        assert [j["jobId"] for j in jobs] == ids[::-1][:3]
        assert cursor is not None
        assert [j["jobId"] for j in client.iter_jobs(page_size=2)] == ids[::-1]
        assert [j["jobId"] for j in client.iter_jobs(state=JobState.CANCELLED)] == [ids[0]]
        assert len(list(client.iter_jobs(state="QUEUED"))) == 6


def test_error_replies(coordinator):
    with CoordinatorClient(*coordinator.client_addr) as client:
        with pytest.raises(RequestFailed):
            client.status("no-such-job")
        with pytest.raises(RequestFailed):
            client.cancel("no-such-job")
        with pytest.raises(RequestFailed):
            client.submit("PRIME_COUNT", {"limit": 1})
        with pytest.raises(RequestFailed):
            client.submit("NOPE", {})
        first = client.submit("SHA256", {"text": "a"}, idempotency_key="key-1")
        assert client.submit("SHA256", {"text": "a"}, idempotency_key="key-1") == first
        with pytest.raises(RequestFailed):
            client.submit("SHA256", {"text": "different"}, idempotency_key="key-1")
        # the connection survived every ERROR
        assert client.status(first)["jobId"] == first


def test_submit_retries_wait_out_an_overload(coordinator_factory, worker_procs):
    coord = coordinator_factory(max_active_jobs=1)
    with CoordinatorClient(*coord.client_addr) as client:
        # Given the coordinator full with one job
        blocker = client.submit("SLEEP", {"durationMillis": 300})
        # Then a plain submit is rejected with the numbers
        with pytest.raises(SubmitRejected) as info:
            client.submit("SLEEP", {"durationMillis": 1})
        assert (info.value.active_count, info.value.limit, info.value.retryable) == (1, 1, True)
        # When a worker drains it, a submit with retries gets through
        worker_procs.start(coord, "w-drain", capacity=1)
        job_id = client.submit("SLEEP", {"durationMillis": 1}, submit_retries=30)
        assert client.wait(job_id, timeout=10)["state"] == "COMPLETED"
        # and it was admitted only once the first job had made room
        first = client.status(blocker)
        assert first["state"] == "COMPLETED"
        assert client.status(job_id)["createdAtMillis"] >= first["updatedAtMillis"]


def test_unavailable_then_reconnects(coordinator_factory):
    coordinator = coordinator_factory()  # of its own: it is killed and started again
    client = CoordinatorClient(*coordinator.client_addr, connect_timeout=1, timeout=2)
    worker_port, client_port = coordinator.worker_addr[1], coordinator.client_addr[1]
    try:
        job_id = client.submit("SHA256", {"text": "kept"})
        coordinator.kill()
        with pytest.raises(CoordinatorUnavailable):
            client.submit("SHA256", {"text": "lost"})
        with pytest.raises(CoordinatorUnavailable):
            client.status(job_id)
        # the same client object works again once a coordinator is back on the port
        coordinator.start(worker_port=worker_port, client_port=client_port)
        assert client.status(job_id)["state"] == "QUEUED"
    finally:
        client.close()


def test_one_client_shared_by_threads(coordinator):
    ids: list[str] = []
    errors: list[BaseException] = []
    with CoordinatorClient(*coordinator.client_addr) as client:
        before = job_ids(client)

        def submit_many():
            try:
                for i in range(25):
                    ids.append(client.submit("SHA256", {"text": str(i)}))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=submit_many) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert not errors
        assert len(set(ids)) == 100
        assert sorted(added_since(client, before)) == sorted(ids)


def test_the_client_takes_host_colon_port_as_the_cli_does(coordinator):
    host, port = coordinator.client_addr
    with CoordinatorClient("%s:%d" % (host, port)) as client:
        assert (client.host, client.port) == (host, port)
        assert client.stats().jobs is not None
    with pytest.raises(ValueError, match="HOST:PORT"):
        CoordinatorClient("%s:notaport" % host)


@pytest.mark.parametrize("bad, named", [
    ({"payload": [1]}, "payload must be a dict"),
    ({"priority": 2}, "priority must be a str or None"),
    ({"idempotency_key": 123}, "idempotency_key must be a str or None"),
    ({"max_attempts": "3"}, "max_attempts must be an int"),
    ({"task_type": None}, "task_type must be a str"),
])
def test_a_wrongly_typed_argument_is_named_and_the_next_call_works(coordinator, bad, named):
    with CoordinatorClient(*coordinator.client_addr) as client:
        before = job_ids(client)
        args = {"task_type": "SHA256", "payload": {"text": "a"}, **bad}
        with pytest.raises(TypeError, match=named):
            client.submit(**args)
        job_id = client.submit("SHA256", {"text": "b"})
        assert client.status(job_id)["state"] == "QUEUED"
        assert added_since(client, before) == [job_id]  # the refused submit created nothing


def test_the_call_after_a_refusal_that_closed_the_connection_goes_on_a_fresh_one(coordinator, monkeypatch):
    # Given a request the library does not catch (as from an older library), which the
    # coordinator refuses as a protocol violation and then closes the connection
    monkeypatch.setattr(messages.SubmitJob, "check_types", lambda self: None)
    with CoordinatorClient(*coordinator.client_addr) as client:
        before = job_ids(client)
        first = client.submit("SHA256", {"text": "a"})
        with pytest.raises(RequestFailed, match="payload"):
            client.submit("SHA256", [1])
        # Then the next write and the next read both succeed, on a fresh connection
        second = client.submit("SHA256", {"text": "b"})
        with pytest.raises(RequestFailed, match="idempotencyKey"):
            client.submit("SHA256", {"text": "c"}, idempotency_key=123)
        assert added_since(client, before) == [second, first]
