"""Declared task types and scheduled jobs through a real coordinator (CONTRACT.md "Your own
task types", "Scheduled jobs"): routing by ``taskTypes``, known types across a restart,
SCHEDULED jobs that run when due, keep their time across a restart, and are queued by
recovery when they fell due while the coordinator was down."""

from __future__ import annotations

import itertools
import time

import pytest

from tests.support.peers import wait_no_worker
from tests.support.waiting import assert_stays

_serial = itertools.count(1)


def now_ms() -> int:
    return int(time.time() * 1000)


def own_type() -> str:
    """A task type no other test of this module declares."""
    return "GREET-%d" % next(_serial)


@pytest.fixture
def coordinator(shared_coordinator, peers):
    """The coordinator the module's tests share: each test's workers are the only live ones
    while it runs, its own types are its own, and it cancels the built-in jobs it leaves
    unfinished so that no later test's worker is given them. A test that restarts the
    coordinator has one of its own."""
    wait_no_worker(peers.client(shared_coordinator))
    return shared_coordinator


def test_jobs_are_routed_only_to_workers_that_declared_their_type(coordinator, peers):
    client = peers.client(coordinator)
    greet_type = own_type()
    # An undeclared type is refused and creates no job
    before = client.list_jobs(limit=1000)["jobs"]
    reply = client.submit(greet_type, {"name": "Ada"})
    assert reply["type"] == "ERROR" and greet_type in reply["message"]
    assert client.list_jobs(limit=1000)["jobs"] == before
    # Once a worker declares it, it is accepted and goes to that worker only
    plain = peers.worker(coordinator, "plain", capacity=2)
    greeter = peers.worker(coordinator, "greeter", capacity=2, task_types=[greet_type])
    greet = client.submit_ok(greet_type, {"name": "Ada"})
    sleep = client.submit_ok("SLEEP", {"durationMillis": 1})
    assert greeter.await_assign()["jobId"] == greet
    assert plain.await_assign()["jobId"] == sleep
    assert_stays(lambda: not greeter.poll_assign(0) and not plain.poll_assign(0), 0.3)
    items = {w["workerId"]: w for w in client.workers()}
    assert items["greeter"]["taskTypes"] == [greet_type]
    assert items["plain"]["taskTypes"] == ["FAIL", "PRIME_COUNT", "SHA256", "SLEEP", "WORD_COUNT"]
    assert client.cancel(sleep)["cancelled"] is True


def test_a_queued_job_without_a_free_worker_does_not_block_others(coordinator, peers):
    client = peers.client(coordinator)
    greet_type = own_type()
    greeter = peers.worker(coordinator, "greeter", capacity=1, task_types=[greet_type])
    plain = peers.worker(coordinator, "plain", capacity=1)
    first = client.submit_ok(greet_type, {})
    greeter.await_assign()
    blocked = client.submit_ok(greet_type, {}, priority="HIGH")
    runnable = client.submit_ok("SLEEP", {"durationMillis": 1}, priority="LOW")
    assert plain.await_assign()["jobId"] == runnable
    assert client.state(blocked) == "QUEUED" and client.state(first) == "RUNNING"
    assert client.cancel(runnable)["cancelled"] is True


def test_declared_types_survive_a_restart_with_no_worker_attached(coordinator_factory, peers):
    coord = coordinator_factory()
    peers.worker(coord, "greeter", task_types=["GREET", "resize.image"])
    client = peers.client(coord)
    wait_for = client.submit_ok("resize.image", {"w": 10})
    assert coord.terminate() == 0
    coord.start()
    client = peers.client(coord)
    assert client.state(wait_for) == "QUEUED"
    assert client.submit("GREET", {"name": "after restart"})["type"] == "JOB_SUBMITTED"
    assert client.submit("NEVER_DECLARED", {})["type"] == "ERROR"


def test_a_delayed_job_waits_scheduled_then_runs(coordinator, peers):
    client = peers.client(coordinator)
    worker = peers.worker(coordinator, "w-1", capacity=1)
    before = now_ms()
    job_id = client.submit_ok("SLEEP", {"durationMillis": 1}, delayMillis=400)
    snap = client.status(job_id)
    assert snap["state"] == "SCHEDULED"
    assert before + 400 - 2 <= snap["runAtMillis"] <= now_ms() + 400 + 2  # instants are core time + drift: ±1 ms
    assigned = worker.await_assign(timeout=5)
    assert assigned["jobId"] == job_id and now_ms() >= snap["runAtMillis"]
    assert job_id not in [j["jobId"] for j in client.list_jobs(state="SCHEDULED", limit=1000)["jobs"]]
    assert client.cancel(job_id)["cancelled"] is True


def test_a_scheduled_job_can_be_cancelled_and_never_runs(coordinator, peers):
    client = peers.client(coordinator)
    worker = peers.worker(coordinator, "w-1", capacity=1)
    job_id = client.submit_ok("SLEEP", {"durationMillis": 1}, runAtMillis=now_ms() + 300)
    reply = client.cancel(job_id)
    assert reply["cancelled"] is True and reply["job"]["state"] == "CANCELLED"
    assert_stays(lambda: worker.poll_assign(0) is None, 0.6)


@pytest.mark.parametrize("how", ["kill", "terminate"])
def test_schedules_survive_a_restart_and_overdue_ones_are_queued_by_recovery(coordinator_factory, peers, how):
    coord = coordinator_factory()
    client = peers.client(coord)
    far = now_ms() + 3_600_000
    later = client.submit_ok("SLEEP", {"durationMillis": 1}, runAtMillis=far)
    soon = client.submit_ok("SLEEP", {"durationMillis": 1}, delayMillis=300)
    due_at = client.status(soon)["runAtMillis"]
    if how == "kill":
        coord.kill()
    else:
        assert coord.terminate() == 0
    while now_ms() <= due_at:  # time passing is the behaviour: the job falls due while the coordinator is down
        time.sleep(0.05)
    coord.start()
    assert "due_while_down=1" in coord.stderr() and "scheduled=1" in coord.stderr()
    client = peers.client(coord)
    assert client.state(soon) == "QUEUED"
    kept = client.status(later)
    assert kept["state"] == "SCHEDULED" and kept["runAtMillis"] == far
    worker = peers.worker(coord, "w-1", capacity=2)
    assert worker.await_assign()["jobId"] == soon
    assert_stays(lambda: worker.poll_assign(0) is None, 0.3)
