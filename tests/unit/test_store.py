"""JobStore on SQLite: schema, row round-trip, atomic group commit, reads, in-place migration.

ARCHITECTURE.md "Persistence and recovery"; the lease/deadline PR's execution_timeout and
deadline columns; PROTOCOL.md's migration of pre-priority databases to NORMAL and seq 0.
"""

from __future__ import annotations

import sqlite3

import pytest

from jobmesh.coordinator.job import Job
from jobmesh.coordinator.store import (
    ADDED_COLUMNS, BASE_COLUMNS, JobStore, insert_row, job_from_row, update_row,
)
from jobmesh.protocol.jobs import JobState, Priority

ALL_COLUMNS = {
    "job_id", "task_type", "payload", "state", "attempts", "max_attempts", "worker_id", "attempt_id",
    "result", "error", "created_at", "updated_at", "retry_at", "idempotency_key",
    "execution_timeout", "deadline", "priority", "seq", "run_at", "retry_of", "name", "periodic", "events",
}
LEGACY_COLUMNS = ("job_id, task_type, payload, state, attempts, max_attempts, worker_id, attempt_id, result,"
                  " error, created_at, updated_at, retry_at, idempotency_key")


def make_job(job_id: str = "j1", **kw) -> Job:
    fields = dict(
        job_id=job_id, seq=1, task_type="SLEEP", payload={"durationMillis": 5}, max_attempts=3,
        priority=Priority.NORMAL, created_at=1000,
    )
    fields.update(kw)
    return Job(**fields)


def fields_of(job: Job) -> dict:
    return {name: getattr(job, name) for name in Job.__slots__}


@pytest.fixture
def store():
    s = JobStore(":memory:")
    yield s
    s.close()


def columns(conn: sqlite3.Connection) -> list[str]:
    return [row[1] for row in conn.execute("PRAGMA table_info(jobs)")]


# ---- schema ----------------------------------------------------------------------------


def test_fresh_database_gets_the_full_schema_without_migrating(store):
    assert set(columns(store.conn)) == ALL_COLUMNS
    assert store.migrated == []
    assert store.count() == 0
    assert store.max_seq() == 0
    assert store.load_active() == []
    assert store.list_page(10, None, None) == []
    indexes = {row[1] for row in store.conn.execute("PRAGMA index_list(jobs)")}
    assert {"jobs_idempotency_key", "jobs_state"} <= indexes


def test_reopening_a_current_file_database_changes_nothing(tmp_path):
    path = str(tmp_path / "jobs.db")
    s = JobStore(path)
    s.write([insert_row(make_job())], [])
    s.close()
    s = JobStore(path)
    assert s.migrated == []
    assert fields_of(s.get("j1")) == fields_of(make_job())
    s.close()


# ---- round trip -----------------------------------------------------------------------


def test_every_field_round_trips_including_json_and_unicode(store):
    job = make_job(
        "ジョブ-1", seq=42, task_type="WORD_COUNT",
        payload={"text": "héllo wörld ✓ 😀 / \"quoted\" \\ back\nslash", "extra": [1, {"n": None}]},
        max_attempts=7, priority=Priority.HIGH, created_at=1_700_000_000_123,
        idempotency_key="clé-😀", state=JobState.RUNNING, attempts=2, worker_id="wörker",
        attempt_id="att-1", result={"words": 3, "nested": {"ü": ["a", 1.5, True, None]}},
        error="boom: ünïcode 💥", updated_at=1_700_000_000_999, retry_at=None,
        execution_timeout=600_000, deadline=1_700_000_600_999,
    )
    store.write([insert_row(job)], [])
    got = store.get("ジョブ-1")
    assert fields_of(got) == fields_of(job)
    assert got.state is JobState.RUNNING and got.priority is Priority.HIGH
    assert store.find_by_key("clé-😀").job_id == "ジョブ-1"
    assert got.snapshot() == job.snapshot()


