"""Admission control and idempotent submission (PROTOCOL.md, SUBMIT_REJECTED and idempotencyKey).

With --max-active-jobs=N a new submission beyond N active (non-terminal) jobs gets
SUBMIT_REJECTED {reason, activeCount, limit, retryable=true} and creates nothing; retries
of admitted jobs never pass admission. A known idempotencyKey with the same logical request
(taskType, payload, effective maxAttempts, priority with null = NORMAL) returns the original
jobId, even after the job ended and even at the limit; a different request is an ERROR and
the original is left untouched.

The checks that need no limit share one coordinator per store: each uses keys of its
own, its workers declare a task type of their own, and it compares the job list before
and after.
"""

from __future__ import annotations

import itertools

import pytest

from tests.pg_support import on_both_stores
from tests.support.waiting import wait_until


_serial = itertools.count(1)


def unique(prefix: str) -> str:
    """An idempotency key or task type no other test of this module uses."""
    return "%s-%d" % (prefix, next(_serial))


def declare(peers, coordinator, client, task_type: str) -> None:
    """Make ``task_type`` known (a worker declares it) and leave no worker for it."""
    worker_id = "w-declares-" + task_type
    peers.worker(coordinator, worker_id, capacity=1, task_types=[task_type]).close()
    wait_until(lambda: worker_id not in [w["workerId"] for w in client.workers()], timeout=3,
               message="the declaring worker gone")


def job_ids(client) -> list[str]:
    """Every job's id, newest first."""
    reply = client.list_jobs(limit=1000)
    assert reply["nextCursor"] is None, "more jobs than one page"
    return [j["jobId"] for j in reply["jobs"]]


def assert_rejected(reply: dict, active: int, limit: int) -> None:
    assert reply["type"] == "SUBMIT_REJECTED", reply
    assert isinstance(reply["reason"], str) and reply["reason"]
    assert reply["activeCount"] == active
    assert reply["limit"] == limit
    assert reply["retryable"] is True


@on_both_stores
def test_submit_beyond_the_limit_is_rejected_until_a_job_ends(coordinator_factory, peers):
    # Given --max-active-jobs=3 and three active jobs (no worker, so they stay QUEUED)
    coord = coordinator_factory(max_active_jobs=3)
    client = peers.client(coord)
    admitted = [client.submit_ok("SLEEP", {"durationMillis": 1}) for _ in range(3)]

    # When a fourth is submitted
    reply = client.submit("SLEEP", {"durationMillis": 1})

    # Then it is rejected as retryable overload, and no job is created
    assert_rejected(reply, active=3, limit=3)
    assert sorted(job_ids(client)) == sorted(admitted)
    # and the connection stays usable
    assert client.status(admitted[0])["state"] == "QUEUED"

    # When one job completes
    worker = peers.worker(coord, "w-adm", capacity=1)
    a = worker.await_assign()
    worker.complete(a, {"sleptMillis": 1})
    client.wait_state(a["jobId"], "COMPLETED")

    # Then a workflow of two jobs, with room for one, is refused whole: nothing is made
    sleep = {"taskType": "SLEEP", "payload": {"durationMillis": 1}}
    flow = client.request({"type": "SUBMIT_WORKFLOW", "jobs": [dict(sleep, ref="a"), dict(sleep, ref="b")]})
    assert_rejected(flow, active=2, limit=3)
    assert sorted(job_ids(client)) == sorted(admitted)

    # And a submission is admitted again, and the next one is rejected again
    fourth = client.submit_ok("SLEEP", {"durationMillis": 1})
    assert fourth not in admitted
    assert_rejected(client.submit("SLEEP", {"durationMillis": 1}), active=3, limit=3)
    assert len(job_ids(client)) == 4


@pytest.mark.parametrize("ending", ["cancel", "fail"])
def test_every_way_of_ending_frees_admission(coordinator_factory, peers, ending):
    # Given the limit of 1 reached
    coord = coordinator_factory(max_active_jobs=1)
    client = peers.client(coord)
    first = client.submit_ok("SLEEP", {"durationMillis": 1}, max_attempts=1)
    assert_rejected(client.submit("SLEEP", {"durationMillis": 1}), active=1, limit=1)

    # When the job ends by cancellation or by failing its last attempt
    if ending == "cancel":
        assert client.cancel(first)["cancelled"] is True
    else:
        worker = peers.worker(coord, "w-end", capacity=1)
        worker.fail(worker.await_assign(), "gave up")
        client.wait_state(first, "FAILED")

    # Then a new job is admitted
    client.submit_ok("SLEEP", {"durationMillis": 1})


