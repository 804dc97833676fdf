"""The Periodic port's RUN_JOB (with streaming and REMOVE_JOB), locks, BROADCAST, role
checks, Periodic workers in LIST_WORKERS and the idle timeout, against the real aio-periodic
1.0.0 Client and Worker (tests/periodic_aio_peer.py) or a raw connection, and a real
coordinator. The behaviour is PERIODIC.md's (sections 7, 8 and 10), with jobmesh's own
decisions: a RUN_JOB job whose worker fails ends FAILED; a job refused a lock is QUEUED
with waitingReason LOCK_WAIT; Periodic workers are in LIST_WORKERS with ``protocol:
"periodic"`` (JSON workers with ``"json"``); a Periodic connection silent for longer than
``--periodic-keepalive-millis`` after its handshake is closed."""

from __future__ import annotations

import signal
import sqlite3
import time

import pytest

from jobmesh.periodic import codec as pc
from tests.support.peers import Client, ScriptedWorker
from tests.support.waiting import wait_until
from tests.integration.periodic_support import RawPeriodic, client_ops, job_named, periodic_jobs

pytest.importorskip("aio_periodic")


@pytest.fixture(scope="module")
def coord(module_coordinators):
    """The coordinator with its Periodic port the module's tests share: each test's jobs and
    workers are of funcs of its own, and what a test checks of the job list is of its funcs."""
    return module_coordinators(periodic_port=0)


def states_of(coord, func: str) -> dict[str, str]:
    """The state of each Periodic job of ``func``, by name."""
    return {j["name"]: j["state"] for j in periodic_jobs(coord) if j["taskType"] == func}


def events_of(coord, job: dict) -> list[str]:
    reply = Client(coord.client_addr).request({"type": "GET_JOB_EVENTS", "jobId": job["jobId"]})
    return [e["event"] for e in reply["events"]]


def wait_job_state(coord, func: str, name: str, state: str, timeout: float = 10.0) -> dict:
    last: dict = {}

    def check():
        found = [j for j in periodic_jobs(coord) if j["taskType"] == func and j["name"] == name]
        last["job"] = found[0] if found else None
        return found and found[0]["state"] == state

    try:
        wait_until(check, timeout=timeout, message="%s/%s %s" % (func, name, state))
    except AssertionError as exc:
        raise AssertionError("%s; last snapshot %r" % (exc, last.get("job"))) from None
    return last["job"]


def wait_running(worker, caller) -> dict:
    """The job line ``worker`` prints for a RUN_JOB that ``caller`` (ClientOps) is waiting on;
    fails at once if ``caller`` has already returned (NO_WORKER, say)."""
    wait_until(lambda: caller.done() or not worker.lines.empty(), timeout=10, message="the worker to run the job")
    assert not caller.done(), "run_job returned before the job ran: %r" % (caller.result(),)
    return worker.next(0)


# ---- RUN_JOB (PERIODIC.md 7.3, 7.19) ------------------------------------------------------


def test_run_job_without_a_worker_is_no_worker_and_stores_nothing(coord):
    [ran] = client_ops(coord.periodic_addr, ["run", "nw", "j", "x", 5])
    # answered NO_WORKER, not left to its 5 s timeout (that would be a TimeoutError)
    assert ran["error"] == "Exception: no worker", ran
    assert [j for j in periodic_jobs(coord) if j["taskType"] == "nw"] == []
    assert "nw" not in client_ops(coord.periodic_addr, ["status"])[0]


def test_run_job_returns_the_workers_bytes(coord, periodic_peers):
    worker = periodic_peers(coord.periodic_addr, "rj")
    [ran] = client_ops(coord.periodic_addr, ["run", "rj", "j1", "hi", 10])
    assert ran.get("data") == "done:hi", ran
    seen = worker.next(5)
    assert (seen["name"], seen["workload"], seen["timeout"]) == ("j1", "hi", 10)
    job = wait_job_state(coord, "rj", "j1", "COMPLETED")
    assert job["result"] == {"data": "done:hi"}


