"""Limits stay exact across a kill -9 (docs/PROTOCOL.md, "Limits"), with real processes.

A real coordinator with a type limited to maxRunning 3 and maxRunningPerKey 1 runs jobs
on real workers with more slots than that, some submitted with a uniqueKey again and
again; it is killed (SIGKILL) under load, and another takes over the same database (on
SQLite a second coordinator on the file, with a lease grace so the attempts that ran on
go on counting; on PostgreSQL a standby that was waiting: test_standby.py). Every job's timeline (its
ASSIGNED event and the event that ended that attempt, with their instants) then shows
that at no instant were more of the type's jobs running than the limit allowed, in total
or per key, and that no unique key was held by two live jobs at once.
"""

from __future__ import annotations

from typing import Any

from jobmesh.client import CoordinatorClient
from jobmesh.protocol import messages as m
from tests.support.peers import wait_registered
from tests.support.waiting import wait_until

TYPE = "SLEEP"
KEYS = ("acme", "bolt", "corp", "dyne")
MAX_RUNNING, PER_KEY = 3, 1
ENDS = {"COMPLETED", "ATTEMPT_FAILED", "LEASE_EXPIRED", "WORKER_LOST", "RECOVERED", "CANCELLED", "FAILED"}
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED"}


def set_limit(client: CoordinatorClient) -> None:
    reply = client.request(m.LimitPut({"taskType": TYPE, "maxRunning": MAX_RUNNING, "maxRunningPerKey": PER_KEY}),
                           m.Limit)
    assert reply.limit["maxRunning"] == MAX_RUNNING


def submit_load(client: CoordinatorClient, n: int, offset: int = 0) -> list[str]:
    """``n`` short SLEEPs over the keys; every third one with a uniqueKey shared by three."""
    ids = []
    for i in range(offset, offset + n):
        unique = "u%d" % (i // 9) if i % 3 == 0 else None
        reply = client.request(m.SubmitJob(TYPE, {"durationMillis": 120}, 0, concurrency_key=KEYS[i % len(KEYS)],
                                           unique_key=unique), m.JobSubmitted)
        if not reply.duplicate:
            ids.append(reply.job_id)
    return ids


def attempts(events: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(start, end) instants of each attempt: its ASSIGNED and the next event ending it."""
    spans, start = [], None
    for event in events:
        if event["event"] == "ASSIGNED":
            start = event["atMillis"]
        elif start is not None and event["event"] in ENDS:
            spans.append((start, event["atMillis"]))
            start = None
    assert start is None, events  # every attempt ended
    return spans


def most_at_once(spans: list[tuple[int, int]]) -> int:
    """The largest number of spans open at one instant (one ending when another starts: not both)."""
    points = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda p: (p[0], p[1]))
    most = now = 0
    for _at, step in points:
        now += step
        most = max(most, now)
    return most


def check_timelines(client: CoordinatorClient, job_ids: list[str]) -> None:
    by_key: dict[str, list[tuple[int, int]]] = {}
    everything: list[tuple[int, int]] = []
    live_by_unique: dict[str, list[tuple[int, int]]] = {}
    for job_id in job_ids:
        job = client.wait(job_id, timeout=60)
        assert job["state"] == "COMPLETED", job
        events = client.events(job_id)
        spans = attempts(events)
        everything += spans
        by_key.setdefault(job["concurrencyKey"], []).extend(spans)
        if job["uniqueKey"] is not None:
            born = events[0]["atMillis"]
            died = [e["atMillis"] for e in events if e["event"] in TERMINAL][-1]
            live_by_unique.setdefault(job["uniqueKey"], []).append((born, died))
    assert most_at_once(everything) <= MAX_RUNNING
    for key, spans in by_key.items():
        assert most_at_once(spans) <= PER_KEY, key
    for unique, lives in live_by_unique.items():
        assert most_at_once(lives) == 1, (unique, lives)
    assert most_at_once(everything) == MAX_RUNNING  # the limit was reached: this load tests it


def test_a_killed_coordinator_restarted_on_its_database_keeps_limits_exact(coordinator_factory, worker_procs):
    # Given a coordinator with a limit, and two real workers with more slots than it allows
    coord = coordinator_factory(lease_grace_millis=10_000)
    for n in (1, 2):
        worker_procs.start(coord, "w-%d" % n, capacity=4)
    with CoordinatorClient(*coord.client_addr) as client:
        wait_registered(client, ["w-1", "w-2"])
        set_limit(client)
        job_ids = submit_load(client, 36)
        wait_until(lambda: client.request(m.LimitGet(TYPE), m.Limit).limit["running"] == MAX_RUNNING,
                   message="the limit reached")
    # When it is killed under load and another coordinator starts on the same database
    worker_port = coord.worker_addr[1]
    coord.kill()
    coord.start(worker_port=worker_port)
    with CoordinatorClient(*coord.client_addr) as client:
        assert client.request(m.LimitGet(TYPE), m.Limit).limit["maxRunningPerKey"] == PER_KEY
        job_ids += submit_load(client, 12, offset=36)
        # Then no instant of any timeline passed a limit, and no unique key had two live jobs
        check_timelines(client, job_ids)


def test_a_rate_limited_type_starts_a_job_per_token_on_a_real_coordinator(coordinator, worker_procs):
    # Given a type limited to 4 starts a second (burst 1) and a worker with room for all
    worker_procs.start(coordinator, "w-rate", capacity=8)
    with CoordinatorClient(*coordinator.client_addr) as client:
        wait_registered(client, ["w-rate"])
        limit = client.request(m.LimitPut({"taskType": "WORD_COUNT", "ratePerSecond": 4, "burst": 1}), m.Limit).limit
        assert limit["burst"] == 1
        # When five jobs are submitted at once
        job_ids = [client.submit("WORD_COUNT", {"text": "a b"}) for _ in range(5)]
        # Then each starts when its token is due (the timer wakes the core; nothing polls),
        # and no two starts are closer than a token's 250 ms (the instants are wall-clock: a ms of slack)
        starts = sorted(next(e["atMillis"] for e in client.events(job_id) if e["event"] == "ASSIGNED")
                        for job_id in job_ids if client.wait(job_id, timeout=30)["state"] == "COMPLETED")
        assert len(starts) == 5
        assert all(b - a >= 248 for a, b in zip(starts, starts[1:])), starts
