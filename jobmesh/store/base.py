"""The storage seam: what the core and the runtime ask of a job store.

``Store`` is the whole interface; ``sqlite.py`` is its first implementation, and every
implementation passes ``tests/unit/test_store_contract.py``. The core and the runtime
never see SQL, a rowid, a driver's exception type or the thread a write runs on:

* Writes come as one ``Batch`` per core batch, applied in one transaction (group
  commit). ``write`` applies it on the calling thread (start-up, tests); ``commit``
  applies it where the store runs its writes (SQLite: one thread off the hub) and
  returns an ``Outcome`` the runtime waits on, or polls, without blocking the hub.
* A call that fails for a storage reason (disk full, read-only, locked, unreachable)
  raises ``StorageFault``, whose ``reason`` is the short words clients see: the runtime
  serves reads, answers writes with "storage unavailable", and probes until it works.
  Anything else a store raises is a bug (the runtime stops); a driver's exception never
  crosses the seam as a fault.
* Recurring schedules are rows of their own, a name and a JSON body the core encodes
  (``coordinator/core/schedules.py``); a batch writes them in the same transaction as the jobs
  their fires made, so a fire and its job are durable together or not at all. So are the
  task types' declared defaults (WORKER_REGISTER ``taskDefaults``), one body per type, and
  the limits per task type (``coordinator/core/limits.py``), and a new workflow's row
  (``coordinator/core/workflows.py``), which goes when its jobs are purged.
* Only one coordinator leads a store at a time: ``lead`` returns once this one does. A
  store of one process (SQLite) takes its file lock there and raises ``DatabaseInUse``
  while another process holds it; a shared store (PostgreSQL) may have several
  coordinators, the others standing by in ``lead``, and every write is fenced, so one
  that lost leadership commits nothing more: its calls raise ``LeadershipLost``.
* Jobs are ordered by their sequence (``Job.seq``, unique per row): listings page
  newest first with a sequence as the cursor, and the retention walk goes oldest first.
* The reads the core makes while it serves go through ``read_later`` (a job not in
  memory: a finished job by id, the job of an idempotency key) and ``later`` (listing
  pages, the purge walks, expired jobs), which return a ``Read``: SQLite's is ready at
  once (its reader never waits for the writer); a networked store's may finish later,
  and the core then holds that request's reply in order and applies the request again
  once the read is done (``Read.then`` wakes the runtime), or applies retention's reads
  at a later sweep, so a slow read never stalls the core. The synchronous reads are for
  start-up (recovery), ``later`` and tests.
"""

from __future__ import annotations

from typing import Any, Callable, Generic, Iterable, NamedTuple, Protocol, Sequence, TypeVar