@pytest.mark.parametrize("mode", ["fail_once", "later_once"])
def test_run_job_whose_worker_fails_is_failed_and_not_retried(coord, periodic_peers, mode):
    """WORK_FAIL and SCHED_LATER both give the caller b"failed"; the job ends there
    (the worker, which would succeed the second time, never sees it again)."""
    func = "rf-" + mode
    worker = periodic_peers(coord.periodic_addr, func, mode)
    [ran] = client_ops(coord.periodic_addr, ["run", func, "f", "w", 10])
    assert ran.get("data") == "failed", ran
    assert worker.next(5)["name"] == "f"
    wait_job_state(coord, func, "f", "FAILED")
    assert worker.none_within(1.5)  # a retry would come after 1 s (WORK_FAIL) or 1 s (SCHED_LATER)
    assert job_named(coord, func, "f")["state"] == "FAILED"
    assert client_ops(coord.periodic_addr, ["status"])[0][func]["job_count"] == 0


def test_run_job_streams_work_data_to_the_caller(coord, periodic_peers):
    worker = periodic_peers(coord.periodic_addr, "rs", "stream")
    [ran] = client_ops(coord.periodic_addr, ["run_stream", "rs", "s", "w", 10])
    assert ran.get("chunks") == ["c1", "c2", "c3"] and ran.get("data") == "end", ran
    assert worker.next(5)["name"] == "s"
    wait_job_state(coord, "rs", "s", "COMPLETED")


def test_remove_job_ends_a_waiting_run_job_with_removed(coord, periodic_peers):
    worker = periodic_peers(coord.periodic_addr, "rr", "hang")
    caller = periodic_peers.client(coord.periodic_addr, ["run", "rr", "x", "w", 15])
    assert wait_running(worker, caller)["name"] == "x"
    assert client_ops(coord.periodic_addr, ["remove", "rr", "x"]) == [True]
    [ran] = caller.result(10)
    assert ran.get("data") == "removed", ran
    wait_job_state(coord, "rr", "x", "CANCELLED")


# ---- locks (PERIODIC.md 7.14) -------------------------------------------------------------


def run_contended(coord, workers, func: str, n: int, timeout: float = 20.0):
    """Submit ``n`` jobs of ``func`` and collect what ``workers`` (mode sleep=...) print until
    every job has ended, polling STATUS and LIST_JOBS meanwhile. Returns the (start, end)
    intervals by name, the largest STATUS ``locked`` seen and whether a QUEUED job of ``func``
    with waitingReason LOCK_WAIT was seen."""
    status = RawPeriodic(coord.periodic_addr)
    client = Client(coord.client_addr)
    names = ["j%d" % i for i in range(n)]
    assert client_ops(coord.periodic_addr, *[["submit", func, name, name, 0, 0] for name in names]) == [True] * n
    starts: dict[str, float] = {}
    ends: dict[str, float] = {}
    seen = {"locked": 0, "lock_wait": False}

    def every_job_ended() -> bool:
        for w in workers:
            for line in w.drain():
                if "end" in line:
                    ends[line["end"]] = line["t"]
                else:
                    assert line["name"] not in starts, "%s ran twice" % line["name"]
                    starts[line["name"]] = line["t"]
        row = status.status().get(func)
        seen["locked"] = max(seen["locked"], row.locked if row else 0)
        seen["lock_wait"] = seen["lock_wait"] or any(j["state"] == "QUEUED" and j["waitingReason"] == "LOCK_WAIT"
                                                     for j in client.list_jobs(taskType=func)["jobs"])
        return len(ends) == n

    try:
        wait_until(every_job_ended, timeout=timeout, message="every %s job to end" % func)
    except AssertionError as exc:
        raise AssertionError("%s: started %s, ended %s" % (exc, sorted(starts), sorted(ends))) from None
    status.close()
    assert sorted(starts) == sorted(ends) == names
    return {name: (starts[name], ends[name]) for name in names}, seen["locked"], seen["lock_wait"]