def test_retries_never_pass_admission(coordinator_factory, peers):
    # Given --max-active-jobs=1 and an admitted job that fails its first attempt
    coord = coordinator_factory(max_active_jobs=1)
    client = peers.client(coord)
    worker = peers.worker(coord, "w-rt", capacity=1)
    job_id = client.submit_ok("FAIL", {"failUntilAttempt": 2}, max_attempts=3)
    worker.fail(worker.await_assign(), "attempt 1 failed")

    # Then a new submission is still rejected (the retrying job is active)
    assert_rejected(client.submit("SLEEP", {"durationMillis": 1}), active=1, limit=1)

    # And the retry itself is not gated: attempt 2 is assigned although the coordinator is at its limit
    second = worker.await_assign()
    assert (second["jobId"], second["attemptNumber"]) == (job_id, 2)
    assert_rejected(client.submit("SLEEP", {"durationMillis": 1}), active=1, limit=1)
    worker.complete(second, {"attempt": 2})
    client.wait_state(job_id, "COMPLETED")
    client.submit_ok("SLEEP", {"durationMillis": 1})


@on_both_stores
def test_same_key_same_request_returns_the_same_job(shared_on_store, peers):
    # Given a job submitted with an idempotency key (of a type that only this test's worker runs)
    coordinator = shared_on_store
    client = peers.client(coordinator)
    task_type = unique("SAME")
    declare(peers, coordinator, client, task_type)
    request = dict(task_type=task_type, payload={"text": "abc"}, max_attempts=2, idempotencyKey=unique("k-same"),
                   priority="HIGH")
    earlier = job_ids(client)
    job_id = client.submit_ok(**request)

    # When the same request is submitted again, on this and on another connection
    again = client.submit(**request)
    other = peers.client(coordinator).submit(**request)

    # Then the reply is indistinguishable from the first success, and no new job exists
    assert again == {"type": "JOB_SUBMITTED", "jobId": job_id}
    assert other == {"type": "JOB_SUBMITTED", "jobId": job_id}
    assert job_ids(client) == [job_id] + earlier

    # And the same holds after the job has completed, without running it again
    worker = peers.worker(coordinator, "w-key-" + task_type, capacity=1, task_types=[task_type])
    a = worker.await_assign()
    worker.complete(a, {"sha256": "0" * 64})
    client.wait_state(job_id, "COMPLETED")
    assert client.submit(**request) == {"type": "JOB_SUBMITTED", "jobId": job_id}
    assert worker.poll_assign(0.2) is None
    snap = client.status(job_id)
    assert (snap["state"], snap["attempts"]) == ("COMPLETED", 1)
    assert job_ids(client) == [job_id] + earlier


@on_both_stores
@pytest.mark.parametrize("ending", ["fail", "cancel"])
def test_key_stays_bound_after_failure_or_cancel(shared_on_store, peers, ending):
    coordinator = shared_on_store
    client = peers.client(coordinator)
    task_type, key = unique("END"), unique("k-end")
    if ending == "cancel":
        declare(peers, coordinator, client, task_type)
    else:
        worker = peers.worker(coordinator, "w-kend-" + task_type, capacity=1, task_types=[task_type])
    earlier = job_ids(client)
    job_id = client.submit_ok(task_type, {"durationMillis": 1}, max_attempts=1, idempotencyKey=key)
    if ending == "cancel":
        client.cancel(job_id)
        state = "CANCELLED"
    else:
        worker.fail(worker.await_assign(), "nope")
        state = "FAILED"
    client.wait_state(job_id, state)
    assert client.submit(task_type, {"durationMillis": 1}, max_attempts=1, idempotencyKey=key) == {
        "type": "JOB_SUBMITTED", "jobId": job_id}
    assert client.status(job_id)["state"] == state
    assert job_ids(client) == [job_id] + earlier


