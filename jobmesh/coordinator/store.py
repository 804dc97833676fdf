"""JobStore: the durable job table in SQLite.

One row per job, written through by the core: every transition is committed before any
client or worker can observe it (the runtime commits each core batch in one transaction
before releasing its replies and frames — docs/ARCHITECTURE.md, "Group commit").
The working set lives in memory; the table exists for recovery and for reading jobs that
have finished and left memory.

Schema history, migrated in place on open:

* v1 (legacy): no ``execution_timeout``/``deadline`` columns (pre-deadline databases);
* v2: adds them;
* v3: adds ``priority`` (legacy rows become NORMAL) and ``seq`` (legacy rows get 0).

``newest first`` listing uses SQLite's rowid, which grows with each insert and is kept
by the UPDATE-based upsert, so paging by rowid is stable and O(page) at any table size.

Two connections: ``conn`` is the writer (migrations, recovery, then batch writes from
the runtime's one-thread pool); ``reader`` serves reads inline on the hub's thread. In
WAL mode a reader never waits for a writer, so a read never stalls the hub behind an
fsync; it sees the last committed state, which is all the core asks of it (finished jobs,
idempotency keys of finished jobs, listing pages). An in-memory store (unit tests) has a
single connection for both.
"""

from __future__ import annotations

import sqlite3
from typing import Any

import ujson

from jobmesh.coordinator.job import Job
from jobmesh.protocol.jobs import JobState, Priority

ACTIVE_STATES = (JobState.QUEUED.value, JobState.RUNNING.value, JobState.RETRY_WAIT.value)

BASE_COLUMNS = """
    job_id TEXT PRIMARY KEY,
    task_type TEXT NOT NULL,
    payload TEXT NOT NULL,
    state TEXT NOT NULL,
    attempts INTEGER NOT NULL,
    max_attempts INTEGER NOT NULL,
    worker_id TEXT,
    attempt_id TEXT,
    result TEXT,
    error TEXT,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL,
    retry_at INTEGER,
    idempotency_key TEXT
"""
# Columns added by later schema versions: name -> column definition for ALTER TABLE.
ADDED_COLUMNS = {
    "execution_timeout": "INTEGER",
    "deadline": "INTEGER",
    "priority": "TEXT NOT NULL DEFAULT 'NORMAL'",
    "seq": "INTEGER NOT NULL DEFAULT 0",
}
SELECT_COLUMNS = (
    "job_id, task_type, payload, state, attempts, max_attempts, worker_id, attempt_id, result, error,"
    " created_at, updated_at, retry_at, idempotency_key, execution_timeout, deadline, priority, seq"
)
# A batch is written with multi-row statements, ROWS_PER_STATEMENT rows each: one
# sqlite3_step per statement instead of one per row. The sqlite3 module releases the GIL
# around each step, and every reacquisition may wait for the hub's thread, so per-row
# statements made the commit thread ping-pong the GIL with the hub (docs/PERFORMANCE.md).
ROWS_PER_STATEMENT = 64
INSERT_WIDTH = 18
UPDATE_WIDTH = 10


def _insert_sql(rows: int) -> str:
    values = ",".join(["(%s)" % ",".join("?" * INSERT_WIDTH)] * rows)
    return "INSERT INTO jobs (%s) VALUES %s" % (SELECT_COLUMNS, values)


def _update_sql(rows: int) -> str:
    # UPDATE ... FROM a VALUES list (SQLite >= 3.33): the planner scans the list and finds
    # each job by its primary key. A batch never holds two rows for one job.
    values = ",".join(["(%s)" % ",".join("?" * UPDATE_WIDTH)] * rows)
    return (
        "UPDATE jobs SET state=u.column1, attempts=u.column2, worker_id=u.column3, attempt_id=u.column4,"
        " result=u.column5, error=u.column6, updated_at=u.column7, retry_at=u.column8, deadline=u.column9"
        " FROM (VALUES %s) AS u WHERE jobs.job_id=u.column10" % values
    )


def _chunks(rows: list[tuple]):
    """(sql row count, flat parameters) for each statement that writes ``rows``."""
    for start in range(0, len(rows), ROWS_PER_STATEMENT):
        chunk = rows[start : start + ROWS_PER_STATEMENT]
        yield len(chunk), [v for row in chunk for v in row]


INSERT_SQL = _insert_sql(1)  # one row, for executemany (bench/scaling.py builds big tables with it)
_INSERT_SQL = {n: _insert_sql(n) for n in range(1, ROWS_PER_STATEMENT + 1)}
_UPDATE_SQL = {n: _update_sql(n) for n in range(1, ROWS_PER_STATEMENT + 1)}


def _dumps(value: Any) -> str | None:
    return None if value is None else ujson.dumps(value, ensure_ascii=False, escape_forward_slashes=False)


def _loads(text: str | None) -> Any:
    return None if text is None else ujson.loads(text)


def insert_row(job: Job) -> tuple:
    return (
        job.job_id, job.task_type, job.payload_json or _dumps(job.payload), job.state.value, job.attempts, job.max_attempts,
        job.worker_id, job.attempt_id, _dumps(job.result), job.error, job.created_at, job.updated_at,
        job.retry_at, job.idempotency_key, job.execution_timeout, job.deadline, job.priority.value, job.seq,
    )