def test_update_row_changes_only_the_mutable_fields(store):
    job = make_job(priority=Priority.LOW, seq=9, idempotency_key="k", execution_timeout=50)
    store.write([insert_row(job)], [])
    job.state = JobState.RETRY_WAIT
    job.attempts = 1
    job.error = "nope"
    job.retry_at = 5000
    job.updated_at = 4000
    store.write([], [update_row(job)])
    assert fields_of(store.get("j1")) == fields_of(job)
    job.state = JobState.COMPLETED
    job.retry_at = None
    job.result = {"sleptMillis": 5}
    store.write([], [update_row(job)])
    assert fields_of(store.get("j1")) == fields_of(job)
    assert job_from_row(insert_row(job)).snapshot() == job.snapshot()


def test_get_unknown_and_find_unknown_key(store):
    assert store.get("nope") is None
    assert store.find_by_key("nope") is None


# ---- atomic group commit --------------------------------------------------------------


def test_a_failing_batch_leaves_nothing(store):
    store.write([insert_row(make_job("a", seq=1))], [])
    before = fields_of(store.get("a"))
    a_changed = make_job("a", seq=1, state=JobState.CANCELLED, updated_at=9)
    with pytest.raises(sqlite3.IntegrityError):
        store.write(
            [insert_row(make_job("b", seq=2)), insert_row(make_job("c", seq=3)), insert_row(make_job("b", seq=4))],
            [update_row(a_changed)],
        )
    assert store.count() == 1
    assert store.get("b") is None and store.get("c") is None
    assert fields_of(store.get("a")) == before
    assert not store.conn.in_transaction
    # The store is still usable after the rollback.
    store.write([insert_row(make_job("b", seq=2))], [update_row(a_changed)])
    assert store.count() == 2
    assert store.get("a").state is JobState.CANCELLED


def test_a_batch_failing_on_an_existing_primary_key_leaves_nothing(store):
    store.write([insert_row(make_job("a"))], [])
    with pytest.raises(sqlite3.IntegrityError):
        store.write([insert_row(make_job("new", seq=2)), insert_row(make_job("a", seq=3))], [])
    assert store.count() == 1 and store.get("new") is None


def test_idempotency_keys_are_unique_but_null_keys_are_not(store):
    store.write([insert_row(make_job("a", seq=1)), insert_row(make_job("b", seq=2))], [])
    store.write([insert_row(make_job("k1", seq=3, idempotency_key="k"))], [])
    with pytest.raises(sqlite3.IntegrityError):
        store.write([insert_row(make_job("k2", seq=4, idempotency_key="k"))], [])
    assert store.count() == 3
    assert store.find_by_key("k").job_id == "k1"


def test_empty_batch_is_fine(store):
    store.write([], [])
    assert store.count() == 0


# ---- reads ------------------------------------------------------------------------------


def fill(store: JobStore) -> list[Job]:
    states = [JobState.QUEUED, JobState.RUNNING, JobState.COMPLETED, JobState.RETRY_WAIT, JobState.FAILED,
              JobState.QUEUED, JobState.CANCELLED, JobState.RUNNING]
    jobs = [make_job("j%d" % i, seq=i * 10, state=s, created_at=1000 + i) for i, s in enumerate(states, start=1)]
    # Separate batches: rowid order follows insertion order across commits too.
    store.write([insert_row(j) for j in jobs[:3]], [])
    store.write([insert_row(j) for j in jobs[3:]], [])
    return jobs


def test_list_page_is_newest_first_and_pages_by_rowid(store):
    jobs = fill(store)
    ids = [j.job_id for j in reversed(jobs)]
    page = store.list_page(3, None, None)
    assert [j.job_id for _, j in page] == ids[:3]
    rowids = [r for r, _ in page]
    assert rowids == sorted(rowids, reverse=True)
    seen = []
    before = None
    while True:
        page = store.list_page(3, None, before)
        if not page:
            break
        seen += [j.job_id for _, j in page]
        before = page[-1][0]
    assert seen == ids