@on_both_stores
def test_known_key_is_resolved_before_admission(coordinator_factory, peers):
    # Given --max-active-jobs=1, a completed keyed job and an active job filling the limit
    coord = coordinator_factory(max_active_jobs=1)
    client = peers.client(coord)
    worker = peers.worker(coord, "w-lim", capacity=1)
    done = client.submit_ok("SLEEP", {"durationMillis": 1}, idempotencyKey="k-done")
    worker.complete(worker.await_assign(), {"sleptMillis": 1})
    client.wait_state(done, "COMPLETED")
    active = client.submit_ok("SLEEP", {"durationMillis": 60_000}, idempotencyKey="k-active")
    worker.await_assign()
    assert_rejected(client.submit("SLEEP", {"durationMillis": 2}), active=1, limit=1)

    # When either known key is resubmitted at the limit
    # Then the original jobId comes back (not SUBMIT_REJECTED), and nothing new is created
    assert client.submit("SLEEP", {"durationMillis": 1}, idempotencyKey="k-done") == {
        "type": "JOB_SUBMITTED", "jobId": done}
    assert client.submit("SLEEP", {"durationMillis": 60_000}, idempotencyKey="k-active") == {
        "type": "JOB_SUBMITTED", "jobId": active}
    assert sorted(job_ids(client)) == sorted([done, active])

    # But a genuinely new key is new work and is admission-controlled
    assert_rejected(client.submit("SLEEP", {"durationMillis": 1}, idempotencyKey="k-new"), active=1, limit=1)


def test_a_rejected_key_is_not_remembered(coordinator_factory, peers):
    # Given a keyed submission rejected at the limit
    coord = coordinator_factory(max_active_jobs=1)
    client = peers.client(coord)
    blocker = client.submit_ok("SLEEP", {"durationMillis": 1})
    assert_rejected(client.submit("SLEEP", {"durationMillis": 3}, idempotencyKey="k-later"), active=1, limit=1)

    # When room frees up and the same keyed request is sent again
    client.cancel(blocker)
    job_id = client.submit_ok("SLEEP", {"durationMillis": 3}, idempotencyKey="k-later")

    # Then it creates exactly one job, and the key now maps to it
    assert client.submit("SLEEP", {"durationMillis": 3}, idempotencyKey="k-later")["jobId"] == job_id
    assert sorted(job_ids(client)) == sorted([blocker, job_id])


BASE = dict(task_type="WORD_COUNT", payload={"text": "original"}, max_attempts=2, priority="LOW")
CONFLICTS = [
    ("task-type", dict(BASE, task_type="SHA256")),
    ("payload", dict(BASE, payload={"text": "different"})),
    ("payload-extra-field", dict(BASE, payload={"text": "original", "extra": 1})),
    ("max-attempts", dict(BASE, max_attempts=3)),
    ("priority", dict(BASE, priority="HIGH")),
    ("priority-omitted-is-normal", {k: v for k, v in BASE.items() if k != "priority"}),
]


@pytest.mark.parametrize("case,changed", CONFLICTS, ids=[c[0] for c in CONFLICTS])
def test_same_key_different_request_is_an_error(shared_coordinator, peers, case, changed):
    # Given a keyed job
    client = peers.client(shared_coordinator)
    key = unique("k-conflict")
    earlier = job_ids(client)
    job_id = client.submit_ok(idempotencyKey=key, **BASE)
    before = client.status(job_id)

    # When the key is reused for a different request
    reply = client.submit(idempotencyKey=key, **changed)

    # Then the reply is ERROR, the connection stays open, and the original job is untouched
    assert reply["type"] == "ERROR", reply
    assert isinstance(reply["message"], str) and reply["message"]
    assert client.status(job_id) == before
    assert job_ids(client) == [job_id] + earlier
    # And the original request still maps to it
    assert client.submit(idempotencyKey=key, **BASE)["jobId"] == job_id


@pytest.mark.parametrize("first,second", [
    ({}, {"priority": "NORMAL"}),
    ({"priority": "NORMAL"}, {}),
    ({"priority": None}, {"priority": "NORMAL"}),
    ({}, {"priority": None}),
])
def test_omitted_priority_equals_normal_for_identity(shared_coordinator, peers, first, second):
    client = peers.client(shared_coordinator)
    key = unique("k-prio")
    earlier = job_ids(client)
    job_id = client.submit_ok("SLEEP", {"durationMillis": 1}, idempotencyKey=key, **first)
    assert client.status(job_id)["priority"] == "NORMAL"
    assert client.submit("SLEEP", {"durationMillis": 1}, idempotencyKey=key, **second) == {
        "type": "JOB_SUBMITTED", "jobId": job_id}
    assert job_ids(client) == [job_id] + earlier


