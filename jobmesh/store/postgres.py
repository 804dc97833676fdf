"""PostgresStore: the ``Store`` (base.py) on PostgreSQL, shared by several coordinators.

The tables are those of the SQLite store, prefixed ``jobmesh_`` (they may live in a
database other programs use) and created in the connection's current schema, so that one
database can hold several independent jobmesh installations, one per schema. The columns
come from ``columns.COLUMNS``: text as ``text``, 64-bit integers (milliseconds, counts,
the sequence) as ``bigint``, JSON as ``text`` (the store never looks inside it, and text
keeps the exact JSON the core wrote: no parse per write, no reformatting on the way back).
The schema comes from numbered migrations (``MIGRATIONS``, and the columns whose
``added`` is the migration's number), each recorded in ``jobmesh_migrations``
(base.SCHEMA_VERSION); applying them is serialized by a transaction-scoped advisory
lock, so coordinators that start together apply them once, and a current schema is
not written to. Every error a call meets is raised typed (``typed``): ``LeadershipLost``,
``StorageFault``, or as it is (a bug).

Three connections:

* the writer: leadership, then every batch. ``lead`` takes a session advisory lock (one
  per schema), then bumps the epoch row (``jobmesh_leader``) and remembers the epoch.
  Each batch is one round trip in pipeline mode: BEGIN, the fence
  (``jobmesh_fence(epoch)``, a function that RAISES unless the epoch row still holds
  this epoch, and holds the row FOR SHARE so that no bump can commit in between), then
  one statement per kind of row: the jobs' inserts and updates each one JSON parameter
  (the rows, encoded by ujson in C) that the server takes apart, the smaller tables'
  rows one array parameter per column expanded by ``unnest`` (either way the statement
  text is the same for every batch size, so psycopg prepares it once; multi-row VALUES
  would make one statement per size), then COMMIT. Commits run on a
  greenlet of the store, one at a time in call order: a connection made on the hub
  cannot be driven from another thread. The writer is never reconnected: a lost writer
  session is lost leadership (``LeadershipLost``), and a process that lost it stops.
  A leader that stops answering loses the lock in bounded time: its session's timeouts
  (idle, idle in a transaction, TCP user timeout, keepalives: ``session_timeout_millis``)
  end a vanished leader's session. A frozen one's idle timeout is not always armed (the
  server arms it after a Sync or a simple query, and psycopg ends a pipeline with a
  Flush after its Sync), so a standby waiting in ``lead`` ends the holder's session once
  it has been idle longer than the timeout. A healthy leader's session is never idle
  that long: the commit greenlet runs a cheap statement when no batch ran for a quarter
  of it.
* the reader (psycopg, synchronous): recovery, and the reads ``later`` runs on greenlets
  of their own (listings, the purge walks, expired jobs), so the core never waits for
  its round trips; psycopg serializes the greenlets that share it.
* the deferred reader: ``read_later``'s queries, one at a time on libpq's non-blocking
  interface. A read is sent at once; its ``Read`` finishes when the reply is in, noticed
  by an I/O watcher on the hub (the coordinator) or by ``ready()`` itself (which only
  consumes what has arrived), so a read never stalls the core.

PostgreSQL's text cannot hold a NUL character, which JSON can carry (``\\u0000``) into a
key, a worker id or an error: a batch psycopg refuses for one is written again with
U+FFFD in its place (``storable``), and reads look keys and ids up the same way.

Idempotency keys: recovery (``load_active``) builds a Bloom filter of the stored keys
(``KeyFilter``) and every batch's new keys are added to it, so ``read_later(key=...)`` of
a key never stored is answered at once without a query. A Bloom filter rather than a set:
at a million stored keys a set of the key strings holds about 120 MB, the filter 8 MiB
(measured; sized for as many keys again, in powers of two), built in under a second.
Its false positives (about 0.1% as built, under 1% until the keys doubled) cost one read
each; purged keys stay in it, as positives, until the next recovery.
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Generic, Iterator, TypeVar, cast

import gevent
import gevent.event
import gevent.queue
import psycopg
import ujson
from psycopg import pq
from psycopg.types.numeric import Int8Dumper

from jobmesh.store.base import (SCHEMA_VERSION, Batch, Done, LeadershipLost, NewerSchema, Outcome, Read,
                                StorageFault, expired_query, expiry_index, first_line, lost, outcome_of, page_query,
                                purge_walk, workflow_queries)
from jobmesh.store.columns import (ACTIVE_STATES, COLUMN_NAMES, COLUMNS, MUTABLE_COLUMNS, Column, Kind, added_in,
                                   column_definition, read_row)
from jobmesh.store.job import Job

log = logging.getLogger(__name__)
T = TypeVar("T")

_SQL_TYPES = {Kind.TEXT: "text", Kind.INT64: "bigint", Kind.JSON: "text"}

JOBS = "jobmesh_jobs"
SELECT_COLUMNS = ", ".join(COLUMN_NAMES)
# The fence's own SQLSTATE (class JM is no standard class): raised when the epoch moved.
FENCE_SQLSTATE = "JM001"
# Advisory lock keys (the two-int form): leadership, per schema (its oid), and schema
# creation (transaction-scoped, per schema name's hash).
LEAD_LOCK = 0x6A6D6C64  # "jmld"
SCHEMA_LOCK = 0x6A6D7363  # "jmsc"
DEFAULT_SESSION_TIMEOUT_MILLIS = 10_000
KEEPALIVE_FRACTION = 4  # an idle writer runs a statement every timeout / KEEPALIVE_FRACTION
RECOVERY_SLICE = 2000  # active rows recovery reads and takes in between two chances for other greenlets
YIELD_SECONDS = 0.0001


def column_sql(column: Column) -> str:
    """The column's type and constraints in PostgreSQL's dialect."""
    return column_definition(column, _SQL_TYPES)


def _rows(columns: tuple[Column, ...]) -> str:
    """The rows of one JSON parameter (an array of rows, each an array in ``columns``
    order) as a relation whose columns are ``columns``: the server takes the rows apart,
    so the hub encodes a batch with one ``ujson.dumps`` instead of adapting an array
    per column element by element in Python (psycopg's array dumper is pure Python)."""
    return "(SELECT %s FROM jsonb_array_elements(%%s::text::jsonb) AS r)" % ", ".join(
        "(r->>%d)::%s AS %s" % (i, _SQL_TYPES[c.kind], c.name) for i, c in enumerate(columns))


INSERT_SQL = "INSERT INTO %s (%s) SELECT * FROM %s AS u" % (JOBS, SELECT_COLUMNS, _rows(COLUMNS))
_UPDATE_SOURCE = MUTABLE_COLUMNS + (COLUMNS[0],)  # the mutable columns, then the job id
UPDATE_SQL = "UPDATE %s AS j SET %s FROM %s AS u WHERE j.job_id = u.job_id" % (
    JOBS, ", ".join("%s = u.%s" % (c.name, c.name) for c in MUTABLE_COLUMNS), _rows(_UPDATE_SOURCE))
# PostgreSQL's jsonb refuses \u0000 in a string (and text cannot hold NUL): the batch is
# written again through ``storable``.
_UNTRANSLATABLE = "22P05"
PURGE_SQL = "DELETE FROM %s WHERE job_id = ANY(%%s::text[])" % JOBS
# A workflow's row goes with its jobs (before them: found through them).
PURGE_FLOWS_SQL = ("DELETE FROM jobmesh_workflows WHERE workflow_id IN (SELECT workflow_id FROM %s"
                   " WHERE job_id = ANY(%%s::text[]) AND workflow_id IS NOT NULL)" % JOBS)
WORKFLOWS_SQL = "INSERT INTO jobmesh_workflows (workflow_id, body) SELECT * FROM unnest(%s::text[], %s::text[])"
TASK_TYPES_SQL = ("INSERT INTO jobmesh_task_types (name, first_seen) SELECT * FROM unnest(%s::text[], %s::bigint[])"
                  " ON CONFLICT (name) DO NOTHING")
SCHEDULES_DELETE_SQL = "DELETE FROM jobmesh_schedules WHERE name = ANY(%s::text[])"
SCHEDULES_PUT_SQL = ("INSERT INTO jobmesh_schedules (name, body) SELECT * FROM unnest(%s::text[], %s::text[])"
                     " ON CONFLICT (name) DO UPDATE SET body = EXCLUDED.body")
LIMITS_DELETE_SQL = "DELETE FROM jobmesh_limits WHERE task_type = ANY(%s::text[])"
LIMITS_PUT_SQL = ("INSERT INTO jobmesh_limits (task_type, body) SELECT * FROM unnest(%s::text[], %s::text[])"
                  " ON CONFLICT (task_type) DO UPDATE SET body = EXCLUDED.body")
TASK_DEFAULTS_PUT_SQL = ("INSERT INTO jobmesh_task_defaults (name, body) SELECT * FROM unnest(%s::text[], %s::text[])"
                         " ON CONFLICT (name) DO UPDATE SET body = EXCLUDED.body")
FENCE_SQL = "SELECT jobmesh_fence(%s)"
KEY_INDEX = COLUMN_NAMES.index("idempotency_key")

FENCE_FUNCTION = """CREATE OR REPLACE FUNCTION jobmesh_fence(expected bigint) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM jobmesh_leader WHERE id = 1 AND epoch = expected FOR SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'leadership lost: epoch % is no longer the current one', expected
            USING ERRCODE = 'FENCE_SQLSTATE';
    END IF;
END $$""".replace("FENCE_SQLSTATE", FENCE_SQLSTATE)
# The numbered migrations applied (base.SCHEMA_VERSION): one row each, when it was applied.
MIGRATIONS_TABLE = ("CREATE TABLE IF NOT EXISTS jobmesh_migrations (version bigint PRIMARY KEY,"
                    " applied_at bigint NOT NULL)")
# What each migration creates besides its columns (``Column.added``), each statement
# harmless when its object exists: a schema from before the migrations table runs them
# all. Migration 1 creates the jobs table as it is now on a new schema.
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: ("CREATE TABLE IF NOT EXISTS %s (%s)" % (JOBS, ", ".join("%s %s" % (c.name, column_sql(c)) for c in COLUMNS)),
        "CREATE UNIQUE INDEX IF NOT EXISTS jobmesh_jobs_idempotency_key ON %s (idempotency_key)"
        " WHERE idempotency_key IS NOT NULL" % JOBS,
        "CREATE TABLE IF NOT EXISTS jobmesh_probe (x text)",  # always empty: the storage probe's
        "CREATE SEQUENCE IF NOT EXISTS jobmesh_epoch",
        # One row: the epoch of the current leader, and its session timeout (how long a
        # standby lets its session sit idle). Recreated by the next leader if deleted; its
        # epochs come from the sequence, so they only grow.
        "CREATE TABLE IF NOT EXISTS jobmesh_leader (id int PRIMARY KEY CHECK (id = 1), epoch bigint NOT NULL,"
        " timeout_millis bigint NOT NULL)",
        FENCE_FUNCTION),
    4: ("CREATE TABLE IF NOT EXISTS jobmesh_task_types (name text PRIMARY KEY, first_seen bigint NOT NULL)",),
    7: ("CREATE UNIQUE INDEX IF NOT EXISTS jobmesh_jobs_seq ON %s (seq)" % JOBS,
        "CREATE INDEX IF NOT EXISTS jobmesh_jobs_state_seq ON %s (state, seq)" % JOBS,
        "CREATE INDEX IF NOT EXISTS jobmesh_jobs_task_type_seq ON %s (task_type, seq)" % JOBS),
    8: ("CREATE TABLE IF NOT EXISTS jobmesh_schedules (name text PRIMARY KEY, body text NOT NULL)",),
    10: (expiry_index("jobmesh_jobs_expiry", JOBS),
         "CREATE TABLE IF NOT EXISTS jobmesh_task_defaults (name text PRIMARY KEY, body text NOT NULL)"),
    11: ("CREATE TABLE IF NOT EXISTS jobmesh_limits (task_type text PRIMARY KEY, body text NOT NULL)",),
    12: ("CREATE TABLE IF NOT EXISTS jobmesh_workflows (workflow_id text PRIMARY KEY, body text NOT NULL)",
         "CREATE INDEX IF NOT EXISTS jobmesh_jobs_workflow ON %s (workflow_id, seq) WHERE workflow_id IS NOT NULL"
         % JOBS),
}
# The session holding the leadership lock (the lock's key: LEAD_LOCK, the schema's oid).
_HOLDER_FROM = " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
_HOLDER_WHERE = (" WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s::oid AND l.objid = %s::oid"
                 " AND l.objsubid = 2"
                 " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())")
