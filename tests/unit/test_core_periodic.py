"""The core's Periodic capabilities (docs/PERIODIC.md): named jobs, replace, grab-token
dispatch, outcomes, STATUS figures, REMOVE_JOB, DROP_FUNC, disconnects and recovery.

Pure: the core is driven with decoded codec requests and a fixed clock (core time =
wall time here, drift 0); frames it sends are decoded back with the codec.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator

from jobmesh.coordinator.core import events as ev
from jobmesh.periodic import codec as pc
from jobmesh.protocol.jobs import JobState
from jobmesh.store.job import Job
from jobmesh.store.sqlite import SQLiteStore
from tests.unit.core_driver import Conn, CoreDriver

T0 = 1_700_000_000_000  # epoch millis
TIMEOUT = 30_000


class H(CoreDriver):
    """The shared ``CoreDriver`` with the Periodic port's requests; frames decoded back."""

    def __init__(self, store: SQLiteStore | None = None, ids: Iterator[int] | None = None, **cfg: Any) -> None:
        super().__init__(store, "p", ids=ids, task_timeout_millis=TIMEOUT, **cfg)
        self.msgid = itertools.count(100)
        self.paced: list[tuple[Conn, int]] = []  # (conn, msgid) of every Paced frame sent

    def send(self, now: int, conn: Conn, msg: Any) -> list[Any]:
        """Apply one request, end the batch; the frames sent, decoded."""
        self.apply(now, ev.PeriodicPacket(conn, msg))
        return self.finish(now)

    def finish(self, now: int) -> list[Any]:
        out = []
        for conn, data in self.end_batch(now):
            if isinstance(data, pc.Paced):  # a stream frame: written on its own (periodic_port.py)
                self.paced.append((conn, data.msgid))
                data = data.frame
            out.append((conn, data if data is None or not isinstance(data, bytes) else pc.decode_reply(_body(data))))
        return out

    def submit(self, now: int, func: str = "f", name: str = "a", workload: bytes = b"w", sched_at: int = 0,
               timeout: int = 0, conn: Conn | None = None) -> list[Any]:
        job = pc.Job(func.encode(), name.encode(), workload, sched_at, 0, timeout)
        return self.send(now, conn or Conn("client"), pc.SubmitJob(next(self.msgid), job))

    def worker(self, now: int, conn: Conn, func: str = "f", tokens: int = 1) -> list[Any]:
        out = self.send(now, conn, pc.CanDo(next(self.msgid), func.encode()))
        for i in range(tokens):
            out += self.send(now, conn, pc.GrabJob(i + 1))
        return out

    def job(self, func: str = "f", name: str = "a") -> Job | None:
        job_id = self.core.periodic.index.named.get((func, name))
        return None if job_id is None else self.core.table.lookup(job_id)

    def status(self, now: int) -> list[pc.FuncStatus]:
        data = pc.decode_reply(_body(self.core.periodic.index.status(now, 1)))
        assert isinstance(data, pc.Data)
        return pc.parse_status(data.data)


def _body(frame: bytes) -> bytes:
    decoder = pc.PacketDecoder(pc.MAGIC_RES)
    decoder.feed(frame)
    body = decoder.next_packet()
    assert body is not None
    return body


def assigns(out: list[Any]) -> list[pc.JobAssign]:
    return [msg for _, msg in out if isinstance(msg, pc.JobAssign)]


class TimesHeard:
    """A time listener of the job table (``listen_times``): the jobs it was told of, with
    their state and deadline then."""

    def __init__(self) -> None:
        self.jobs: list[tuple[str, JobState, int | None]] = []

    def retimed(self, job: Job) -> None:
        self.jobs.append((job.job_id, job.state, job.deadline))


def test_submit_creates_a_named_queued_job_and_answers_success():
    h = H()
    out = h.submit(T0)
    assert [type(msg) for _, msg in out] == [pc.Success]
    job = h.job()
    assert job.state is JobState.QUEUED and job.task_type == "f" and job.name == "a"
    snap = h.core.requests.snapshot(job)
    assert snap["protocol"] == "periodic" and snap["name"] == "a" and snap["runAtMillis"] == T0
    assert h.store.get(job.job_id).periodic["workload"] == "w"  # durable