def max_overlap(intervals) -> int:
    """The most intervals open at one instant (one that ends as another starts does not overlap)."""
    edges = sorted([(end, -1) for _, end in intervals] + [(start, 1) for start, _ in intervals])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def test_a_lock_of_one_runs_its_jobs_one_at_a_time(coord, periodic_peers):
    workers = periodic_peers.several(2, coord.periodic_addr, "lk", "sleep=0.3", 2, lock="L:1")
    runs, most_locked, lock_wait = run_contended(coord, workers, "lk", 5)
    assert max_overlap(runs.values()) == 1, sorted(runs.values())
    assert most_locked > 0, "STATUS never showed a locked job"
    assert lock_wait, "no job of lk was ever QUEUED with waitingReason LOCK_WAIT"
    wait_until(lambda: set(states_of(coord, "lk").values()) == {"COMPLETED"}, timeout=10,
               message="every lk job COMPLETED")
    assert client_ops(coord.periodic_addr, ["status"])[0]["lk"]["locked"] == 0


def test_a_lock_of_two_lets_two_jobs_run_at_once(coord, periodic_peers):
    workers = periodic_peers.several(2, coord.periodic_addr, "lk2", "sleep=0.3", 2, lock="L2:2")
    runs, _, _ = run_contended(coord, workers, "lk2", 5)
    assert max_overlap(runs.values()) == 2, sorted(runs.values())
    wait_until(lambda: set(states_of(coord, "lk2").values()) == {"COMPLETED"}, timeout=10,
               message="every lk2 job COMPLETED")


def wait_locked(coord, func: str, count: int) -> None:
    conn = RawPeriodic(coord.periodic_addr)
    try:
        wait_until(lambda: (row := conn.status().get(func)) is not None and row.locked == count, timeout=5,
                   message="STATUS %s locked = %d" % (func, count))
    finally:
        conn.close()


def hold_and_refuse(coord, periodic_peers, func: str):
    """A hanging worker holding lock K (max 1) with job x, and a second worker whose job y
    was refused that lock; returns (holder, other)."""
    holder = periodic_peers(coord.periodic_addr, func, "hang", 1, lock="K:1")
    client_ops(coord.periodic_addr, ["submit", func, "x", "1", 0, 0])
    assert holder.next()["name"] == "x"
    other = periodic_peers(coord.periodic_addr, func, "done", 1, lock="K:1")
    client_ops(coord.periodic_addr, ["submit", func, "y", "2", 0, 0])
    wait_locked(coord, func, 1)
    assert other.none_within(0.5)  # refused: its task did not run
    return holder, other


def test_killing_the_lock_holder_releases_the_lock(coord, periodic_peers):
    holder, other = hold_and_refuse(coord, periodic_peers, "lkk")
    holder.kill()
    ran = [other.next()["name"], other.next()["name"]]
    assert sorted(ran) == ["x", "y"] and ran[0] == "y", ran  # y was promoted at once; x retries after 1 s
    wait_until(lambda: states_of(coord, "lkk") == {"x": "COMPLETED", "y": "COMPLETED"},
               timeout=10, message="x and y COMPLETED")


def test_restart_keeps_a_running_and_a_locked_job(coordinator_factory, periodic_peers):
    coord = coordinator_factory(periodic_port=0)  # of its own: it is killed and started again
    holder, other = hold_and_refuse(coord, periodic_peers, "lkr")
    coord.kill()  # a crash: nothing runs between the stop and the start
    holder.kill()  # only now: with the coordinator up, this would release the lock
    other.kill()
    coord.start()
    assert client_ops(coord.periodic_addr, ["status"])[0]["lkr"]["job_count"] == 2
    fresh = periodic_peers(coord.periodic_addr, "lkr", "done", 1, lock="K:1")
    assert sorted([fresh.next()["name"], fresh.next()["name"]]) == ["x", "y"]
    wait_until(lambda: states_of(coord, "lkr") == {"x": "COMPLETED", "y": "COMPLETED"},
               timeout=10, message="x and y COMPLETED")


