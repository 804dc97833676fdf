"""SchedulingSafetyIT: concurrent submissions never double-assign or over-assign (ARCHITECTURE.md).

60 submissions from 4 client threads at 5 scripted workers: exactly one assignment per
job, no worker ever holds more than its capacity, and every job completes.
"""

from __future__ import annotations

import random
import threading

from tests.support.waiting import wait_until

CAPACITIES = {"w-s1": 1, "w-s2": 2, "w-s3": 3, "w-s4": 2, "w-s5": 1}
THREADS = 4
PER_THREAD = 15


def drive(worker, stop: threading.Event, rng: random.Random, errors: list):
    """Complete each assignment after a short random delay, one at a time, in arrival order."""
    try:
        while not stop.is_set():
            assign = worker.poll_assign(0.05)
            if assign is None:
                continue
            stop.wait(rng.uniform(0, 0.02))
            worker.complete(assign, {"by": worker.worker_id, "attemptId": assign["attemptId"]})
    except Exception as exc:  # surfaced by the test
        errors.append(exc)


def test_sixty_concurrent_submissions_five_workers(coordinator, peers):
    # Given five workers of mixed capacity (9 slots for 60 jobs)
    workers = [peers.worker(coordinator, wid, capacity=cap, heartbeat_millis=100) for wid, cap in CAPACITIES.items()]
    stop = threading.Event()
    errors: list = []
    drivers = [threading.Thread(target=drive, args=(w, stop, random.Random(i), errors), daemon=True)
               for i, w in enumerate(workers)]
    for t in drivers:
        t.start()

    # And a monitor that samples the coordinator's own view of each worker's load
    monitor_client = peers.client(coordinator)
    over_capacity: list = []

    def monitor():
        while not stop.is_set():
            for item in monitor_client.workers():
                if item["activeJobs"] > item["capacity"] or item["activeJobs"] < 0:
                    over_capacity.append(item)
            stop.wait(0.01)

    mon = threading.Thread(target=monitor, daemon=True)
    mon.start()

    # When 4 threads submit 15 jobs each, each on its own connection
    job_ids: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(THREADS)

    def submitter(n: int):
        client = peers.client(coordinator)
        barrier.wait(5)
        for i in range(PER_THREAD):
            job_id = client.submit_ok("SLEEP", {"durationMillis": 1000 * n + i}, max_attempts=1)
            with lock:
                job_ids.append(job_id)

    submitters = [threading.Thread(target=submitter, args=(n,), daemon=True) for n in range(THREADS)]
    for t in submitters:
        t.start()
    for t in submitters:
        t.join(20)
    assert len(job_ids) == THREADS * PER_THREAD
    assert len(set(job_ids)) == len(job_ids), "jobIds must be unique"

    # Then every job completes
    client = peers.client(coordinator)

    def all_done():
        return all(j["state"] == "COMPLETED" for j in client.list_jobs(limit=1000)["jobs"]) and \
            len(client.list_jobs(limit=1000)["jobs"]) == len(job_ids)

    try:
        wait_until(all_done, timeout=20, interval=0.05, message="all 60 jobs COMPLETED")
    finally:
        stop.set()
        for t in drivers + [mon]:
            t.join(5)
    assert errors == []

    # And each job was assigned exactly once, on attempt 1, to one worker
    assigns = [a for w in workers for a in w.assigns]
    assigned_ids = [a["jobId"] for a in assigns]
    assert sorted(assigned_ids) == sorted(job_ids), "each job exactly one TASK_ASSIGN"
    assert all(a["attemptNumber"] == 1 for a in assigns)
    assert len({a["attemptId"] for a in assigns}) == len(assigns)

    # And no worker ever held more than its capacity, as seen by the worker or the coordinator
    for w in workers:
        assert w.max_active <= CAPACITIES[w.worker_id], (w.worker_id, w.max_active)
        assert w.cancels == [] and w.bad_frames == [] and w.errors == []
    assert over_capacity == []

    # And each final snapshot is consistent with the one assignment
    by_job = {a["jobId"]: a for a in assigns}
    for job_id in job_ids:
        snap = client.status(job_id)
        assert snap["attempts"] == 1
        assert snap["workerId"] is None
        assert snap["result"]["attemptId"] == by_job[job_id]["attemptId"]
    for item in client.workers():
        assert item["activeJobs"] == 0
    # The work was actually spread: more than one worker took part
    assert sum(1 for w in workers if w.assigns) > 1


def test_work_goes_to_the_least_loaded_worker(coordinator, peers):
    # Given two workers of equal capacity, A already running two jobs
    client = peers.client(coordinator)
    a = peers.worker(coordinator, "w-busy", capacity=4)
    for _ in range(2):
        client.submit_ok("SLEEP", {"durationMillis": 1})
        a.await_assign()
    b = peers.worker(coordinator, "w-idle", capacity=4)
    # When two more jobs arrive
    j3 = client.submit_ok("SLEEP", {"durationMillis": 1})
    # Then they go to the idle worker first
    assert b.await_assign()["jobId"] == j3
    j4 = client.submit_ok("SLEEP", {"durationMillis": 1})
    assert b.await_assign()["jobId"] == j4
    assert a.poll_assign(0.1) is None


def test_capacity_is_never_exceeded_under_a_backlog(coordinator, peers):
    # Given 20 queued jobs and a capacity-3 worker that never answers
    client = peers.client(coordinator)
    for i in range(20):
        client.submit_ok("SLEEP", {"durationMillis": i})
    w = peers.worker(coordinator, "w-three", capacity=3)
    # Then exactly 3 are assigned and no more
    for _ in range(3):
        w.await_assign()
    assert w.poll_assign(0.3) is None
    assert [x["activeJobs"] for x in client.workers()] == [3]
    assert len([j for j in client.list_jobs()["jobs"] if j["state"] == "RUNNING"]) == 3