from jobmesh.store.columns import COLUMN_NAMES, TERMINAL_STATES
from jobmesh.store.job import Job

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class StorageFault(Exception):
    """A store call failed for a storage reason, not a bug: ``reason`` in a few words
    ("disk full", "database is read-only", "database is locked", ...); the driver's
    exception is its ``__cause__``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class LeadershipLost(Exception):
    """This process no longer leads its store (its session ended, its lock went to
    another, a batch's fence failed): it must commit nothing more, release nothing of the
    batch that found it, and stop (exit 75). ``reason`` in a few words; the message
    names what was raised, and the driver's exception, if any, is its ``__cause__``."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = message if reason is None else reason


def lost(cause: BaseException, reason: str) -> LeadershipLost:
    """``LeadershipLost`` from the driver's exception ``cause``: the message says what it was."""
    return LeadershipLost("%s: %s" % (type(cause).__name__, " ".join(str(cause).split())[:300]), reason)


class CannotLead(Exception):
    """``lead`` cannot make this process the leader, and waiting would not help; the
    message says why in one line."""


class DatabaseInUse(CannotLead):
    """Another live process holds the database's lock; ``pid`` is its pid if it could be read."""

    def __init__(self, path: str, pid: int | None) -> None:
        self.path = path
        self.pid = pid
        holder = "pid %d" % pid if pid is not None else "another process"
        super().__init__("database in use by %s (lock file %s)" % (holder, path))


# The schema's version. Each store keeps a table of the numbered migrations it applied
# (1..SCHEMA_VERSION; the history is in sqlite.py's docstring, the columns each brought
# are ``Column.added``): opening applies those missing, each once, and a database whose
# table says it is current is only read. A database from before that table (whose
# version its columns would have had to tell) runs every migration: each creates only
# what is missing, so whatever such a database holds, it converges to the current schema.
SCHEMA_VERSION = 12


class NewerSchema(Exception):
    """The database's schema is newer than this program knows: it is not opened."""

    def __init__(self, where: str, version: int) -> None:
        super().__init__("%s holds schema version %d, newer than this jobmesh knows (%d): run a newer jobmesh"
                         % (where, version, SCHEMA_VERSION))


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type's name."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


class Batch(NamedTuple):
    """Everything one core batch writes, in one transaction."""

    inserts: list[tuple[Any, ...]]  # columns.insert_row() of new jobs
    updates: list[tuple[Any, ...]]  # columns.update_row() of changed jobs
    task_types: Sequence[tuple[str, int]] = ()  # newly declared (name, first seen millis)
    purges: Sequence[str] = ()  # finished jobs to delete, before the inserts (their keys are free)
    # Recurring schedules written or deleted: (name, stored body as JSON text, or None to delete).
    schedules: Sequence[tuple[str, str | None]] = ()
    # Limits per task type written or deleted: (task type, stored body as JSON text, or None to delete).
    limits: Sequence[tuple[str, str | None]] = ()
    # Task types' declared defaults written: (name, stored body as JSON text), the latest per name.
    task_defaults: Sequence[tuple[str, str]] = ()
    # Workflows created: (workflow id, stored body as JSON text). A workflow's row goes when
    # its jobs are purged (``purges``), in the same transaction.
    workflows: Sequence[tuple[str, str]] = ()


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
    schedules = dict(older.schedules)
    schedules.update(newer.schedules)
    limits = dict(older.limits)
    limits.update(newer.limits)
    defaults = dict(older.task_defaults)
    defaults.update(newer.task_defaults)
    return Batch(list(inserted.values()), list(updated.values()), types, purges, list(schedules.items()),
                 list(limits.items()), list(defaults.items()), list(older.workflows) + list(newer.workflows))


def outcome_of(call: Callable[..., None], *args: Any) -> Exception | None:
    """Run a store call and return its exception rather than raise it (an executor would
    print a traceback for each, and a storage outage would fill the log)."""
    try:
        call(*args)
    except Exception as exc:  # judged by the caller: StorageFault, LeadershipLost or a bug
        return exc
    return None


def page_query(table: str, mark: str, limit: int, state: str | None, before: int | None,
               task_type: str | None) -> tuple[str, list[Any]]:
    """The SELECT behind ``Store.list_page`` on ``table`` and its parameters, ``mark``
    being the driver's parameter placeholder."""
    where: list[str] = []
    params: list[Any] = []
    for column, value in (("state =", state), ("task_type =", task_type), ("seq <", before)):
        if value is not None:
            where.append(column + " " + mark)
            params.append(value)
    params.append(limit)
    return "SELECT %s FROM %s %sORDER BY seq DESC LIMIT %s" % (
        ", ".join(COLUMN_NAMES), table, ("WHERE " + " AND ".join(where) + " ") if where else "", mark), params


# The finished jobs that asked for a time to live (resultTtlMillis), by when it ends: a
# partial index over them alone, so the jobs that did not ask cost it nothing, and the
# expired ones are found in order of expiry without a scan (``Store.expired``).
EXPIRY_KEY = "(updated_at + result_ttl)"
EXPIRY_WHERE = "result_ttl IS NOT NULL AND state IN (%s)" % ", ".join("'%s'" % state for state in TERMINAL_STATES)


def expiry_index(name: str, table: str) -> str:
    """The CREATE INDEX of the expiry index, which SQLite and PostgreSQL spell alike."""
    return "CREATE INDEX IF NOT EXISTS %s ON %s (%s) WHERE %s" % (name, table, EXPIRY_KEY, EXPIRY_WHERE)


def expired_query(table: str, mark: str) -> str:
    """The SELECT behind ``Store.expired`` (parameters: now, limit) from ``table`` (which
    may name the index to use): it repeats the index's condition word for word, so that
    the planner may use the partial index."""
    return "SELECT job_id, idempotency_key FROM %s WHERE %s AND %s <= %s ORDER BY %s LIMIT %s" % (
        table, EXPIRY_WHERE, EXPIRY_KEY, mark, EXPIRY_KEY, mark)


def workflow_queries(jobs: str, workflows: str, mark: str) -> tuple[str, str, str]:
    """The SELECTs of one workflow (parameter: its id), which SQLite and PostgreSQL spell
    alike: its jobs as the purge walk weighs them (job id, key, state, updated at), its
    stored body, and its jobs' whole rows; jobs in sequence order."""
    where = "FROM %s WHERE workflow_id = %s ORDER BY seq" % (jobs, mark)
    return ("SELECT job_id, idempotency_key, state, updated_at " + where,
            "SELECT body FROM %s WHERE workflow_id = %s" % (workflows, mark),
            "SELECT %s %s" % (", ".join(COLUMN_NAMES), where))


def purge_walk(rows: Sequence[tuple[Any, ...]], after: int, cutoff_millis: int, limit: int,
               own_ttl: bool, flow_jobs: Callable[[str], Sequence[tuple[Any, ...]]]
               ) -> tuple[list[tuple[str, str | None]], int]:
    """``Store.purgeable``'s answer from the rows its walk read: (seq, job id, key, state,
    updated at, result ttl, workflow id), in sequence order from just past ``after``, at
    most ``limit`` of them.

    A workflow's jobs go together: a finished job of a workflow that the walk meets
    brings the whole workflow, read by ``flow_jobs`` (its rows: job id, key, state,
    updated at), once every job of it is finished and was last updated before the
    cutoff; until then the walk steps over it, as over an active job."""
    found: list[tuple[str, str | None]] = []
    seen: set[str] = set()
    seq = after
    for seq, job_id, key, state, updated_at, ttl, flow in rows:
        if state in TERMINAL_STATES and (own_ttl or ttl is None):
            if updated_at >= cutoff_millis:
                return found, 0
            if flow is None:
                found.append((job_id, key))
            elif flow not in seen:
                seen.add(flow)
                members = flow_jobs(flow)
                if all(s in TERMINAL_STATES and at < cutoff_millis for _, _, s, at in members):
                    found += [(member, member_key) for member, member_key, _, _ in members]
    return found, (seq if len(rows) == limit else 0)


class Outcome(Protocol):
    """A write in flight (``Store.commit``, ``Store.commit_probe``)."""

    def ready(self) -> bool:
        """Whether it has finished (never blocks)."""

    def get(self) -> Exception | None:
        """Wait for it (other greenlets run meanwhile); None if it succeeded, else what it raised."""

    def wait(self, timeout: float | None = None) -> Any:
        """Wait up to ``timeout`` seconds for it to finish; raises nothing."""


class Read(Protocol[T_co]):
    """A read in flight (``Store.read_later``, ``Store.later``)."""

    def ready(self) -> bool:
        """Whether it has finished (never blocks)."""

    def result(self) -> T_co:
        """What was read (``read_later``: the job, or None: no such job); raises what the
        read raised. Only once ready."""

    def then(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the hub) once the read has finished; at once if it has."""


class Done(Generic[T]):
    """A read answered at once."""

    __slots__ = ("_value", "_error")

    def __init__(self, read: Callable[[], T]) -> None:
        self._value: T | None = None
        self._error: Exception | None = None
        try:
            self._value = read()
        except Exception as exc:  # raised to the reader by result()
            self._error = exc

    def ready(self) -> bool:
        return True

    def result(self) -> T:
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]  # set unless read() raised

    def then(self, callback: Callable[[], None]) -> None:
        callback()


class Store(Protocol):
    """A durable job table; see the module docstring. Reads return ``Job`` records that
    belong to the caller (a new object per call). Every call raises ``StorageFault`` or
    ``LeadershipLost`` for those reasons (an ``Outcome`` or a ``Read`` hands them back)."""

    migrated: list[str]  # columns this open added to an older table (for the log)
    migrations: list[int]  # the numbered migrations this open applied (none: the schema was current)
    # True when several coordinators may share this store (one leads, the others stand
    # by); False when it belongs to one process (SQLite: its file lock, taken by ``lead``).
    shared: bool

    # ---- leadership ------------------------------------------------------------------

    def lead(self, standing_by: Callable[[], None]) -> None:
        """Return once this process leads the store. A store of one process takes its
        lock at once or raises ``CannotLead`` (``DatabaseInUse``: another process holds
        it). On a shared store, if another process leads, call ``standing_by()`` once,
        then wait, without stalling the hub, until this one does. Recovery reads come
        after it; ``close`` gives the leadership up."""

    # ---- writes ----------------------------------------------------------------------

    def write(self, batch: Batch) -> None:
        """Apply ``batch`` in one transaction, on the calling thread: all of it or nothing."""

    def commit(self, batch: Batch) -> Outcome:
        """``write(batch)`` where the store runs its writes, one at a time in call order."""

    def probe(self) -> None:
        """A write that changes nothing and needs what a batch needs (the write lock,
        room to grow); raises what a failing commit would."""

    def commit_probe(self) -> Outcome:
        """``probe()`` where the store runs its writes, after the writes before it."""

    def reopen(self) -> None:
        """Open this store's connections again, keeping its leadership (a connection
        opened while the database was read-only stays read-only); raises
        ``StorageFault`` and then keeps the old ones. A shared store's writer session
        holds its leadership: it reopens nothing. Only with no write in flight."""

    # ---- reads -----------------------------------------------------------------------

    def load_active(self) -> Iterable[Job]:
        """Every non-terminal job (recovery), taken in once: a store may hand them over
        as it reads them."""

    def load_task_types(self) -> list[str]:
        """Every task type ever declared to this store, sorted by name."""

    def load_schedules(self) -> list[tuple[str, str]]:
        """Every recurring schedule as (name, body JSON text), sorted by name (recovery)."""

    def load_limits(self) -> list[tuple[str, str]]:
        """Every task type's limit as (task type, body JSON text), sorted by type (recovery)."""

    def load_task_defaults(self) -> list[tuple[str, str]]:
        """Every task type's declared defaults as (name, body JSON text), sorted by name (recovery)."""

    def max_seq(self) -> int:
        """The largest sequence stored; 0 if there is no job."""

    def get(self, job_id: str) -> Job | None:
        """The job with this id as last committed, or None."""

    def find_by_key(self, key: str) -> Job | None:
        """The job holding this idempotency key as last committed, or None."""

    def read_later(self, job_id: str | None = None, key: str | None = None) -> Read[Job | None]:
        """``get(job_id)`` or ``find_by_key(key)`` (exactly one is given), where and when
        the store runs its reads: a ``Read`` that may be ready at once."""

    def later(self, read: Callable[[], T]) -> Read[T]:
        """``read()``, a function of this store's synchronous reads (``list_page``,
        ``purgeable``, ``expired``...), where and when the store runs its reads: a
        ``Read`` that may be ready at once (SQLite), or finish later without the caller
        waiting (PostgreSQL). The core reads only through this and ``read_later``: a
        synchronous read would hold it for a round trip in mid-batch."""

    def list_page(self, limit: int, state: str | None, before: int | None,
                  task_type: str | None = None) -> list[tuple[int, Job]]:
        """Up to ``limit`` (sequence, job) pairs, newest (largest sequence) first, with
        sequences below ``before`` (None: from the newest); filtered by state and task
        type when given. A pair's sequence is the cursor of the page after it."""

    def purgeable(self, after: int, cutoff_millis: int, limit: int,
                  own_ttl: bool = True) -> tuple[list[tuple[str, str | None]], int]:
        """Retention: finished jobs last updated before ``cutoff_millis``, walking jobs in
        sequence order from just past ``after`` (0: the oldest) and examining at most
        ``limit`` of them. Returns (job id, idempotency key) pairs and where the next walk
        starts: past the examined jobs, or 0 once the walk met a finished job not old
        enough yet (the rest are newer), or the end. Active jobs are stepped over, and so
        are jobs with a time to live of their own unless ``own_ttl``."""

    def load_workflow(self, workflow_id: str) -> tuple[str, list[Job]] | None:
        """A workflow as last committed: its stored body (JSON text) and its jobs in
        sequence order; None if there is no such workflow."""

    def expired(self, now_millis: int, limit: int) -> list[tuple[str, str | None]]:
        """Finished jobs whose time to live (``result_ttl``) has passed: ended (last updated)
        at least that long before ``now_millis``; (job id, idempotency key) pairs, the
        earliest expiry first, at most ``limit``. An index read: O(what it returns)."""

    def close(self) -> None:
        """Release connections and the write executor; the store is unusable after."""
