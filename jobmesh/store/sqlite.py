"""SQLiteStore: the ``Store`` (base.py) on an SQLite file.

One row per job, written through by the core: every transition is committed before any
client or worker can observe it (the runtime commits each core batch in one transaction
before releasing its replies and frames — docs/ARCHITECTURE.md, "Group commit").
The working set lives in memory; the table exists for recovery and for reading jobs that
have finished and left memory.

The columns come from ``columns.COLUMNS``, rendered here to SQLite types (text and JSON
as TEXT, 64-bit integers as INTEGER); the CREATE TABLE, the migrations, the SELECT list
and the multi-row INSERT and UPDATE statements are all derived from that list.

Schema history: numbered migrations, applied in place on open (``MIGRATIONS``, and the
columns whose ``added`` is the migration's number, created by ALTER TABLE), each recorded
in the ``schema_migrations`` table (base.SCHEMA_VERSION):

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
* v12: workflows: the ``workflows`` table (an id and a JSON body), the jobs'
  ``workflow_id``, ``ref``, ``depends_on`` and ``parents`` columns, and the
  ``jobs_workflow`` index of a workflow's jobs.

A database from before the ``schema_migrations`` table runs every migration, each
creating only what it lacks; a new one gets the jobs table as it is now, then the rest.

Two connections: ``conn`` is the writer (migrations, recovery, then batch writes on the
store's one-thread pool, ``commit``); ``reader`` serves reads inline on the hub's thread.
In WAL mode a reader never waits for a writer, so a read never stalls the hub behind an
fsync; it sees the last committed state, which is all the core asks of it (finished jobs,
idempotency keys of finished jobs, listing pages). An in-memory store (unit tests) has a
single connection for both.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import sqlite3
import time
from contextlib import contextmanager
from itertools import chain
from typing import Any, Callable, Iterator, TypeVar, cast

from gevent.threadpool import ThreadPool

from jobmesh.store.base import (SCHEMA_VERSION, Batch, CannotLead, DatabaseInUse, Done, NewerSchema, Outcome, Read,
                                StorageFault, expired_query, expiry_index, outcome_of, page_query, purge_walk,
                                workflow_queries)
from jobmesh.store.columns import (ACTIVE_STATES, COLUMN_NAMES, COLUMNS, MUTABLE_COLUMNS, Column, Kind, added_in,
                                   column_definition, read_row)
from jobmesh.store.job import Job

log = logging.getLogger(__name__)
T = TypeVar("T")

_SQL_TYPES = {Kind.TEXT: "TEXT", Kind.INT64: "INTEGER", Kind.JSON: "TEXT"}


def column_sql(column: Column) -> str:
    """The column's type and constraints in SQLite's dialect."""
    return column_definition(column, _SQL_TYPES)


SELECT_COLUMNS = ", ".join(COLUMN_NAMES)
# The v1 table, as CREATE TABLE text (tests build legacy databases from it).
BASE_COLUMNS = ",\n".join("    %s %s" % (c.name, column_sql(c)) for c in added_in(1))
# Columns added by later schema versions: name -> column definition for ALTER TABLE, in migration order.
ADDED_COLUMNS = {c.name: column_sql(c) for version in range(2, SCHEMA_VERSION + 1) for c in added_in(version)}
INSERT_WIDTH = len(COLUMNS)
UPDATE_WIDTH = len(MUTABLE_COLUMNS) + 1  # and the job id, last
# Indexes of older schemas, ordered by rowid within state or task type: replaced above.
OBSOLETE_INDEXES = ("jobs_state", "jobs_task_type")
# A scratch table for the storage probe (``SQLiteStore.probe``); it is always empty.
PROBE_TABLE = "CREATE TABLE IF NOT EXISTS storage_probe (x BLOB)"
PROBE_FREE_PAGES = 256  # beyond this many free pages, a probe no longer insists that the file grow
# The numbered migrations applied (base.SCHEMA_VERSION): one row each, when it was applied.
MIGRATIONS_TABLE = ("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY,"
                    " applied_at INTEGER NOT NULL)")
# What each migration creates besides its columns (``Column.added``), each statement
# harmless when its object exists: a database from before the migrations table runs them all.
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: ("CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency_key ON jobs(idempotency_key)"
        " WHERE idempotency_key IS NOT NULL", PROBE_TABLE),
    4: ("CREATE TABLE IF NOT EXISTS task_types (name TEXT PRIMARY KEY, first_seen INTEGER NOT NULL)",),
    # v7: listings page by (state, seq) or (task_type, seq) or seq alone, and the
    # retention walk by seq: each reads O(page) rows at any table size (rows renumbered first).
    7: tuple("DROP INDEX IF EXISTS %s" % name for name in OBSOLETE_INDEXES) + (
        "CREATE UNIQUE INDEX IF NOT EXISTS jobs_seq ON jobs(seq)",
        "CREATE INDEX IF NOT EXISTS jobs_state_seq ON jobs(state, seq)",
        "CREATE INDEX IF NOT EXISTS jobs_task_type_seq ON jobs(task_type, seq)"),
    # Recurring schedules: one row per schedule, its body JSON text (coordinator/core/schedules.py).
    8: ("CREATE TABLE IF NOT EXISTS schedules (name TEXT PRIMARY KEY, body TEXT NOT NULL)",),
    # Task types' declared defaults: one row per type, its body JSON text (WORKER_REGISTER taskDefaults).
    10: (expiry_index("jobs_expiry", "jobs"),
         "CREATE TABLE IF NOT EXISTS task_defaults (name TEXT PRIMARY KEY, body TEXT NOT NULL)"),
    # Limits per task type: one row per type, its body JSON text (coordinator/core/limits.py).
    11: ("CREATE TABLE IF NOT EXISTS limits (task_type TEXT PRIMARY KEY, body TEXT NOT NULL)",),
    # Workflows: one row per workflow, its body JSON text; its jobs by workflow (coordinator/core/workflows.py).
    12: ("CREATE TABLE IF NOT EXISTS workflows (workflow_id TEXT PRIMARY KEY, body TEXT NOT NULL)",
         "CREATE INDEX IF NOT EXISTS jobs_workflow ON jobs(workflow_id, seq) WHERE workflow_id IS NOT NULL"),
}
# Every index of a current database (tests compare).
INDEXES = ("jobs_idempotency_key", "jobs_seq", "jobs_state_seq", "jobs_task_type_seq", "jobs_expiry", "jobs_workflow")
# Rows renumbered 1..n in submission order (v7), when their sequences are not unique.
RENUMBER_SQL = ("UPDATE jobs SET seq = r.n FROM (SELECT rowid AS id, row_number() OVER (ORDER BY seq, created_at, rowid) AS n"
                " FROM jobs) AS r WHERE jobs.rowid = r.id")
LOCK_SUFFIX = ".lock"  # one coordinator per file: the lock file beside it (``lock_path``)
# sqlite3 messages -> the words clients see after "storage unavailable: ".
READ_ONLY = "database is read-only"
_REASONS = {
    "database or disk is full": "disk full",
    "attempt to write a readonly database": READ_ONLY,
}


def fault(exc: BaseException) -> StorageFault:
    """A sqlite3 error or OSError as the storage fault it is, in short words."""
    text = str(exc).strip() or type(exc).__name__
    return StorageFault(_REASONS.get(text, text))


@contextmanager
def faults() -> Iterator[None]:
    """Every sqlite3 error and OSError is a storage fault (``StorageFault``): the
    coordinator then serves reads and retries writes rather than stopping."""
    try:
        yield
    except (sqlite3.Error, OSError) as exc:
        raise fault(exc) from exc

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


def _chunks(rows: list[tuple[Any, ...]]) -> Iterator[tuple[int, list[Any]]]:
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
_PURGE_FLOWS_SQL = {n: _in_list("DELETE FROM workflows WHERE workflow_id IN (SELECT workflow_id FROM jobs"
                                " WHERE job_id IN (%s) AND workflow_id IS NOT NULL)", n)
                    for n in range(1, ROWS_PER_STATEMENT + 1)}


class SQLiteStore:
    """The ``Store`` on SQLite. ``SQLiteStore(":memory:")`` serves the unit tests.

    ``synchronous`` is SQLite's PRAGMA (FULL, NORMAL or OFF).

    Raises ``sqlite3.Error`` if the file cannot be opened or migrated.
    """

    shared = False  # one coordinator per file: the file lock ``lead`` takes

    def __init__(self, path: str, synchronous: str = "FULL") -> None:
        self.path = path
        self._synchronous = {"FULL": "FULL", "NORMAL": "NORMAL", "OFF": "OFF"}[synchronous]
        self._lock = FileLock(path)
        self.conn = self._connect_writer()
        self._pool: ThreadPool | None = None  # the write thread, started by the first commit
        self.migrated: list[str] = []
        self.migrations: list[int] = []
        self._migrate()
        self.reader = self._connect_reader()

    def _connect_reader(self) -> sqlite3.Connection:
        if self.path == ":memory:":
            return self.conn
        reader = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        reader.execute("PRAGMA cache_size=-16384")
        return reader

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

    def _version(self) -> int | None:
        """The last migration applied; None for a database from before the migrations table."""
        c = self.conn
        if c.execute("SELECT 1 FROM sqlite_master WHERE name = 'schema_migrations'").fetchone() is None:
            return None
        return int(c.execute("SELECT COALESCE(MAX(version), 0) FROM schema_migrations").fetchone()[0])

    def _migrate(self) -> None:
        """Apply the migrations the database lacks, in order, in one transaction; a current
        database is only read, so a read-only or full one still opens (and serves reads)."""
        version = self._version()
        if version == SCHEMA_VERSION:
            return
        if version is not None and version > SCHEMA_VERSION:
            raise NewerSchema(self.path, version)
        c = self.conn
        with self._transaction("BEGIN IMMEDIATE"):
            version = self._version() or 0  # again, under the write lock
            c.execute(MIGRATIONS_TABLE)
            have = self._columns()
            if not have:  # a new database: the table as it is now, at once
                c.execute("CREATE TABLE jobs (%s)" % ", ".join("%s %s" % (col.name, column_sql(col)) for col in COLUMNS))
                have = self._columns()
            applied = int(time.time() * 1000)
            for number in range(version + 1, SCHEMA_VERSION + 1):
                for column in added_in(number):
                    if column.name not in have:
                        c.execute("ALTER TABLE jobs ADD COLUMN %s %s" % (column.name, column_sql(column)))
                        self.migrated.append(column.name)
                if number == 7 and c.execute("SELECT 1 FROM sqlite_master WHERE name = 'jobs_seq'").fetchone() is None:
                    self._number_rows()
                for sql in MIGRATIONS.get(number, ()):
                    c.execute(sql)
                c.execute("INSERT INTO schema_migrations (version, applied_at) VALUES (?, ?)", (number, applied))
                self.migrations.append(number)

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
        """Take the file lock (``FileLock``): this process is then the only coordinator on
        the file, before recovery rewrites anything. Raises ``DatabaseInUse`` if another
        process holds it, ``CannotLead`` if the lock file cannot be created. Opening
        before it only reads a current schema, so a second coordinator changes nothing."""
        try:
            self._lock.acquire()
        except OSError as exc:
            raise CannotLead("cannot open the database %s: cannot create its lock file %s: %s"
                             % (self.path, self._lock.path, exc.strerror or exc)) from None

    # ---- writes ------------------------------------------------------------------

    def write(self, batch: Batch) -> None:
        """Apply one batch in a single transaction (group commit).

        A batch that is one statement (new jobs only, or updates only, at most
        ``ROWS_PER_STATEMENT`` rows: the usual batch of submits) is that statement alone,
        which SQLite makes a transaction by itself: no BEGIN and no COMMIT. Each statement
        the write thread runs is one more time it takes the GIL back, and the hub then
        waits for it (docs/PERFORMANCE.md)."""
        inserts, updates, task_types, purges, schedules, limits, task_defaults, workflows = batch
        c = self.conn
        rows = inserts or updates
        if (not (inserts and updates) and 0 < len(rows) <= ROWS_PER_STATEMENT
                and not (purges or task_types or schedules or limits or task_defaults or workflows)):
            with self._transaction(None):
                c.execute((_INSERT_SQL if inserts else _UPDATE_SQL)[len(rows)], list(chain.from_iterable(rows)))
            return
        with self._transaction("BEGIN"):
            for start in range(0, len(purges), ROWS_PER_STATEMENT):  # first: a new job may take a purged key
                ids = list(purges[start : start + ROWS_PER_STATEMENT])
                c.execute(_PURGE_FLOWS_SQL[len(ids)], ids)  # a workflow goes with its jobs
                c.execute(_PURGE_SQL[len(ids)], ids)
            if workflows:
                c.executemany("INSERT INTO workflows (workflow_id, body) VALUES (?, ?)", workflows)
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
        return cast(Outcome, self._executor().spawn(outcome_of, self.write, batch))

    def commit_probe(self) -> Outcome:
        return cast(Outcome, self._executor().spawn(outcome_of, self.probe))

    def _executor(self) -> ThreadPool:
        # One thread: writes apply in call order, and the writer connection is never shared.
        if self._pool is None:
            self._pool = ThreadPool(1)
        return self._pool

    @contextmanager
    def _transaction(self, begin: str | None) -> Iterator[None]:
        """One write transaction on the writer: committed if the body returns, else rolled
        back; a failure raises ``StorageFault``. With ``begin`` None the body is a single
        statement, which SQLite makes a transaction by itself."""
        c = self.conn
        with faults():
            if begin is None:
                yield
                return
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
        except StorageFault as fault:
            if self.path == ":memory:" or fault.reason != READ_ONLY:
                raise
            self._reopen_writer()
            self._probe()

    def _reopen_writer(self) -> None:
        """Connect the writer again (on the thread that uses it)."""
        with faults():
            old, self.conn = self.conn, self._connect_writer()
        old.close()

    def reopen(self) -> None:
        """Both connections again (the reader on the hub, the writer too: no write is in
        flight); the file lock stays. Raises ``StorageFault`` and keeps the old ones."""
        if self.path == ":memory:":
            return
        with faults():
            writer = self._connect_writer()
            try:
                reader = self._connect_reader()
            except BaseException:
                writer.close()
                raise
        for old in (self.conn, self.reader):
            old.close()
        self.conn, self.reader = writer, reader

    def _probe(self) -> None:
        c = self.conn
        with faults():
            page_size = int(c.execute("PRAGMA page_size").fetchone()[0])
            free = int(c.execute("PRAGMA freelist_count").fetchone()[0])
        with self._transaction("BEGIN IMMEDIATE"):
            c.execute("INSERT INTO storage_probe (x) VALUES (zeroblob(?))",
                      ((min(free, PROBE_FREE_PAGES) + 2) * page_size,))
            c.execute("DELETE FROM storage_probe")

    # ---- reads -----------------------------------------------------------------

    @staticmethod
    def _all(conn: sqlite3.Connection, sql: str, params: Any = ()) -> list[Any]:
        with faults():
            return conn.execute(sql, params).fetchall()

    def load_active(self) -> list[Job]:
        """Every non-terminal job, for recovery."""
        rows = self._all(self.conn, "SELECT %s FROM jobs WHERE state IN (%s)"
                         % (SELECT_COLUMNS, ",".join("?" * len(ACTIVE_STATES))), ACTIVE_STATES)
        return [read_row(r) for r in rows]

    def load_task_types(self) -> list[str]:
        """Every task type a worker ever declared to this database."""
        return [row[0] for row in self._all(self.conn, "SELECT name FROM task_types ORDER BY name")]

    def load_schedules(self) -> list[tuple[str, str]]:
        """Every recurring schedule as (name, body), sorted by name."""
        return [(row[0], row[1]) for row in self._all(self.conn, "SELECT name, body FROM schedules ORDER BY name")]

    def load_limits(self) -> list[tuple[str, str]]:
        """Every task type's limit as (task type, body), sorted by type."""
        return [(row[0], row[1]) for row in self._all(self.conn,
                                                      "SELECT task_type, body FROM limits ORDER BY task_type")]

    def load_task_defaults(self) -> list[tuple[str, str]]:
        """Every task type's declared defaults as (name, body), sorted by name."""
        return [(row[0], row[1]) for row in self._all(self.conn,
                                                      "SELECT name, body FROM task_defaults ORDER BY name")]

    def max_seq(self) -> int:
        return int(self._all(self.conn, "SELECT COALESCE(MAX(seq), 0) FROM jobs")[0][0])

    def count(self) -> int:
        return int(self._all(self.conn, "SELECT COUNT(*) FROM jobs")[0][0])

    _BY_ID = "SELECT %s FROM jobs WHERE job_id=?" % SELECT_COLUMNS
    _BY_KEY = "SELECT %s FROM jobs WHERE idempotency_key=?" % SELECT_COLUMNS

    def get(self, job_id: str) -> Job | None:
        return self._one(self._BY_ID, job_id)

    def find_by_key(self, key: str) -> Job | None:
        return self._one(self._BY_KEY, key)

    def _one(self, sql: str, value: str) -> Job | None:
        """One row by a unique column (a keyed submit's read: no context manager on its way)."""
        try:
            row = self.reader.execute(sql, (value,)).fetchone()
        except (sqlite3.Error, OSError) as exc:
            raise fault(exc) from exc
        return None if row is None else read_row(row)

    def read_later(self, job_id: str | None = None, key: str | None = None) -> Read[Job | None]:
        """Answered at once: in WAL mode the reader never waits for the writer, and these
        are indexed reads of one row."""
        if job_id is not None:
            return Done(lambda: self.get(job_id))
        assert key is not None, "read_later needs a job id or a key"
        return Done(lambda: self.find_by_key(key))

    def later(self, read: Callable[[], T]) -> Read[T]:
        """Answered at once: the reader never waits for the writer (WAL)."""
        return Done(read)

    def list_page(self, limit: int, state: str | None, before: int | None,
                  task_type: str | None = None) -> list[tuple[int, Job]]:
        """Up to ``limit`` (seq, job) pairs, newest first, with seq below ``before``."""
        sql, params = self.page_query(limit, state, before, task_type)
        return [(job.seq, job) for job in map(read_row, self._all(self.reader, sql, params))]

    @staticmethod
    def page_query(limit: int, state: str | None, before: int | None,
                   task_type: str | None = None) -> tuple[str, list[Any]]:
        """The SELECT behind ``list_page`` and its parameters."""
        return page_query("jobs", "?", limit, state, before, task_type)

    # The walk's SELECT: the seq index gives the rows in order, O(rows examined).
    PURGE_WALK_SQL = ("SELECT seq, job_id, idempotency_key, state, updated_at, result_ttl, workflow_id FROM jobs"
                      " WHERE seq > ? ORDER BY seq LIMIT ?")
    FLOW_JOBS_SQL, FLOW_SQL, FLOW_ROWS_SQL = workflow_queries("jobs", "workflows", "?")

    def load_workflow(self, workflow_id: str) -> tuple[str, list[Job]] | None:
        """A workflow's body and its jobs, in sequence order (``Store.load_workflow``)."""
        body = self._all(self.reader, self.FLOW_SQL, (workflow_id,))
        if not body:
            return None
        return body[0][0], [read_row(row) for row in self._all(self.reader, self.FLOW_ROWS_SQL, (workflow_id,))]

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
        return purge_walk(self._all(self.reader, self.PURGE_WALK_SQL, (after, limit)), after, cutoff_millis, limit,
                          own_ttl, lambda flow: self._all(self.reader, self.FLOW_JOBS_SQL, (flow,)))

    # The index named: on a table without statistics the planner may prefer another one.
    EXPIRED_SQL = expired_query("jobs INDEXED BY jobs_expiry", "?")

    def expired(self, now_millis: int, limit: int) -> list[tuple[str, str | None]]:
        """Finished jobs whose time to live has passed, from the expiry index (``Store.expired``)."""
        return [(row[0], row[1]) for row in self._all(self.reader, self.EXPIRED_SQL, (now_millis, limit))]

    def close(self) -> None:
        """Stop the write thread, close the connections and release the file lock; call
        with no write in flight."""
        if self._pool is not None:
            self._pool.kill()
            self._pool = None
        for c in {id(self.reader): self.reader, id(self.conn): self.conn}.values():
            try:
                c.close()
            except sqlite3.Error:
                pass
        self._lock.release()


