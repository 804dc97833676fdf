"""The storage seam: what the core and the runtime ask of a job store.

``Store`` is the whole interface; ``sqlite.py`` is its first implementation, and every
implementation passes ``tests/unit/test_store_contract.py``. The core and the runtime
never see SQL, a rowid, a driver's exception type or the thread a write runs on:

* Writes come as one ``Batch`` per core batch, applied in one transaction (group
  commit). ``write`` applies it on the calling thread (start-up, tests); ``commit``
  applies it where the store runs its writes (SQLite: one thread off the hub) and
  returns an ``Outcome`` the runtime waits on, or polls, without blocking the hub.
* A failed write raises the driver's exception; ``is_storage_fault`` tells a storage
  fault (disk full, read-only, locked, unreachable: serve reads, answer writes with
  "storage unavailable", probe until it works) from a bug (stop), and ``fault_reason``
  gives the short words clients see.
* Recurring schedules are rows of their own, a name and a JSON body the core encodes
  (``coordinator/schedules.py``); a batch writes them in the same transaction as the jobs
  their fires made, so a fire and its job are durable together or not at all. So are the
  task types' declared defaults (WORKER_REGISTER ``taskDefaults``), one body per type, and
  the limits per task type (``coordinator/limits.py``).
* A shared store (PostgreSQL) may have several coordinators: ``lead`` returns once this
  one leads, and every write is fenced, so one that lost leadership commits nothing more
  (``leadership_lost`` tells those errors from storage faults and bugs).
* Jobs are ordered by their sequence (``Job.seq``, unique per row): listings page
  newest first with a sequence as the cursor, and the retention walk goes oldest first.
* The reads a request makes of a job not in memory (a finished job by id, the job of an
  idempotency key) go through ``read_later``, which returns a ``Read``: SQLite's is ready
  at once (its reader never waits for the writer); a networked store's may finish later,
  and the core then holds that request's reply in order and applies the request again
  once the read is done (``Read.then`` wakes the runtime), so a slow read never stalls
  the core.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, NamedTuple, Protocol, Sequence

from jobmesh.store.columns import COLUMN_NAMES, TERMINAL_STATES
from jobmesh.store.job import Job


class Batch(NamedTuple):
    """Everything one core batch writes, in one transaction."""

    inserts: list[tuple]  # columns.insert_row() of new jobs
    updates: list[tuple]  # columns.update_row() of changed jobs
    task_types: Sequence[tuple[str, int]] = ()  # newly declared (name, first seen millis)
    purges: Sequence[str] = ()  # finished jobs to delete, before the inserts (their keys are free)
    # Recurring schedules written or deleted: (name, stored body as JSON text, or None to delete).
    schedules: Sequence[tuple[str, str | None]] = ()
    # Limits per task type written or deleted: (task type, stored body as JSON text, or None to delete).
    limits: Sequence[tuple[str, str | None]] = ()
    # Task types' declared defaults written: (name, stored body as JSON text), the latest per name.
    task_defaults: Sequence[tuple[str, str]] = ()


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
                 list(limits.items()), list(defaults.items()))


def outcome_of(call: Callable[..., None], *args: Any) -> Exception | None:
    """Run a store call and return its exception rather than raise it (an executor would
    print a traceback for each, and a storage outage would fill the log)."""
    try:
        call(*args)
    except Exception as exc:  # judged by the caller: storage fault or bug
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


def purge_walk(rows: Sequence[tuple], after: int, cutoff_millis: int, limit: int,
               own_ttl: bool = True) -> tuple[list[tuple[str, str | None]], int]:
    """``Store.purgeable``'s answer from the rows its walk read: (seq, job id, key, state,
    updated at, result ttl), in sequence order from just past ``after``, at most ``limit``
    of them."""
    found: list[tuple[str, str | None]] = []
    seq = after
    for seq, job_id, key, state, updated_at, ttl in rows:
        if state in TERMINAL_STATES and (own_ttl or ttl is None):
            if updated_at >= cutoff_millis:
                return found, 0
            found.append((job_id, key))
    return found, (seq if len(rows) == limit else 0)


class Outcome(Protocol):
    """A write in flight (``Store.commit``, ``Store.commit_probe``)."""

    def ready(self) -> bool:
        """Whether it has finished (never blocks)."""

    def get(self) -> Exception | None:
        """Wait for it (other greenlets run meanwhile); None if it succeeded, else what it raised."""

    def wait(self, timeout: float | None = None) -> Any:
        """Wait up to ``timeout`` seconds for it to finish; raises nothing."""


class Read(Protocol):
    """A read of one job in flight (``Store.read_later``)."""

    def ready(self) -> bool:
        """Whether it has finished (never blocks)."""

    def result(self) -> Job | None:
        """The job read (None: no such job); raises what the read raised. Only once ready."""

    def then(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the hub) once the read has finished; at once if it has."""


class Done:
    """A read answered at once."""

    __slots__ = ("_job", "_error")

    def __init__(self, read: Callable[[], Job | None]) -> None:
        self._job: Job | None = None
        self._error: Exception | None = None
        try:
            self._job = read()
        except Exception as exc:  # raised to the reader by result()
            self._error = exc

    def ready(self) -> bool:
        return True

    def result(self) -> Job | None:
        if self._error is not None:
            raise self._error
        return self._job

    def then(self, callback: Callable[[], None]) -> None:
        callback()


class Store(Protocol):
    """A durable job table; see the module docstring. Reads return ``Job`` records that
    belong to the caller (a new object per call)."""

    migrated: list[str]  # columns this open added to an older table (for the log)
    # True when several coordinators may share this store (one leads, the others stand
    # by); False when it belongs to one process (SQLite: its file lock, dblock.py).
    shared: bool

    # ---- leadership ------------------------------------------------------------------

    def lead(self, standing_by: Callable[[], None]) -> None:
        """Return once this process leads the store (at once for a store that is not
        shared). If another process leads, call ``standing_by()`` once, then wait, without
        stalling the hub, until this one does. Recovery reads come after it."""

    def leadership_lost(self, exc: BaseException) -> bool:
        """Whether ``exc`` (raised by this store) means this process no longer leads (its
        session ended, its lock was lost, the fence failed): it must commit nothing more
        and stop. Never true of a storage fault (``is_storage_fault``)."""

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

    def is_storage_fault(self, exc: BaseException) -> bool:
        """Whether ``exc`` (raised by this store) is a storage fault rather than a bug."""

    def fault_reason(self, exc: BaseException) -> str:
        """A storage fault in a few words: "disk full", "database is read-only", ..."""

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

    def read_later(self, job_id: str | None = None, key: str | None = None) -> Read:
        """``get(job_id)`` or ``find_by_key(key)`` (exactly one is given), where and when
        the store runs its reads: a ``Read`` that may be ready at once."""

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

    def expired(self, now_millis: int, limit: int) -> list[tuple[str, str | None]]:
        """Finished jobs whose time to live (``result_ttl``) has passed: ended (last updated)
        at least that long before ``now_millis``; (job id, idempotency key) pairs, the
        earliest expiry first, at most ``limit``. An index read: O(what it returns)."""

    def close(self) -> None:
        """Release connections and the write executor; the store is unusable after."""
