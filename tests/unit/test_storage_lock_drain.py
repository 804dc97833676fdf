"""SQLite's database lock (``SQLiteStore.lead``), its typed storage faults, and the core's
drain/pause flags."""

from __future__ import annotations

import os
import sqlite3

import pytest

from jobmesh.coordinator.core import events as ev
from jobmesh.periodic import codec as pc
from jobmesh.protocol import messages as m
from jobmesh.protocol.jobs import JobState
from jobmesh.store.base import Batch, CannotLead, DatabaseInUse, StorageFault, merge_batches
from jobmesh.store.sqlite import FileLock, SQLiteStore, faults, lock_path
from tests.support.faulty_store import FaultySQLiteStore
from tests.unit.core_driver import Conn
from tests.unit.test_core import Harness, row
from tests.unit.test_core_periodic import _body

REFUSAL = m.Error("storage unavailable: disk full")


# ---- the lock: SQLiteStore.lead -------------------------------------------------------------


def test_a_second_store_on_the_same_database_cannot_lead_and_names_the_holder(tmp_path):
    db = str(tmp_path / "jm.db")
    first = SQLiteStore(db)
    first.lead(lambda: pytest.fail("an SQLite store never stands by"))
    second = SQLiteStore(db)  # opening a current schema writes nothing
    try:
        assert open(db + ".lock").read().strip() == str(os.getpid())
        with pytest.raises(DatabaseInUse) as caught:
            second.lead(lambda: None)  # flock: another open file description conflicts, even in one process
        assert isinstance(caught.value, CannotLead) and caught.value.pid == os.getpid()
        assert str(caught.value).startswith("database in use by pid %d" % os.getpid())
    finally:
        first.close()  # closing gives the lock up
    second.lead(lambda: None)  # released: free again
    second.close()


@pytest.mark.parametrize("alias", ["link", "relative"])
def test_two_names_of_one_database_file_take_one_lock(tmp_path, monkeypatch, alias):
    db = tmp_path / "jm.db"
    first = SQLiteStore(str(db))
    if alias == "link":  # a symlink to the database file
        other = tmp_path / "alias.db"
        other.symlink_to(db)
        name = str(other)
    else:  # the same file through a relative path with a detour
        (tmp_path / "sub").mkdir()
        monkeypatch.chdir(tmp_path / "sub")
        name = "../sub/../jm.db"
    first.lead(lambda: None)
    second = SQLiteStore(name)
    try:
        with pytest.raises(DatabaseInUse):
            second.lead(lambda: None)
    finally:
        first.close()
        second.close()


def test_an_in_memory_database_takes_no_lock(tmp_path):
    assert lock_path(":memory:") is None
    store = SQLiteStore(":memory:")
    store.lead(lambda: None)
    SQLiteStore(":memory:").lead(lambda: None)
    store.close()


def test_a_lock_file_that_cannot_be_created_is_a_one_line_refusal(tmp_path):
    with pytest.raises(OSError):
        FileLock(str(tmp_path / "missing" / "jm.db")).acquire()
    store = SQLiteStore(str(tmp_path / "jm.db"))
    (tmp_path / "jm.db.lock").mkdir()  # where the lock file would be
    with pytest.raises(CannotLead, match="cannot create its lock file"):
        store.lead(lambda: None)
    store.close()


# ---- storage faults: typed --------------------------------------------------------------------


@pytest.mark.parametrize("message, reason", [("database or disk is full", "disk full"),
                                             ("attempt to write a readonly database", "database is read-only"),
                                             ("database is locked", "database is locked")])
def test_sqlite_errors_are_storage_faults_in_short_words(message, reason):
    error = sqlite3.OperationalError(message)
    with pytest.raises(StorageFault) as caught:
        with faults():
            raise error
    assert caught.value.reason == reason and caught.value.__cause__ is error