# The holder, ended if it has been idle (not running a statement) for longer than the
# leader's own session timeout (its keepalive runs four times as often), or the given
# milliseconds if the epoch row is gone.
STALE_HOLDER_SQL = ("SELECT pg_terminate_backend(a.pid)" + _HOLDER_FROM + _HOLDER_WHERE +
                    " AND a.state LIKE 'idle%%' AND a.state_change < now() - make_interval(secs => COALESCE("
                    "(SELECT timeout_millis FROM jobmesh_leader WHERE id = 1), %s) / 1000.0)")
# This session's role, the holder's, and whether STALE_HOLDER_SQL can end the holder as
# PostgreSQL decides it: pg_terminate_backend may be run; a superuser ends any session,
# others no superuser's; the holder's state is seen and its session ended with the
# privileges of its role (a role has its own), or of pg_read_all_stats and pg_signal_backend.
HOLDER_ROLE_SQL = ("SELECT current_user, r.rolname, r.rolsuper,"
                   " (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)"
                   " OR (NOT r.rolsuper AND (pg_has_role(r.oid, 'USAGE')"
                   " OR (pg_has_role('pg_read_all_stats', 'USAGE') AND pg_has_role('pg_signal_backend', 'USAGE'))))"
                   " AND (SELECT bool_and(has_function_privilege(p.oid, 'EXECUTE')) FROM pg_proc p"
                   " WHERE p.proname = 'pg_terminate_backend' AND p.pronamespace = 'pg_catalog'::regnamespace)"
                   + _HOLDER_FROM + " JOIN pg_roles r ON r.oid = a.usesysid" + _HOLDER_WHERE)
