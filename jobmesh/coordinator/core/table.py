"""The job table: every job the core holds, and the one place a job is added or moves.

``JobTable`` owns the jobs in memory (the active ones, a bounded cache of finished ones),
the idempotency-key index, the rows to commit (dirty, new, purged), the per-state counts,
the leases (which session holds each running job) and each session's running set (the
jobs it runs: its leases, and the broadcast jobs it runs a copy of; ``running``), the
known task types and their declared defaults, each job's timeline, and the submission
sequence. Jobs enter it through ``admit`` (a new job) or ``adopt`` (recovery), and change
state only through ``transition``; both tell the registered listeners, which keep their
own indexes (queues, due times, Periodic funcs, waiters) in step. A listener is any
object with ``entered(job, now)`` (the job is in the table, in its current state) and
``moved(job, source, target, now)`` (after the move); it says whether it wants JSON
jobs, Periodic jobs or both. A job's times can change without a move too (a lease kept
by recovery, or claimed; a waiting job given another due time): ``keep_unclaimed``,
``claim`` and ``retime`` tell the time listeners (``retimed(job)``), so the timers follow.
A new index is a listener; a new state is a row of the table in ``protocol/jobs.py``
and, if it needs one, a branch in ``transition``.

Pure: no gevent, no clock; ``now`` is core time from the caller, and ``drift`` (kept by
the core) turns it into the wall-clock instants a job's record holds.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from collections.abc import Set
from typing import Any, Callable, Iterable, NamedTuple, Protocol, TypeVar

import ujson

from jobmesh.config import CoreConfig
from jobmesh.coordinator.core.figures import Counters
from jobmesh.store.job import Job
from jobmesh.coordinator.core.registry import Session
from jobmesh.store.base import Batch, Read, Store
from jobmesh.store.columns import dump_events, event_fragment, insert_row, load_events, update_row
from jobmesh.protocol.jobs import TERMINAL, JobState, Priority
from jobmesh.protocol.payloads import TASK_TYPES

T = TypeVar("T")

FINISHED_CACHE = 20_000
EVENTS_KEPT = 100  # a job's timeline keeps its newest events
BUILTIN_TYPES = frozenset(TASK_TYPES)
_ABOUT_THE_LEASE = frozenset({JobState.COMPLETED, JobState.CANCELLED})  # events naming the attempt that ended
# The timeline event a transition writes, by target state (None: the caller writes its own).
TRANSITION_EVENTS = {
    JobState.QUEUED: "QUEUED", JobState.RUNNING: "ASSIGNED", JobState.RETRY_WAIT: "RETRY_WAIT",
    JobState.SCHEDULED: "RESCHEDULED", JobState.COMPLETED: "COMPLETED", JobState.FAILED: "FAILED",
    JobState.CANCELLED: "CANCELLED",
}
_random = random.Random()
_NOTHING: frozenset[str] = frozenset()  # the running set of a session that runs nothing


class MoveListener(Protocol):
    """A part told of every move of a job."""

    def moved(self, job: Job, source: JobState, target: JobState, now: int) -> None:
        """The job moved from ``source`` to ``target`` (``job`` already shows the move)."""


class Listener(MoveListener, Protocol):
    """A part that indexes jobs: told of each job that enters the table, and of its moves."""

    def entered(self, job: Job, now: int) -> None:
        """The job is in the table now (admitted or recovered), in ``job.state``."""


class TimeListener(Protocol):
    """A part told when a job's time changes without a move."""

    def retimed(self, job: Job) -> None:
        """A RUNNING job's lease has another deadline (``job.deadline``), or a waiting job
        another due time (``job.run_at`` / ``job.retry_at``), in the same state."""


class TaskDefaults(NamedTuple):
    """What a task type's worker declared for its jobs (WORKER_REGISTER ``taskDefaults``,
    checked by ``payloads.task_defaults_problem``); None: not declared."""

    timeout: int | None = None
    max_attempts: int | None = None
    retry_base: int | None = None
    retry_cap: int | None = None

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> TaskDefaults:
        return cls(body.get("timeoutMillis"), body.get("maxAttempts"), body.get("retryBaseMillis"),
                   body.get("retryCapMillis"))

    def to_wire(self) -> dict[str, Any]:
        return {"timeoutMillis": self.timeout, "maxAttempts": self.max_attempts, "retryBaseMillis": self.retry_base,
                "retryCapMillis": self.retry_cap}


