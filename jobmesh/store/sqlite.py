"""SQLiteStore: the ``Store`` (base.py) on an SQLite file.

One row per job, written through by the core: every transition is committed before any
client or worker can observe it (the runtime commits each core batch in one transaction
before releasing its replies and frames — docs/ARCHITECTURE.md, "Group commit").
The working set lives in memory; the table exists for recovery and for reading jobs that
have finished and left memory.

The columns come from ``columns.COLUMNS``, rendered here to SQLite types (text and JSON
as TEXT, 64-bit integers as INTEGER); the CREATE TABLE, the migrations, the SELECT list
and the multi-row INSERT and UPDATE statements are all derived from that list.

Schema history, migrated in place on open (a column marked ``added`` is created by
ALTER TABLE on an older database):

* v1 (legacy): the base columns only;
* v2: ``execution_timeout``, ``deadline``;
* v3: ``priority`` (legacy rows become NORMAL) and ``seq`` (legacy rows got 0);
* v4: ``run_at`` (scheduled jobs), and the ``task_types`` table of declared task types;
* v5: ``retry_of`` and ``events`` (the job's timeline, compactly encoded);
* v6: ``name`` and ``periodic`` (Periodic jobs: their name and Periodic fields);
* v7: ``seq`` is unique and indexed, alone and after ``state`` and ``task_type``:
  listings, their cursors and the retention walk order by it. A database whose rows
  lack unique sequences (rows from before v3 hold 0) has every row renumbered 1..n in
  (seq, created_at, rowid) order, which is submission order, once, when the index is built;
* v8: recurring schedules: the ``schedules`` table (a name and a JSON body), and the
  ``schedule_name`` and ``scheduled_for`` columns of the jobs their fires made.
* v9: ``submitted_by`` (the name of the token that submitted the job; NULL without auth).
* v10: ``result_ttl``, ``retry_base``, ``retry_cap`` (what a job asked for at creation),
  the ``jobs_expiry`` index of finished jobs with a time to live, and the
  ``task_defaults`` table (each task type's declared defaults, a JSON body).
* v11: limits: the ``limits`` table (a task type and a JSON body), and the jobs'
  ``concurrency_key`` and ``unique_key`` columns.

Two connections: ``conn`` is the writer (migrations, recovery, then batch writes on the
store's one-thread pool, ``commit``); ``reader`` serves reads inline on the hub's thread.
In WAL mode a reader never waits for a writer, so a read never stalls the hub behind an
fsync; it sees the last committed state, which is all the core asks of it (finished jobs,
idempotency keys of finished jobs, listing pages). An in-memory store (unit tests) has a
single connection for both.
"""

from __future__ import annotations

import logging
import sqlite3
from contextlib import contextmanager
from itertools import chain
from typing import Any, Callable, Iterator, cast

from gevent.threadpool import ThreadPool

from jobmesh.store.base import (Batch, Done, Outcome, Read, expired_query, expiry_index, outcome_of, page_query,
                                purge_walk)
from jobmesh.store.columns import (ACTIVE_STATES, COLUMN_NAMES, COLUMNS, MUTABLE_COLUMNS, Column, Kind,
                                   column_definition, read_row)
from jobmesh.store.job import Job

log = logging.getLogger(__name__)

_SQL_TYPES = {Kind.TEXT: "TEXT", Kind.INT64: "INTEGER", Kind.JSON: "TEXT"}


def column_sql(column: Column) -> str:
    """The column's type and constraints in SQLite's dialect."""
    return column_definition(column, _SQL_TYPES)