def update_row(job: Job) -> tuple:
    return (
        job.state.value, job.attempts, job.worker_id, job.attempt_id, _dumps(job.result), job.error,
        job.updated_at, job.retry_at, job.deadline, job.job_id,
    )


def job_from_row(row: tuple) -> Job:
    (job_id, task_type, payload, state, attempts, max_attempts, worker_id, attempt_id, result, error,
     created_at, updated_at, retry_at, key, execution_timeout, deadline, priority, seq) = row
    return Job(
        job_id=job_id, seq=seq or 0, task_type=task_type, payload=_loads(payload) or {},
        max_attempts=max_attempts, priority=Priority.parse(priority or None), created_at=created_at,
        idempotency_key=key, state=JobState(state), attempts=attempts, worker_id=worker_id,
        attempt_id=attempt_id, result=_loads(result), error=error, updated_at=updated_at, retry_at=retry_at,
        execution_timeout=execution_timeout, deadline=deadline,
    )


class JobStore:
    """SQLite-backed job table. ``JobStore(":memory:")`` serves the unit tests."""

    def __init__(self, path: str, synchronous: str = "FULL") -> None:
        self.path = path
        # Room in the statement cache for every multi-row statement size, both kinds.
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False,
                                    cached_statements=2 * ROWS_PER_STATEMENT + 32)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA cache_size=-65536")  # 64 MiB: keeps hot index pages of big tables
        self.conn.execute("PRAGMA synchronous=%s" % {"FULL": "FULL", "NORMAL": "NORMAL", "OFF": "OFF"}[synchronous])
        self.migrated: list[str] = []
        self._migrate()
        if path == ":memory:":
            self.reader = self.conn
        else:
            self.reader = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self.reader.execute("PRAGMA cache_size=-16384")

    # ---- schema ---------------------------------------------------------------

    def _columns(self) -> set[str]:
        return {row[1] for row in self.conn.execute("PRAGMA table_info(jobs)")}

    def _migrate(self) -> None:
        c = self.conn
        c.execute("BEGIN IMMEDIATE")
        try:
            have = self._columns()
            if not have:
                added = ",".join("%s %s" % item for item in ADDED_COLUMNS.items())
                c.execute("CREATE TABLE jobs (%s, %s)" % (BASE_COLUMNS, added))
                have = self._columns()
            for name, definition in ADDED_COLUMNS.items():
                if name not in have:
                    c.execute("ALTER TABLE jobs ADD COLUMN %s %s" % (name, definition))
                    self.migrated.append(name)
            c.execute(
                "CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency_key ON jobs(idempotency_key)"
                " WHERE idempotency_key IS NOT NULL"
            )
            c.execute("CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state)")
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise

    # ---- writes (called from the runtime's DB thread) -------------------------

    def write(self, inserts: list[tuple], updates: list[tuple]) -> None:
        """Apply one batch of rows in a single transaction (group commit)."""
        c = self.conn
        c.execute("BEGIN")
        try:
            for n, params in _chunks(inserts):
                c.execute(_INSERT_SQL[n], params)
            for n, params in _chunks(updates):
                c.execute(_UPDATE_SQL[n], params)
            c.execute("COMMIT")
        except BaseException:
            if c.in_transaction:
                c.execute("ROLLBACK")
            raise

    # ---- reads -----------------------------------------------------------------

    def load_active(self) -> list[Job]:
        """Every non-terminal job, for recovery."""
        rows = self.conn.execute(
            "SELECT %s FROM jobs WHERE state IN (?,?,?)" % SELECT_COLUMNS, ACTIVE_STATES
        ).fetchall()
        return [job_from_row(r) for r in rows]

    def max_seq(self) -> int:
        # Sequences grow with rowid (rows are inserted in submission order), so the newest
        # rows hold the largest; looking at a few avoids scanning a million-row table.
        return self.conn.execute(
            "SELECT COALESCE(MAX(seq), 0) FROM (SELECT seq FROM jobs ORDER BY rowid DESC LIMIT 1000)"
        ).fetchone()[0]

    def count(self) -> int:
        return self.conn.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]

    def get(self, job_id: str) -> Job | None:
        row = self.reader.execute("SELECT %s FROM jobs WHERE job_id=?" % SELECT_COLUMNS, (job_id,)).fetchone()
        return None if row is None else job_from_row(row)

    def find_by_key(self, key: str) -> Job | None:
        row = self.reader.execute(
            "SELECT %s FROM jobs WHERE idempotency_key=?" % SELECT_COLUMNS, (key,)
        ).fetchone()
        return None if row is None else job_from_row(row)

    def list_page(self, limit: int, state: str | None, before_rowid: int | None) -> list[tuple[int, Job]]:
        """Up to ``limit`` (rowid, job) pairs, newest first, strictly older than ``before_rowid``."""
        where, params = [], []
        if state is not None:
            where.append("state=?")
            params.append(state)
        if before_rowid is not None:
            where.append("rowid<?")
            params.append(before_rowid)
        sql = "SELECT rowid, %s FROM jobs %s ORDER BY rowid DESC LIMIT ?" % (
            SELECT_COLUMNS, ("WHERE " + " AND ".join(where)) if where else "")
        params.append(limit)
        return [(r[0], job_from_row(r[1:])) for r in self.reader.execute(sql, params)]

    def close(self) -> None:
        for c in {id(self.reader): self.reader, id(self.conn): self.conn}.values():
            try:
                c.close()
            except sqlite3.Error:
                pass