class ReadPending(Exception):
    """A lookup needs a row the store has not read yet (``Store.read_later``): the
    request that asked waits for ``read`` and is applied again once it is done."""

    def __init__(self, read: Read[Any]) -> None:
        super().__init__("a store read is in flight")
        self.read = read


def due_time(job: Job) -> int | None:
    """When a waiting job becomes due (wall clock): its retry time (RETRY_WAIT) or run-at
    time (SCHEDULED); None in other states."""
    if job.state is JobState.RETRY_WAIT:
        return job.retry_at
    if job.state is JobState.SCHEDULED:
        return job.run_at
    return None


class JobTable:
    def __init__(self, store: Store, config: CoreConfig, counters: Counters,
                 new_id: Callable[[], str] | None = None) -> None:
        self.store = store
        self.config = config
        self.counters = counters
        self._new_id = new_id
        self.jobs: dict[str, Job] = {}  # every non-terminal job
        self.finished: OrderedDict[str, Job] = OrderedDict()  # LRU of terminal jobs
        self.keys: dict[str, str] = {}  # idempotency key -> job id, for jobs held in memory
        self.leases: dict[str, Session] = {}  # running job id -> the session holding its lease
        # Session -> the job ids it runs: its leases, and (Periodic broadcast) the jobs it
        # runs a copy of, whose lease another session holds (``_copies``: job id -> those).
        self._running: dict[Session, set[str]] = {}
        self._copies: dict[str, list[Session]] = {}
        # Running JSON jobs recovery kept on their old lease for their worker to claim
        # (--lease-grace-millis): no session holds them; their deadline ends the grace.
        self.unclaimed: set[str] = set()
        self.known_types: set[str] = set(BUILTIN_TYPES)  # built-ins and every type ever declared
        self.defaults: dict[str, TaskDefaults] = {}  # task type -> its latest declared defaults
        self.next_seq = 1
        self.drift = 0  # wall clock minus core time (the core keeps it current)
        # (state, task type or Periodic func, priority, whether Periodic) -> active jobs;
        # enum keys: no .value on the hot path
        self.counts: Counter[tuple[JobState, str, Priority, bool]] = Counter()
        self.finished_counts = {state: 0 for state in TERMINAL}
        self._json: list[MoveListener] = []  # told of moves
        self._periodic: list[MoveListener] = []
        self._json_enter: list[Listener] = []  # told of jobs entering (a subset: some index no new job)
        self._periodic_enter: list[Listener] = []
        self._timed: list[TimeListener] = []  # told of times that change without a move
        self._forgets: list[Callable[[list[tuple[str, str | None]]], None]] = []  # told of the finished jobs purged
        self._dirty: dict[str, Job] = {}
        self._new: set[str] = set()
        self._new_types: list[tuple[str, int]] = []
        self._new_defaults: dict[str, str] = {}  # task type -> its defaults' body to store
        self._purges: list[str] = []
        self._purging: set[str] = set()  # the same, to look up: their rows are gone as of this batch
        self._reads: dict[tuple[Any, ...], Read[Any]] = {}  # store reads a waiting request will use
        # A job read back by id or key is kept in memory unless it was forgotten (purged)
        # at or after the batch its read began in: a read on a connection of its own can
        # return a row the purge's commit has deleted since. Batches are counted by commit.
        self._batch = 0
        self._job_reads_began: dict[tuple[str, str], int] = {}  # (kind, value) -> batch
        self._forgotten: dict[str, int] = {}  # job id -> batch it was forgotten in, while a read may predate it

    def listen(self, listener: Listener, json: bool = True, periodic: bool = True) -> None:
        """Tell ``listener`` of every JSON and/or Periodic job that enters the table or moves."""
        self.listen_moves(listener, json, periodic)
        if json:
            self._json_enter.append(listener)
        if periodic:
            self._periodic_enter.append(listener)

    def unlisten(self, listener: MoveListener) -> None:
        """Tell ``listener`` of nothing more (it may ``listen`` again)."""
        for group in (self._json, self._periodic, self._json_enter, self._periodic_enter):
            if listener in group:
                group.remove(listener)  # type: ignore[arg-type]

    def listen_moves(self, listener: MoveListener, json: bool = True, periodic: bool = True) -> None:
        """Tell ``listener`` of every move of a JSON and/or Periodic job."""
        if json:
            self._json.append(listener)
        if periodic:
            self._periodic.append(listener)

    def listen_forgets(self, forgotten: Callable[[list[tuple[str, str | None]]], None]) -> None:
        """Call ``forgotten(found)`` with the finished jobs each purge drops, as ``forget`` takes them."""
        self._forgets.append(forgotten)

    def listen_times(self, listener: TimeListener) -> None:
        """Tell ``listener`` of every job whose lease deadline or due time changes without a move."""
        self._timed.append(listener)

    # ---- jobs in and out ------------------------------------------------------------

    @property
    def active_count(self) -> int:
        """Non-terminal jobs: the admission-control counter (O(1))."""
        return len(self.jobs)

    def new_job(self, now: int, task_type: str, payload: dict[str, Any], max_attempts: int, priority: Priority,
                state: JobState, key: str | None = None, execution_timeout: int | None = None,
                payload_json: str | None = None, run_at: int | None = None, retry_of: str | None = None,
                name: str | None = None, periodic: dict[str, Any] | None = None) -> Job:
        """A Job with a fresh id and sequence, created now (wall clock), due now (core time).

        Its id is the sequence (so ids sort, and inserts append to the primary-key index)
        followed by 96 random bits (so ids never collide with rows of an older database,
        whatever their sequence). No syscall."""
        seq = self.next_seq
        self.next_seq += 1
        job_id = self._new_id() if self._new_id is not None else "%08x%024x" % (seq, _random.getrandbits(96))
        return Job(job_id, seq, task_type, payload, max_attempts, priority, now + self.drift, key, state,
                   execution_timeout=execution_timeout, payload_json=payload_json, run_at=run_at, retry_of=retry_of,
                   name=name, periodic=periodic, ready_at=now, event_count=0)

    def new_id(self) -> str:
        """A fresh id for something other than a job (a workflow), unique as job ids are."""
        return self._new_id() if self._new_id is not None else "%08x%024x" % (self.next_seq, _random.getrandbits(96))

    def admit(self, job: Job, now: int, detail: str | None = None) -> None:
        """A new job (QUEUED, SCHEDULED, or WAITING for its dependencies), with its SUBMITTED
        event; inserted at the commit."""
        job_id = job.job_id
        self.jobs[job_id] = job
        if job.idempotency_key is not None:
            self.keys[job.idempotency_key] = job_id
        self._new.add(job_id)
        self.counters.submitted += 1
        periodic = job.periodic is not None
        self.counts[(job.state, job.task_type, job.priority, periodic)] += 1
        self.event(job, now, "SUBMITTED", detail)
        for listener in self._periodic_enter if periodic else self._json_enter:
            listener.entered(job, now)

    def adopt(self, job: Job, now: int) -> None:
        """Recovery: a non-terminal job read back from the store, as it was stored."""
        self.jobs[job.job_id] = job
        job.ready_at = job.due_at - self.drift
        self.counts[(job.state, job.task_type, job.priority, job.periodic is not None)] += 1
        if job.idempotency_key is not None:
            self.keys[job.idempotency_key] = job.job_id
        for listener in self._periodic_enter if job.periodic is not None else self._json_enter:
            listener.entered(job, now)

    def transition(self, job: Job, target: JobState, now: int, *, due_at: int | None = None,
                   session: Session | None = None, event: str | None = "") -> None:
        """Move an active job to ``target``; the listeners keep their indexes in step.

        Leaving RUNNING frees the lease holder's slot; entering RUNNING takes ``session``
        and issues a new lease with its deadline; RETRY_WAIT and SCHEDULED take ``due_at``
        (core time); a terminal state leaves the active set (freeing its admission slot)
        for the finished cache. The per-state counts follow, the move is written to the
        job's timeline (``event``: "" the state's own event, None none, or another name),
        and the job is marked dirty for the batch's commit.
        """
        source = job.state
        holder_id = job.worker_id  # the lease holder while RUNNING
        periodic = job.periodic is not None
        if source is JobState.RUNNING:
            holder = self.leases.pop(job.job_id, None)
            if holder is not None:
                running = self._running.get(holder)
                if running is not None:
                    running.discard(job.job_id)
            else:
                self.unclaimed.discard(job.job_id)
            if periodic and self._copies:
                self._end_copies(job.job_id)
        job.move_to(target, now + self.drift)
        counts = self.counts
        key = (source, job.task_type, job.priority, periodic)
        counts[key] -= 1
        if not counts[key]:
            del counts[key]
        if target is JobState.QUEUED:
            if source is JobState.SCHEDULED and job.wake_at is not None:
                job.ready_at = job.wake_at  # it became due at its run-at time, not when the sweep saw it
            elif source is JobState.WAITING:
                job.ready_at = now  # due once its dependencies completed: aging counts from then
        elif target is JobState.RUNNING:
            assert session is not None, "an assignment needs a worker"
            job.attempts += 1
            # Unique per assignment: attempts only grows, and is durable before any send.
            job.attempt_id = "%s.%d" % (job.job_id, job.attempts)
            job.worker_id = holder_id = session.worker_id
            job.deadline = now + (job.execution_timeout or self.config.task_timeout_millis)
            self.leases[job.job_id] = session
            self._running[session].add(job.job_id)
        elif target is JobState.RETRY_WAIT:
            assert due_at is not None, "a waiting job needs its due time"
            job.retry_at = due_at + self.drift
            self.counters.retries += 1
        elif target is JobState.SCHEDULED:
            assert due_at is not None, "a waiting job needs its due time"
            job.run_at = due_at + self.drift
        if target in TERMINAL:
            self.jobs.pop(job.job_id, None)
            self._remember_finished(job)
            self.finished_counts[target] += 1
        else:
            counts[(target, job.task_type, job.priority, periodic)] += 1
        for listener in self._periodic if periodic else self._json:
            listener.moved(job, source, target, now)
        if event is None:
            self._dirty[job.job_id] = job
        elif target is JobState.RUNNING or (source is JobState.RUNNING and target in _ABOUT_THE_LEASE):
            self.event(job, now, event or TRANSITION_EVENTS[target], None, None, job.attempts, holder_id)
        else:
            detail = job.error if target is JobState.FAILED else None
            self.event(job, now, event or TRANSITION_EVENTS[target], detail, due_at)

    # ---- leases and running sets ---------------------------------------------------------

    def running(self, session: Session) -> Set[str]:
        """The job ids ``session`` runs: those whose lease it holds, and the broadcast jobs
        it runs a copy of (read only: the table keeps it, the same set while the session
        lives; empty once it ended)."""
        return self._running.get(session, _NOTHING)

    def keep_unclaimed(self, job: Job, until: int) -> None:
        """Recovery: a RUNNING job stays on its lease, held by no session, until ``until``
        (core time, its deadline now) for a worker to claim it (``claim``)."""
        job.deadline = until
        self.unclaimed.add(job.job_id)
        self._dirty[job.job_id] = job
        for listener in self._timed:
            listener.retimed(job)

    def claim(self, job: Job, session: Session, now: int) -> None:
        """A worker that registered again names a lease recovery kept: it holds that lease
        now (the same attempt, no new one), with a fresh deadline."""
        self.unclaimed.discard(job.job_id)
        self.leases[job.job_id] = session
        self._running[session].add(job.job_id)
        job.worker_id = session.worker_id
        job.deadline = now + (job.execution_timeout or self.config.task_timeout_millis)
        self._dirty[job.job_id] = job
        for listener in self._timed:
            listener.retimed(job)

    def run_copy(self, job: Job, session: Session) -> None:
        """A RUNNING Periodic broadcast job runs on ``session`` too, whose running set holds
        it until the job leaves RUNNING; its lease stays with its holder."""
        assert job.state is JobState.RUNNING and job.periodic is not None
        self._copies.setdefault(job.job_id, []).append(session)
        self._running[session].add(job.job_id)

    def _end_copies(self, job_id: str) -> None:
        for session in self._copies.pop(job_id, ()):
            running = self._running.get(session)
            if running is not None:
                running.discard(job_id)

    def session_started(self, session: Session) -> None:
        """A worker session (JSON or Periodic) opened: it runs nothing yet. Only a started
        session is given a lease or a copy."""
        self._running[session] = set()

    def session_ended(self, session: Session) -> None:
        """A session ended, and its part has moved on the jobs it ran: its running set goes."""
        self._running.pop(session, None)

    def retime(self, job: Job) -> None:
        """A waiting job's due time changed in its state (its ``run_at`` or ``retry_at`` was
        set): written with this batch, and the time listeners told."""
        self._dirty[job.job_id] = job
        for listener in self._timed:
            listener.retimed(job)

    def attempt_ended(self, job: Job, now: int, error: str, cause: str) -> None:
        """An attempt ended without a result (``cause``: ATTEMPT_FAILED, LEASE_EXPIRED or
        WORKER_LOST): the error and the timeline say so; the job's part decides what next."""
        job.error = error
        self.event(job, now, cause, error, attempt=job.attempts, worker_id=job.worker_id)

    # ---- a job's fields besides its state (written with its next event or move) ---------

    def record(self, job: Job, *, error: str | None = None, result: dict[str, Any] | None = None,
               submitted_by: str | None = None) -> None:
        """What a part keeps on a job: why its next move ends it (``error``), its result,
        who submitted it (a new job, before ``admit``)."""
        if error is not None:
            job.error = error
        if result is not None:
            job.result = result
        if submitted_by is not None:
            job.submitted_by = submitted_by

    def set_periodic(self, job: Job, fields: dict[str, Any], timeout: int | None = None,
                     run_at: int | None = None) -> None:
        """A Periodic job's own fields (workload, count, timeout, sched; docs/PERIODIC.md),
        with its per-attempt timeout (ms) and run-at time (wall clock) when they change too."""
        job.periodic = fields
        if timeout is not None:
            job.execution_timeout = timeout
        if run_at is not None:
            job.run_at = run_at

    # ---- timelines and rows ---------------------------------------------------------

    def event(self, job: Job, now: int, event: str, detail: str | None = None, retry_at: int | None = None,
              attempt: int | None = None, worker_id: str | None = None) -> None:
        """Append one event to the job's timeline (its ``events`` column, committed with the
        job's row in this batch); only the newest EVENTS_KEPT are kept. ``retry_at`` is
        core time; the timeline holds wall-clock instants."""
        if job.event_count < 0:  # read back from the store: count what it holds
            stored = load_events(job.events)
            job.event_count = len(stored)
            job.event_last_at = stored[-1][0] if stored else 0
        at = now + self.drift
        fragment = event_fragment(job.event_last_at, at, event, attempt, worker_id, detail,
                                  None if retry_at is None else retry_at + self.drift)
        job.events = job.events + "," + fragment if job.events else fragment
        job.event_last_at = at
        job.event_count += 1
        if job.event_count > EVENTS_KEPT:
            kept = load_events(job.events)[-EVENTS_KEPT:]
            job.events = dump_events(kept)
            job.event_count = len(kept)
        self._dirty[job.job_id] = job

    def touch(self, job: Job) -> None:
        """The job's row changed outside a transition: write it with this batch."""
        self._dirty[job.job_id] = job

    def declare_types(self, names: Iterable[str], now: int) -> list[str]:
        """Task types a worker declared; the new ones are stored with this batch (durable
        before its registration is answered). Returns the new names."""
        new = sorted(set(names) - self.known_types)
        for name in new:
            self.known_types.add(name)
            self._new_types.append((name, now + self.drift))
        return new

    def changes_defaults(self, declared: dict[str, Any]) -> bool:
        """Whether keeping ``declared`` (a registration's checked ``taskDefaults``) would
        change what is kept (and so write a row)."""
        return any(self.defaults.get(name) != TaskDefaults.from_wire(body) for name, body in declared.items())

    def declare_defaults(self, declared: dict[str, Any]) -> list[str]:
        """Keep a registration's checked ``taskDefaults``: each type named there takes its
        new defaults (the latest declaration wins), stored with this batch, so they are
        durable before the registration is answered; types not named keep theirs. Returns
        the types whose defaults changed."""
        changed = []
        for name, body in sorted(declared.items()):
            defaults = TaskDefaults.from_wire(body)
            if self.defaults.get(name) != defaults:
                self.defaults[name] = defaults
                self._new_defaults[name] = ujson.dumps(defaults.to_wire())
                changed.append(name)
        return changed

    def load_defaults(self, rows: Iterable[tuple[str, str]]) -> None:
        """Recovery: the defaults the store keeps, as (type, body JSON text)."""
        for name, body in rows:
            self.defaults[name] = TaskDefaults.from_wire(ujson.loads(body))

    def max_attempts_of(self, task_type: str) -> int:
        """The attempt budget of a new job of ``task_type`` whose submit named none."""
        defaults = self.defaults.get(task_type)
        return (defaults is not None and defaults.max_attempts) or self.config.default_max_attempts

    def give_defaults(self, job: Job, timeout: int | None) -> None:
        """A new JSON job takes its per-attempt deadline (``timeout`` if its submit gave
        one, else its task type's, else --task-timeout-millis) and its retry backoff (its
        task type's; None: --retry-base/cap-millis when it retries) as they stand now, and
        keeps them."""
        defaults = self.defaults.get(job.task_type)
        if defaults is None:
            job.execution_timeout = timeout or self.config.task_timeout_millis
            return
        job.execution_timeout = timeout or defaults.timeout or self.config.task_timeout_millis
        job.retry_base, job.retry_cap = defaults.retry_base, defaults.retry_cap

    def take_dirty(self) -> Batch:
        """What to commit for everything changed since the last call."""
        inserts, updates = [], []
        new = self._new
        for job_id, job in self._dirty.items():
            if job_id in new:
                inserts.append(insert_row(job))
            else:
                updates.append(update_row(job))
        batch = Batch(inserts, updates, self._new_types, self._purges,
                      task_defaults=list(self._new_defaults.items()) if self._new_defaults else ())
        self._new_types, self._purges = [], []
        if self._new_defaults:
            self._new_defaults = {}
        self._purging = set()
        self._batch += 1
        if self._forgotten:
            began = self._job_reads_began
            if not began:
                self._forgotten = {}
            else:
                oldest = min(began.values())
                self._forgotten = {job_id: batch for job_id, batch in self._forgotten.items() if batch >= oldest}
        self._dirty = {}
        self._new = set()
        return batch

    # ---- lookups --------------------------------------------------------------------

    def _remember_finished(self, job: Job) -> None:
        self.finished[job.job_id] = job
        self.finished.move_to_end(job.job_id)
        if job.idempotency_key is not None:
            self.keys[job.idempotency_key] = job.job_id
        while len(self.finished) > FINISHED_CACHE:
            _, old = self.finished.popitem(last=False)
            if old.idempotency_key is not None and self.keys.get(old.idempotency_key) == old.job_id:
                del self.keys[old.idempotency_key]

    def lookup(self, job_id: str) -> Job | None:
        """Any job by id: active, recently finished, or read back from the store."""
        job = self.jobs.get(job_id)
        if job is not None:
            return job
        job = self.finished.get(job_id)
        if job is not None:
            return job
        return self._read("id", job_id)

    def lookup_key(self, key: str) -> Job | None:
        """The job bound to an idempotency key, wherever it is."""
        job_id = self.keys.get(key)
        if job_id is not None:
            return self.lookup(job_id)
        return self._read("key", key)

    def awaited(self, key: tuple[Any, ...], start: Callable[[], Read[T]]) -> T:
        """What the store read ``start()`` began, under ``key`` (what the request asks,
        the same when it is applied again); raises ``ReadPending`` while it is in
        flight. A read that finished is used once, by the request applied again for it."""
        read = self._reads.pop(key, None)
        if read is None:
            read = start()
        if not read.ready():
            self._reads[key] = read
            raise ReadPending(read)
        return read.result()

    def _read(self, kind: str, value: str) -> Job | None:
        """A job from the store, as ``awaited`` reads (spelled out: a keyed submit's path)."""
        read = self._reads.pop((kind, value), None)
        began = self._job_reads_began.pop((kind, value), self._batch)
        if read is None:
            read = self.store.read_later(job_id=value) if kind == "id" else self.store.read_later(key=value)
        if not read.ready():
            self._reads[(kind, value)] = read
            self._job_reads_began[(kind, value)] = began
            raise ReadPending(read)
        job = read.result()
        if job is not None and self._forgotten.get(job.job_id, -1) >= began:
            return None  # read back from a row a purge since its read began deletes (or deleted)
        if job is not None and job.state in TERMINAL:
            self._remember_finished(job)
        return job

    def current(self, stored: Job) -> Job:
        """The job as memory holds it now, if it does (a row read back may be older)."""
        return self.jobs.get(stored.job_id) or self.finished.get(stored.job_id) or stored

    # ---- purges -----------------------------------------------------------------------

    def forget(self, found: list[tuple[str, str | None]]) -> int:
        """Drop finished jobs from memory (cache, keys, dirty rows); the batch's commit
        deletes their rows. Their idempotency keys are free again. Returns how many it
        dropped: a job found twice in a batch (its time to live passed, and retention's
        walk met it too) counts once."""
        purging = self._purging
        dropped = 0
        for forgotten in self._forgets:
            forgotten(found)
        for job_id, key in found:
            if job_id in purging:
                continue
            self.finished.pop(job_id, None)
            if key is not None and self.keys.get(key) == job_id:
                del self.keys[key]
            self._dirty.pop(job_id, None)
            self._purges.append(job_id)
            purging.add(job_id)
            self._forgotten[job_id] = self._batch
            dropped += 1
        self.counters.purged += dropped
        return dropped

    def carry_totals(self, old: JobTable) -> None:
        """A reload: the finished counts count since the process started."""
        for state, value in old.finished_counts.items():
            self.finished_counts[state] += value