SELECT_COLUMNS = ", ".join(COLUMN_NAMES)
# The v1 table, as CREATE TABLE text (tests build legacy databases from it).
BASE_COLUMNS = ",\n".join("    %s %s" % (c.name, column_sql(c)) for c in COLUMNS if not c.added)
# Columns added by later schema versions: name -> column definition for ALTER TABLE.
ADDED_COLUMNS = {c.name: column_sql(c) for c in COLUMNS if c.added}
INSERT_WIDTH = len(COLUMNS)
UPDATE_WIDTH = len(MUTABLE_COLUMNS) + 1  # and the job id, last
# Every index by name. Listings page by (state, seq) or (task_type, seq) or seq alone,
# and the retention walk by seq: each reads O(page) rows at any table size.
INDEXES = {
    "jobs_idempotency_key": "CREATE UNIQUE INDEX jobs_idempotency_key ON jobs(idempotency_key)"
                            " WHERE idempotency_key IS NOT NULL",
    "jobs_seq": "CREATE UNIQUE INDEX jobs_seq ON jobs(seq)",
    "jobs_state_seq": "CREATE INDEX jobs_state_seq ON jobs(state, seq)",
    "jobs_task_type_seq": "CREATE INDEX jobs_task_type_seq ON jobs(task_type, seq)",
    "jobs_expiry": expiry_index("jobs_expiry", "jobs"),
}
# Indexes of older schemas, ordered by rowid within state or task type: replaced above.
OBSOLETE_INDEXES = ("jobs_state", "jobs_task_type")
TASK_TYPES_TABLE = "CREATE TABLE IF NOT EXISTS task_types (name TEXT PRIMARY KEY, first_seen INTEGER NOT NULL)"
# Recurring schedules (v8): one row per schedule, its body JSON text (coordinator/schedules.py).
SCHEDULES_TABLE = "CREATE TABLE IF NOT EXISTS schedules (name TEXT PRIMARY KEY, body TEXT NOT NULL)"
# Limits per task type (v11): one row per type, its body JSON text (coordinator/limits.py).
LIMITS_TABLE = "CREATE TABLE IF NOT EXISTS limits (task_type TEXT PRIMARY KEY, body TEXT NOT NULL)"
# Task types' declared defaults (v10): one row per type, its body JSON text (WORKER_REGISTER taskDefaults).
TASK_DEFAULTS_TABLE = "CREATE TABLE IF NOT EXISTS task_defaults (name TEXT PRIMARY KEY, body TEXT NOT NULL)"
# A scratch table for the storage probe (``SQLiteStore.probe``); it is always empty.
PROBE_TABLE = "CREATE TABLE IF NOT EXISTS storage_probe (x BLOB)"
PROBE_FREE_PAGES = 256  # beyond this many free pages, a probe no longer insists that the file grow
# What a current database holds besides the jobs columns; when all of it is there (and no
# obsolete index), opening writes nothing, so a read-only or full database still opens
# (and serves reads).
SCHEMA_OBJECTS = frozenset(INDEXES) | {"task_types", "storage_probe", "schedules", "limits", "task_defaults"}
# Rows renumbered 1..n in submission order (v7), when their sequences are not unique.
RENUMBER_SQL = ("UPDATE jobs SET seq = r.n FROM (SELECT rowid AS id, row_number() OVER (ORDER BY seq, created_at, rowid) AS n"
                " FROM jobs) AS r WHERE jobs.rowid = r.id")
# The test-only fault switch (docs/FAILURE_MODEL.md, "Testing storage faults"): the
# environment variable names a file that the store reads before each write.
FAULT_FILE_ENV = "JOBMESH_TEST_STORAGE_FAULT_FILE"
# sqlite3 messages -> the words clients see after "storage unavailable: ".
_REASONS = {
    "database or disk is full": "disk full",
    "attempt to write a readonly database": "database is read-only",
}

# A batch is written with multi-row statements, ROWS_PER_STATEMENT rows each: one
# sqlite3_step per statement instead of one per row. The sqlite3 module releases the GIL
# around each step, and every reacquisition may wait for the hub's thread, so per-row
# statements made the commit thread ping-pong the GIL with the hub (docs/PERFORMANCE.md).
ROWS_PER_STATEMENT = 64
# Binding a None goes through the sqlite3 module's adaptation protocol, which for a type
# it has no adapter for raises and clears an AttributeError (formatting its message):
# about 90 ns a NULL column, a dozen of them in a new job's row, all on the write thread
# holding the GIL the hub waits for. An adapter for None (a C callable returning None)
# ends the lookup at the registry; the value bound is still NULL.
sqlite3.register_adapter(type(None), cast(Callable[[None], None], {}.get))


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
        yield len(chunk), list(chain.from_iterable(chunk))  # in C: the GIL is held for less


def _in_list(sql: str, rows: int) -> str:
    return sql % ",".join("?" * rows)


