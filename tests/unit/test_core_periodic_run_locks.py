"""The core's Periodic run-and-wait, streaming, counting locks, DUMP/LOAD and WORKER_LIST
(docs/PERIODIC.md). Pure, like test_core_periodic.py, whose harness it uses."""

from __future__ import annotations

import itertools

import pytest

from jobmesh.coordinator.core import events as ev
from jobmesh.coordinator.core.periodic.locks import LockTable
from jobmesh.periodic import codec as pc
from jobmesh.protocol import messages as m
from jobmesh.protocol.jobs import JobState

from tests.unit.test_core_periodic import T0, Conn, H, assigns

HANDLE = pc.Handle(b"f", b"a")


def run(h: H, now: int, conn: Conn, msgid: int = 7, timeout: int = 10, name: str = "a") -> list:
    return h.send(now, conn, pc.RunJob(msgid, pc.Job(b"f", name.encode(), b"w", 0, 0, timeout)))


def to(out: list, conn: Conn) -> list:
    return [msg for c, msg in out if c is conn]


# ---- RUN_JOB ----------------------------------------------------------------------------


def test_run_job_without_a_worker_is_no_worker_and_stores_nothing():
    h = H()
    c = Conn("c")
    assert [type(msg) for msg in to(run(h, T0, c), c)] == [pc.NoWorker]
    assert not h.core.table.jobs
    w = Conn("w")
    h.send(T0, w, pc.CanDo(1, b"f"))
    h.core.periodic.on_closed(T0, w)  # a worker that left does not count
    assert [type(msg) for msg in to(run(h, T0, c), c)] == [pc.NoWorker]


def test_run_job_answers_with_the_result_after_the_commit_of_the_end():
    h = H()
    c, w = Conn("c"), Conn("w")
    h.send(T0, w, pc.CanDo(1, b"f"))  # a worker without a token is still a worker
    assert to(run(h, T0, c), c) == []  # no immediate reply
    [assign] = assigns(h.send(T0, w, pc.GrabJob(1)))
    out = h.send(T0 + 5, w, pc.WorkDone(9, HANDLE, b"RESULT"))
    assert to(out, c) == [pc.Data(7, b"RESULT")]
    assert h.job() is None and h.core.table.finished  # ended: the name is free again
    assert not h.core.periodic.waits.by_key


def test_run_job_failures_end_the_job_with_failed_instead_of_retrying():
    for outcome in (pc.WorkFail(9, HANDLE), pc.SchedLater(9, HANDLE, 5, 1)):
        h = H()
        c, w = Conn("c"), Conn("w")
        h.worker(T0, w)
        run(h, T0, c)
        out = h.send(T0 + 1, w, outcome)
        assert to(out, c) == [pc.Data(7, pc.RESULT_FAILED)], outcome
        [job] = h.core.table.finished.values()
        assert job.state is JobState.FAILED


def test_run_job_on_a_lost_worker_and_on_removal():
    h = H()
    c, w = Conn("c"), Conn("w")
    h.worker(T0, w)
    run(h, T0, c)
    h.core.periodic.on_closed(T0 + 1, w)
    assert to(h.finish(T0 + 1), c) == [pc.Data(7, pc.RESULT_FAILED)]
    w2 = Conn("w2")
    h.worker(T0, w2)
    run(h, T0 + 2, c, msgid=8)
    out = h.send(T0 + 3, Conn("other"), pc.RemoveJob(3, HANDLE))
    assert to(out, c) == [pc.Data(8, pc.RESULT_REMOVED)]


def test_run_job_wait_expiry_ends_the_job_with_expired():
    h = H()
    c, w = Conn("c"), Conn("w")
    h.send(T0, w, pc.CanDo(1, b"f"))
    run(h, T0, c, timeout=2)
    h.core.sweep(T0 + 1999)
    assert to(h.finish(T0 + 1999), c) == []
    h.core.sweep(T0 + 2000)
    assert to(h.finish(T0 + 2000), c) == [pc.Data(7, pc.RESULT_EXPIRED)]
    [job] = h.core.table.finished.values()
    assert job.state is JobState.CANCELLED and job.error.startswith("expired")  # it never ran
    h.send(T0 + 3000, w, pc.GrabJob(1))
    assert assigns(run(h, T0 + 3000, c, msgid=8, timeout=2))
    h.core.sweep(T0 + 5000)  # a running job: its attempt's deadline (the same 2 s) ends it first
    assert to(h.finish(T0 + 5000), c) == [pc.Data(8, pc.RESULT_FAILED)]
    assert h.core.table.finished[next(reversed(h.core.table.finished))].state is JobState.FAILED


