"""JobStore: the durable job table in SQLite.

One row per job, written through by the core: every transition is committed before any
client or worker can observe it (the runtime commits each core batch in one transaction
before releasing its replies and frames — docs/ARCHITECTURE.md, "Group commit").
The working set lives in memory; the table exists for recovery and for reading jobs that
have finished and left memory.

The columns are declared once, in ``COLUMNS``: the CREATE TABLE, the migrations, the
SELECT list, the multi-row INSERT and UPDATE statements, and the functions that turn a
``Job`` into a row and back (``insert_row``, ``update_row``, ``job_from_row``) are all
derived from that list. Adding a column is one line there (and the attribute on ``Job``).

Schema history, migrated in place on open (a column marked ``added`` is created by
ALTER TABLE on an older database):

* v1 (legacy): the base columns only;
* v2: ``execution_timeout``, ``deadline``;
* v3: ``priority`` (legacy rows become NORMAL) and ``seq`` (legacy rows get 0);
* v4: ``run_at`` (scheduled jobs), and the ``task_types`` table of declared task types;
* v5: ``retry_of`` and ``events`` (the job's timeline, compactly encoded);
* v6: ``name`` and ``periodic`` (Periodic jobs: their name and Periodic fields).

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

import re
import sqlite3
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import ujson

from jobmesh.coordinator.job import Job
from jobmesh.protocol.jobs import ACTIVE, JobState, Priority


def _dumps(value: Any) -> str | None:
    return None if value is None else ujson.dumps(value, ensure_ascii=False, escape_forward_slashes=False)


def _loads(text: str | None) -> Any:
    return None if text is None else ujson.loads(text)


# A job's timeline is stored compactly: each event an array [time, code, attempt, worker,
# detail, retry time] with trailing nulls dropped, its time as milliseconds after the
# previous event (the first: absolute) and its retry time as milliseconds after it.
# In memory an event is the full tuple (atMillis, name, attempt, workerId, detail, retryAtMillis).
EVENT_CODES = {
    "SUBMITTED": "S", "ASSIGNED": "A", "COMPLETED": "C", "ATTEMPT_FAILED": "F", "LEASE_EXPIRED": "E",
    "WORKER_LOST": "L", "RETRY_WAIT": "R", "FAILED": "X", "QUEUED": "Q", "RESCHEDULED": "D", "REPLACED": "P",
    "CANCELLED": "K", "STALE_RESULT": "T", "RECOVERED": "V",
}
EVENT_NAMES = {code: name for name, code in EVENT_CODES.items()}


def event_fragment(since: int, at: int, name: str, attempt: int | None, worker: str | None,
                   detail: str | None, retry_at: int | None) -> str:
    """One event's stored form: JSON text, its time ``at`` relative to ``since``."""
    code = EVENT_CODES.get(name)
    if code is not None and detail is None and retry_at is None:  # the common shapes, formatted directly
        if attempt is None and worker is None:
            return '[%d,"%s"]' % (at - since, code)
        if attempt is not None and worker is not None:
            return '[%d,"%s",%d,%s]' % (at - since, code, attempt, _dumps(worker))
    item: list[Any] = [at - since, code or name, attempt, worker, detail,
                       None if retry_at is None else retry_at - at]
    while item[-1] is None:
        item.pop()
    return ujson.dumps(item, ensure_ascii=False, escape_forward_slashes=False)


def dump_events(events: list) -> str:
    """The stored text of a timeline given as full tuples (without the outer brackets)."""
    out = []
    previous = 0
    for at, name, attempt, worker, detail, retry_at in events:
        out.append(event_fragment(previous, at, name, attempt, worker, detail, retry_at))
        previous = at
    return ",".join(out)


def load_events(text: str | None) -> list:
    """A stored timeline (without the outer brackets) as full tuples, oldest first."""
    events = []
    at = 0
    for item in ujson.loads("[" + text + "]") if text else ():
        item += [None] * (6 - len(item))
        at += item[0]
        events.append((at, EVENT_NAMES.get(item[1], item[1]), item[2], item[3], item[4],
                       None if item[5] is None else at + item[5]))
    return events


@dataclass(frozen=True)
class Column:
    """One column of the jobs table and how a ``Job`` attribute maps to it.

    ``encode`` / ``decode`` are Python expressions over ``job`` (the record) and ``v``
    (the stored value); the row functions are compiled from them once, at import, so a
    row costs what hand-written tuple code would.
    """

    name: str
    sql: str  # type and constraints
    encode: str = ""  # default: job.<name>
    decode: str = "v"
    mutable: bool = False  # written again by UPDATE after the insert
    added: bool = False  # not in the v1 table: added by ALTER TABLE on older databases

    @property
    def encode_expr(self) -> str:
        return self.encode or "job." + self.name