def test_jobs_a_token_creates_name_it_as_submitted_by():
    # Given requests from a connection registered with token "team" (types 3 and 4)
    h = H()
    client = Conn("client")

    def send(now, msg):
        h.apply(now, ev.PeriodicPacket(client, msg, 1, "team"))
        return h.finish(now)

    send(T0, pc.SubmitJob(1, pc.Job(b"f", b"a", b"w", 0, 0, 0)))
    send(T0, pc.Load(2, (pc.Job(b"f", b"b", b"w", 0, 0, 0),)))
    h.worker(T0, Conn("w"), "g", tokens=0)
    send(T0, pc.RunJob(3, pc.Job(b"g", b"c", b"w", 0, 0, 0)))
    # Then each job it made carries the name, in memory, in the store and in its snapshot
    for func, name in (("f", "a"), ("f", "b"), ("g", "c")):
        job = h.job(func, name)
        assert job.submitted_by == "team" and h.store.get(job.job_id).submitted_by == "team"
        assert h.core.requests.snapshot(job)["submittedBy"] == "team"
        assert "by team" in h.core.requests.get_job_events(T0, job.job_id).events[0]["detail"]
    # And a replacement by another token is named in its REPLACED event; without a token, nothing
    h.apply(T0 + 1, ev.PeriodicPacket(Conn("other"), pc.SubmitJob(4, pc.Job(b"f", b"a", b"v", 0, 0, 0)), 1, "ops"))
    h.finish(T0 + 1)
    events = h.core.requests.get_job_events(T0 + 1, h.job("f", "a").job_id).events
    assert events[-1]["event"] == "REPLACED" and events[-1]["detail"] == "by ops"
    assert h.job("f", "a").submitted_by == "team"
    h.submit(T0 + 2, name="plain")
    assert h.job(name="plain").submitted_by is None


def test_a_job_goes_only_to_a_periodic_worker_on_a_held_token():
    h = H()
    h.submit(T0)
    w = Conn("w")
    out = h.send(T0, w, pc.CanDo(1, b"f"))
    assert not assigns(out)  # no token yet
    out = h.send(T0, w, pc.GrabJob(7))
    [assign] = assigns(out)
    assert assign.msgid == 7 and assign.job.name == b"a" and assign.job.timeout == TIMEOUT // 1000
    assert h.job().state is JobState.RUNNING
    # a repeated GRAB_JOB with a held msgid counts once
    h.submit(T0, name="b")
    h.submit(T0, name="c")
    h.core.periodic.on_packet(T0, w, pc.GrabJob(8))
    h.core.periodic.on_packet(T0, w, pc.GrabJob(8))
    h.finish(T0)
    assert h.job(name="b").state is JobState.RUNNING and h.job(name="c").state is JobState.QUEUED