def test_a_second_run_job_attaches_to_the_running_job():
    h = H()
    c1, c2, w = Conn("c1"), Conn("c2"), Conn("w")
    h.worker(T0, w)
    run(h, T0, c1)
    run(h, T0, c2, msgid=11)  # dropped as a submission, but its caller waits for that job
    out = h.send(T0 + 1, w, pc.WorkDone(9, HANDLE, b"x"))
    assert to(out, c1) == [pc.Data(7, b"x")] and to(out, c2) == [pc.Data(11, b"x")]


# ---- RECV_DATA / WORK_DATA --------------------------------------------------------------


def test_streaming_success_chunks_then_eof_then_the_result_all_paced():
    h = H()
    c, w = Conn("c"), Conn("w")
    h.worker(T0, w)
    run(h, T0, c, msgid=7)
    out = h.send(T0, c, pc.RecvData(8, pc.Job(b"f", b"a")))
    assert to(out, c) == [pc.Success(8)]
    for chunk in (b"c1", b"c2"):
        out = h.send(T0 + 1, w, pc.WorkData(20, HANDLE, chunk))
        assert to(out, c) == [pc.Data(8, chunk)] and to(out, w) == [pc.Success(20)]
    out = h.send(T0 + 2, w, pc.WorkDone(21, HANDLE, b"end"))
    assert to(out, c) == [pc.Data(8, pc.STREAM_EOF), pc.Data(7, b"end")]
    # every frame on the RECV_DATA msgid is written on its own; the RUN_JOB result is not
    assert h.paced == [(c, 8)] * 4


def test_recv_data_for_a_job_that_just_ended_gets_eof_at_once():
    h = H()
    c, w = Conn("c"), Conn("w")
    h.worker(T0, w)
    run(h, T0, c)
    h.send(T0 + 1, w, pc.WorkDone(9, HANDLE, b"x"))  # finished before RECV_DATA arrived
    out = h.send(T0 + 2, c, pc.RecvData(8, pc.Job(b"f", b"a")))
    assert to(out, c) == [pc.Success(8), pc.Data(8, pc.STREAM_EOF)]
    assert not h.core.periodic.waits.by_key


def test_recv_data_without_a_worker_and_its_own_expiry():
    h = H()
    c = Conn("c")
    out = h.send(T0, c, pc.RecvData(8, pc.Job(b"f", b"a")))
    assert to(out, c) == [pc.NoWorker(8)]
    h.send(T0, Conn("w"), pc.CanDo(1, b"f"))
    h.send(T0, c, pc.RecvData(9, pc.Job(b"f", b"a", timeout=3)))
    h.core.sweep(T0 + 3000)
    assert to(h.finish(T0 + 3000), c) == [pc.Data(9, pc.STREAM_EOF)]
    assert not h.core.periodic.waits.by_key and h.core.periodic.waits.live == 0


# ---- locks --------------------------------------------------------------------------------


def test_lock_table_counts_holders_and_promotes_in_fifo_order():
    t = LockTable()
    assert t.acquire("L", 2, "a") == (True, []) and t.acquire("L", 2, "b") == (True, [])
    assert t.acquire("L", 2, "c") == (False, []) and t.acquire("L", 2, "d") == (False, [])
    assert t.acquire("L", 1, "a") == (True, [])  # a holder asking again; the max stays the largest asked
    assert t.release("L", "a") == ["c"]
    assert t.release_all("d") == []  # a waiting job that goes just leaves the FIFO
    assert t.release("L", "b") == [] and t.release("L", "c") == []
    assert len(t) == 0 and not t.held and not t.waiting