COLUMNS: tuple[Column, ...] = (
    Column("job_id", "TEXT PRIMARY KEY"),
    Column("task_type", "TEXT NOT NULL"),
    Column("payload", "TEXT NOT NULL", "job.payload_json or _dumps(job.payload)", "_loads(v) or {}"),
    Column("state", "TEXT NOT NULL", "job.state.value", "JobState(v)", mutable=True),
    Column("attempts", "INTEGER NOT NULL", mutable=True),
    Column("max_attempts", "INTEGER NOT NULL"),
    Column("worker_id", "TEXT", mutable=True),
    Column("attempt_id", "TEXT", mutable=True),
    Column("result", "TEXT", "_dumps(job.result)", "_loads(v)", mutable=True),
    Column("error", "TEXT", mutable=True),
    Column("created_at", "INTEGER NOT NULL"),
    Column("updated_at", "INTEGER NOT NULL", mutable=True),
    Column("retry_at", "INTEGER", mutable=True),
    Column("idempotency_key", "TEXT"),
    Column("execution_timeout", "INTEGER", added=True),
    Column("deadline", "INTEGER", mutable=True, added=True),
    Column("priority", "TEXT NOT NULL DEFAULT 'NORMAL'", "job.priority.value", "Priority.parse(v or None)",
           added=True),
    Column("seq", "INTEGER NOT NULL DEFAULT 0", decode="v or 0", added=True),
    Column("run_at", "INTEGER", mutable=True, added=True),
    Column("retry_of", "TEXT", added=True),
    # v6: Periodic jobs (docs/PERIODIC.md): the name, and the Periodic fields (JSON; NULL for JSON jobs).
    Column("name", "TEXT", added=True),
    Column("periodic", "TEXT", "job.periodic and _dumps(job.periodic)", "_loads(v)", mutable=True,
           added=True),  # NULL for JSON jobs without a call
    # (the timeline stays the last column)
    # The job's timeline (its newest events, EVENT_CODES above), rewritten with the row it
    # belongs to, so it is exactly as durable as the state it explains.
    # In memory the job keeps it as text too (Job.events), appended one fragment per event.
    Column("events", "TEXT", "'[' + job.events + ']'", "v[1:-1] if v else ''", mutable=True, added=True),
)

ACTIVE_STATES = tuple(sorted(s.value for s in ACTIVE))
MUTABLE_COLUMNS = tuple(c for c in COLUMNS if c.mutable)
# The v1 table, as CREATE TABLE text (tests build legacy databases from it).
BASE_COLUMNS = ",\n".join("    %s %s" % (c.name, c.sql) for c in COLUMNS if not c.added)
# Columns added by later schema versions: name -> column definition for ALTER TABLE.
ADDED_COLUMNS = {c.name: c.sql for c in COLUMNS if c.added}
SELECT_COLUMNS = ", ".join(c.name for c in COLUMNS)
INSERT_WIDTH = len(COLUMNS)
UPDATE_WIDTH = len(MUTABLE_COLUMNS) + 1  # and the job id, last
TASK_TYPES_TABLE = "CREATE TABLE IF NOT EXISTS task_types (name TEXT PRIMARY KEY, first_seen INTEGER NOT NULL)"
TERMINAL_STATES = tuple(sorted(s.value for s in JobState if s.value not in ACTIVE_STATES))
# A scratch table for the storage probe (``JobStore.probe``); it is always empty.
PROBE_TABLE = "CREATE TABLE IF NOT EXISTS storage_probe (x BLOB)"
PROBE_FREE_PAGES = 256  # beyond this many free pages, a probe no longer insists that the file grow
# What a current database holds besides the jobs columns; when all of it is there, opening
# writes nothing, so a read-only or full database still opens (and serves reads).
SCHEMA_OBJECTS = frozenset({"jobs_idempotency_key", "jobs_state", "jobs_task_type", "task_types", "storage_probe"})
# The test-only fault switch (docs/FAILURE_MODEL.md, "Testing storage faults"): the
# environment variable names a file that the store reads before each write.
FAULT_FILE_ENV = "JOBMESH_TEST_STORAGE_FAULT_FILE"
# sqlite3 messages -> the words clients see after "storage unavailable: ".
_REASONS = {
    "database or disk is full": "disk full",
    "attempt to write a readonly database": "database is read-only",
}