# ---- BROADCAST (PERIODIC.md 7.15) ---------------------------------------------------------


def test_broadcast_runs_a_job_on_every_worker_once(coord, periodic_peers):
    a, b = periodic_peers.several(2, coord.periodic_addr, "bc", broadcast=True)
    # due in 1-2 s: by then both workers hold a grab token
    assert client_ops(coord.periodic_addr, ["submit", "bc", "all", "w", int(time.time()) + 2, 0]) == [True]
    assert a.next(5)["name"] == "all"
    assert b.next(5)["name"] == "all"
    job = wait_job_state(coord, "bc", "all", "COMPLETED")
    assert job["result"] == {"data": "done:w"}
    assert a.none_within(1.0) and b.none_within(0.01)
    assert events_of(coord, job).count("COMPLETED") == 1
    assert client_ops(coord.periodic_addr, ["status"])[0]["bc"]["worker_count"] == 2


# ---- role checks (PERIODIC.md 7.16) -------------------------------------------------------


def test_a_client_connection_sending_worker_commands_gets_no_worker(coord):
    conn = RawPeriodic(coord.periodic_addr, pc.ConnType.CLIENT)
    for msg in (pc.CanDo(conn.next_msgid(), b"rc"), pc.GrabJob(conn.next_msgid()),
                pc.Broadcast(conn.next_msgid(), b"rc")):
        assert conn.request(msg) == pc.NoWorker(msg.msgid), msg
    row = conn.status().get("rc")
    assert row is None or row.workers == 0, row
    assert conn.ping()  # the connection stays open
    # the ignored CAN_DO and GRAB_JOB took no job: RUN_JOB still finds no worker
    [ran] = client_ops(coord.periodic_addr, ["run", "rc", "j", "x", 5])
    assert ran["error"] == "Exception: no worker", ran
    conn.close()


def test_a_worker_connection_may_send_client_commands(coord):
    conn = RawPeriodic(coord.periodic_addr, pc.ConnType.WORKER)
    assert conn.ping()
    can_do = pc.CanDo(conn.next_msgid(), b"wc")
    assert conn.request(can_do) == pc.Success(can_do.msgid)
    assert conn.status()["wc"].workers == 1
    conn.close()


# ---- LIST_WORKERS -------------------------------------------------------------------------


def test_periodic_workers_are_listed_until_their_process_dies(coord, periodic_peers):
    worker = periodic_peers(coord.periodic_addr, "lw")
    client = Client(coord.client_addr)

    def periodic_workers():
        return [w for w in client.workers() if w.get("protocol") == "periodic"]

    # (the Periodic workers of the tests before are gone)
    wait_until(lambda: [w["taskTypes"] for w in periodic_workers()] in ([], [["lw"]]), timeout=5,
               message="no Periodic worker but this test's")
    with ScriptedWorker(coord.worker_addr, worker_id="json-1") as json_worker:
        json_worker.register(task_types=["t"])
        [listed] = wait_until(periodic_workers, timeout=5, message="a periodic worker in LIST_WORKERS")
        assert listed["taskTypes"] == ["lw"], listed
        [as_json] = [w for w in client.workers() if w["workerId"] == "json-1"]
        assert as_json["protocol"] == "json" and as_json["taskTypes"] == ["t"], as_json
    worker.kill()
    wait_until(lambda: not periodic_workers(), timeout=5, message="the killed periodic worker gone from LIST_WORKERS")
    client.close()


# ---- idle timeout (PERIODIC.md 8) ---------------------------------------------------------