def test_lock_table_a_larger_max_lets_the_waiting_in_first():
    t = LockTable()
    t.acquire("L", 1, "a")
    assert t.acquire("L", 1, "b") == (False, [])
    assert t.acquire("L", 3, "c") == (True, ["b"])  # b waited longer than c asked
    assert t.held == {"a": {"L"}, "b": {"L"}, "c": {"L"}} and not t.waiting


def test_lock_table_release_held_keeps_the_wait():
    t = LockTable()
    t.acquire("X", 1, "a")
    t.acquire("Y", 1, "b")
    t.acquire("Y", 1, "a")  # a holds X and waits for Y
    assert t.release_held("a") == [] and t.waiting == {"a": "Y"} and "X" not in t.locks


def contended(h: H, w: Conn) -> tuple[list, list]:
    """Jobs a and b run on ``w`` (two tokens); both ask for lock L (1 holder): the replies."""
    h.worker(T0, w, tokens=2)
    h.submit(T0, name="a")
    h.submit(T0, name="b")
    return (to(h.send(T0, w, pc.Acquire(30, b"L", 1, pc.Handle(b"f", b"a"))), w),
            to(h.send(T0, w, pc.Acquire(31, b"L", 1, pc.Handle(b"f", b"b"))), w))


def test_a_refused_job_waits_queued_with_lock_wait_and_runs_after_the_release():
    h = H()
    w = Conn("w")
    ha, hb = pc.Handle(b"f", b"a"), pc.Handle(b"f", b"b")
    assert contended(h, w) == ([pc.Acquired(30, True)], [pc.Acquired(31, False)])
    b = h.job(name="b")
    assert b.state is JobState.QUEUED and h.core.requests.snapshot(b)["waitingReason"] == "LOCK_WAIT"
    [row] = h.status(T0)
    assert (row.jobs, row.processing, row.locked) == (2, 1, 1)
    h.send(T0, w, pc.GrabJob(2))
    assert assigns(h.finish(T0)) == []  # a token is free, but b waits for the lock
    out = h.send(T0 + 1, w, pc.WorkDone(32, ha, b""))  # done releases a's locks: b is dispatched
    [assign] = assigns(out)
    assert assign.job.name == b"b"
    assert to(h.send(T0 + 1, w, pc.Acquire(33, b"L", 1, hb)), w) == [pc.Acquired(33, True)]  # already a holder
    assert h.status(T0 + 1)[0].locked == 0


def test_locks_are_released_on_fail_sched_later_worker_loss_and_removal():
    for end in ("fail", "later", "lost", "remove", "release"):
        h = H()
        w1, w2 = Conn("w1"), Conn("w2")
        h.worker(T0, w1)
        h.worker(T0, w2)
        h.submit(T0, name="a")
        h.submit(T0, name="b")
        ha, hb = pc.Handle(b"f", b"a"), pc.Handle(b"f", b"b")
        holder = w1 if h.job(name="a").worker_id == h.core.periodic.sessions.conns[w1].worker_id else w2
        other = w2 if holder is w1 else w1
        h.send(T0, holder, pc.Acquire(30, b"L", 1, ha))
        h.send(T0, other, pc.Acquire(31, b"L", 1, hb))
        assert h.core.periodic.locking.locks.waiting == {h.job(name="b").job_id: "L"}
        h.send(T0, other, pc.GrabJob(1))  # its token is back (aio-periodic re-grabs)
        if end == "fail":
            out = h.send(T0 + 1, holder, pc.WorkFail(40, ha))
        elif end == "later":
            out = h.send(T0 + 1, holder, pc.SchedLater(40, ha, 60, 0))
        elif end == "lost":
            h.core.periodic.on_closed(T0 + 1, holder)
            out = h.finish(T0 + 1)
        elif end == "remove":
            out = h.send(T0 + 1, Conn("c"), pc.RemoveJob(40, ha))
        else:
            out = h.send(T0 + 1, holder, pc.Release(40, b"L", ha))
        assert [a.job.name for a in assigns(out)] == [b"b"], end
        assert not h.core.periodic.locking.locks.waiting and h.status(T0 + 1)[0].locked == 0


def test_a_waiting_job_removed_or_replaced_leaves_the_lock_queue():
    h = H()
    w = Conn("w")
    contended(h, w)
    h.submit(T0 + 1, name="b", workload=b"new")  # replaced: pending again, no longer locked
    assert not h.core.periodic.locking.locks.waiting and h.status(T0 + 1)[0].locked == 0
    [assign] = assigns(h.send(T0 + 1, w, pc.GrabJob(2)))
    assert assign.job.workload == b"new"