INSERT_SQL = _insert_sql(1)  # one row, for executemany (bench/scaling.py builds big tables with it)
_INSERT_SQL = {n: _insert_sql(n) for n in range(1, ROWS_PER_STATEMENT + 1)}
_UPDATE_SQL = {n: _update_sql(n) for n in range(1, ROWS_PER_STATEMENT + 1)}
_PURGE_SQL = {n: _in_list("DELETE FROM jobs WHERE job_id IN (%s)", n) for n in range(1, ROWS_PER_STATEMENT + 1)}


class SQLiteStore:
    """The ``Store`` on SQLite. ``SQLiteStore(":memory:")`` serves the unit tests.

    ``synchronous`` is SQLite's PRAGMA (FULL, NORMAL or OFF). ``fault_file`` (tests only)
    names a file read before each write: ``full`` makes the database unable to grow
    (``PRAGMA max_page_count``), ``readonly`` makes the writer refuse writes
    (``PRAGMA query_only``), anything else or no file clears both.

    Raises ``sqlite3.Error`` if the file cannot be opened or migrated.
    """

    shared = False  # one coordinator per file: the runtime's file lock (dblock.py)

    def __init__(self, path: str, synchronous: str = "FULL", fault_file: str | None = None) -> None:
        self.path = path
        self.fault_file = fault_file
        self._synchronous = {"FULL": "FULL", "NORMAL": "NORMAL", "OFF": "OFF"}[synchronous]
        self.conn = self._connect_writer()
        self._max_pages = int(self.conn.execute("PRAGMA max_page_count").fetchone()[0])
        self._pool: ThreadPool | None = None  # the write thread, started by the first commit
        self.migrated: list[str] = []
        self._inject_fault()
        self._migrate()
        if path == ":memory:":
            self.reader = self.conn
        else:
            self.reader = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self.reader.execute("PRAGMA cache_size=-16384")

    def _connect_writer(self) -> sqlite3.Connection:
        # Room in the statement cache for every multi-row statement size, both kinds.
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                               cached_statements=3 * ROWS_PER_STATEMENT + 32)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA cache_size=-65536")  # 64 MiB: keeps hot index pages of big tables
        conn.execute("PRAGMA synchronous=%s" % self._synchronous)
        return conn

    # ---- schema ---------------------------------------------------------------

    def _columns(self) -> set[str]:
        return {row[1] for row in self.conn.execute("PRAGMA table_info(jobs)")}

    def _objects(self) -> set[str]:
        return {row[0] for row in self.conn.execute("SELECT name FROM sqlite_master")}

    def _current(self) -> bool:
        """True if the schema needs nothing: opening then writes nothing."""
        if not set(ADDED_COLUMNS) <= self._columns():
            return False
        names = self._objects()
        return SCHEMA_OBJECTS <= names and not names & set(OBSOLETE_INDEXES)

    def _migrate(self) -> None:
        if self._current():
            return
        c = self.conn
        c.execute("BEGIN IMMEDIATE")
        try:
            have = self._columns()
            if not have:
                c.execute("CREATE TABLE jobs (%s)" % ", ".join("%s %s" % (col.name, column_sql(col)) for col in COLUMNS))
                have = self._columns()
            for name, definition in ADDED_COLUMNS.items():
                if name not in have:
                    c.execute("ALTER TABLE jobs ADD COLUMN %s %s" % (name, definition))
                    self.migrated.append(name)
            names = self._objects()
            if "jobs_seq" not in names:
                self._number_rows()
            for name in OBSOLETE_INDEXES:
                c.execute("DROP INDEX IF EXISTS %s" % name)
            for name, sql in INDEXES.items():
                if name not in names:
                    c.execute(sql)
            c.execute(TASK_TYPES_TABLE)
            c.execute(SCHEDULES_TABLE)
            c.execute(LIMITS_TABLE)
            c.execute(TASK_DEFAULTS_TABLE)
            c.execute(PROBE_TABLE)
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise

    def _number_rows(self) -> None:
        """Before the unique index on seq: renumber every row if any lacks a unique sequence."""
        c = self.conn
        if (c.execute("SELECT 1 FROM jobs WHERE seq IS NULL OR seq <= 0 LIMIT 1").fetchone() is None
                and c.execute("SELECT 1 FROM jobs GROUP BY seq HAVING COUNT(*) > 1 LIMIT 1").fetchone() is None):
            return
        count = c.execute(RENUMBER_SQL).rowcount
        log.info("numbered the %d jobs of %s 1..%d in submission order (rows without a unique sequence)",
                 count, self.path, count)

    # ---- leadership: the file lock makes this process the only one --------------

    def lead(self, standing_by: Callable[[], None]) -> None:
        """Leads at once: the runtime's file lock already excludes every other coordinator."""

    def leadership_lost(self, exc: BaseException) -> bool:
        return False

    # ---- writes ------------------------------------------------------------------

    def write(self, batch: Batch) -> None:
        """Apply one batch in a single transaction (group commit)."""
        inserts, updates, task_types, purges, schedules, limits, task_defaults = batch
        c = self.conn
        with self._transaction("BEGIN"):
            for start in range(0, len(purges), ROWS_PER_STATEMENT):  # first: a new job may take a purged key
                ids = list(purges[start : start + ROWS_PER_STATEMENT])
                c.execute(_PURGE_SQL[len(ids)], ids)
            for n, params in _chunks(inserts):
                c.execute(_INSERT_SQL[n], params)
            for n, params in _chunks(updates):
                c.execute(_UPDATE_SQL[n], params)
            if task_types:
                c.executemany("INSERT OR IGNORE INTO task_types (name, first_seen) VALUES (?, ?)", task_types)
            if schedules:
                c.executemany("DELETE FROM schedules WHERE name=?", [(name,) for name, body in schedules if body is None])
                c.executemany("INSERT OR REPLACE INTO schedules (name, body) VALUES (?, ?)",
                              [row for row in schedules if row[1] is not None])
            if limits:
                c.executemany("DELETE FROM limits WHERE task_type=?", [(name,) for name, body in limits if body is None])
                c.executemany("INSERT OR REPLACE INTO limits (task_type, body) VALUES (?, ?)",
                              [row for row in limits if row[1] is not None])
            if task_defaults:
                c.executemany("INSERT OR REPLACE INTO task_defaults (name, body) VALUES (?, ?)", task_defaults)

    def commit(self, batch: Batch) -> Outcome:
        """``write`` on the store's one write thread, off the hub."""
        return self._executor().spawn(outcome_of, self.write, batch)

    def commit_probe(self) -> Outcome:
        return self._executor().spawn(outcome_of, self.probe)

    def _executor(self) -> ThreadPool:
        # One thread: writes apply in call order, and the writer connection is never shared.
        if self._pool is None:
            self._pool = ThreadPool(1)
        return self._pool

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
        them), so a database that cannot grow fails it, however often it ran before.

        A connection opened while the file was read-only stays read-only, so a probe
        that finds the database read-only opens the writer again first (on the write
        thread, where the writer is used) and tries with that."""
        try:
            self._probe()
        except sqlite3.OperationalError as exc:
            if self.path == ":memory:" or self.fault_reason(exc) != "database is read-only":
                raise
            old, self.conn = self.conn, self._connect_writer()
            old.close()
            self._probe()

    def _probe(self) -> None:
        c = self.conn
        page_size = int(c.execute("PRAGMA page_size").fetchone()[0])
        free = int(c.execute("PRAGMA freelist_count").fetchone()[0])
        with self._transaction("BEGIN IMMEDIATE"):
            c.execute("INSERT INTO storage_probe (x) VALUES (zeroblob(?))",
                      ((min(free, PROBE_FREE_PAGES) + 2) * page_size,))
            c.execute("DELETE FROM storage_probe")

    def is_storage_fault(self, exc: BaseException) -> bool:
        """Every sqlite3 error and OSError counts as a storage fault: the coordinator then
        serves reads and retries writes rather than stopping."""
        return isinstance(exc, (sqlite3.Error, OSError))

    def fault_reason(self, exc: BaseException) -> str:
        """A short reason for a failed write: "disk full", "database is locked", ..."""
        text = str(exc).strip() or type(exc).__name__
        return _REASONS.get(text, text)

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
        return [read_row(r) for r in rows]

    def load_task_types(self) -> list[str]:
        """Every task type a worker ever declared to this database."""
        return [row[0] for row in self.conn.execute("SELECT name FROM task_types ORDER BY name")]

    def load_schedules(self) -> list[tuple[str, str]]:
        """Every recurring schedule as (name, body), sorted by name."""
        return [(row[0], row[1]) for row in self.conn.execute("SELECT name, body FROM schedules ORDER BY name")]

    def load_limits(self) -> list[tuple[str, str]]:
        """Every task type's limit as (task type, body), sorted by type."""
        return [(row[0], row[1]) for row in self.conn.execute("SELECT task_type, body FROM limits ORDER BY task_type")]

    def load_task_defaults(self) -> list[tuple[str, str]]:
        """Every task type's declared defaults as (name, body), sorted by name."""
        return [(row[0], row[1]) for row in self.conn.execute("SELECT name, body FROM task_defaults ORDER BY name")]

    def max_seq(self) -> int:
        return int(self.conn.execute("SELECT COALESCE(MAX(seq), 0) FROM jobs").fetchone()[0])

    def count(self) -> int:
        return int(self.conn.execute("SELECT COUNT(*) FROM jobs").fetchone()[0])

    def get(self, job_id: str) -> Job | None:
        row = self.reader.execute("SELECT %s FROM jobs WHERE job_id=?" % SELECT_COLUMNS, (job_id,)).fetchone()
        return None if row is None else read_row(row)

    def find_by_key(self, key: str) -> Job | None:
        row = self.reader.execute(
            "SELECT %s FROM jobs WHERE idempotency_key=?" % SELECT_COLUMNS, (key,)
        ).fetchone()
        return None if row is None else read_row(row)

    def read_later(self, job_id: str | None = None, key: str | None = None) -> Read:
        """Answered at once: in WAL mode the reader never waits for the writer, and these
        are indexed reads of one row."""
        if job_id is not None:
            return Done(lambda: self.get(job_id))
        assert key is not None, "read_later needs a job id or a key"
        return Done(lambda: self.find_by_key(key))

    def list_page(self, limit: int, state: str | None, before: int | None,
                  task_type: str | None = None) -> list[tuple[int, Job]]:
        """Up to ``limit`` (seq, job) pairs, newest first, with seq below ``before``."""
        sql, params = self.page_query(limit, state, before, task_type)
        return [(job.seq, job) for job in map(read_row, self.reader.execute(sql, params))]

    @staticmethod
    def page_query(limit: int, state: str | None, before: int | None,
                   task_type: str | None = None) -> tuple[str, list[Any]]:
        """The SELECT behind ``list_page`` and its parameters."""
        return page_query("jobs", "?", limit, state, before, task_type)

    # The walk's SELECT: the seq index gives the rows in order, O(rows examined).
    PURGE_WALK_SQL = ("SELECT seq, job_id, idempotency_key, state, updated_at, result_ttl FROM jobs WHERE seq > ?"
                      " ORDER BY seq LIMIT ?")

    def purgeable(self, after: int, cutoff_millis: int, limit: int,
                  own_ttl: bool = True) -> tuple[list[tuple[str, str | None]], int]:
        """Finished jobs last updated before ``cutoff_millis``, walking the table in
        sequence (submission) order from just past ``after``, examining at most ``limit``
        rows (see ``Store.purgeable``).

        Rows are purged oldest first, so the walk's front is always the oldest rows: a
        walk reads little more than it returns and needs no index by update time (such an
        index cost every finished job one more B-tree update at commit, measured as a loss
        of throughput). Active jobs are stepped over, so a long queue of old jobs cannot
        stall it."""
        return purge_walk(self.reader.execute(self.PURGE_WALK_SQL, (after, limit)).fetchall(), after, cutoff_millis,
                          limit, own_ttl)

    # The index named: on a table without statistics the planner may prefer another one.
    EXPIRED_SQL = expired_query("jobs INDEXED BY jobs_expiry", "?")

    def expired(self, now_millis: int, limit: int) -> list[tuple[str, str | None]]:
        """Finished jobs whose time to live has passed, from the expiry index (``Store.expired``)."""
        return [(row[0], row[1]) for row in self.reader.execute(self.EXPIRED_SQL, (now_millis, limit))]

    def close(self) -> None:
        """Stop the write thread and close the connections; call with no write in flight."""
        if self._pool is not None:
            self._pool.kill()
            self._pool = None
        for c in {id(self.reader): self.reader, id(self.conn): self.conn}.values():
            try:
                c.close()
            except sqlite3.Error:
                pass