# A new leader's epoch (and its session timeout); %s is the timeout in milliseconds.
BUMP_SQL = ("INSERT INTO jobmesh_leader (id, epoch, timeout_millis) VALUES (1, nextval('jobmesh_epoch'), %s)"
            " ON CONFLICT (id) DO UPDATE SET epoch = EXCLUDED.epoch, timeout_millis = EXCLUDED.timeout_millis"
            " RETURNING epoch")

# Errors that end the session or say it has ended: admin shutdown, crash shutdown, cannot
# connect now, the idle timeouts, and every connection exception (class 08).
_SESSION_GONE = {"57P01", "57P02", "57P03", "57P05", "25P03"}
_REASONS = {"53100": "disk full", "25006": "database is read-only", "53200": "out of memory",
            "53300": "too many connections", "53400": "configuration limit exceeded"}


class KeyFilter:
    """A Bloom filter of idempotency keys: two positions per key from its MD5 (which the
    server computes at build, so no key string crosses the wire then), at least 40 bits
    per key when built. ``key in filter`` is False only for a key never added."""

    def __init__(self, expected: int) -> None:
        bits = 1 << 23
        while bits < 40 * expected:  # room for as many keys again before the rate grows
            bits <<= 1
        self.mask = bits - 1
        self.bits = bytearray(bits >> 3)

    def add_digest(self, digest: bytes) -> None:
        mask, bits = self.mask, self.bits
        a = int.from_bytes(digest[:8], "little") & mask
        b = int.from_bytes(digest[8:], "little") & mask
        bits[a >> 3] |= 1 << (a & 7)
        bits[b >> 3] |= 1 << (b & 7)

    def add(self, key: str) -> None:
        self.add_digest(hashlib.md5(key.encode()).digest())

    def __contains__(self, key: str) -> bool:
        digest = hashlib.md5(key.encode()).digest()
        mask, bits = self.mask, self.bits
        a = int.from_bytes(digest[:8], "little") & mask
        b = int.from_bytes(digest[8:], "little") & mask
        return bool(bits[a >> 3] & (1 << (a & 7))) and bool(bits[b >> 3] & (1 << (b & 7)))


class Later:
    """A read of one job on the deferred reader (``Read``)."""

    __slots__ = ("reader", "sql", "param", "_job", "_error", "_done", "_callbacks", "_rows")

    def __init__(self, reader: "_DeferredReader", sql: bytes, param: str) -> None:
        self.reader = reader
        self.sql = sql
        self.param = param
        self._job: Job | None = None
        self._error: Exception | None = None
        self._done = False
        self._callbacks: list[Callable[[], None]] = []
        self._rows: list[tuple[Any, ...]] = []

    def ready(self) -> bool:
        if not self._done:
            self.reader.pump()
        return self._done

    def result(self) -> Job | None:
        assert self._done, "result() of a read still in flight"
        if self._error is not None:
            raise self.reader.typed(self._error)
        return self._job

    def then(self, callback: Callable[[], None]) -> None:
        if self._done:
            callback()
        else:
            self._callbacks.append(callback)

    def finish(self, job: Job | None, error: Exception | None) -> None:
        self._job, self._error, self._done = job, error, True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