@pytest.mark.parametrize("first,second", [(None, 0), (0, 3), (-1, None), (3, -7)])
def test_identity_uses_the_effective_max_attempts(shared_coordinator, peers, first, second):
    # maxAttempts <= 0 (or absent) means the server default, 3: the same logical request as 3
    client = peers.client(shared_coordinator)
    key = unique("k-eff")
    job_id = client.submit_ok("SLEEP", {"durationMillis": 1}, max_attempts=first, idempotencyKey=key)
    assert client.submit("SLEEP", {"durationMillis": 1}, max_attempts=second, idempotencyKey=key) == {
        "type": "JOB_SUBMITTED", "jobId": job_id}
    assert client.status(job_id)["maxAttempts"] == 3


def test_payload_identity_ignores_member_order(shared_coordinator, peers):
    # JSON objects are unordered: the same members in another order are the same payload
    client = peers.client(shared_coordinator)
    key = unique("k-order")
    job_id = client.submit_ok("SLEEP", {"durationMillis": 1, "note": "x"}, idempotencyKey=key)
    assert client.submit("SLEEP", {"note": "x", "durationMillis": 1}, idempotencyKey=key) == {
        "type": "JOB_SUBMITTED", "jobId": job_id}


def test_without_a_key_every_submission_is_a_new_job(shared_coordinator, peers):
    client = peers.client(shared_coordinator)
    earlier = job_ids(client)
    a = client.submit_ok("SLEEP", {"durationMillis": 1})
    b = client.submit_ok("SLEEP", {"durationMillis": 1})
    c = client.submit_ok("SLEEP", {"durationMillis": 1}, idempotencyKey=None)
    assert len({a, b, c}) == 3
    assert job_ids(client) == [c, b, a] + earlier


def test_different_keys_are_different_jobs(shared_coordinator, peers):
    client = peers.client(shared_coordinator)
    earlier = job_ids(client)
    a = client.submit_ok("SLEEP", {"durationMillis": 1}, idempotencyKey=unique("k-a"))
    b = client.submit_ok("SLEEP", {"durationMillis": 1}, idempotencyKey=unique("k-b"))
    assert a != b
    assert job_ids(client) == [b, a] + earlier


@on_both_stores
def test_concurrent_duplicates_create_one_job(shared_on_store, peers):
    # Given 8 connections racing the same keyed request
    import threading
    clients = [peers.client(shared_on_store) for _ in range(8)]
    replies: list = []
    barrier = threading.Barrier(len(clients))
    key = unique("k-race")
    earlier = job_ids(clients[0])

    def go(c):
        barrier.wait(5)
        replies.append(c.submit("SLEEP", {"durationMillis": 1}, idempotencyKey=key))

    threads = [threading.Thread(target=go, args=(c,), daemon=True) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    # Then every reply names the same single job
    assert len(replies) == 8
    assert {r["type"] for r in replies} == {"JOB_SUBMITTED"}
    assert len({r["jobId"] for r in replies}) == 1
    wait_until(lambda: job_ids(clients[0]) == [replies[0]["jobId"]] + earlier, timeout=2,
               message="exactly one job")


@on_both_stores
def test_key_and_status_survive_many_later_jobs(coordinator, peers):
    # Given a keyed job that ended long ago, followed by more than 20 000 other finished jobs
    # (enough to push old finished jobs out of any in-memory cache)
    client = peers.client(coordinator)
    old = client.submit_ok("SLEEP", {"durationMillis": 1}, idempotencyKey="k-ancient")
    assert client.cancel(old)["cancelled"] is True
    old_snap = client.status(old)
    total, batch = 20_500, 250
    for start in range(0, total, batch):
        for i in range(batch):
            client.conn.send({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 1}})
        ids = []
        for _ in range(batch):
            reply = client.conn.recv()
            assert reply["type"] == "JOB_SUBMITTED", reply
            ids.append(reply["jobId"])
        for job_id in ids:
            client.conn.send({"type": "CANCEL_JOB", "jobId": job_id})
        for _ in ids:
            assert client.conn.recv()["type"] == "JOB_CANCEL"
    # Then the old job is still readable exactly as it was, and its key still maps to it
    assert client.status(old) == old_snap
    assert client.submit("SLEEP", {"durationMillis": 1}, idempotencyKey="k-ancient") == {
        "type": "JOB_SUBMITTED", "jobId": old}
    assert client.submit("SLEEP", {"durationMillis": 2}, idempotencyKey="k-ancient")["type"] == "ERROR"
    assert client.cancel(old) == {"type": "JOB_CANCEL", "cancelled": False, "job": old_snap}