def storage_reason(exc: BaseException) -> str:
    """A short reason for a failed write: "disk full", "database is locked", ..."""
    text = str(exc).strip() or type(exc).__name__
    return _REASONS.get(text, text)


class Batch(NamedTuple):
    """Everything one core batch writes, in one transaction."""

    inserts: list[tuple]  # insert_row() of new jobs
    updates: list[tuple]  # update_row() of changed jobs
    task_types: list[tuple[str, int]] = []  # newly declared (name, first seen)
    purges: list[str] = []  # finished jobs to delete


def _compile(name: str, source: str) -> Callable[..., Any]:
    namespace: dict[str, Any] = {"_dumps": _dumps, "_loads": _loads, "JobState": JobState,
                                 "Priority": Priority, "Job": Job}
    exec(source, namespace)  # noqa: S102 - source built above from COLUMNS only
    return namespace[name]


def _decoder(index: int, column: Column) -> str:
    return "%s=%s" % (column.name, re.sub(r"\bv\b", "_c%d" % index, column.decode))


insert_row: Callable[[Job], tuple] = _compile(
    "insert_row", "def insert_row(job):\n    return (%s,)\n" % ", ".join(c.encode_expr for c in COLUMNS))
update_row: Callable[[Job], tuple] = _compile(
    "update_row", "def update_row(job):\n    return (%s, job.job_id)\n" % ", ".join(c.encode_expr for c in MUTABLE_COLUMNS))
job_from_row: Callable[[tuple], Job] = _compile(
    "job_from_row",
    "def job_from_row(row):\n    (%s,) = row\n    return Job(%s)\n" % (
        ", ".join("_c%d" % i for i in range(len(COLUMNS))),
        ", ".join(_decoder(i, c) for i, c in enumerate(COLUMNS))),
)

# A batch is written with multi-row statements, ROWS_PER_STATEMENT rows each: one
# sqlite3_step per statement instead of one per row. The sqlite3 module releases the GIL
# around each step, and every reacquisition may wait for the hub's thread, so per-row
# statements made the commit thread ping-pong the GIL with the hub (docs/PERFORMANCE.md).
ROWS_PER_STATEMENT = 64


def _insert_sql(rows: int) -> str:
    values = ",".join(["(%s)" % ",".join("?" * INSERT_WIDTH)] * rows)
    return "INSERT INTO jobs (%s) VALUES %s" % (SELECT_COLUMNS, values)


def _update_sql(rows: int) -> str:
    # UPDATE ... FROM a VALUES list (SQLite >= 3.33): the planner scans the list and finds
    # each job by its primary key. A batch never holds two rows for one job.
    values = ",".join(["(%s)" % ",".join("?" * UPDATE_WIDTH)] * rows)
    sets = ", ".join("%s=u.column%d" % (c.name, i + 1) for i, c in enumerate(MUTABLE_COLUMNS))
    return "UPDATE jobs SET %s FROM (VALUES %s) AS u WHERE jobs.job_id=u.column%d" % (sets, values, UPDATE_WIDTH)


def _chunks(rows: list[tuple]) -> Iterator[tuple[int, list[Any]]]:
    """(sql row count, flat parameters) for each statement that writes ``rows``."""
    for start in range(0, len(rows), ROWS_PER_STATEMENT):
        chunk = rows[start : start + ROWS_PER_STATEMENT]
        yield len(chunk), [v for row in chunk for v in row]


def _in_list(sql: str, rows: int) -> str:
    return sql % ",".join("?" * rows)


INSERT_SQL = _insert_sql(1)  # one row, for executemany (bench/scaling.py builds big tables with it)
_INSERT_SQL = {n: _insert_sql(n) for n in range(1, ROWS_PER_STATEMENT + 1)}
_UPDATE_SQL = {n: _update_sql(n) for n in range(1, ROWS_PER_STATEMENT + 1)}
_PURGE_SQL = {n: _in_list("DELETE FROM jobs WHERE job_id IN (%s)", n) for n in range(1, ROWS_PER_STATEMENT + 1)}


def merge_batches(older: Batch, newer: Batch) -> Batch:
    """One batch that writes both: for a job in both, ``newer``'s row wins.

    Used for rows that could not be committed yet (recovery's, during a storage outage)
    and the next batch's rows, which may hold a newer row of the same job.
    """
    inserted = {row[0]: row for row in older.inserts}
    inserted.update((row[0], row) for row in newer.inserts)
    updated = {row[-1]: row for row in older.updates}
    updated.update((row[-1], row) for row in newer.updates)
    for job_id in inserted:
        updated.pop(job_id, None)  # never both: a new job's row already holds its latest state
    types = list(dict.fromkeys(list(older.task_types) + list(newer.task_types)))
    purges = list(dict.fromkeys(list(older.purges) + list(newer.purges)))
    return Batch(list(inserted.values()), list(updated.values()), types, purges)