class GreenRead(Generic[T]):
    """A read on a greenlet of its own (``PostgresStore.later``): the core goes on while
    the synchronous reader waits for its round trip (green)."""

    __slots__ = ("_greenlet",)

    def __init__(self, read: Callable[[], T]) -> None:
        self._greenlet = gevent.spawn(_captured, read)

    def ready(self) -> bool:
        return bool(self._greenlet.ready())

    def result(self) -> T:
        assert self._greenlet.ready(), "result() of a read still in flight"
        value, error = self._greenlet.value
        if error is not None:
            raise error
        return cast(T, value)

    def then(self, callback: Callable[[], None]) -> None:
        if self._greenlet.ready():
            callback()
        else:
            self._greenlet.rawlink(lambda _greenlet: callback())


def _captured(read: Callable[[], T]) -> tuple[Any, Exception | None]:
    """``read()``'s value or exception (a greenlet that raised would print a traceback)."""
    try:
        return read(), None
    except Exception as exc:  # raised to the reader by result()
        return None, exc


def _decoder(column: Column) -> Callable[[bytes | None], Any]:
    if column.kind is Kind.INT64:
        return lambda v: None if v is None else int(v)
    return lambda v: None if v is None else v.decode()


_DECODERS = [_decoder(c) for c in COLUMNS]


class _DeferredReader:
    """libpq's non-blocking interface on a connection of its own: reads queued, one in
    flight. ``pump`` consumes what has arrived and never waits; on the hub an I/O watcher
    calls it when the socket is readable."""

    def __init__(self, conninfo: str, connect: Callable[..., psycopg.Connection],
                 typed: Callable[[BaseException], BaseException]) -> None:
        self.typed = typed  # a failed read's error as the seam raises it (``PostgresStore.typed``)
        self.conn = connect(conninfo)  # connected by psycopg (green); used through its libpq handle only
        self.pg = self.conn.pgconn
        self.pg.nonblocking = 1
        self.queue: deque[Later] = deque()
        self.watcher: Any = None
        self.writing: Any = None
        self.error: Exception | None = None

    def read(self, sql: bytes, param: str) -> Later:
        later = Later(self, sql, param)
        if self.error is not None:
            later.finish(None, self.error)
            return later
        self.queue.append(later)
        if len(self.queue) == 1:
            self._send()
        return later

    def _send(self) -> None:
        later = self.queue[0]
        try:
            self.pg.send_query_params(later.sql, [later.param.encode()])
            self._flush()
        except Exception as exc:
            self._fail(exc)
            return
        if self.watcher is None:
            self.watcher = gevent.get_hub().loop.io(self.pg.socket, 1)
        if not self.watcher.active:
            self.watcher.start(self.pump)

    def _flush(self) -> None:
        if self.pg.flush() == 0:
            if self.writing is not None:
                self.writing.stop()
            return
        if self.writing is None:
            self.writing = gevent.get_hub().loop.io(self.pg.socket, 2)
        self.writing.start(self._flush_safely)

    def _flush_safely(self) -> None:
        try:
            self._flush()
        except Exception as exc:
            self._fail(exc)

    def pump(self) -> None:
        """Finish every read whose reply has arrived; send the next. Never waits."""
        pg = self.pg
        while self.queue:
            try:
                pg.consume_input()
                while True:
                    if pg.is_busy():
                        return
                    res = pg.get_result()
                    if res is None:
                        break
                    if res.status == pq.ExecStatus.TUPLES_OK:
                        self.queue[0]._rows = [tuple(d(res.get_value(r, i)) for i, d in enumerate(_DECODERS))
                                               for r in range(res.ntuples)]
                    elif self.queue[0]._error is None:
                        # The server refused this statement (a statement timeout, a cancel):
                        # this read fails, and the connection serves the next one.
                        self.queue[0]._error = psycopg.errors.error_from_result(res)
            except Exception as exc:
                self._fail(exc)
                return
            later = self.queue.popleft()
            rows, later._rows = later._rows, []
            if self.queue:
                self._send()
            error = later._error
            later.finish(read_row(rows[0]) if rows and error is None else None, error)
        self._stop_watching()

    def _fail(self, exc: Exception) -> None:
        """The connection failed: every queued read fails with ``exc``, and every later one."""
        self.error = exc
        self._stop_watching()
        queue, self.queue = self.queue, deque()
        for later in queue:
            later.finish(None, exc)

    def _stop_watching(self) -> None:
        for watcher in (self.watcher, self.writing):
            if watcher is not None:
                watcher.stop()

    def close(self) -> None:
        for watcher in (self.watcher, self.writing):
            if watcher is not None:
                watcher.close()
        self.watcher = self.writing = None
        self.conn.close()