def test_merge_batches_keeps_the_newer_row_of_a_job():
    older = Batch([], [("QUEUED", 1, "a"), ("QUEUED", 1, "b")], [("T", 1)], [])
    newer = Batch([("new", "x")], [("RUNNING", 2, "a")], [("T", 1), ("U", 2)], ["z"])
    merged = merge_batches(older, newer)
    assert sorted(merged.updates) == [("QUEUED", 1, "b"), ("RUNNING", 2, "a")]
    assert merged.inserts == [("new", "x")]
    assert merged.task_types == [("T", 1), ("U", 2)]
    assert merged.purges == ["z"]


def test_fault_file_makes_writes_fail_and_clearing_it_heals(tmp_path):
    fault = tmp_path / "fault"
    db = str(tmp_path / "jm.db")
    SQLiteStore(db).close()  # a current schema: opening later writes nothing
    for text, reason in (("readonly", "database is read-only"), ("full", "disk full")):
        fault.write_text(text)
        store = FaultySQLiteStore(db, fault_file=str(fault))  # opens (reads only) despite the fault
        with pytest.raises(StorageFault) as caught:
            store.probe()
        assert caught.value.reason == reason and isinstance(caught.value.__cause__, sqlite3.OperationalError)
        failure = store.commit_probe().get()  # on the write thread too
        assert isinstance(failure, StorageFault) and failure.reason == reason
        fault.write_text("")
        store.probe()
        store.close()


# ---- drain and pause --------------------------------------------------------------------


def test_a_draining_core_assigns_nothing_but_takes_results():
    h = Harness()
    h.register(0, "w1", capacity=2)
    first = h.submit_ok(1)
    assert h.core.running_attempts == 1
    h.core.draining = True
    second = h.submit_ok(2)
    h.step(3)
    assert h.core.table.jobs[second].state is JobState.QUEUED
    h.report(4, first)
    assert h.core.running_attempts == 0
    assert h.core.table.jobs[second].state is JobState.QUEUED


def test_a_paused_core_neither_promotes_nor_assigns():
    h = Harness()
    later = h.submit_ok(1, delay=10)
    queued = h.submit_ok(2)
    h.core.refusal = REFUSAL
    h.register(3, "w1", capacity=2)
    h.sweep(100)
    assert h.core.table.jobs[later].state is JobState.SCHEDULED
    assert h.core.table.jobs[queued].state is JobState.QUEUED
    h.core.refusal = None
    h.sweep(101)
    assert {h.core.table.jobs[j].state for j in (later, queued)} == {JobState.RUNNING}


