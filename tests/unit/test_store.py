"""SQLiteStore specifics: schema, column rendering, in-place migration, sequences made
unique, query plans, synchronous modes, multi-row statements.

What every store does (round trips, paging, retention, faults, reopening) is in
test_store_contract.py. ARCHITECTURE.md "Persistence and recovery"; PROTOCOL.md's
migration of pre-priority databases to NORMAL (their rows numbered in submission order).
"""

from __future__ import annotations

import sqlite3

import pytest

from jobmesh.protocol.jobs import JobState, Priority
from jobmesh.store.base import SCHEMA_VERSION, Batch, StorageFault
from jobmesh.store.columns import COLUMNS, Kind, insert_row, update_row
from jobmesh.store.job import Job
from jobmesh.store.opening import CannotOpen, open_store
from jobmesh.store.sqlite import (ADDED_COLUMNS, BASE_COLUMNS, INDEXES, OBSOLETE_INDEXES, ROWS_PER_STATEMENT,
                                  SQLiteStore, column_sql)

ALL_COLUMNS = {
    "job_id", "task_type", "payload", "state", "attempts", "max_attempts", "worker_id", "attempt_id",
    "result", "error", "created_at", "updated_at", "retry_at", "idempotency_key",
    "execution_timeout", "deadline", "priority", "seq", "run_at", "retry_of", "name", "periodic", "submitted_by", "concurrency_key", "unique_key",
    "workflow_id", "ref", "depends_on", "parents",
    "events", "schedule_name", "scheduled_for", "result_ttl", "retry_base", "retry_cap",
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
    s = SQLiteStore(":memory:")
    yield s
    s.close()


def columns(conn: sqlite3.Connection) -> list[str]:
    return [row[1] for row in conn.execute("PRAGMA table_info(jobs)")]


# ---- schema ----------------------------------------------------------------------------


def indexes(conn: sqlite3.Connection) -> set[str]:
    return {row[1] for row in conn.execute("PRAGMA index_list(jobs)") if not row[1].startswith("sqlite_")}


def test_fresh_database_gets_the_full_schema_without_migrating(store):
    assert set(columns(store.conn)) == ALL_COLUMNS
    assert store.migrated == []
    assert store.count() == 0
    assert indexes(store.conn) == set(INDEXES)


# The on-disk types as every earlier version wrote them: the rendering must keep them, or
# databases written before would differ from new ones.
ON_DISK_TYPES = {
    "job_id": "TEXT PRIMARY KEY", "task_type": "TEXT NOT NULL", "payload": "TEXT NOT NULL",
    "state": "TEXT NOT NULL", "attempts": "INTEGER NOT NULL", "max_attempts": "INTEGER NOT NULL",
    "worker_id": "TEXT", "attempt_id": "TEXT", "result": "TEXT", "error": "TEXT",
    "created_at": "INTEGER NOT NULL", "updated_at": "INTEGER NOT NULL", "retry_at": "INTEGER",
    "idempotency_key": "TEXT", "execution_timeout": "INTEGER", "deadline": "INTEGER",
    "priority": "TEXT NOT NULL DEFAULT 'NORMAL'", "seq": "INTEGER NOT NULL DEFAULT 0", "run_at": "INTEGER",
    "retry_of": "TEXT", "name": "TEXT", "periodic": "TEXT", "submitted_by": "TEXT", "events": "TEXT", "schedule_name": "TEXT", "scheduled_for": "INTEGER",
    "result_ttl": "INTEGER", "retry_base": "INTEGER", "retry_cap": "INTEGER",
    "concurrency_key": "TEXT", "unique_key": "TEXT",
    "workflow_id": "TEXT", "ref": "TEXT", "depends_on": "TEXT", "parents": "TEXT",
}


def test_logical_kinds_render_to_the_sqlite_types_of_every_earlier_schema():
    assert {c.name: column_sql(c) for c in COLUMNS} == ON_DISK_TYPES
    assert {c.name for c in COLUMNS if c.kind is Kind.JSON} == {"payload", "result", "periodic", "events", "depends_on",
                                                                           "parents"}


def test_reopening_a_current_file_database_changes_nothing(tmp_path):
    path = str(tmp_path / "jobs.db")
    s = SQLiteStore(path)
    s.write(Batch([insert_row(make_job())], []))
    s.close()
    s = SQLiteStore(path)
    assert s.migrated == []
    assert fields_of(s.get("j1")) == fields_of(make_job())
    s.close()


# ---- numbered migrations ---------------------------------------------------------------


def applied(conn: sqlite3.Connection) -> list[int]:
    return [row[0] for row in conn.execute("SELECT version FROM schema_migrations ORDER BY version")]


def test_a_new_database_records_every_migration_and_a_reopen_applies_none(tmp_path):
    path = str(tmp_path / "jobs.db")
    s = SQLiteStore(path)
    assert s.migrations == list(range(1, SCHEMA_VERSION + 1)) == applied(s.conn)
    s.close()
    s = SQLiteStore(path)
    assert s.migrations == [] and applied(s.conn) == list(range(1, SCHEMA_VERSION + 1))
    s.close()


def older_database(tmp_path, last: int, *undo: str) -> str:
    """A database holding job "old", taken back by the statements ``undo`` to what a
    jobmesh whose last migration was ``last`` left; its path."""
    path = str(tmp_path / ("v%d.db" % last))
    s = SQLiteStore(path)
    s.write(Batch([insert_row(make_job("old"))], []))
    s.close()
    conn = sqlite3.connect(path)
    for statement in undo:
        conn.execute(statement)
    conn.execute("DELETE FROM schema_migrations WHERE version > ?", (last,))
    conn.commit()
    conn.close()
    return path


def test_a_database_at_an_earlier_version_gets_only_the_migrations_after_it(tmp_path):
    # Given a database whose table says migration 10 was the last: as a jobmesh before
    # limits left it (no limits table, no key columns), a job in it
    path = older_database(tmp_path, 10, "DROP TABLE limits", "ALTER TABLE jobs DROP COLUMN concurrency_key",
                          "ALTER TABLE jobs DROP COLUMN unique_key")
    # When it is opened, the migrations after 10 alone run: 11's table and columns (12's are there)
    s = SQLiteStore(path)
    assert s.migrations == [11, 12] and s.migrated == ["concurrency_key", "unique_key"]
    assert applied(s.conn) == list(range(1, SCHEMA_VERSION + 1))
    assert s.load_limits() == [] and s.get("old").concurrency_key is None
    s.close()


def test_a_database_from_before_workflows_gains_their_table_columns_and_index(tmp_path):
    # Given a database as a jobmesh before workflows left it (migration 11 the last), a job in it
    path = older_database(tmp_path, 11, "DROP TABLE workflows", "DROP INDEX jobs_workflow",
                          *("ALTER TABLE jobs DROP COLUMN %s" % column
                            for column in ("workflow_id", "ref", "depends_on", "parents")))
    # When it is opened, migration 12 alone runs, and the old job reads as outside any workflow
    s = SQLiteStore(path)
    assert s.migrations == [12] and s.migrated == ["workflow_id", "ref", "depends_on", "parents"]
    assert indexes(s.conn) == set(INDEXES)
    old = s.get("old")
    assert (old.workflow_id, old.ref, old.depends_on, old.parents) == (None, None, None, None)
    s.write(Batch([], [], workflows=[("wf", "{}")]))
    assert s.load_workflow("wf") == ("{}", [])
    s.close()


def test_the_table_not_the_columns_says_what_is_applied(tmp_path):
    # A database whose table says it is current is only read, whatever it lacks
    path = str(tmp_path / "jobs.db")
    SQLiteStore(path).close()
    conn = sqlite3.connect(path)
    conn.execute("DROP TABLE task_defaults")
    conn.commit()
    conn.close()
    s = SQLiteStore(path)
    assert s.migrations == [] and "task_defaults" not in {row[0] for row in s.conn.execute(
        "SELECT name FROM sqlite_master")}
    s.close()


def test_a_database_from_a_newer_jobmesh_is_not_opened(tmp_path):
    path = str(tmp_path / "jobs.db")
    SQLiteStore(path).close()
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO schema_migrations (version, applied_at) VALUES (?, 0)", (SCHEMA_VERSION + 1,))
    conn.commit()
    conn.close()
    with pytest.raises(CannotOpen, match="holds schema version %d, newer than this jobmesh knows" % (SCHEMA_VERSION + 1)):
        open_store(path)


# ---- SQLite specifics of writes and reads ----------------------------------------------------


def test_a_failing_batch_is_rolled_back_and_leaves_no_transaction_open(store):
    store.write(Batch([insert_row(make_job("a", seq=1))], []))
    with pytest.raises(StorageFault, match="UNIQUE constraint"):
        store.write(Batch([insert_row(make_job("b", seq=2)), insert_row(make_job("b", seq=3))], []))
    assert not store.conn.in_transaction
    assert store.count() == 1


def test_a_batch_of_one_statement_is_a_transaction_by_itself(store):
    # The write thread takes the GIL back after every statement: a batch that is one
    # statement runs without BEGIN and COMMIT; anything more is one transaction.
    statements: list[str] = []
    store.conn.set_trace_callback(statements.append)
    a, b, c = make_job("a", seq=1), make_job("b", seq=2), make_job("c", seq=3)
    store.write(Batch([insert_row(a), insert_row(b)], []))
    a.state, b.state = JobState.COMPLETED, JobState.CANCELLED
    store.write(Batch([], [update_row(a), update_row(b)]))
    store.write(Batch([insert_row(c)], [update_row(a)]))
    d = make_job("d", seq=4)
    d.workflow_id, d.ref = "w-1", "d"
    store.write(Batch([insert_row(d)], [], workflows=[("w-1", '{"name": "etl"}')]))  # a workflow's row: two
    store.conn.set_trace_callback(None)
    assert [sql.split()[0] for sql in statements] == ["INSERT", "UPDATE", "BEGIN", "INSERT", "UPDATE", "COMMIT",
                                                      "BEGIN", "INSERT", "INSERT", "COMMIT"]
    assert [store.get(job.job_id).state for job in (a, b, c)] == [JobState.COMPLETED, JobState.CANCELLED,
                                                                 JobState.QUEUED]
    assert store.load_workflow("w-1") is not None


def test_sequences_are_unique(store):
    store.write(Batch([insert_row(make_job("a", seq=5))], []))
    with pytest.raises(StorageFault, match="UNIQUE constraint"):
        store.write(Batch([insert_row(make_job("b", seq=5))], []))


@pytest.mark.parametrize("mode, value", [("FULL", 2), ("NORMAL", 1), ("OFF", 0)])
def test_synchronous_modes(tmp_path, mode, value):
    s = SQLiteStore(str(tmp_path / "jobs.db"), mode)
    assert s.conn.execute("PRAGMA synchronous").fetchone()[0] == value
    assert s.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    s.close()


def plan(store: SQLiteStore, sql: str, params) -> str:
    return " | ".join(row[-1] for row in store.reader.execute("EXPLAIN QUERY PLAN " + sql, params))


@pytest.mark.parametrize("state, before, task_type", [
    (None, None, None), (None, 50, None), ("QUEUED", None, None), ("COMPLETED", 50, None),
    (None, None, "SLEEP"), (None, 50, "SLEEP"),
])
def test_pages_and_the_retention_walk_read_an_index_in_order(store, state, before, task_type):
    # O(page) at any table size: an index gives the rows in sequence order, nothing is sorted.
    sql, params = store.page_query(10, state, before, task_type)
    text = plan(store, sql, params)
    assert "USING INDEX" in text and "TEMP B-TREE" not in text, text
    walk = plan(store, store.PURGE_WALK_SQL, (0, 10))
    assert "USING INDEX jobs_seq" in walk and "TEMP B-TREE" not in walk, walk
    assert "jobs_seq" in plan(store, "SELECT COALESCE(MAX(seq), 0) FROM jobs", ())


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
    s = SQLiteStore(str(path))
    assert s.migrations == list(range(1, SCHEMA_VERSION + 1))  # from before the migrations table: all of them
    assert s.migrated == ["execution_timeout", "deadline", "priority", "seq", "run_at", "retry_of", "events", "name", "periodic", "schedule_name", "scheduled_for", "submitted_by", "result_ttl", "retry_base", "retry_cap", "concurrency_key", "unique_key", "workflow_id", "ref", "depends_on", "parents"]
    assert set(columns(s.conn)) == ALL_COLUMNS
    jobs = {j.job_id: j for j in s.load_active()}
    assert set(jobs) == {"old-q", "old-r", "old-w"}
    for job in jobs.values():
        assert job.priority is Priority.NORMAL
        assert job.execution_timeout is None and job.deadline is None
    # Rows from before sequences (all 0) are numbered in submission (creation) order.
    assert {j.job_id: j.seq for j in [s.get(i) for i in ("old-c", "old-r", "old-w", "old-q")]} == {
        "old-c": 1, "old-r": 2, "old-w": 3, "old-q": 4}
    assert [j.job_id for _, j in s.list_page(10, None, None)] == ["old-q", "old-w", "old-r", "old-c"]
    assert jobs["old-r"].worker_id == "w1" and jobs["old-r"].attempt_id == "att"
    assert jobs["old-w"].retry_at == 900 and jobs["old-w"].error == "boom"
    assert jobs["old-q"].payload == {"durationMillis": 5}
    done = s.get("old-c")
    assert done.state is JobState.COMPLETED and done.result == {"sha256": "x"} and done.payload == {"text": "é"}
    assert s.find_by_key("key-q").job_id == "old-q"
    assert s.max_seq() == 4
    # New rows can be written next to the migrated ones.
    s.write(Batch([insert_row(make_job("new", seq=5, priority=Priority.HIGH))], []))
    assert s.get("new").priority is Priority.HIGH
    s.close()
    # The migration is durable and runs once.
    s = SQLiteStore(str(path))
    assert s.migrated == [] and s.migrations == []
    assert s.count() == 5
    assert s.get("old-q").seq == 4
    s.close()


def test_database_missing_only_the_deadline_columns_is_migrated(tmp_path):
    path = tmp_path / "no-deadline.db"
    legacy_db(path, {"priority": "TEXT NOT NULL DEFAULT 'NORMAL'", "seq": "INTEGER NOT NULL DEFAULT 0"},
              [LEGACY_ROWS[0]], extra_values=("LOW", 7))
    s = SQLiteStore(str(path))
    assert s.migrated == ["execution_timeout", "deadline", "run_at", "retry_of", "events", "name", "periodic", "schedule_name", "scheduled_for", "submitted_by", "result_ttl", "retry_base", "retry_cap", "concurrency_key", "unique_key", "workflow_id", "ref", "depends_on", "parents"]
    assert set(columns(s.conn)) == ALL_COLUMNS
    job = s.get("old-q")
    assert job.priority is Priority.LOW and job.seq == 7
    assert job.execution_timeout is None and job.deadline is None
    s.close()


def test_database_missing_only_priority_and_seq_is_migrated(tmp_path):
    path = tmp_path / "v2.db"
    legacy_db(path, {"execution_timeout": "INTEGER", "deadline": "INTEGER"}, [LEGACY_ROWS[1]],
              extra_values=(600_000, 600_100))
    s = SQLiteStore(str(path))
    assert s.migrated == ["priority", "seq", "run_at", "retry_of", "events", "name", "periodic", "schedule_name", "scheduled_for", "submitted_by", "result_ttl", "retry_base", "retry_cap", "concurrency_key", "unique_key", "workflow_id", "ref", "depends_on", "parents"]
    job = s.get("old-r")
    assert job.priority is Priority.NORMAL and job.seq == 1
    assert job.execution_timeout == 600_000 and job.deadline == 600_100
    s.close()


def test_previous_schema_gains_run_at_and_the_task_types_table(tmp_path):
    # The schema before scheduled jobs and declared types: every column but run_at, no task_types table
    path = tmp_path / "v3.db"
    legacy_db(path, {"execution_timeout": "INTEGER", "deadline": "INTEGER",
                     "priority": "TEXT NOT NULL DEFAULT 'NORMAL'", "seq": "INTEGER NOT NULL DEFAULT 0"},
              [LEGACY_ROWS[0]], extra_values=(600_000, None, "HIGH", 3))
    s = SQLiteStore(str(path))
    assert s.migrated == ["run_at", "retry_of", "events", "name", "periodic", "schedule_name", "scheduled_for", "submitted_by", "result_ttl", "retry_base", "retry_cap", "concurrency_key", "unique_key", "workflow_id", "ref", "depends_on", "parents"]
    job = s.get("old-q")
    assert job.retry_of is None and job.events == ""
    assert job.run_at is None and job.priority is Priority.HIGH and job.seq == 3
    assert job.snapshot()["runAtMillis"] is None
    assert s.load_task_types() == []
    s.write(Batch([], [], [("GREET", 5)]))
    s.write(Batch([], [], [("GREET", 6), ("OTHER", 6)]))  # a type already known is kept as first seen
    assert s.load_task_types() == ["GREET", "OTHER"]
    assert s.conn.execute("SELECT first_seen FROM task_types WHERE name='GREET'").fetchone() == (5,)
    s.close()


def v6_db(path, rows: list[tuple[str, int, int]]) -> None:
    """A database as the previous schema wrote it: every column, the indexes by state and
    by task type (rowid order within them), no index on seq. Rows: (id, seq, created)."""
    conn = sqlite3.connect(str(path))
    conn.execute("CREATE TABLE jobs (%s)" % ", ".join("%s %s" % item for item in ON_DISK_TYPES.items()))
    conn.execute("CREATE UNIQUE INDEX jobs_idempotency_key ON jobs(idempotency_key) WHERE idempotency_key IS NOT NULL")
    conn.execute("CREATE INDEX jobs_state ON jobs(state)")
    conn.execute("CREATE INDEX jobs_task_type ON jobs(task_type)")
    conn.execute("CREATE TABLE task_types (name TEXT PRIMARY KEY, first_seen INTEGER NOT NULL)")
    conn.execute("CREATE TABLE storage_probe (x BLOB)")
    for job_id, seq, created in rows:
        conn.execute("INSERT INTO jobs VALUES (%s)" % ",".join("?" * len(ON_DISK_TYPES)),
                     insert_row(make_job(job_id, seq=seq, created_at=created)))
    conn.commit()
    conn.close()


def test_previous_schema_gains_the_sequence_indexes_and_keeps_unique_sequences(tmp_path, caplog):
    path = tmp_path / "v6.db"
    v6_db(path, [("a", 3, 100), ("b", 7, 200), ("c", 9, 300)])
    with caplog.at_level("INFO", logger="jobmesh.store.sqlite"):
        s = SQLiteStore(str(path))
    assert s.migrated == []
    assert indexes(s.conn) == set(INDEXES) and not indexes(s.conn) & set(OBSOLETE_INDEXES)
    assert [(seq, j.job_id) for seq, j in s.list_page(10, None, None)] == [(9, "c"), (7, "b"), (3, "a")]
    assert "numbered" not in caplog.text
    s.close()
    # Done once: the next open finds a current schema.
    s = SQLiteStore(str(path))
    assert indexes(s.conn) == set(INDEXES)
    s.close()


def test_rows_sharing_a_sequence_are_renumbered_in_order_before_the_unique_index(tmp_path, caplog):
    path = tmp_path / "v6-dup.db"
    # Inserted out of order: sequence first, then creation time, then insertion decide.
    v6_db(path, [("late", 5, 500), ("x", 2, 200), ("y", 2, 100), ("zero", 0, 900), ("last", 8, 50)])
    with caplog.at_level("INFO", logger="jobmesh.store.sqlite"):
        s = SQLiteStore(str(path))
    assert "numbered the 5 jobs" in caplog.text
    assert [(seq, j.job_id) for seq, j in s.list_page(10, None, None)] == [
        (5, "last"), (4, "late"), (3, "x"), (2, "y"), (1, "zero")]
    assert s.max_seq() == 5
    s.close()


def test_added_columns_cover_the_schema_history():
    assert list(ADDED_COLUMNS) == ["execution_timeout", "deadline", "priority", "seq", "run_at", "retry_of", "events", "name", "periodic", "schedule_name", "scheduled_for", "submitted_by", "result_ttl", "retry_base", "retry_cap", "concurrency_key", "unique_key", "workflow_id", "ref", "depends_on", "parents"]


def test_a_batch_larger_than_one_statement_writes_every_row(store):
    # Given a batch that spans several multi-row statements, both inserts and updates
    n = 2 * ROWS_PER_STATEMENT + 3
    jobs = [make_job("j%04d" % i, seq=i + 1, payload={"durationMillis": i}) for i in range(n)]
    store.write(Batch([insert_row(j) for j in jobs], []))
    for i, job in enumerate(jobs):
        job.state = JobState.COMPLETED
        job.attempts = 1
        job.result = {"sleptMillis": i}
        job.updated_at = 2000 + i
    # When every row is updated in one batch (with one more insert beside them)
    extra = make_job("extra", seq=n + 1)
    store.write(Batch([insert_row(extra)], [update_row(j) for j in jobs]))
    # Then each row holds exactly its own values
    assert store.count() == n + 1
    for job in jobs:
        assert fields_of(store.get(job.job_id)) == fields_of(job)
    assert fields_of(store.get("extra")) == fields_of(extra)
