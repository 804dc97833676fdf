"""Requests that need a store read the store answers later: held in order, applied again.

Spec: the storage seam (store/base.py, ``Store.read_later`` and ``Store.later``): a
networked store may finish a read after the core has moved on; the request waits with
its reply's Slot, later requests are applied meanwhile, and it is applied again once the
read is done; retention applies its reads at a later sweep. The store here is a real
SQLite store whose ``read_later`` and ``later`` finish only when the test says so.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

from jobmesh.coordinator.core import events as ev
from jobmesh.coordinator.core import table as table_mod
from jobmesh.coordinator.core.waiters import Slot
from jobmesh.protocol import messages as m
from jobmesh.store.base import Read
from jobmesh.store.sqlite import SQLiteStore
from tests.unit.core_driver import Conn, CoreDriver

SLEEP = {"durationMillis": 1}


class LateRead:
    """A read that finishes when ``finish`` is called (then reads for real)."""

    def __init__(self, read: Callable[[], Any]) -> None:
        self._read = read
        self._done = False
        self._job: Any = None
        self._callbacks: list[Callable[[], None]] = []

    def finish(self) -> None:
        self._job = self._read()
        self._done = True
        for callback in self._callbacks:
            callback()

    def ready(self) -> bool:
        return self._done

    def result(self) -> Any:
        assert self._done
        return self._job

    def then(self, callback: Callable[[], None]) -> None:
        if self._done:
            callback()
        else:
            self._callbacks.append(callback)


class LateStore(SQLiteStore):
    def __init__(self) -> None:
        super().__init__(":memory:")
        self.reads: list[LateRead] = []

    def read_later(self, job_id: str | None = None, key: str | None = None) -> Read:
        read = LateRead((lambda: self.get(job_id)) if job_id is not None else (lambda: self.find_by_key(key or "")))
        self.reads.append(read)
        return read

    def later(self, read: Callable[[], Any]) -> Read[Any]:
        late = LateRead(read)
        self.reads.append(late)
        return late


@pytest.fixture
def d(monkeypatch) -> CoreDriver:
    monkeypatch.setattr(table_mod, "FINISHED_CACHE", 1)  # finished jobs leave memory at once
    driver = CoreDriver(LateStore())
    driver.apply(0, ev.Registered(Conn("w1"), m.WorkerRegister("w1", 4, None)))
    driver.end_batch(0)
    return driver


def submit(d: CoreDriver, now: int, key: str | None) -> str:
    """A submit, its key's read (if any) finished at once."""
    reply = d.request(now, m.SubmitJob("SLEEP", SLEEP, 0, key))
    if isinstance(reply, Slot):
        store = d.store
        assert isinstance(store, LateStore)
        store.reads[-1].finish()
        d.apply(now, ev.READS_DONE)
        d.end_batch(now)
        [(_waiter, reply)] = d.take_answers()
    assert isinstance(reply, m.JobSubmitted), reply
    return reply.job_id


def finished_job(d: CoreDriver, now: int, key: str | None = None) -> str:
    """A job that completed and then left memory (another job finished after it)."""
    job_ids = []
    for k in (key, None):
        job_ids.append(submit(d, now, k))
        d.end_batch(now)
        [(conn, assign)] = [(c, f) for c, f in d.sent if isinstance(f, m.TaskAssign) and f.job_id == job_ids[-1]]
        d.apply(now, ev.Result(conn, m.TaskResult("w1", assign.job_id, assign.attempt_id, True, {"n": len(job_ids)})))
        d.end_batch(now)
    assert job_ids[0] not in d.core.table.finished and job_ids[0] not in d.core.table.jobs
    return job_ids[0]


def held_status(d: CoreDriver) -> tuple[str, LateStore, Conn, Slot]:
    """A finished job out of memory, and the GET_JOB_STATUS of it that client "c" sent at
    20, held for its store read: (job id, the store, the client, the held reply)."""
    job_id = finished_job(d, 10)
    store = d.store
    assert isinstance(store, LateStore)
    client = Conn("c")
    held = d.request(20, m.GetJobStatus(job_id), client)
    assert isinstance(held, Slot)
    return job_id, store, client, held


def test_a_status_that_needs_a_late_read_is_held_and_answered_once_it_is_done(d):
    # The status of a job not in memory waits for the read; a later request is answered now
    job_id, store, client, held = held_status(d)
    later = d.request(20, m.GetStats(), client)
    assert isinstance(later, m.Stats)
    assert d.end_batch(20) == [] and d.take_answers() == []
    assert not d.woken
    # When the read finishes, the runtime is woken and the request is applied again
    store.reads[-1].finish()
    assert d.woken
    d.apply(30, ev.READS_DONE)
    d.end_batch(30)
    [(waiter, reply)] = d.take_answers()
    assert waiter.token is held and waiter.conn is client and not waiter.job_id
    assert isinstance(reply, m.JobStatus) and reply.job["jobId"] == job_id and reply.job["state"] == "COMPLETED"
    # and the job is in memory again: the next status needs no read
    assert isinstance(d.request(40, m.GetJobStatus(job_id), client), m.JobStatus)