class JobStore:
    """SQLite-backed job table. ``JobStore(":memory:")`` serves the unit tests.

    ``fault_file`` (tests only) names a file read before each write: ``full`` makes the
    database unable to grow (``PRAGMA max_page_count``), ``readonly`` makes the writer
    refuse writes (``PRAGMA query_only``), anything else or no file clears both.
    """

    def __init__(self, path: str, synchronous: str = "FULL", fault_file: str | None = None) -> None:
        self.path = path
        self.fault_file = fault_file
        # Room in the statement cache for every multi-row statement size, both kinds.
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False,
                                    cached_statements=3 * ROWS_PER_STATEMENT + 32)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA cache_size=-65536")  # 64 MiB: keeps hot index pages of big tables
        self.conn.execute("PRAGMA synchronous=%s" % {"FULL": "FULL", "NORMAL": "NORMAL", "OFF": "OFF"}[synchronous])
        self._max_pages = int(self.conn.execute("PRAGMA max_page_count").fetchone()[0])
        self.migrated: list[str] = []
        self._inject_fault()
        self._migrate()
        if path == ":memory:":
            self.reader = self.conn
        else:
            self.reader = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self.reader.execute("PRAGMA cache_size=-16384")

    # ---- schema ---------------------------------------------------------------

    def _columns(self) -> set[str]:
        return {row[1] for row in self.conn.execute("PRAGMA table_info(jobs)")}

    def _current(self) -> bool:
        """True if the schema needs nothing: opening then writes nothing."""
        if not set(ADDED_COLUMNS) <= self._columns():
            return False
        names = {row[0] for row in self.conn.execute("SELECT name FROM sqlite_master")}
        return SCHEMA_OBJECTS <= names

    def _migrate(self) -> None:
        if self._current():
            return
        c = self.conn
        c.execute("BEGIN IMMEDIATE")
        try:
            have = self._columns()
            if not have:
                c.execute("CREATE TABLE jobs (%s)" % ", ".join("%s %s" % (col.name, col.sql) for col in COLUMNS))
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
            c.execute("CREATE INDEX IF NOT EXISTS jobs_task_type ON jobs(task_type)")
            c.execute(TASK_TYPES_TABLE)
            c.execute(PROBE_TABLE)
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise

    # ---- writes (called from the runtime's DB thread) -------------------------

    def write(self, inserts: list[tuple], updates: list[tuple], task_types: Sequence[tuple[str, int]] = (),
              purges: Sequence[str] = ()) -> None:
        """Apply one batch (the fields of ``Batch``) in a single transaction (group commit)."""
        c = self.conn
        with self._transaction("BEGIN"):
            for n, params in _chunks(inserts):
                c.execute(_INSERT_SQL[n], params)
            for n, params in _chunks(updates):
                c.execute(_UPDATE_SQL[n], params)
            for start in range(0, len(purges), ROWS_PER_STATEMENT):
                ids = list(purges[start : start + ROWS_PER_STATEMENT])
                c.execute(_PURGE_SQL[len(ids)], ids)
            if task_types:
                c.executemany("INSERT OR IGNORE INTO task_types (name, first_seen) VALUES (?, ?)", task_types)

    @contextmanager
    def _transaction(self, begin: str) -> Iterator[None]:
        """One write transaction on the writer: committed if the body returns, else rolled back."""
        c = self.conn
        if self.fault_file is not None:
            self._inject_fault()
        c.execute(begin)
        try:
            yield
            c.execute("COMMIT")
        except BaseException:
            if c.in_transaction:
                c.execute("ROLLBACK")
            raise

    def probe(self) -> None:
        """A write that changes nothing, to learn whether writes work again; raises what a
        commit would. It needs what a batch needs: the write lock, room in the WAL, and
        new pages: its blob is larger than the free pages (up to PROBE_FREE_PAGES of
        them), so a database that cannot grow fails it, however often it ran before."""
        c = self.conn
        page_size = int(c.execute("PRAGMA page_size").fetchone()[0])
        free = int(c.execute("PRAGMA freelist_count").fetchone()[0])
        with self._transaction("BEGIN IMMEDIATE"):
            c.execute("INSERT INTO storage_probe (x) VALUES (zeroblob(?))",
                      ((min(free, PROBE_FREE_PAGES) + 2) * page_size,))
            c.execute("DELETE FROM storage_probe")

    def _inject_fault(self) -> None:
        """Tests only: simulate a full or read-only database as ``fault_file`` says."""
        if self.fault_file is None:
            return
        try:
            with open(self.fault_file) as f:
                fault = f.read().strip()
        except OSError:
            fault = ""
        # 1 is below any database's size, and SQLite raises the limit to the current size:
        # the file cannot grow, as on a full disk.
        self.conn.execute("PRAGMA max_page_count=%d" % (1 if fault == "full" else self._max_pages))
        self.conn.execute("PRAGMA query_only=%d" % (fault == "readonly"))

    # ---- reads -----------------------------------------------------------------

    def load_active(self) -> list[Job]:
        """Every non-terminal job, for recovery."""
        rows = self.conn.execute(
            "SELECT %s FROM jobs WHERE state IN (%s)" % (SELECT_COLUMNS, ",".join("?" * len(ACTIVE_STATES))),
            ACTIVE_STATES,
        ).fetchall()
        return [job_from_row(r) for r in rows]

    def load_task_types(self) -> list[str]:
        """Every task type a worker ever declared to this database."""
        return [row[0] for row in self.conn.execute("SELECT name FROM task_types ORDER BY name")]

    def max_seq(self) -> int:
        # Sequences grow with rowid (rows are inserted in submission order), so the newest
        # rows hold the largest; looking at a few avoids scanning a million-row table.
        return int(self.conn.execute(
            "SELECT COALESCE(MAX(seq), 0) FROM (SELECT seq FROM jobs ORDER BY rowid DESC LIMIT 1000)"
        ).fetchone()[0])

    def count(self) -> int:
        return int(self.conn.execute("SELECT COUNT(*) FROM jobs").fetchone()[0])

    def get(self, job_id: str) -> Job | None:
        row = self.reader.execute("SELECT %s FROM jobs WHERE job_id=?" % SELECT_COLUMNS, (job_id,)).fetchone()
        return None if row is None else job_from_row(row)

    def find_by_key(self, key: str) -> Job | None:
        row = self.reader.execute(
            "SELECT %s FROM jobs WHERE idempotency_key=?" % SELECT_COLUMNS, (key,)
        ).fetchone()
        return None if row is None else job_from_row(row)

    def list_page(self, limit: int, state: str | None, before_rowid: int | None,
                  task_type: str | None = None) -> list[tuple[int, Job]]:
        """Up to ``limit`` (rowid, job) pairs, newest first, strictly older than ``before_rowid``."""
        where: list[str] = []
        params: list[Any] = []
        for column, value in (("state", state), ("task_type", task_type), ("rowid<", before_rowid)):
            if value is not None:
                where.append(column + ("?" if column.endswith("<") else "=?"))
                params.append(value)
        sql = "SELECT rowid, %s FROM jobs %s ORDER BY rowid DESC LIMIT ?" % (
            SELECT_COLUMNS, ("WHERE " + " AND ".join(where)) if where else "")
        params.append(limit)
        return [(r[0], job_from_row(r[1:])) for r in self.reader.execute(sql, params)]

    def purgeable(self, after_rowid: int, cutoff_millis: int, limit: int) -> tuple[list[tuple[str, str | None]], int]:
        """Finished jobs last updated before ``cutoff_millis``, walking the table in rowid
        (submission) order from ``after_rowid``, examining at most ``limit`` rows.

        Returns (job id, idempotency key) pairs and where the next walk starts: past the
        examined rows, or 0 (from the start again) once the walk meets a finished job that
        is not old enough yet, or the end. Rows are purged oldest first, so the table's
        front is always its oldest rows: a walk reads little more than it returns, and
        needs no index of its own (an index by update time cost every finished job one
        more B-tree insert at commit, measured as a loss of throughput). Active jobs are
        stepped over, so a long queue of old jobs cannot stall it."""
        found: list[tuple[str, str | None]] = []
        rowid = after_rowid
        rows = self.reader.execute(
            "SELECT rowid, job_id, idempotency_key, state, updated_at FROM jobs WHERE rowid > ? ORDER BY rowid LIMIT ?",
            (after_rowid, limit)).fetchall()
        for rowid, job_id, key, state, updated_at in rows:
            if state in TERMINAL_STATES:
                if updated_at >= cutoff_millis:
                    return found, 0
                found.append((job_id, key))
        return found, (rowid if len(rows) == limit else 0)

    def close(self) -> None:
        for c in {id(self.reader): self.reader, id(self.conn): self.conn}.values():
            try:
                c.close()
            except sqlite3.Error:
                pass
