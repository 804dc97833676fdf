"""kill -9 under load, again and again, through real worker processes.

A client submits with a unique idempotency key per job while two real workers run the
jobs (some fail on purpose and are retried); five times the coordinator is killed with
SIGKILL and restarted on the same database and ports. Afterwards every invariant holds:
no acknowledged job is lost, none was completed by a stale lease (its COMPLETED event
names its last attempt, and it was assigned once per attempt), attempts never exceed
maxAttempts, and every key maps to exactly one job. The same holds when the restarted
coordinator keeps running jobs for their workers to claim (--lease-grace-millis)."""

from __future__ import annotations

import itertools
import random
import threading
import time

import pytest

from jobmesh.client import CoordinatorClient
from jobmesh.errors import ClientError
from tests.support.waiting import wait_until

ROUNDS = 5
LOAD_SECONDS = 0.8


@pytest.mark.parametrize("grace", [0, 2000], ids=["requeued", "kept for a grace"])
def test_kill_9_loop_keeps_every_invariant(coordinator_factory, worker_procs, grace):
    coord = coordinator_factory(retry_base_millis=20, retry_cap_millis=50, lease_grace_millis=grace)
    worker_port, client_port = coord.worker_addr[1], coord.client_addr[1]
    for i in range(2):
        worker_procs.start(coord, "w-%d" % i, capacity=4, log_level="WARNING")
    acked: dict[str, str] = {}  # idempotency key -> job id, for every acknowledged submit
    sent: list[tuple[str, str, dict, int]] = []  # every submit attempted: key, type, payload, max
    rng = random.Random(9)
    numbers = itertools.count(1)
    stop = threading.Event()

    def submitter() -> None:
        while not stop.is_set():
            key = "k-%d" % next(numbers)
            if rng.random() < 0.3:
                task, payload, budget = "FAIL", {"failUntilAttempt": 2}, 3
            else:
                task, payload, budget = "SLEEP", {"durationMillis": rng.choice([0, 5, 30])}, 2
            sent.append((key, task, payload, budget))
            try:
                # (no wait for the coordinator to come back: the loop goes on with the next key)
                with CoordinatorClient(*coord.client_addr, timeout=5, failover_timeout=0) as client:
                    acked[key] = client.submit(task, payload, max_attempts=budget, idempotency_key=key)
            except ClientError:
                time.sleep(0.02)  # the coordinator is down: its outcome is unknown, resolved below

    for _ in range(ROUNDS):
        stop.clear()
        thread = threading.Thread(target=submitter, daemon=True)
        thread.start()
        time.sleep(LOAD_SECONDS)
        coord.kill()
        stop.set()
        thread.join(10)
        coord.start(worker_port=worker_port, client_port=client_port)
    assert len(acked) > 50, len(acked)

    with CoordinatorClient(*coord.client_addr, timeout=10) as client:
        # Every submit whose outcome was unknown is resolved by its key: the same job, or a new one
        for key, task, payload, budget in sent:
            job_id = client.submit(task, payload, max_attempts=budget, idempotency_key=key)
            if key in acked:
                assert job_id == acked[key], "key %s maps to two jobs" % key
            acked[key] = job_id
        # Every job ends (workers reconnect to the same port after each restart)
        def all_done() -> bool:
            return all(client.status(j)["state"] in ("COMPLETED", "FAILED") for j in acked.values())
        wait_until(all_done, timeout=60, interval=0.2, message="every job finished")
        for key, job_id in acked.items():
            snap = client.status(job_id)
            assert snap["attempts"] <= snap["maxAttempts"], snap
            events = client.events(job_id)
            assigned = [e for e in events if e["event"] == "ASSIGNED"]
            assert len(assigned) == snap["attempts"], (snap, events)
            if snap["state"] == "COMPLETED":
                done = [e for e in events if e["event"] == "COMPLETED"]
                assert len(done) == 1 and done[0]["attempt"] == snap["attempts"], (snap, events)
                if snap["taskType"] == "FAIL":
                    assert snap["result"] == {"attempt": snap["attempts"]}
        assert len(set(acked.values())) == len(acked)  # no two keys share a job