def test_keyed_submits_held_for_the_same_key_resolve_in_order_to_one_job(d):
    first = finished_job(d, 10, key="k1")
    d.core.table.keys.pop("k1", None)  # the key's job left memory long ago
    store = d.store
    assert isinstance(store, LateStore)
    a = d.request(20, m.SubmitJob("SLEEP", SLEEP, 0, "k1"))
    b = d.request(20, m.SubmitJob("SLEEP", SLEEP, 0, "k1"))
    fresh = d.request(20, m.SubmitJob("SLEEP", SLEEP, 0, "k2"))
    assert isinstance(a, Slot) and isinstance(b, Slot) and isinstance(fresh, Slot)  # every key not in memory
    for read in store.reads:
        if not read.ready():
            read.finish()
    d.apply(30, ev.READS_DONE)
    d.end_batch(30)
    replies = {id(w.token): r for w, r in d.take_answers()}
    assert replies[id(a)] == m.JobSubmitted(first) and replies[id(b)] == m.JobSubmitted(first)
    new = replies[id(fresh)]
    assert isinstance(new, m.JobSubmitted) and new.job_id != first
    assert d.core.active_count == 1  # one new job (k2), no duplicate of k1's


def test_a_request_whose_read_is_not_done_stays_held(d):
    job_id = finished_job(d, 10)
    held = d.request(20, m.GetJobEvents(job_id))
    assert isinstance(held, Slot)
    d.apply(30, ev.READS_DONE)  # a wake-up for another read: this one is not done
    d.end_batch(30)
    assert d.take_answers() == []
    assert [w.token for w in d.core.held_requests()] == [held]


def test_a_listing_is_held_for_its_page_and_answered_once_it_is_read(d):
    job_id = submit(d, 10, None)
    d.end_batch(10)
    store = d.store
    assert isinstance(store, LateStore)
    client = Conn("c")
    # The page is a store read: the listing waits for it, a later request is answered now
    held = d.request(20, m.ListJobs(limit=10), client)
    assert isinstance(held, Slot)
    assert isinstance(d.request(20, m.GetStats(), client), m.Stats)
    d.end_batch(20)
    assert d.take_answers() == [] and not d.woken
    # Once it is read (the core is woken), the listing is applied again and answered in its place
    store.reads[-1].finish()
    assert d.woken
    d.apply(30, ev.READS_DONE)
    d.end_batch(30)
    [(waiter, reply)] = d.take_answers()
    assert waiter.token is held and waiter.conn is client
    assert isinstance(reply, m.JobList) and [j["jobId"] for j in reply.jobs] == [job_id]


def test_a_purge_is_held_for_its_whole_walk_and_applied_in_one_batch(d):
    # Given finished jobs on both sides of a running one, so the walk takes two steps
    # (sequences 1-2 finished, 3 running, 4-7 finished: the first step examines 1-4)
    done = [finished_job(d, 10)]
    running = submit(d, 10, None)
    d.end_batch(10)
    done += [finished_job(d, 10), finished_job(d, 10)]
    store = d.store
    assert isinstance(store, LateStore)
    before = store.count()
    # When a purge of four arrives, it waits for the whole walk: nothing is forgotten meanwhile
    held = d.request(20, m.PurgeJobs(0, limit=4))
    assert isinstance(held, Slot)
    d.end_batch(20)
    assert d.core.counters.purged == 0 and store.count() == before and d.take_answers() == []
    # Then, the walk read, it is applied once, whole, in one batch
    store.reads[-1].finish()
    d.apply(30, ev.READS_DONE)
    [(waiter, reply)] = d.core.end_batch(30)
    rows = d.core.take_dirty()
    assert len(rows.purges) == 4 and d.core.counters.purged == 4
    d.store.write(rows)
    assert waiter.token is held and reply == m.JobsPurged(4, True)
    assert store.count() == before - 4 and store.get(running) is not None
    assert [store.get(job_id) is None for job_id in done] == [True, True, False]  # the oldest four went