def test_list_page_filters_by_state_and_update_keeps_position(store):
    jobs = fill(store)
    assert [j.job_id for _, j in store.list_page(100, "QUEUED", None)] == ["j6", "j1"]
    assert [j.job_id for _, j in store.list_page(100, "RUNNING", None)] == ["j8", "j2"]
    assert store.list_page(100, "NOPE", None) == []
    # An update moves the row between states but not in the newest-first order.
    jobs[0].state = JobState.RUNNING
    store.write([], [update_row(jobs[0])])
    assert [j.job_id for _, j in store.list_page(100, "RUNNING", None)] == ["j8", "j2", "j1"]
    assert [j.job_id for _, j in store.list_page(100, None, None)][-1] == "j1"
    rowid_j8 = store.list_page(1, "RUNNING", None)[0][0]
    assert [j.job_id for _, j in store.list_page(100, "RUNNING", rowid_j8)] == ["j2", "j1"]


def test_load_active_returns_only_non_terminal_jobs(store):
    fill(store)
    active = {j.job_id: j.state for j in store.load_active()}
    assert active == {"j1": JobState.QUEUED, "j2": JobState.RUNNING, "j4": JobState.RETRY_WAIT,
                      "j6": JobState.QUEUED, "j8": JobState.RUNNING}


def test_max_seq_and_count(store):
    fill(store)
    assert store.max_seq() == 80
    assert store.count() == 8


def test_find_by_key_returns_the_bound_job(store):
    store.write([insert_row(make_job("a", seq=1, idempotency_key="x")),
                 insert_row(make_job("b", seq=2, idempotency_key="y", state=JobState.COMPLETED))], [])
    assert store.find_by_key("x").job_id == "a"
    found = store.find_by_key("y")
    assert found.job_id == "b" and found.state is JobState.COMPLETED


# ---- legacy migration ------------------------------------------------------------------


def legacy_db(path, extra_columns: dict[str, str], rows: list[tuple], extra_values=()) -> None:
    conn = sqlite3.connect(str(path))
    extra = "".join(", %s %s" % item for item in extra_columns.items())
    conn.execute("CREATE TABLE jobs (%s%s)" % (BASE_COLUMNS, extra))
    names = LEGACY_COLUMNS + "".join(", " + c for c in extra_columns)
    marks = ",".join("?" * (14 + len(extra_columns)))
    for row in rows:
        conn.execute("INSERT INTO jobs (%s) VALUES (%s)" % (names, marks), row + tuple(extra_values))
    conn.commit()
    conn.close()


LEGACY_ROWS = [
    ("old-q", "SLEEP", '{"durationMillis": 5}', "QUEUED", 0, 3, None, None, None, None, 300, 300, None, "key-q"),
    ("old-r", "WORD_COUNT", '{"text": "a b"}', "RUNNING", 1, 3, "w1", "att", None, None, 100, 150, None, None),
    ("old-w", "FAIL", '{"failUntilAttempt": 2}', "RETRY_WAIT", 1, 3, None, None, None, "boom", 200, 250, 900, None),
    ("old-c", "SHA256", '{"text": "é"}', "COMPLETED", 1, 3, None, None, '{"sha256": "x"}', None, 50, 60, None, None),
]


def test_pre_deadline_pre_priority_database_is_migrated_in_place(tmp_path):
    path = tmp_path / "legacy.db"
    legacy_db(path, {}, LEGACY_ROWS)
    s = JobStore(str(path))
    assert s.migrated == ["execution_timeout", "deadline", "priority", "seq", "run_at", "retry_of", "name", "periodic", "events"]
    assert set(columns(s.conn)) == ALL_COLUMNS
    jobs = {j.job_id: j for j in s.load_active()}
    assert set(jobs) == {"old-q", "old-r", "old-w"}
    for job in jobs.values():
        assert job.priority is Priority.NORMAL
        assert job.seq == 0
        assert job.execution_timeout is None and job.deadline is None
    assert jobs["old-r"].worker_id == "w1" and jobs["old-r"].attempt_id == "att"
    assert jobs["old-w"].retry_at == 900 and jobs["old-w"].error == "boom"
    assert jobs["old-q"].payload == {"durationMillis": 5}
    done = s.get("old-c")
    assert done.state is JobState.COMPLETED and done.result == {"sha256": "x"} and done.payload == {"text": "é"}
    assert s.find_by_key("key-q").job_id == "old-q"
    assert s.max_seq() == 0
    # New rows can be written next to the migrated ones.
    s.write([insert_row(make_job("new", seq=1, priority=Priority.HIGH))], [])
    assert s.get("new").priority is Priority.HIGH
    s.close()
    # The migration is durable and runs once.
    s = JobStore(str(path))
    assert s.migrated == []
    assert s.count() == 5
    s.close()