def test_a_silent_connection_is_closed_after_the_idle_timeout(coordinator_factory):
    coord = coordinator_factory(periodic_port=0, periodic_keepalive_millis=500)
    started = time.monotonic()
    silent = RawPeriodic(coord.periodic_addr)
    busy = RawPeriodic(coord.periodic_addr)
    closed_after = None
    # The busy one pings until the silent one is closed, and for four idle timeouts at least
    while closed_after is None or time.monotonic() - started < 2.0:
        assert busy.ping(), "a connection that pings every ~0.1 s was closed"
        if closed_after is not None:
            time.sleep(0.1)  # the busy connection's pace, a ping every ~0.1 s: the behaviour under test
        elif silent.closed_within(0.1):
            closed_after = time.monotonic() - started
        else:
            assert time.monotonic() - started < 30, "a connection silent since its handshake was still open " \
                                                    "after 30 s (--periodic-keepalive-millis=500)"
    assert closed_after >= 0.45, "closed %.2fs after its handshake (idle timeout 0.5 s)" % closed_after
    assert busy.ping()
    busy.close()
    silent.close()


def test_a_drain_waits_for_running_periodic_attempts(coordinator_factory, periodic_peers):
    # Given a coordinator with --drain-millis and an aio-periodic worker running a 1.5 s job
    coord = coordinator_factory(periodic_port=0, drain_millis=10_000)
    worker = periodic_peers(coord.periodic_addr, "dr", "sleep=1.5")
    assert client_ops(coord.periodic_addr, ["submit", "dr", "first", "w", 0, 0]) == [True]
    assert worker.next()["name"] == "first"
    # When it is told to stop
    coord.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "draining: no new assignments" in coord.stderr(), message="the drain started")
    # Then it exits 0 once the attempt reported, with the job COMPLETED on disk
    assert coord.proc.wait(15) == 0, coord.stderr()[-3000:]
    assert "drained: no attempt is running" in coord.stderr()
    with sqlite3.connect(str(coord.db)) as db:
        assert db.execute("SELECT state FROM jobs WHERE name='first'").fetchone() == ("COMPLETED",)


def test_a_recv_data_that_comes_after_a_fast_jobs_result_still_gets_its_chunks(coord):
    # Given a worker holding a token, and a caller whose RUN_JOB it takes at once
    worker = RawPeriodic(coord.periodic_addr, pc.ConnType.WORKER)
    assert worker.request(pc.CanDo(worker.next_msgid(), b"fast")) == pc.Success(1)
    worker.send(pc.GrabJob(worker.next_msgid()))
    assert worker.reply() == pc.Success(2)
    caller = RawPeriodic(coord.periodic_addr)
    caller.send(pc.RunJob(7, pc.Job(b"fast", b"j", b"w", 0, 0, 10)))
    assign = worker.reply()
    assert isinstance(assign, pc.JobAssign) and assign.job.name == b"j"
    # When the job streams and ends before the caller's RECV_DATA gets in (the caller
    # was slow to send it: here, after the result)
    handle = pc.Handle(b"fast", b"j")
    for msg in (pc.WorkData(3, handle, b"c1"), pc.WorkData(4, handle, b"c2"), pc.WorkDone(5, handle, b"end")):
        assert worker.request(msg) == pc.Success(msg.msgid)
    assert caller.reply() == pc.Data(7, b"end")
    caller.send(pc.RecvData(8, pc.Job(b"fast", b"j")))
    # Then the RECV_DATA still gets that job's chunks, then EOF
    frames = [caller.reply()]
    while frames[-1] != pc.Data(8, pc.STREAM_EOF):
        frames.append(caller.reply())
    assert frames == [pc.Success(8), pc.Data(8, b"c1"), pc.Data(8, b"c2"), pc.Data(8, pc.STREAM_EOF)]
    worker.close()
    caller.close()