def test_retention_starts_its_reads_at_a_sweep_and_forgets_what_they_found_at_a_later_one(monkeypatch):
    monkeypatch.setattr(table_mod, "FINISHED_CACHE", 1)
    d = CoreDriver(LateStore(), retain_finished_millis=5)
    d.apply(0, ev.Registered(Conn("w1"), m.WorkerRegister("w1", 4, None)))
    d.end_batch(0)
    finished_job(d, 10)
    store = d.store
    assert isinstance(store, LateStore)
    # A sweep starts retention's reads and goes on: nothing is purged while they are out
    d.apply(100, ev.SWEEP)
    d.end_batch(100)
    assert store.count() == 2 and not store.reads[-1].ready()
    d.apply(200, ev.SWEEP)
    d.end_batch(200)
    assert store.count() == 2
    # Once they are done, the next sweep forgets what they found
    store.reads[-1].finish()
    d.apply(300, ev.SWEEP)
    d.end_batch(300)
    assert store.count() == 0 and d.core.counters.purged == 2


def test_a_keyed_submit_in_the_batch_that_purges_the_key_s_job_makes_a_new_job(monkeypatch):
    monkeypatch.setattr(table_mod, "FINISHED_CACHE", 1)
    d = CoreDriver()  # a plain SQLite store: reads answer at once
    d.apply(0, ev.Registered(Conn("w1"), m.WorkerRegister("w1", 4, None)))
    d.end_batch(0)
    old = finished_job(d, 10, key="k")
    # One batch: the purge of every finished job, then a submit under the purged job's key
    purged = d.request(20, m.PurgeJobs(0))
    assert isinstance(purged, m.JobsPurged) and purged.purged == 2
    again = d.request(20, m.SubmitJob("SLEEP", SLEEP, 0, "k"))
    d.end_batch(20)
    assert isinstance(again, m.JobSubmitted) and again.job_id != old
    assert d.request(30, m.GetJobStatus(old)) == m.Error("unknown job '%s'" % old)
    again_status = d.request(30, m.SubmitJob("SLEEP", SLEEP, 0, "k"))
    assert again_status == m.JobSubmitted(again.job_id)  # the key now names the new job


def test_a_damaged_row_ends_alone_and_recovery_serves_the_rest(tmp_path):
    import sqlite3

    db = str(tmp_path / "jm.db")
    d = CoreDriver(SQLiteStore(db))
    d.apply(0, ev.Registered(Conn("w1"), m.WorkerRegister("w1", 1, None)))
    d.end_batch(0)
    ids = [d.request(0, m.SubmitJob("SLEEP", SLEEP)).job_id for _ in range(4)]
    d.end_batch(0)  # the first runs, three wait
    d.store.close()
    with sqlite3.connect(db) as raw:  # edited by hand, or by another program
        raw.execute("UPDATE jobs SET payload='not json' WHERE job_id=?", (ids[0],))  # the running one
        raw.execute("UPDATE jobs SET priority='URGENT' WHERE job_id=?", (ids[1],))
        raw.execute("UPDATE jobs SET periodic='{broken' WHERE job_id=?", (ids[2],))
    again = CoreDriver(SQLiteStore(db))
    stats = again.core.recover(10)
    again.end_batch(10)
    assert stats.damaged == 3 and stats.requeued == 0
    states = {job_id: again.request(10, m.GetJobStatus(job_id)).job for job_id in ids}
    assert [states[i]["state"] for i in ids] == ["FAILED", "CANCELLED", "CANCELLED", "QUEUED"]
    assert "payload" in states[ids[0]]["error"] and "priority" in states[ids[1]]["error"]
    assert "could not be read" in states[ids[2]]["error"] and "periodic" in states[ids[2]]["error"]
    # a worker runs the one job that was fine
    again.apply(20, ev.Registered(Conn("w2"), m.WorkerRegister("w2", 1, None)))
    out = again.end_batch(20)
    assert [f.job_id for _c, f in out if isinstance(f, m.TaskAssign)] == [ids[3]]


def test_a_row_read_before_its_purge_and_returned_after_it_is_not_kept(d):
    # Given a finished job out of memory, and a status request whose store read saw its
    # row (the read runs on its own connection, so it can see the row the purge deletes)
    job_id, store, _client, held = held_status(d)
    seen = store.get(job_id)
    assert seen is not None
    status_read = store.reads[-1]
    d.end_batch(20)
    # When retention forgets the job and its row is deleted, a batch later than the read began
    d.core.table.forget([(job_id, None)])
    d.end_batch(30)
    assert store.get(job_id) is None
    # And the read then returns the row it saw
    status_read._read = lambda: seen
    status_read.finish()
    d.apply(40, ev.READS_DONE)
    d.end_batch(40)
    # Then the request is answered as for a job that is gone, and memory keeps no copy of it
    [(waiter, reply)] = d.take_answers()
    assert waiter.token is held
    assert isinstance(reply, m.Error) and "unknown job" in reply.message, reply
    assert job_id not in d.core.table.finished