class PostgresStore:
    """The ``Store`` on PostgreSQL. ``url`` is any libpq connection string or URL.

    ``session_timeout_millis`` bounds how long a leader that stopped answering keeps the
    lock (its session's timeouts and keepalives).

    Raises ``psycopg.Error`` if the database cannot be reached or the schema not created.
    """

    shared = True

    def __init__(self, url: str, session_timeout_millis: int = DEFAULT_SESSION_TIMEOUT_MILLIS) -> None:
        self.url = url
        self.timeout_millis = session_timeout_millis
        self.migrated: list[str] = []
        self.migrations: list[int] = []
        self._epoch: int | None = None
        self._lost: BaseException | None = None
        self._writer: gevent.Greenlet | None = None
        self._jobs: gevent.queue.Queue = gevent.queue.Queue()
        self._keys: KeyFilter | None = None
        self._deferred: _DeferredReader | None = None
        seconds = max(1, session_timeout_millis // 3000)
        # Each connection's client side notices a vanished server as the writer's server
        # side notices a vanished client: keepalives, and a bound on unacknowledged data
        # (a reader without them could hold a listing, and the core, for TCP's ~15 minutes).
        network: dict[str, Any] = dict(keepalives=1, keepalives_idle=seconds, keepalives_interval=seconds, keepalives_count=3,
                       tcp_user_timeout=session_timeout_millis)
        self.conn = self._connect(url, **network)
        try:
            self.reader = self._connect(url, **network)
            self._create_schema()
            self._schema_oid = int(self.conn.execute(
                "SELECT oid FROM pg_namespace WHERE nspname = current_schema()").fetchone()[0])  # type: ignore[index]
            self._keys_usable = self.conn.execute("SHOW server_encoding").fetchone() == ("UTF8",)
            self._deferred = _DeferredReader(url, partial(self._connect, **network), self.typed)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _connect(url: str, **options: Any) -> psycopg.Connection:
        conn = psycopg.connect(url, autocommit=True, **options)
        conn.adapters.register_dumper(int, Int8Dumper)  # every integer a bigint: one prepared type per statement
        return conn

    # ---- schema -------------------------------------------------------------------

    def _version(self) -> int | None:
        """The last migration applied; None for a schema from before the migrations table
        (in the current schema, whatever later schemas of the search path hold)."""
        c = self.conn
        if c.execute("SELECT current_schema()").fetchone() == (None,):
            raise psycopg.ProgrammingError("no schema to create the tables in: the search path names none that exists")
        row = c.execute("SELECT to_regclass(format('%I.%I', current_schema(), 'jobmesh_migrations'))"
                        " IS NULL").fetchone()
        if row == (True,):
            return None
        try:
            row = c.execute("SELECT COALESCE(MAX(version), 0) FROM jobmesh_migrations").fetchone()
        except psycopg.errors.InsufficientPrivilege:
            # A role that may not read the table could apply no migration either: the
            # schema is taken as it is (such a role may stand by; leading, its reads fail).
            return SCHEMA_VERSION
        return int(row[0]) if row else 0

    def _create_schema(self) -> None:
        """Apply the migrations the schema lacks, in order, in one transaction, one
        coordinator at a time; writes nothing when the schema is current (a read-only
        database still opens)."""
        version = self._version()
        if version == SCHEMA_VERSION:
            return
        c = self.conn
        with c.transaction():
            c.execute("SELECT pg_advisory_xact_lock(%s::int, hashtext(current_schema()))", (SCHEMA_LOCK,))
            version = self._version() or 0  # again, under the lock
            if version > SCHEMA_VERSION:
                raise NewerSchema("the database's schema %s" % (c.execute("SELECT current_schema()").fetchone() or ("",))[0],
                                  version)
            c.execute(MIGRATIONS_TABLE.encode())
            have = {row[0] for row in c.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema()"
                " AND table_name = %s", (JOBS,))}
            for number in range(version + 1, SCHEMA_VERSION + 1):
                for column in added_in(number) if have else ():  # first: an index may be over them
                    if column.name not in have:
                        c.execute(("ALTER TABLE %s ADD COLUMN IF NOT EXISTS %s %s"
                                   % (JOBS, column.name, column_sql(column))).encode())
                        self.migrated.append(column.name)
                for sql in MIGRATIONS.get(number, ()):
                    c.execute(sql.encode())
                have = have or set(COLUMN_NAMES)  # a new schema: created whole by migration 1
                c.execute("INSERT INTO jobmesh_migrations (version, applied_at) VALUES (%s,"
                          " (extract(epoch FROM now()) * 1000)::bigint)", (number,))
                self.migrations.append(number)

    # ---- leadership -----------------------------------------------------------------

    def lead(self, standing_by: Callable[[], None]) -> None:
        """Return once this store leads: its writer session holds the schema's advisory
        lock and has bumped the epoch. If another session holds the lock, call
        ``standing_by()`` once, then wait (green) for it. Raises ``LeadershipLost`` when
        the session ends meanwhile, ``StorageFault`` for a refused statement."""
        with self._faults():
            self._lead(standing_by)

    def _lead(self, standing_by: Callable[[], None]) -> None:
        c = self.conn
        key = (LEAD_LOCK, _int32(self._schema_oid))
        if c.execute("SELECT pg_try_advisory_lock(%s::int, %s::int)", key).fetchone() != (True,):
            self._warn_if_holder_unending()
            standing_by()
            self._wait_for_lock(key)
        row = c.execute(BUMP_SQL, (self.timeout_millis,)).fetchone()
        assert row is not None
        self._epoch = int(row[0])
        ms = self.timeout_millis
        seconds = max(1, ms // 3000)
        c.execute("SELECT set_config('idle_in_transaction_session_timeout', %s, false),"
                  " set_config('idle_session_timeout', %s, false), set_config('tcp_user_timeout', %s, false),"
                  " set_config('tcp_keepalives_idle', %s, false), set_config('tcp_keepalives_interval', %s, false),"
                  " set_config('tcp_keepalives_count', '3', false)",
                  (str(ms), str(ms), str(ms), str(seconds), str(seconds)))
        self._writer = gevent.spawn(self._write_loop)

    def _warn_if_holder_unending(self) -> None:
        """Standing by: say so when this role cannot end the leader's session, which a
        frozen leader's own timeouts do not always end (``_wait_for_lock``)."""
        try:
            row = self.conn.execute(HOLDER_ROLE_SQL, (LEAD_LOCK, self._schema_oid)).fetchone()
        except psycopg.Error as exc:
            if self._session_gone(exc):  # the session: the caller's to handle
                raise
            log.info("could not tell whether this role can end the leader's session: %s", _reason(exc))
            return
        if row is None or row[3]:
            return
        log.warning("database role %s cannot end the session of the leading coordinator (role %s%s): if that leader"
                    " freezes, only PostgreSQL's own timeouts end its session, which do not cover every freeze, and"
                    " this coordinator stands by until then; run the coordinators as one role that is no superuser"
                    " (docs/SCALING.md)", row[0], row[1], ", a superuser" if row[2] else "")

    def _wait_for_lock(self, key: tuple[int, int]) -> None:
        """Wait for the lock in slices of ``lock_timeout``; after each, end the holder's
        session if it has been idle longer than the session timeout.

        The holder's own idle timeout does not always cover a frozen leader: the server
        arms it only after a Sync or a simple query, and psycopg ends a pipeline with a
        Flush after its Sync. A healthy leader runs a statement at least every quarter of
        the timeout, so only a leader that stopped answering is ended. Where this role
        may not see or end the holder's session, its own timeouts are what remains."""
        c = self.conn
        c.execute("SELECT set_config('lock_timeout', %s, false)", (str(max(100, self.timeout_millis // 4)),))
        while True:
            try:
                c.execute("SELECT pg_advisory_lock(%s::int, %s::int)", key)
                break
            except psycopg.errors.LockNotAvailable:
                pass
            try:
                c.execute(STALE_HOLDER_SQL, (LEAD_LOCK, self._schema_oid, self.timeout_millis))
            except psycopg.errors.InsufficientPrivilege:
                pass
        c.execute("RESET lock_timeout")

    @property
    def epoch(self) -> int | None:
        """The epoch this store leads in (None before ``lead``)."""
        return self._epoch

    def _session_gone(self, exc: BaseException) -> bool:
        """Whether ``exc`` means the writer session is gone, the lock lost, or the fence
        failed: this store then commits nothing more."""
        if isinstance(exc, LeadershipLost):
            return True
        if not isinstance(exc, psycopg.Error):
            return False
        state = exc.sqlstate
        if state == FENCE_SQLSTATE or state in _SESSION_GONE or (state or "").startswith("08"):
            return True
        if self.conn.closed or self.conn.broken:
            return True
        return isinstance(exc, psycopg.OperationalError) and state is None

    def typed(self, exc: BaseException) -> BaseException:
        """``exc`` as the seam raises it: ``LeadershipLost`` (the writer session is gone,
        the lock lost, the fence failed), ``StorageFault`` (a database error with the
        writer session intact: disk full, read-only, a statement refused), or ``exc``
        itself (a misuse of the driver, a bug). A new exception's cause is ``exc``."""
        if isinstance(exc, (LeadershipLost, StorageFault)):
            return exc
        new: BaseException
        if self._session_gone(exc):
            new = lost(exc, _reason(exc))
        elif isinstance(exc, OSError) or (isinstance(exc, psycopg.Error) and not (
                isinstance(exc, (psycopg.InterfaceError, psycopg.ProgrammingError)) and exc.sqlstate is None)):
            new = StorageFault(_reason(exc))
        else:
            return exc
        new.__cause__ = exc
        return new

    @contextmanager
    def _faults(self) -> Iterator[None]:
        """Raise the driver's errors as ``typed`` says."""
        try:
            yield
        except (psycopg.Error, OSError) as exc:
            new = self.typed(exc)
            if new is exc:
                raise
            raise new from exc

    # ---- writes ------------------------------------------------------------------

    def write(self, batch: Batch) -> None:
        """Apply one batch in one transaction, in one round trip (see the module docstring)."""
        if self._lost is not None:
            raise LeadershipLost("this coordinator lost leadership: %s" % self._lost)
        if self._epoch is None:
            raise LeadershipLost("this store does not lead (lead() first)")
        inserts, updates, task_types, purges, schedules, limits, task_defaults, workflows = batch
        keys = self._keys
        if keys is not None:
            for row in inserts:
                if row[KEY_INDEX] is not None:
                    keys.add(storable(row[KEY_INDEX]))
        statements: list[tuple[str, Any]] = []
        if purges:  # first: a new job may take a purged key
            statements.append((PURGE_FLOWS_SQL, (list(purges),)))
            statements.append((PURGE_SQL, (list(purges),)))
        if workflows:
            statements.append((WORKFLOWS_SQL, [list(column) for column in zip(*workflows)]))
        if inserts:
            statements.append((INSERT_SQL, (_json_rows(inserts),)))
        if updates:
            statements.append((UPDATE_SQL, (_json_rows(updates),)))
        if task_types:
            statements.append((TASK_TYPES_SQL, [list(column) for column in zip(*task_types)]))
        for rows, delete_sql, put_sql in ((schedules, SCHEDULES_DELETE_SQL, SCHEDULES_PUT_SQL),
                                          (limits, LIMITS_DELETE_SQL, LIMITS_PUT_SQL)):
            if rows:
                latest = dict(rows)
                gone = [name for name, body in latest.items() if body is None]
                put = [(name, body) for name, body in latest.items() if body is not None]
                if gone:
                    statements.append((delete_sql, (gone,)))
                if put:
                    statements.append((put_sql, [list(column) for column in zip(*put)]))
        if task_defaults:
            statements.append((TASK_DEFAULTS_PUT_SQL, [list(column) for column in zip(*dict(task_defaults).items())]))
        with self._faults():
            try:
                self._transaction(statements)
            except psycopg.DataError as exc:
                if exc.sqlstate not in (None, _UNTRANSLATABLE):  # the server's: nothing to mend here
                    raise
                # psycopg refused a value before sending it, or the server a row's JSON:
                # text holding NUL, which PostgreSQL's text cannot (see storable). Written
                # again without.
                self._transaction([(sql, _mended(params)) for sql, params in statements])

    def _transaction(self, statements: list[tuple[str, Any]]) -> None:
        """BEGIN, the fence, ``statements``, COMMIT: one pipeline, one round trip."""
        c = self.conn
        try:
            with c.pipeline(), c.cursor() as cur:
                cur.execute(b"BEGIN")
                cur.execute(FENCE_SQL, (self._epoch,))
                for sql, params in statements:
                    cur.execute(sql, params)
                cur.execute(b"COMMIT")
        except BaseException as exc:
            if self._session_gone(exc):
                self._lost = exc
            elif not c.closed and c.info.transaction_status != pq.TransactionStatus.IDLE:
                try:
                    c.execute(b"ROLLBACK")
                except psycopg.Error as again:
                    if self._session_gone(again):
                        self._lost = again
            raise

    def commit(self, batch: Batch) -> Outcome:
        """``write`` on the store's commit greenlet, after the commits before it."""
        return self._submit(self.write, batch)

    def commit_probe(self) -> Outcome:
        return self._submit(self.probe)

    def _submit(self, call: Callable[..., None], *args: Any) -> Outcome:
        done = gevent.event.AsyncResult()
        if self._writer is None:
            done.set(outcome_of(self._not_leading))
        else:
            self._jobs.put((done, call, args))
        return cast(Outcome, done)

    def _not_leading(self) -> None:
        raise LeadershipLost("this store does not lead (lead() first)" if self._lost is None
                             else "this coordinator lost leadership: %s" % self._lost)

    def _write_loop(self) -> None:
        """The commit greenlet: queued writes in order; a keepalive when idle."""
        interval = self.timeout_millis / 1000.0 / KEEPALIVE_FRACTION
        while True:
            try:
                item = self._jobs.get(timeout=interval)
            except gevent.queue.Empty:
                self._keepalive()
                continue
            if item is None:
                return
            done, call, args = item
            done.set(outcome_of(call, *args))

    def _keepalive(self) -> None:
        """A cheap statement so that a healthy leader's session is never idle for long;
        it also notices an epoch moved under it (the next commit then fails at once)."""
        if self._lost is not None:
            return
        try:
            row = self.conn.execute(b"SELECT epoch FROM jobmesh_leader WHERE id = 1").fetchone()
        except psycopg.Error as exc:
            if self._session_gone(exc):
                self._lost = exc
            return
        if row is None or row[0] != self._epoch:
            self._lost = LeadershipLost("the epoch moved from %s to %s" % (self._epoch, None if row is None else row[0]))

    def probe(self) -> None:
        """A write that changes nothing and needs what a batch needs (the fence, a row
        written); raises what a commit would."""
        if self._lost is not None or self._epoch is None:
            self._not_leading()
        with self._faults():
            self._transaction([("INSERT INTO jobmesh_probe (x) VALUES ('')", None),
                               ("DELETE FROM jobmesh_probe", None)])

    def reopen(self) -> None:
        """Nothing: the writer session holds the leadership, and the readers reconnect
        with it (a new leader's recovery)."""

    # ---- reads -------------------------------------------------------------------

    def load_active(self) -> Iterator[Job]:
        """Every non-terminal job, for recovery; also builds the idempotency key filter
        (once the last job has been taken).

        Read in slices of ``RECOVERY_SLICE`` rows through a server-side cursor, and
        handed over one slice at a time: other greenlets run after the recovery has
        taken in each slice (decoded here, then whatever the caller does with it, such
        as the core building its table). The writer's keepalive must reach the server
        while a large recovery runs, or the new leader's own idle timeout (or a standby,
        judging it frozen) would end its session before it ever served."""
        with self._faults():
            with self.reader.transaction():
                with self.reader.cursor(name="jobmesh_active") as cur:
                    cur.execute("SELECT %s FROM %s WHERE state = ANY(%%s)" % (SELECT_COLUMNS, JOBS),
                                (list(ACTIVE_STATES),))
                    while True:
                        rows = cur.fetchmany(RECOVERY_SLICE)
                        if not rows:
                            break
                        yield from map(read_row, rows)
                        # A short sleep, not sleep(0): that would switch greenlets without
                        # running the loop's timers, and the keepalive waits on one.
                        gevent.sleep(YIELD_SECONDS)
            self._keys = self._key_filter() if self._keys_usable else None

    def _key_filter(self) -> KeyFilter:
        """A filter holding every stored key: their MD5s, computed by the server and
        streamed (a server-side cursor), so no key string is held in memory."""
        with self.reader.transaction():
            count = self.reader.execute(
                "SELECT count(*) FROM %s WHERE idempotency_key IS NOT NULL" % JOBS).fetchone()
            keys = KeyFilter(int(count[0]) if count else 0)
            with self.reader.cursor(name="jobmesh_keys") as cur:
                cur.itersize = 20_000
                cur.execute("SELECT decode(md5(idempotency_key), 'hex') FROM %s"
                            " WHERE idempotency_key IS NOT NULL" % JOBS)
                add = keys.add_digest
                for (digest,) in cur:
                    add(digest)
        return keys

    def _all(self, sql: str | bytes, params: Any = None) -> list[Any]:
        """The rows of a query on the synchronous reader (start-up, recovery, tests)."""
        with self._faults():
            return self.reader.execute(sql, params).fetchall()

    def load_task_types(self) -> list[str]:
        return [row[0] for row in self._all("SELECT name FROM jobmesh_task_types ORDER BY name")]

    def load_schedules(self) -> list[tuple[str, str]]:
        return [(row[0], row[1]) for row in self._all("SELECT name, body FROM jobmesh_schedules ORDER BY name")]

    def load_limits(self) -> list[tuple[str, str]]:
        return [(row[0], row[1]) for row in self._all("SELECT task_type, body FROM jobmesh_limits ORDER BY task_type")]

    def load_task_defaults(self) -> list[tuple[str, str]]:
        return [(row[0], row[1]) for row in self._all("SELECT name, body FROM jobmesh_task_defaults ORDER BY name")]

    def max_seq(self) -> int:
        return int(self._all("SELECT COALESCE(MAX(seq), 0) FROM %s" % JOBS)[0][0])

    def count(self) -> int:
        return int(self._all("SELECT count(*) FROM %s" % JOBS)[0][0])

    def get(self, job_id: str) -> Job | None:
        rows = self._all("SELECT %s FROM %s WHERE job_id = %%s" % (SELECT_COLUMNS, JOBS), (storable(job_id),))
        return read_row(rows[0]) if rows else None

    def find_by_key(self, key: str) -> Job | None:
        rows = self._all("SELECT %s FROM %s WHERE idempotency_key = %%s" % (SELECT_COLUMNS, JOBS), (storable(key),))
        return read_row(rows[0]) if rows else None

    _BY_ID = ("SELECT %s FROM %s WHERE job_id = $1" % (SELECT_COLUMNS, JOBS)).encode()
    _BY_KEY = ("SELECT %s FROM %s WHERE idempotency_key = $1" % (SELECT_COLUMNS, JOBS)).encode()

    def read_later(self, job_id: str | None = None, key: str | None = None) -> Read[Job | None]:
        """On the deferred reader; a key the filter has never seen is answered at once."""
        if job_id is None:
            assert key is not None, "read_later needs a job id or a key"
            key = storable(key)
            if self._keys is not None and key not in self._keys:
                return Done(lambda: None)
        assert self._deferred is not None
        if job_id is not None:
            return self._deferred.read(self._BY_ID, storable(job_id))
        assert key is not None
        return self._deferred.read(self._BY_KEY, key)

    def later(self, read: Callable[[], T]) -> Read[T]:
        """On a greenlet of its own: the synchronous reader's round trips never hold the
        core (psycopg serializes the greenlets that share the reader)."""
        return GreenRead(read)

    def list_page(self, limit: int, state: str | None, before: int | None,
                  task_type: str | None = None) -> list[tuple[int, Job]]:
        sql, params = page_query(JOBS, "%s", limit, state, before, task_type)
        return [(job.seq, job) for job in map(read_row, self._all(sql.encode(), storable(params)))]

    PURGE_WALK_SQL = ("SELECT seq, job_id, idempotency_key, state, updated_at, result_ttl, workflow_id FROM %s"
                      " WHERE seq > %%s ORDER BY seq LIMIT %%s" % JOBS)
    FLOW_JOBS_SQL, FLOW_SQL, FLOW_ROWS_SQL = workflow_queries(JOBS, "jobmesh_workflows", "%s")

    def purgeable(self, after: int, cutoff_millis: int, limit: int,
                  own_ttl: bool = True) -> tuple[list[tuple[str, str | None]], int]:
        """As SQLite's: the walk in sequence order (see ``Store.purgeable``)."""
        return purge_walk(self._all(self.PURGE_WALK_SQL, (after, limit)), after, cutoff_millis, limit, own_ttl,
                          lambda flow: self._all(self.FLOW_JOBS_SQL, (flow,)))

    def load_workflow(self, workflow_id: str) -> tuple[str, list[Job]] | None:
        """As SQLite's (``Store.load_workflow``)."""
        body = self._all(self.FLOW_SQL, (storable(workflow_id),))
        if not body:
            return None
        return body[0][0], [read_row(row) for row in self._all(self.FLOW_ROWS_SQL, (storable(workflow_id),))]

    EXPIRED_SQL = expired_query(JOBS, "%s")

    def expired(self, now_millis: int, limit: int) -> list[tuple[str, str | None]]:
        """As SQLite's: from the expiry index (``Store.expired``)."""
        return [(row[0], row[1]) for row in self._all(self.EXPIRED_SQL, (now_millis, limit))]

    def close(self) -> None:
        """Stop the commit greenlet (after the writes queued) and close the connections;
        closing the writer releases the leadership lock."""
        if self._writer is not None:
            self._jobs.put(None)
            self._writer.join(10)
            self._writer.kill(block=False)
            self._writer = None
        if self._deferred is not None:
            self._deferred.close()
            self._deferred = None
        for conn in (getattr(self, "reader", None), self.conn):
            if conn is not None:
                try:
                    conn.close()
                except psycopg.Error:
                    pass


def _reason(exc: BaseException) -> str:
    """A failure in a few words: "disk full", "database is read-only", ..."""
    state = getattr(exc, "sqlstate", None)
    return _REASONS[state] if state in _REASONS else first_line(exc)


def storable(value: Any) -> Any:
    """``value`` (text, or lists and tuples of values) as PostgreSQL's text can hold it: a
    NUL character (which a client's JSON may carry as ``\\u0000``) becomes U+FFFD. SQLite
    keeps it; on PostgreSQL keys that differ only there are one key."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, (list, tuple)):
        return [storable(v) for v in value]
    return value


def _json_rows(rows: list[tuple[Any, ...]]) -> str:
    """Rows as the JSON parameter ``_rows`` takes apart; anything but tuples is the
    program's bug (``TypeError``), never a row the database refuses."""
    if not all(type(row) is tuple for row in rows):
        raise TypeError("a batch's rows must be tuples")
    return ujson.dumps(rows, ensure_ascii=False, escape_forward_slashes=False)


def _mended(params: Any) -> Any:
    """A statement's parameters with NUL replaced (``storable``), inside JSON rows too."""
    return [ujson.dumps(storable(ujson.loads(p)), ensure_ascii=False, escape_forward_slashes=False)
            if isinstance(p, str) and p[:1] == "[" else storable(p) for p in params]


def _int32(n: int) -> int:
    """An oid (unsigned 32-bit) as the signed int the two-int advisory lock takes."""
    return n - (1 << 32) if n >= (1 << 31) else n
