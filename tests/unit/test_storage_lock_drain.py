"""The database lock, the store's storage-fault helpers, and the core's drain/pause flags."""

from __future__ import annotations

import os
import sqlite3

import pytest

from jobmesh.coordinator.dblock import DatabaseInUse, DatabaseLock, lock_path
from jobmesh.protocol.jobs import JobState
from jobmesh.store.base import Batch, merge_batches
from jobmesh.store.sqlite import SQLiteStore
from tests.unit.test_core import Harness


# ---- the lock -----------------------------------------------------------------------------


def test_a_second_lock_on_the_same_database_names_the_holder(tmp_path):
    db = str(tmp_path / "jm.db")
    first = DatabaseLock(db)
    first.acquire()
    try:
        assert open(db + ".lock").read().strip() == str(os.getpid())
        with pytest.raises(DatabaseInUse) as caught:
            DatabaseLock(db).acquire()  # flock: another open file description conflicts, even in one process
        assert caught.value.pid == os.getpid()
        assert str(caught.value).startswith("database in use by pid %d" % os.getpid())
    finally:
        first.release()
    again = DatabaseLock(db)
    again.acquire()  # released: free again
    assert again.held
    again.release()


@pytest.mark.parametrize("alias", ["link", "relative"])
def test_two_names_of_one_database_file_take_one_lock(tmp_path, monkeypatch, alias):
    db = tmp_path / "jm.db"
    db.write_bytes(b"")
    if alias == "link":  # a symlink to the database file
        other = tmp_path / "alias.db"
        other.symlink_to(db)
        name = str(other)
    else:  # the same file through a relative path with a detour
        (tmp_path / "sub").mkdir()
        monkeypatch.chdir(tmp_path / "sub")
        name = "../sub/../jm.db"
    first = DatabaseLock(str(db))
    first.acquire()
    try:
        with pytest.raises(DatabaseInUse):
            DatabaseLock(name).acquire()
    finally:
        first.release()


def test_an_in_memory_database_takes_no_lock(tmp_path):
    assert lock_path(":memory:") is None
    lock = DatabaseLock(":memory:")
    lock.acquire()
    assert not lock.held


def test_a_lock_file_that_cannot_be_created_is_an_os_error(tmp_path):
    with pytest.raises(OSError):
        DatabaseLock(str(tmp_path / "missing" / "jm.db")).acquire()


# ---- store helpers ------------------------------------------------------------------------


def test_storage_reasons_are_short_words():
    store = SQLiteStore(":memory:")
    reason = store.fault_reason
    assert reason(sqlite3.OperationalError("database or disk is full")) == "disk full"
    assert reason(sqlite3.OperationalError("attempt to write a readonly database")) == "database is read-only"
    assert reason(sqlite3.OperationalError("database is locked")) == "database is locked"
    store.close()


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
        store = SQLiteStore(db, fault_file=str(fault))  # opens (reads only) despite the fault
        with pytest.raises(sqlite3.OperationalError) as caught:
            store.probe()
        assert store.is_storage_fault(caught.value) and store.fault_reason(caught.value) == reason
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
    h.register(0, "w1", capacity=2)
    h.core.paused = True
    later = h.submit_ok(1, delay=10)
    queued = h.submit_ok(2)
    h.sweep(100)
    assert h.core.table.jobs[later].state is JobState.SCHEDULED
    assert h.core.table.jobs[queued].state is JobState.QUEUED
    h.core.paused = False
    h.sweep(101)
    assert {h.core.table.jobs[j].state for j in (later, queued)} == {JobState.RUNNING}