# ---- DUMP / LOAD, WORKER_LIST, roles -------------------------------------------------------


def test_dump_lists_live_jobs_and_load_submits_them():
    h = H()
    h.submit(T0, name="a", workload=b"1", timeout=5)
    h.submit(T0, name="b", workload=b"2", sched_at=(T0 + 60_000) // 1000)
    [(_, reply)] = h.send(T0, Conn("c"), pc.Dump(3))
    jobs = pc.decode_jobs(reply.data)
    assert sorted((j.name, j.workload, j.timeout) for j in jobs) == [(b"a", b"1", 5), (b"b", b"2", 0)]
    h2 = H()
    out = h2.send(T0, Conn("c"), pc.Load(4, jobs))
    assert [type(msg) for _, msg in out] == [pc.Success]
    assert h2.job(name="a").state is JobState.QUEUED and h2.job(name="b").state is JobState.SCHEDULED


def test_periodic_workers_appear_in_the_worker_list():
    h = H()
    w = Conn("w")
    h.worker(T0, w, func="resize", tokens=2)
    [item] = h.core.requests.list_workers(T0).workers
    assert item["protocol"] == "periodic" and item["taskTypes"] == ["resize"] and item["capacity"] == 2
    h.submit(T0, func="resize")
    [item] = h.core.requests.list_workers(T0).workers
    assert (item["capacity"], item["activeJobs"]) == (2, 1)
    assert h.core.running_attempts == 1  # what a drain waits for
    h.send(T0, Conn("c"), pc.RunJob(7, pc.Job(b"resize", b"b", b"", 0, 0, 10)))
    figures = h.core.metrics()
    assert (figures.periodic_workers, figures.waits) == (1, 1)
    assert figures.jobs == {("RUNNING", "resize", "NORMAL", "periodic"): 2}  # two tokens
    h.core.periodic.on_closed(T0, w)
    assert isinstance(h.core.requests.list_workers(T0), m.WorkerList) and h.core.requests.list_workers(T0).workers == []


def test_a_broadcast_job_goes_to_every_worker_holding_a_token_and_the_first_done_ends_it():
    h = H()
    w1, w2, w3 = Conn("w1"), Conn("w2"), Conn("w3")
    for w in (w1, w2):
        h.send(T0, w, pc.Broadcast(1, b"f"))
        h.send(T0, w, pc.GrabJob(5))
    h.send(T0, w3, pc.Broadcast(1, b"f"))  # no token: left out
    out = h.submit(T0)
    assert sorted(c.name for c, msg in out if isinstance(msg, pc.JobAssign)) == ["w1", "w2"]
    assert h.status(T0)[0].processing == 1 and h.status(T0)[0].workers == 3
    # it runs on both (one holds its lease), as the table's running sets say
    running = {w.name: set(h.core.table.running(h.core.periodic.sessions.conns[w])) for w in (w1, w2, w3)}
    assert running == {"w1": {h.job().job_id}, "w2": {h.job().job_id}, "w3": set()}
    assert h.core.running_attempts == 2
    other = w2 if h.job().worker_id == h.core.periodic.sessions.conns[w1].worker_id else w1
    h.core.periodic.on_closed(T0 + 1, w3)
    out = h.send(T0 + 2, other, pc.WorkDone(9, HANDLE, b"x"))  # the other one finishes first
    assert [type(msg) for _, msg in out] == [pc.Success] and h.job() is None
    assert not h.core.periodic.sessions.fanout and not any(h.core.table.running(s) for s in h.core.periodic.workers.values())
    [job] = h.core.table.finished.values()
    assert job.state is JobState.COMPLETED and job.result == {"data": "x"}


def test_a_connection_piling_up_waits_is_closed_and_counts_are_returned(monkeypatch):
    from jobmesh.coordinator.core.periodic import waits as periodic_waits

    monkeypatch.setattr(periodic_waits, "MAX_WAITS_PER_CONN", 3)
    h = H()
    c, w = Conn("c"), Conn("w")
    h.send(T0, w, pc.CanDo(1, b"f"))
    for i in range(3):
        assert to(h.send(T0, c, pc.RecvData(10 + i, pc.Job(b"f", b"n%d" % i))), c) == [pc.Success(10 + i)]
    assert to(run(h, T0, c, msgid=20, name="x"), c) == [None]  # the fourth wait: closed
    assert h.job(name="x") is None  # and nothing stored for it
    assert h.core.periodic.waits.per_conn[c] == 3
    h.core.sweep(T0 + 60_000)
    h.finish(T0 + 60_000)
    assert not h.core.periodic.waits.per_conn and h.core.periodic.waits.live == 0


def test_a_refused_job_gives_up_its_locks_so_opposite_orders_do_not_deadlock():
    h = H()
    w = Conn("w")
    h.worker(T0, w, tokens=2)
    h.submit(T0, name="a")
    h.submit(T0, name="b")
    ha, hb = pc.Handle(b"f", b"a"), pc.Handle(b"f", b"b")
    h.send(T0, w, pc.Acquire(30, b"X", 1, ha))
    h.send(T0, w, pc.Acquire(31, b"Y", 1, hb))
    assert to(h.send(T0, w, pc.Acquire(32, b"Y", 1, ha)), w) == [pc.Acquired(32, False)]  # a waits for Y, drops X
    assert to(h.send(T0, w, pc.Acquire(33, b"X", 1, hb)), w) == [pc.Acquired(33, True)]  # so b gets X
    h.send(T0, w, pc.GrabJob(1))
    [assign] = assigns(h.send(T0 + 1, w, pc.WorkDone(34, hb, b"")))  # b done: Y goes to a
    assert assign.job.name == b"a"


def test_release_by_a_waiting_job_makes_it_pending_again():
    h = H()
    w = Conn("w")
    contended(h, w)  # b waits for L
    h.send(T0, w, pc.GrabJob(2))
    [assign] = assigns(h.send(T0 + 1, w, pc.Release(40, b"L", pc.Handle(b"f", b"b"))))
    assert assign.job.name == b"b" and h.status(T0 + 1)[0].locked == 0 and not h.core.periodic.locking.locks.waiting


def test_a_larger_max_dispatches_the_waiting_job():
    h = H()
    w = Conn("w")
    contended(h, w)  # a holds L (max 1), b waits
    h.submit(T0, name="c")
    h.send(T0, w, pc.GrabJob(2))
    h.send(T0, w, pc.GrabJob(3))
    out = h.send(T0, w, pc.Acquire(41, b"L", 3, pc.Handle(b"f", b"c")))  # c asks with max 3
    assert to(out, w)[0] == pc.Acquired(41, True) and [a.job.name for a in assigns(out)] == [b"b"]
    assert h.status(T0)[0].locked == 0


def test_acquire_from_an_attempt_that_has_ended_changes_nothing():
    h = H()
    w1, w2 = Conn("w1"), Conn("w2")
    h.worker(T0, w1)
    h.submit(T0, name="a", timeout=1)
    h.core.sweep(T0 + 1000)  # the attempt on w1 timed out
    h.core.sweep(T0 + 2000)
    h.worker(T0 + 2000, w2)  # the retry runs on w2
    assert h.job(name="a").worker_id == h.core.periodic.sessions.conns[w2].worker_id
    out = h.send(T0 + 2001, w1, pc.Acquire(50, b"L", 1, pc.Handle(b"f", b"a")))  # late, from w1
    assert to(out, w1) == [pc.Acquired(50, False)]
    assert h.job(name="a").state is JobState.RUNNING and not h.core.periodic.locking.locks.locks


def test_retry_of_a_finished_periodic_job_is_refused():
    h = H()
    w = Conn("w")
    h.worker(T0, w)
    h.submit(T0)
    h.send(T0, w, pc.WorkDone(9, HANDLE, b""))
    [job] = h.core.table.finished.values()
    reply = h.core.requests.retry_job(T0, job.job_id)
    assert isinstance(reply, m.Error) and "Periodic job" in reply.message


def test_broadcast_after_can_do_marks_the_func():
    h = H()
    w = Conn("w")
    h.send(T0, w, pc.CanDo(1, b"f"))
    h.send(T0, w, pc.Broadcast(2, b"f"))
    assert h.core.periodic.funcs["f"].broadcast and h.status(T0)[0].workers == 1


def test_a_closed_connection_takes_its_waits_with_it_and_its_jobs_go_on():
    h = H()
    c, other, w = Conn("c"), Conn("other"), Conn("w")
    h.send(T0, w, pc.CanDo(1, b"f"))
    for i in range(50):
        run(h, T0, c, msgid=100 + i, name="j%d" % i)
    run(h, T0, other, msgid=7, name="j0")  # a second caller on one of those jobs
    assert h.core.periodic.waits.live == 51 and h.core.periodic.waits.per_conn[c] == 50
    h.apply(T0, ev.PeriodicClosed(c))
    h.finish(T0)
    waits = h.core.periodic.waits
    assert waits.live == 1 and c not in waits.per_conn and sum(len(v) for v in waits.by_key.values()) == 1
    assert len(h.core.table.jobs) == 50  # the jobs themselves go on
    # the other caller is still answered when its job ends
    [assign] = assigns(h.send(T0, w, pc.GrabJob(2)))
    assert assign.job.name == b"j0"  # (sched, name) order
    out = h.send(T0, w, pc.WorkDone(3, pc.Handle(b"f", b"j0"), b"done"))
    assert to(out, other) == [pc.Data(7, b"done")]


def test_release_and_work_data_from_a_worker_the_job_does_not_run_on_are_ignored():
    h = H()
    w1, w2, c = Conn("w1"), Conn("w2"), Conn("c")
    h.worker(T0, w1, tokens=1)
    h.worker(T0, w2, tokens=1)
    h.submit(T0, name="a")
    h.submit(T0, name="b")
    ha, hb = pc.Handle(b"f", b"a"), pc.Handle(b"f", b"b")
    runs_a = h.core.periodic.sessions.conns[w1].worker_id == h.job(name="a").worker_id
    wa, wb = (w1, w2) if runs_a else (w2, w1)  # the worker a runs on, and the one b runs on
    assert to(h.send(T0, wa, pc.Acquire(30, b"L", 1, ha)), wa) == [pc.Acquired(30, True)]
    # a worker that does not run a releases a's lock: nothing happens, b is still kept out
    assert to(h.send(T0, wb, pc.Release(31, b"L", ha)), wb) == [pc.Success(31)]
    assert to(h.send(T0, wb, pc.Acquire(32, b"L", 1, hb)), wb) == [pc.Acquired(32, False)]
    # a stream of a's data from the wrong worker reaches no RECV_DATA caller
    assert to(h.send(T0, c, pc.RecvData(40, pc.Job(b"f", b"a"))), c) == [pc.Success(40)]
    assert to(h.send(T0, wb, pc.WorkData(41, ha, b"forged")), c) == []
    assert to(h.send(T0, wa, pc.WorkData(42, ha, b"real")), c) == [pc.Data(40, b"real")]


# ---- RUN_JOB + RECV_DATA against a fast worker: any order, no chunk lost --------------------


STREAMED = [pc.Success(8), pc.Data(8, b"c1"), pc.Data(8, b"c2"), pc.Data(8, pc.STREAM_EOF), pc.Data(7, b"end")]
CHUNKS_AND_END = (pc.WorkData(20, HANDLE, b"c1"), pc.WorkData(21, HANDLE, b"c2"), pc.WorkDone(22, HANDLE, b"end"))


def caller_frames(h: H, c: Conn) -> list:
    return [msg for conn, msg in h.sent_decoded if conn is c]


class Streamed(H):
    """``H`` that keeps every frame sent, decoded (``sent_decoded``)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent_decoded: list = []

    def finish(self, now: int) -> list:
        out = super().finish(now)
        self.sent_decoded.extend(out)
        return out


def run_on_a_worker() -> tuple[Streamed, Conn, Conn]:
    """A RUN_JOB (msgid 7) of f/a on caller ``c``, running at once on worker ``w``."""
    h = Streamed()
    c, w = Conn("c"), Conn("w")
    h.worker(T0, w)
    run(h, T0, c, msgid=7)
    return h, c, w


@pytest.mark.parametrize("order", list(itertools.permutations(["run", "recv", "grab"])))
def test_run_job_recv_data_and_the_grab_in_one_batch_in_any_order(order):
    # Given a worker that declared the func (its token comes with the batch)
    h = Streamed()
    c, w = Conn("c"), Conn("w")
    h.send(T0, w, pc.CanDo(1, b"f"))
    # When RUN_JOB, RECV_DATA and the worker's GRAB_JOB are applied in one batch
    events = {"run": (c, pc.RunJob(7, pc.Job(b"f", b"a", b"w", 0, 0, 10))), "recv": (c, pc.RecvData(8, pc.Job(b"f", b"a"))),
              "grab": (w, pc.GrabJob(2))}
    for name in order:
        h.apply(T0, ev.PeriodicPacket(*events[name]))
    assert len(assigns(h.finish(T0))) == 1
    # And the worker streams and finishes
    for msg in CHUNKS_AND_END:
        h.send(T0 + 1, w, msg)
    # Then the caller got SUCCESS, every chunk, EOF, then the result
    assert caller_frames(h, c) == STREAMED


def test_a_recv_data_applied_after_the_workers_frames_in_one_batch_still_gets_every_chunk():
    # Given a RUN_JOB whose job went to a worker at once
    h, c, w = run_on_a_worker()
    # When the worker's chunks and result and the caller's RECV_DATA land in one batch,
    # the worker's first (the mailbox serves worker connections first)
    for msg in CHUNKS_AND_END:
        h.apply(T0 + 1, ev.PeriodicPacket(w, msg))
    h.apply(T0 + 1, ev.PeriodicPacket(c, pc.RecvData(8, pc.Job(b"f", b"a"))))
    h.finish(T0 + 1)
    # Then the caller still gets SUCCESS, the chunks and EOF before the result
    assert caller_frames(h, c) == STREAMED


def test_a_recv_data_after_some_chunks_gets_them_first():
    h, c, w = run_on_a_worker()
    h.send(T0 + 1, w, CHUNKS_AND_END[0])  # before the RECV_DATA was applied
    h.send(T0 + 2, c, pc.RecvData(8, pc.Job(b"f", b"a")))
    for msg in CHUNKS_AND_END[1:]:
        h.send(T0 + 3, w, msg)
    assert caller_frames(h, c) == STREAMED


def test_a_recv_data_after_the_result_still_gets_the_chunks_of_that_job():
    # Later than the result (another batch), the chunks are still the caller's
    h, c, w = run_on_a_worker()
    for msg in CHUNKS_AND_END:
        h.send(T0 + 1, w, msg)
    h.send(T0 + 2, c, pc.RecvData(8, pc.Job(b"f", b"a")))
    assert caller_frames(h, c) == [pc.Data(7, b"end")] + STREAMED[:-1]
    # and only once, for that caller: another RECV_DATA gets EOF alone
    h.send(T0 + 3, c, pc.RecvData(9, pc.Job(b"f", b"a")))
    assert caller_frames(h, c)[-2:] == [pc.Success(9), pc.Data(9, pc.STREAM_EOF)]


def test_chunks_kept_for_a_recv_data_to_come_are_bounded(monkeypatch):
    # A plain RUN_JOB (no RECV_DATA ever) whose worker streams: kept up to KEPT_BYTES
    from jobmesh.coordinator.core.periodic import waits as periodic_waits
    monkeypatch.setattr(periodic_waits, "KEPT_BYTES", 10)
    h, c, w = run_on_a_worker()
    waits = h.core.periodic.waits
    for i in range(8):
        h.send(T0 + 1, w, pc.WorkData(20 + i, HANDLE, b"abc"))
    assert waits.kept_bytes == 9
    h.send(T0 + 2, w, pc.WorkDone(30, HANDLE, b"end"))
    assert waits.kept_bytes == 9  # kept for a RECV_DATA within 10 s of the end
    h.send(T0 + 3, c, pc.RecvData(8, pc.Job(b"f", b"a")))
    assert caller_frames(h, c)[1:] == [pc.Success(8)] + [pc.Data(8, b"abc")] * 3 + [pc.Data(8, pc.STREAM_EOF)]
    assert waits.kept_bytes == 0