def test_while_storage_fails_writes_are_refused_unapplied_and_reads_answered():
    # Given a core with a queued, a scheduled, a finished and a Periodic job, a JSON
    # worker and a Periodic worker, whose storage then fails
    h = Harness()
    queued = h.submit_ok(1)
    later = h.submit_ok(1, delay=50)
    done = h.submit_ok(1)
    h.cancel(2, done)
    h.apply(2, ev.PeriodicPacket(Conn("pc"), pc.SubmitJob(1, pc.Job(b"f", b"a", b"w", 0, 0, 0))))
    h.step(2)
    before = {job_id: row(h, job_id) for job_id in (queued, later, done)}
    h.core.refusal = REFUSAL
    client, pclient, worker = Conn("client"), Conn("pclient"), Conn("w-new")

    # When every kind of write arrives in one batch, among reads
    writes = [m.SubmitJob("SLEEP", {"durationMillis": 1}), m.CancelJob(queued), m.RetryJob(done),
              m.PurgeJobs(older_than_millis=0)]
    replies = [h.apply(3, ev.Request(client, msg)) for msg in writes]
    status = h.apply(3, ev.Request(client, m.GetJobStatus(queued)))
    listing = h.apply(3, ev.Request(client, m.ListJobs()))
    for msg in (pc.SubmitJob(7, pc.Job(b"f", b"b", b"w", 0, 0, 0)), pc.RunJob(8, pc.Job(b"f", b"c", b"w", 0, 0, 0)),
                pc.RemoveJob(9, pc.Handle(b"f", b"a")), pc.DropFunc(10, b"f"),
                pc.Load(11, [pc.Job(b"f", b"d", b"w", 0, 0, 0)])):
        h.apply(3, ev.PeriodicPacket(pclient, msg))
    h.apply(3, ev.Registered(worker, m.WorkerRegister("w-new", 2, ["NEW_TYPE"])))
    h.apply(3, ev.Result(worker, m.TaskResult("w-new", queued, queued + ".1", True, {}, None)))
    h.apply(3, ev.Registered(Conn("w1"), m.WorkerRegister("w1", 2, None)))  # declares nothing new
    h.apply(300, ev.SWEEP)  # the scheduled job is due, and a worker is free
    h.core.end_batch(300)

    # Then nothing was applied: no row to commit, every job as it was
    assert not any(h.core.take_dirty())
    assert replies == [REFUSAL] * len(writes)
    assert isinstance(status, m.JobStatus) and status.job["state"] == "QUEUED"
    assert isinstance(listing, m.JobList) and len(listing.jobs) == 4
    assert {job_id: row(h, job_id) for job_id in before} == before
    assert h.core.table.jobs[later].state is JobState.SCHEDULED
    assert "NEW_TYPE" not in h.core.table.known_types and h.core.counters.stale_results == 1
    out = h.core.take_outbound()
    periodic = [pc.decode_reply(_body(frame)) for conn, frame in out if conn is pclient]
    assert [p.data for p in periodic] == [b"storage unavailable: disk full"] * 5
    assert [(c, msg) for c, msg in out if c is worker] == [(worker, m.Error("storage unavailable: disk full")),
                                                            (worker, None)]
    assert [msg for c, msg in out if c.name == "w1"] == [m.WorkerRegistered("w1")]

    # And once storage works, the same writes apply
    h.core.refusal = None
    assert isinstance(h.apply(400, ev.Request(client, m.CancelJob(queued))), m.JobCancel)
    h.step(400)
    assert h.store.get(queued).state is JobState.CANCELLED


def test_a_probe_reopens_a_writer_opened_on_a_read_only_file(tmp_path):
    # A connection opened while the file could not be written stays read-only after the
    # file can be (SQLite decides at open); as root no mode bit can show it, so the
    # writer is opened read-only by URI here, as the kernel would have opened it.
    db = str(tmp_path / "jm.db")
    store = SQLiteStore(db)
    store.conn.close()
    store.conn = sqlite3.connect("file:%s?mode=ro" % db, uri=True, isolation_level=None, check_same_thread=False)
    with pytest.raises(sqlite3.OperationalError):
        store.conn.execute("INSERT INTO storage_probe (x) VALUES (1)")
    store.probe()  # finds it read-only, opens the writer again: works
    store.write(Batch([], [], [("T", 1)], []))
    assert "T" in store.load_task_types()
    store.close()


def test_while_storage_fails_a_registration_with_new_task_defaults_is_refused_and_the_same_ones_are_not():
    # Given a core that keeps ONCE's defaults (maxAttempts 1), whose storage then fails
    h = Harness()
    kept = {"ONCE": {"maxAttempts": 1}}
    h.apply(1, ev.Registered(Conn("w0"), m.WorkerRegister("w0", 1, ["ONCE"], task_defaults=kept)))
    h.step(1)
    h.core.refusal = REFUSAL
    # When one worker declares other defaults for it, and another the ones kept
    changed, same = Conn("w-changed"), Conn("w-same")
    h.apply(2, ev.Registered(changed, m.WorkerRegister("w-changed", 1, ["ONCE"],
                                                       task_defaults={"ONCE": {"maxAttempts": 5}})))
    h.apply(2, ev.Registered(same, m.WorkerRegister("w-same", 1, ["ONCE"], task_defaults=kept)))
    # Then the first is refused and closed, nothing written; the second registers
    assert not any(h.core.take_dirty())
    out = h.core.take_outbound()
    assert [msg for c, msg in out if c is changed] == [REFUSAL, None]
    assert [msg for c, msg in out if c is same] == [m.WorkerRegistered("w-same")]
    assert h.core.table.max_attempts_of("ONCE") == 1