def lock_path(db_path: str) -> str | None:
    """The lock file beside the database file ``db_path`` names, with symlinks and relative
    parts resolved (two names of one file must take one lock); None for an in-memory
    database."""
    if db_path == ":memory:" or db_path.startswith("file::memory:"):
        return None
    if not db_path.startswith("file:"):
        db_path = os.path.realpath(db_path)
    return db_path + LOCK_SUFFIX


class FileLock:
    """One coordinator per database file: an exclusive, non-blocking ``flock`` on
    ``<db>.lock``, held until ``release`` or the process's death.

    Taken before recovery, so a second coordinator on the same file stops before it
    could touch anything (recovery rewrites RUNNING jobs, which would be the live
    coordinator's running work). The kernel drops the lock when the process ends, however
    it ends, so a restart right after ``kill -9`` finds it free: nothing here decides
    anything from the file's content. The file holds the holder's pid as text, only so
    that the refusal can name it, and is left in place when the lock is released
    (deleting it could let two processes lock two different files). An in-memory
    database belongs to one process anyway and takes no lock.

    ``acquire`` raises ``DatabaseInUse`` if another process holds it, or ``OSError`` if
    the lock file cannot be created (e.g. its directory does not exist).
    """

    def __init__(self, db_path: str) -> None:
        self.path = lock_path(db_path)
        self._fd: int | None = None

    def acquire(self) -> None:
        if self.path is None or self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            try:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise DatabaseInUse(self.path, _read_pid(fd)) from None
                raise
            finally:
                os.close(fd)
        # Ours now: say who holds it (a reader racing this write may see it empty).
        os.ftruncate(fd, 0)
        os.pwrite(fd, b"%d\n" % os.getpid(), 0)
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.ftruncate(fd, 0)  # no stale pid for anyone to misread
            except OSError:
                pass
            os.close(fd)  # closing the descriptor drops the lock


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else None
    except (OSError, ValueError):
        return None