def test_database_missing_only_the_deadline_columns_is_migrated(tmp_path):
    path = tmp_path / "no-deadline.db"
    legacy_db(path, {"priority": "TEXT NOT NULL DEFAULT 'NORMAL'", "seq": "INTEGER NOT NULL DEFAULT 0"},
              [LEGACY_ROWS[0]], extra_values=("LOW", 7))
    s = JobStore(str(path))
    assert s.migrated == ["execution_timeout", "deadline", "run_at", "retry_of", "name", "periodic", "events"]
    assert set(columns(s.conn)) == ALL_COLUMNS
    job = s.get("old-q")
    assert job.priority is Priority.LOW and job.seq == 7
    assert job.execution_timeout is None and job.deadline is None
    s.close()


def test_database_missing_only_priority_and_seq_is_migrated(tmp_path):
    path = tmp_path / "v2.db"
    legacy_db(path, {"execution_timeout": "INTEGER", "deadline": "INTEGER"}, [LEGACY_ROWS[1]],
              extra_values=(600_000, 600_100))
    s = JobStore(str(path))
    assert s.migrated == ["priority", "seq", "run_at", "retry_of", "name", "periodic", "events"]
    job = s.get("old-r")
    assert job.priority is Priority.NORMAL and job.seq == 0
    assert job.execution_timeout == 600_000 and job.deadline == 600_100
    s.close()


def test_previous_schema_gains_run_at_and_the_task_types_table(tmp_path):
    # The schema before scheduled jobs and declared types: every column but run_at, no task_types table
    path = tmp_path / "v3.db"
    legacy_db(path, {"execution_timeout": "INTEGER", "deadline": "INTEGER",
                     "priority": "TEXT NOT NULL DEFAULT 'NORMAL'", "seq": "INTEGER NOT NULL DEFAULT 0"},
              [LEGACY_ROWS[0]], extra_values=(600_000, None, "HIGH", 3))
    s = JobStore(str(path))
    assert s.migrated == ["run_at", "retry_of", "name", "periodic", "events"]
    job = s.get("old-q")
    assert job.retry_of is None and job.events == ""
    assert job.run_at is None and job.priority is Priority.HIGH and job.seq == 3
    assert job.snapshot()["runAtMillis"] is None
    assert s.load_task_types() == []
    s.write([], [], [("GREET", 5)])
    s.write([], [], [("GREET", 6), ("OTHER", 6)])  # a type already known is kept as first seen
    assert s.load_task_types() == ["GREET", "OTHER"]
    assert s.conn.execute("SELECT first_seen FROM task_types WHERE name='GREET'").fetchone() == (5,)
    s.close()


def test_added_columns_cover_the_schema_history():
    assert list(ADDED_COLUMNS) == ["execution_timeout", "deadline", "priority", "seq", "run_at", "retry_of", "name", "periodic", "events"]


def test_a_batch_larger_than_one_statement_writes_every_row(store):
    # Given a batch that spans several multi-row statements, both inserts and updates
    from jobmesh.coordinator.store import ROWS_PER_STATEMENT

    n = 2 * ROWS_PER_STATEMENT + 3
    jobs = [make_job("j%04d" % i, seq=i + 1, payload={"durationMillis": i}) for i in range(n)]
    store.write([insert_row(j) for j in jobs], [])
    for i, job in enumerate(jobs):
        job.state = JobState.COMPLETED
        job.attempts = 1
        job.result = {"sleptMillis": i}
        job.updated_at = 2000 + i
    # When every row is updated in one batch (with one more insert beside them)
    extra = make_job("extra", seq=n + 1)
    store.write([insert_row(extra)], [update_row(j) for j in jobs])
    # Then each row holds exactly its own values
    assert store.count() == n + 1
    for job in jobs:
        assert fields_of(store.get(job.job_id)) == fields_of(job)
    assert fields_of(store.get("extra")) == fields_of(extra)