def test_resubmitting_a_pending_name_replaces_it_and_running_drops_it():
    h = H()
    h.submit(T0, workload=b"old")
    h.submit(T0 + 1, workload=b"new", sched_at=(T0 + 60_000) // 1000)
    job = h.job()
    assert job.state is JobState.SCHEDULED and job.periodic["workload"] == "new"
    assert len(h.core.table.jobs) == 1 and h.status(T0)[0].jobs == 1
    h.submit(T0 + 2, workload=b"now")
    assert job.state is JobState.QUEUED
    w = Conn("w")
    [assign] = assigns(h.worker(T0 + 3, w))
    assert assign.job.workload == b"now"
    h.submit(T0 + 4, workload=b"while running")
    assert job.state is JobState.RUNNING and job.periodic["workload"] == "now" and len(h.core.table.jobs) == 1
    h.send(T0 + 5, w, pc.WorkDone(9, pc.Handle(b"f", b"a"), b"ok"))
    assert job.state is JobState.COMPLETED and job.result == {"data": "ok"}
    assert ("f", "a") not in h.core.periodic.index.named  # released: the name is free again
    h.submit(T0 + 6)
    assert h.job().job_id != job.job_id


def test_a_scheduled_job_replaced_with_another_time_falls_due_then_as_the_table_tells_the_timers():
    h = H()
    heard = TimesHeard()
    h.core.table.listen_times(heard)
    h.submit(T0, sched_at=(T0 + 60_000) // 1000)
    # When it is replaced with an earlier time, staying SCHEDULED
    h.submit(T0 + 1, sched_at=(T0 + 10_000) // 1000)
    job = h.job()
    assert job.state is JobState.SCHEDULED and heard.jobs == [(job.job_id, JobState.SCHEDULED, None)]
    # Then it falls due at the new time
    h.core.sweep(T0 + 9_999)
    assert job.state is JobState.SCHEDULED
    h.core.sweep(T0 + 10_000)
    assert job.state is JobState.QUEUED and h.store.get(job.job_id).run_at == T0 + 10_000


def test_work_fail_retries_after_one_second_without_a_budget():
    h = H()
    h.submit(T0)
    w = Conn("w")
    h.worker(T0, w)
    now = T0
    for attempt in range(1, 6):  # more than any default budget
        assert h.job().state is JobState.RUNNING and h.job().attempts == attempt
        h.send(now, w, pc.WorkFail(50, pc.Handle(b"f", b"a")))
        assert h.job().state is JobState.RETRY_WAIT
        h.core.sweep(now + 999)
        assert h.job().state is JobState.RETRY_WAIT
        h.core.sweep(now + 1000)
        h.send(now + 1000, w, pc.GrabJob(1))
        now += 1000
    assert h.job().state is JobState.RUNNING


def test_sched_later_puts_it_back_with_count_plus_step():
    h = H()
    h.submit(T0)
    w = Conn("w")
    h.worker(T0, w)
    h.send(T0, w, pc.SchedLater(60, pc.Handle(b"f", b"a"), 5, 2))
    job = h.job()
    assert job.state is JobState.SCHEDULED and job.run_at == T0 + 5000 and job.periodic["count"] == 2
    assert h.status(T0)[0].processing == 0
    h.core.sweep(T0 + 5000)
    [assign] = assigns(h.send(T0 + 5000, w, pc.GrabJob(1)))
    assert assign.job.count == 2 and assign.job.sched_at == (T0 + 5000) // 1000


def test_status_counts_come_from_figures_kept_by_transitions():
    h = H()
    later = (T0 + 600_000) // 1000
    h.submit(T0, name="a")
    h.submit(T0, name="b", sched_at=later)
    h.submit(T0, func="g", name="x", sched_at=later + 5)
    assert h.status(T0) == [pc.FuncStatus(b"f", 0, 2, 0, 0, T0 // 1000), pc.FuncStatus(b"g", 0, 1, 0, 0, later + 5)]
    w = Conn("w")
    h.worker(T0, w)
    assert h.status(T0)[0] == pc.FuncStatus(b"f", 1, 2, 1, 0, later)
    h.send(T0, w, pc.WorkDone(9, pc.Handle(b"f", b"a"), b""))
    assert h.status(T0)[0] == pc.FuncStatus(b"f", 1, 1, 0, 0, later)
    h.core.periodic.on_closed(T0, w)
    assert h.status(T0 + 1000)[0] == pc.FuncStatus(b"f", 0, 1, 0, 0, later)


def test_remove_job_and_drop_func():
    h = H()
    h.submit(T0, name="a")
    h.submit(T0, name="b")
    h.send(T0, Conn("c"), pc.RemoveJob(3, pc.Handle(b"f", b"a")))
    assert h.job(name="a") is None and h.status(T0)[0].jobs == 1
    w = Conn("w")
    h.send(T0, w, pc.CanDo(1, b"f"))
    h.send(T0, Conn("c"), pc.DropFunc(4, b"f"))  # a worker declares it: nothing happens
    assert h.status(T0)[0].jobs == 1
    h.send(T0, w, pc.CantDo(2, b"f"))
    out = h.send(T0, Conn("c"), pc.DropFunc(5, b"f"))
    assert [type(msg) for _, msg in out] == [pc.Success]
    assert h.status(T0) == [] and not h.core.table.jobs


def test_a_lost_worker_gives_its_job_back_and_the_deadline_sweep_applies():
    h = H()
    h.submit(T0, timeout=2)
    w1, w2 = Conn("w1"), Conn("w2")
    h.worker(T0, w1)
    h.core.periodic.on_closed(T0, w1)
    h.finish(T0)
    assert h.job().state is JobState.RETRY_WAIT
    h.core.sweep(T0 + 1000)
    [assign] = assigns(h.worker(T0 + 1000, w2))
    assert assign.job.timeout == 2
    h.core.sweep(T0 + 3000)  # its 2 s deadline passed
    assert h.job().state is JobState.RETRY_WAIT and h.job().error.startswith("attempt 2 exceeded")


def test_admission_limit_answers_a_non_success_reply():
    h = H(max_active_jobs=1)
    h.submit(T0, name="a")
    [(_, reply)] = h.submit(T0, name="b")
    assert isinstance(reply, pc.Data) and reply.data.startswith(b"rejected")


def test_recovery_keeps_queued_and_scheduled_periodic_jobs_with_their_names(tmp_path):
    db = str(tmp_path / "p.db")
    h = H(SQLiteStore(db))
    h.submit(T0, name="now")
    h.submit(T0, name="later", sched_at=(T0 + 60_000) // 1000)
    h.submit(T0, name="running")
    w = Conn("w")
    h.worker(T0, w, tokens=0)
    h.send(T0, w, pc.GrabJob(1))
    assert h.job(name="now").state is JobState.RUNNING  # (sched, name) order: "now" < "running"
    h.store.close()
    h2 = H(SQLiteStore(db))
    h2.core.recover(T0 + 10)
    assert {name: h2.job(name=name).state for name in ("now", "later", "running")} == {
        "now": JobState.QUEUED, "later": JobState.SCHEDULED, "running": JobState.QUEUED}  # "now" was RUNNING
    assert h2.status(T0 + 10)[0].jobs == 3
    out = h2.worker(T0 + 10, Conn("w2"), tokens=2)
    assert sorted(a.job.name for a in assigns(out)) == [b"now", b"running"]


def test_json_workers_never_get_periodic_jobs():
    from jobmesh.protocol import messages as m
    h = H()
    h.submit(T0, func="SLEEP")
    conn = Conn("json")
    h.apply(T0, ev.Registered(conn, m.WorkerRegister("w", 4, None)))
    assert not [msg for c, msg in h.end_batch(T0) if isinstance(msg, m.TaskAssign)]
    assert h.job(func="SLEEP").state is JobState.QUEUED


def test_job_unassigned_puts_the_job_back_without_a_reply():
    h = H()
    h.submit(T0)
    w = Conn("w")
    [assign] = assigns(h.worker(T0, w))
    out = h.send(T0, w, pc.JobUnassigned(assign.msgid))
    assert out == [] and h.job().state is JobState.QUEUED
    [again] = assigns(h.send(T0, w, pc.GrabJob(assign.msgid)))
    assert again.job.name == b"a" and h.job().attempts == 2


# ---- hardening: what a hostile or careless peer sent once -------------------------------------


def test_a_count_stepped_past_32_bits_saturates_and_dispatch_and_dump_go_on():
    h = H()
    job = pc.Job(b"f", b"a", b"w", 0, 2**31 - 1, 0)
    h.send(T0, Conn("client"), pc.SubmitJob(1, job))
    w = Conn("w")
    [first] = assigns(h.worker(T0, w))
    assert first.job.count == 2**31 - 1
    h.send(T0, w, pc.SchedLater(2, pc.Handle(b"f", b"a"), 0, 1))  # count + 1: past an i32
    assert h.job().periodic["count"] == 2**31 - 1
    [again] = assigns(h.send(T0, w, pc.GrabJob(3)))
    assert again.job.count == 2**31 - 1 and h.job().state is JobState.RUNNING
    [(_conn, dump)] = h.send(T0, Conn("admin"), pc.Dump(4))
    assert [j.count for j in pc.decode_jobs(dump.data)] == [2**31 - 1]


def test_a_job_that_cannot_be_encoded_fails_alone_and_the_pass_goes_on():
    h = H()
    h.submit(T0, name="bad")
    h.submit(T0, name="good")
    damaged = h.job(name="bad")
    damaged.periodic["count"] = "not a number"  # a row damaged by hand
    h.core.table.touch(damaged)
    h.end_batch(T0)
    out = h.worker(T0, Conn("w"), tokens=2)
    assert [a.job.name for a in assigns(out)] == [b"good"]
    assert damaged.state is JobState.CANCELLED and "cannot be assigned" in (damaged.error or "")


def test_resending_one_scheduled_submit_does_not_grow_the_indexes():
    h = H()
    later = (T0 + 3_600_000) // 1000
    for _ in range(3000):
        h.submit(T0, sched_at=later)
    pf = h.core.periodic.funcs["f"]
    assert len(h.core.table.jobs) == 1 and h.job().state is JobState.SCHEDULED
    assert len(pf.pending) <= 2 and len(h.core.timers.due_heap) <= 2
    h.submit(T0, sched_at=later + 60)  # a new time re-indexes
    assert h.status(T0)[0].sched_at == later + 60


def test_a_sched_at_in_the_year_10000_is_refused():
    h = H()
    [(_conn, reply)] = h.submit(T0, sched_at=253_402_300_800)  # 10000-01-01T00:00:00Z
    assert isinstance(reply, pc.Data) and b"year 10000" in reply.data
    assert h.job() is None


def test_worker_ids_are_one_namespace_for_json_workers_and_periodic_sessions():
    from jobmesh.protocol import messages as m
    h = H()
    # A JSON worker registered as "periodic-1": the first Periodic session skips that id
    json_conn = Conn("json")
    h.apply(T0, ev.Registered(json_conn, m.WorkerRegister("periodic-1", 4, None)))
    h.end_batch(T0)
    h.submit(T0)
    w = Conn("w")
    [assign] = assigns(h.worker(T0, w))
    job = h.job()
    assert job.worker_id == "periodic-2" and h.core.running_attempts == 1
    h.send(T0, w, pc.WorkDone(9, pc.Handle(b"f", b"a"), b"ok"))
    assert job.state is JobState.COMPLETED
    assert h.core.running_attempts == 0  # the Periodic session let go of it: a drain ends at once
    # A JSON worker may not register under a live Periodic session's id
    other = Conn("json2")
    h.apply(T0, ev.Registered(other, m.WorkerRegister("periodic-2", 4, None)))
    assert h.end_batch(T0) == [(other, m.Error("worker id 'periodic-2' belongs to a live Periodic worker session")),
                               (other, None)]
    # Once that session has ended, the id is free
    h.core.periodic.on_closed(T0, w)
    h.apply(T0, ev.Registered(other, m.WorkerRegister("periodic-2", 4, None)))
    assert h.end_batch(T0) == [(other, m.WorkerRegistered("periodic-2"))]


def test_a_func_holding_a_status_separator_is_refused_and_status_stays_parseable():
    h = H()
    for bad in (b"resize,v2", b"two\nlines", b"cr\rlf"):
        w = Conn("w")
        assert h.send(T0, w, pc.CanDo(1, bad)) == [(w, None)]  # closed
        c = Conn("c")
        assert h.send(T0, c, pc.SubmitJob(2, pc.Job(bad, b"a", b"w", 0, 0, 0))) == [(c, None)]
    h.worker(T0, Conn("ok"), func="resize.v2")
    assert [row.func for row in h.status(T0)] == [b"resize.v2"] and not h.core.table.jobs


def test_sizes_count_the_live_jobs_and_funcs_a_dump_or_status_walks():
    h = H()
    assert h.core.periodic.sizes() == (0, 0)
    h.submit(T0, name="a")
    h.submit(T0, name="b")
    h.submit(T0, func="g", name="a")
    assert h.core.periodic.sizes() == (3, 2)
    h.send(T0, Conn("c"), pc.RemoveJob(9, pc.Handle(b"f", b"a")))
    assert h.core.periodic.sizes() == (2, 2)


def test_the_core_prices_a_dump_by_its_live_jobs_and_a_status_by_its_funcs():
    # Given 9 live jobs of 2 funcs (a LIST_JOBS page costs 1 + rows // LIST_ROWS_PER_COST)
    h = H()
    assert (h.core.periodic_cost(pc.Dump), h.core.periodic_cost(pc.Status)) == (1, 1)
    for i in range(8):
        h.submit(T0, name="n%d" % i)
    h.submit(T0, func="g")
    # Then a DUMP costs by the jobs it lists, a STATUS by the funcs, anything else 1
    assert h.core.periodic_cost(pc.Dump) == 1 + 9 // ev.LIST_ROWS_PER_COST == 3
    assert h.core.periodic_cost(pc.Status) == 1 + 2 // ev.LIST_ROWS_PER_COST
    assert h.core.periodic_cost(pc.SubmitJob) == 1


def test_a_func_without_worker_or_live_job_stays_listed_until_it_has_been_idle_long_enough():
    forget = 60_000
    h = H(periodic_forget_idle_millis=forget)
    # Given many workers that each declared funcs of their own and then left
    baseline = h.core.periodic.index.status(T0, 1)
    for i in range(50):
        w = Conn("w%d" % i)
        for j in range(20):
            h.send(T0, w, pc.CanDo(1, b"f-%d-%d" % (i, j)))
        h.send(T0, w, pc.CanDo(2, b"shared"))
    assert len(h.status(T0)) == 50 * 20 + 1
    for session in list(h.core.periodic.workers.values()):
        h.apply(T0, ev.PeriodicClosed(session.conn))
        h.finish(T0)
    # Then STATUS lists them with zero counts (periodicd's clients poll for that)
    rows = h.status(T0)
    assert len(rows) == 50 * 20 + 1 and all((r.workers, r.jobs) == (0, 0) for r in rows)
    # until they have been idle for --periodic-forget-idle-millis, when a sweep forgets them
    h.core.sweep(T0 + forget - 1)
    assert len(h.status(T0 + forget - 1)) == 50 * 20 + 1
    h.core.sweep(T0 + forget)
    assert h.core.periodic.index.status(T0, 1) == baseline and h.core.periodic.sizes() == (0, 0)

    # A func with a live job stays while the job lives, with or without a worker
    t = T0 + forget
    h.submit(t, func="g", name="a")
    w = Conn("wg")
    assert len(assigns(h.worker(t, w, func="g"))) == 1
    h.send(t, w, pc.CantDo(3, b"g"))  # no worker declares it now, but its job runs
    h.core.periodic.forget_idle(t + 2 * forget)
    assert [(row.func, row.workers, row.processing) for row in h.status(t)] == [(b"g", 0, 1)]
    # and its idle time starts when the job ends
    t += 2 * forget
    h.send(t, w, pc.WorkDone(4, pc.Handle(b"g", b"a"), b"ok"))
    assert [(row.func, row.workers, row.jobs) for row in h.status(t)] == [(b"g", 0, 0)]
    h.core.periodic.forget_idle(t + forget - 1)
    assert [row.func for row in h.status(t)] == [b"g"]
    # A worker declaring it meanwhile keeps it, however long
    h.send(t + 1, w, pc.CanDo(5, b"g"))
    h.core.periodic.forget_idle(t + 3 * forget)
    assert [(row.func, row.workers, row.jobs) for row in h.status(t)] == [(b"g", 1, 0)]
    # Once that worker leaves too, the func goes after its own idle time
    h.core.periodic.on_closed(t + 3 * forget, w)
    h.core.periodic.forget_idle(t + 4 * forget - 1)
    assert [row.func for row in h.status(t)] == [b"g"]
    h.core.periodic.forget_idle(t + 4 * forget)
    assert h.status(t) == []


def test_drop_func_forgets_a_func_at_once():
    h = H()
    # A func a worker declared and left, and one whose jobs all ended
    w = Conn("w")
    h.send(T0, w, pc.CanDo(1, b"gone"))
    h.core.periodic.on_closed(T0, w)
    h.submit(T0, func="done", name="a")
    h.send(T0, Conn("c"), pc.RemoveJob(2, pc.Handle(b"done", b"a")))
    assert [(row.func, row.jobs) for row in h.status(T0)] == [(b"done", 0), (b"gone", 0)]
    # DROP_FUNC forgets each at once, without waiting for the idle time
    for func in (b"gone", b"done"):
        assert [type(msg) for _, msg in h.send(T0, Conn("c"), pc.DropFunc(3, func))] == [pc.Success]
    assert h.status(T0) == [] and h.core.periodic.sizes() == (0, 0) and not h.core.periodic.index.idle


def test_a_connection_declares_at_most_max_funcs():
    from jobmesh.coordinator.core.periodic.workers import MAX_FUNCS

    h = H()
    w = Conn("w")
    for i in range(MAX_FUNCS):
        h.apply(T0, ev.PeriodicPacket(w, pc.CanDo(i, b"f-%d" % i)))
    assert {type(msg) for _, msg in h.finish(T0)} == {pc.Success}
    # One more is refused with NO_WORKER, by CAN_DO or BROADCAST; declaring one it has is fine
    assert [msg for _, msg in h.send(T0, w, pc.CanDo(1, b"one-more"))] == [pc.NoWorker(1)]
    assert [msg for _, msg in h.send(T0, w, pc.Broadcast(2, b"one-more"))] == [pc.NoWorker(2)]
    assert [msg for _, msg in h.send(T0, w, pc.CanDo(3, b"f-7"))] == [pc.Success(3)]
    assert len(h.status(T0)) == MAX_FUNCS
    # After a CANT_DO it may declare another; another connection has its own count
    h.send(T0, w, pc.CantDo(4, b"f-7"))
    assert [msg for _, msg in h.send(T0, w, pc.CanDo(5, b"one-more"))] == [pc.Success(5)]
    assert [msg for _, msg in h.send(T0, Conn("w2"), pc.CanDo(6, b"other"))] == [pc.Success(6)]


def test_funcs_a_connection_brings_in_over_its_life_are_bounded(monkeypatch):
    """CANT_DO frees a place among the funcs a connection declares at once, but a func it
    withdrew stays listed for the forget time: declaring and withdrawing ever new names
    must not grow the listing without bound."""
    from jobmesh.coordinator.core.periodic import workers as periodic_workers

    monkeypatch.setattr(periodic_workers, "MAX_NEW_FUNCS", 20)
    h = H()
    w = Conn("w")
    for i in range(20):
        h.apply(T0, ev.PeriodicPacket(w, pc.CanDo(2 * i, b"churn-%d" % i)))
        h.apply(T0, ev.PeriodicPacket(w, pc.CantDo(2 * i + 1, b"churn-%d" % i)))
    assert {type(msg) for _, msg in h.finish(T0)} == {pc.Success}
    # One more new func is refused; a func the listing has already is fine, as for another connection
    assert [msg for _, msg in h.send(T0, w, pc.CanDo(50, b"churn-more"))] == [pc.NoWorker(50)]
    assert [msg for _, msg in h.send(T0, w, pc.CanDo(51, b"churn-3"))] == [pc.Success(51)]
    assert [msg for _, msg in h.send(T0, Conn("w2"), pc.CanDo(52, b"other"))] == [pc.Success(52)]
    assert len(h.status(T0)) == 21


def test_the_periodic_parts_change_jobs_only_through_the_table_behind_a_short_facade():
    """The table is the one place a job changes, so its listeners see every change: no
    Periodic part sets a Job field itself (``record``, ``set_periodic`` and ``transition``
    do). And ``jobs.py`` is the face of the parts, not a part of its own."""
    import ast
    import dataclasses
    from pathlib import Path

    from jobmesh.coordinator.core import periodic

    fields = {field.name for field in dataclasses.fields(Job)}
    folder = Path(periodic.__file__).parent
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                targets = [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple)
                                                                  else [target])]
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            else:
                continue
            found += ["%s:%d %s" % (path.name, node.lineno, t.attr) for t in targets
                      if isinstance(t, ast.Attribute) and t.attr in fields
                      and not (isinstance(t.value, ast.Name) and t.value.id == "self")]
    assert found == []
    assert len((folder / "jobs.py").read_text().splitlines()) < 300
