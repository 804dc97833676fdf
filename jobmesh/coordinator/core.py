"""CoordinatorCore: the single writer of all coordinator state.

A plain class: no gevent, no sockets, no clock. Every method takes ``now_millis`` from
its caller (the runtime reads the clock once per event). That is core time: monotonic
(``clock.py``), so every duration (heartbeat timeouts, deadlines, backoff) is immune to
wall-clock steps. Instants people give or read (createdAtMillis, runAtMillis, retry
times, event times) are wall-clock: core time plus ``drift``, which the runtime keeps
current (``observe_wall``); a wall-clock step moves only those. The core

* owns every active job, the recently finished ones it still caches, the worker
  registry, the queued/due/deadline indexes, the known task types and the submission
  sequence;
* changes a job's state only through ``_transition``, which also keeps every index in
  step (queues, due times, leases, the active set) and marks the job dirty;
* commits nothing itself: the runtime takes the dirty rows of a batch (``take_dirty``)
  and commits them in one transaction *before* it releases the batch's replies and
  outbound frames, so nothing is observable before it is durable;
* "sends" by appending ``(conn, message)`` to ``outbound`` (``message`` None = close
  that connection after what is queued for it); it never writes a socket itself.

The class is written in three files: this one (bookkeeping, the transition method,
recovery, worker events, outcomes, the sweep and scheduling), ``requests.py`` (the
client requests: each returns its reply message, or None from ``wait_job``, whose reply
comes later from ``take_answers``) and ``periodic_jobs.py`` with ``periodic_waits.py``
(the Periodic port's requests). Event methods (``on_worker_registered``,
``on_heartbeat``, ``on_task_result``, ``on_worker_disconnected``, ``sweep``) return
nothing. ``after_batch`` schedules after each batch, and ``sweep`` does too.

Nothing here scans all jobs: queued jobs live in per-type, per-priority heaps, due times
(SCHEDULED and RETRY_WAIT) and deadlines in time-ordered heaps, finished jobs leave
memory through an LRU and are read back from the store on demand.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import random
from collections import Counter, OrderedDict
from typing import Any, Callable

import ujson

from jobmesh.config import CoreConfig
from jobmesh.coordinator import scheduler
from jobmesh.coordinator.figures import Counters
from jobmesh.coordinator.job import Job
from jobmesh.coordinator.periodic_jobs import PeriodicJobs
from jobmesh.coordinator.requests import ClientRequests
from jobmesh.coordinator.registry import Session, WorkerRegistry
from jobmesh.coordinator.store import Batch, JobStore, dump_events, event_fragment, insert_row, load_events, update_row
from jobmesh.coordinator.waiters import Waiters
from jobmesh.periodic import codec as pc
from jobmesh.protocol import messages as m
from jobmesh.protocol.jobs import TERMINAL, JobState, Priority
from jobmesh.protocol.messages import quote
from jobmesh.protocol.payloads import MAX_NESTING, TASK_TYPES, is_finite_json, too_deep

log = logging.getLogger(__name__)
_random = random.Random()

MAX_WORKER_ID_CHARS = 256
MAX_RESULT_BYTES = 64 * 1024
MAX_ERROR_CHARS = m.MAX_ERROR_CHARS
FINISHED_CACHE = 20_000
BUILTIN_TYPES = frozenset(TASK_TYPES)

PURGE_BATCH = 256  # and per batch while more are due
EVENTS_KEPT = 100  # a job's timeline keeps its newest events
WALL_STEP_MILLIS = 1000  # a change of the wall clock against core time beyond this is a step
MAX_STALE_PER_SECOND = 100  # results for leases a worker does not hold, before it is cut off
_ABOUT_THE_LEASE = frozenset({JobState.COMPLETED, JobState.CANCELLED})  # events naming the attempt that ended
# The timeline event a transition writes, by target state (None: the caller writes its own).
TRANSITION_EVENTS = {
    JobState.QUEUED: "QUEUED", JobState.RUNNING: "ASSIGNED", JobState.RETRY_WAIT: "RETRY_WAIT",
    JobState.SCHEDULED: "RESCHEDULED", JobState.COMPLETED: "COMPLETED", JobState.FAILED: "FAILED",
    JobState.CANCELLED: "CANCELLED",
}


def _attempt_number(job_id: str, attempt_id: str) -> int | None:
    """n of an attempt id ``<jobId>.<n>`` of this job; None if it is not one."""
    head, _, tail = attempt_id.rpartition(".")
    return int(tail) if head == job_id and tail.isdigit() and len(tail) < 10 else None


def _due_time(job: Job) -> int | None:
    """When a waiting job becomes due: its retry time (RETRY_WAIT) or run-at time (SCHEDULED)."""
    if job.state is JobState.RETRY_WAIT:
        return job.retry_at
    if job.state is JobState.SCHEDULED:
        return job.run_at
    return None


class CoordinatorCore(ClientRequests, PeriodicJobs):
    def __init__(self, store: JobStore, config: CoreConfig, new_id: Callable[[], str] | None = None) -> None:
        self.store = store
        self.config = config
        self._new_id = new_id
        self.jobs: dict[str, Job] = {}  # every non-terminal job
        self.finished: OrderedDict[str, Job] = OrderedDict()  # LRU of terminal jobs
        self.keys: dict[str, str] = {}  # idempotency key -> job id, for jobs held in memory
        self.queued = scheduler.TypedQueues()
        self.due_heap: list[tuple[int, str]] = []  # (due time, job id): SCHEDULED and RETRY_WAIT jobs
        self.deadline_heap: list[tuple[int, str, str]] = []  # (deadline, job id, attempt id)
        self.workers = WorkerRegistry()
        self.known_types: set[str] = set(BUILTIN_TYPES)  # built-ins and every type ever declared
        self.next_seq = 1
        self.workers_by_type: dict[str, set[Session]] = {}  # task type -> live sessions that run it
        self.drift = 0  # wall clock minus core time (observe_wall)
        self.outbound: list[tuple[Any, Any]] = []  # a Message (bytes for a Periodic connection) or None
        self._init_periodic()  # periodic_jobs.py
        self.waiters = Waiters()  # pending WAIT_JOB requests
        self._dirty: dict[str, Job] = {}
        self._new: set[str] = set()
        self._new_types: list[tuple[str, int]] = []
        self._purges: list[str] = []
        self._purge_backlog = False  # the last retention walk stopped early: more may be due
        self._purge_cursor = 0  # where the next retention walk starts (a rowid)
        # Metrics: plain counters (read at scrape time), and the active jobs by
        # (state, task type, priority), kept by _transition.
        # (state, task type or Periodic func, priority, whether Periodic); enum keys: no .value on the hot path
        self.counts: Counter[tuple[JobState, str, Priority, bool]] = Counter()
        self.stats = Counters()
        self.finished_counts = {state: 0 for state in TERMINAL}
        # Set by the runtime between batches. Draining (a graceful stop in progress):
        # assign nothing, let running attempts finish. Paused (storage is failing): also
        # make no change of the core's own accord (no due promotion, no retention purge),
        # so that only requests and worker events ever ask for a commit.
        self.draining = False
        self.paused = False

    # ---- bookkeeping -------------------------------------------------------------

    def _job_id(self, seq: int) -> str:
        """A new job id: the sequence (so ids sort, and inserts append to the primary-key
        index) followed by 96 random bits (so ids never collide with rows of an older
        database, whatever their sequence). No syscall: the generator was seeded once."""
        if self._new_id is not None:
            return self._new_id()
        return "%08x%024x" % (seq, _random.getrandbits(96))

    @property
    def running_attempts(self) -> int:
        """Attempts whose lease a live worker holds (JSON and Periodic): O(workers)."""
        return sum(len(s.running) for s in self.workers) + sum(len(s.running) for s in self.pworkers.values())

    @property
    def active_count(self) -> int:
        """Non-terminal jobs: the admission-control counter (O(1))."""
        return len(self.jobs)

    def _touch(self, job: Job) -> None:
        self._dirty[job.job_id] = job

    def take_dirty(self) -> Batch:
        """What to commit for everything changed since the last call."""
        inserts, updates = [], []
        for job_id, job in self._dirty.items():
            if job_id in self._new:
                inserts.append(insert_row(job))
            else:
                updates.append(update_row(job))
        batch = Batch(inserts, updates, self._new_types, self._purges)
        self._new_types, self._purges = [], []
        self._dirty = {}
        self._new = set()
        return batch

    def _event(self, job: Job, now_millis: int, event: str, detail: str | None = None,
               retry_at: int | None = None, attempt: int | None = None, worker_id: str | None = None) -> None:
        """Append one event to the job's timeline (its ``events`` column, committed with the
        job's row in this batch); only the newest EVENTS_KEPT are kept. ``retry_at`` is
        core time; the timeline holds wall-clock instants."""
        if job.event_count < 0:  # read back from the store: count what it holds
            stored = load_events(job.events)
            job.event_count = len(stored)
            job.event_last_at = stored[-1][0] if stored else 0
        at = now_millis + self.drift
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

    def take_outbound(self) -> list[tuple[Any, Any]]:
        out, self.outbound = self.outbound, []
        return out

    def _send(self, conn: Any, msg: m.Message | bytes | pc.Paced | None) -> None:
        self.outbound.append((conn, msg))

    def _remember_finished(self, job: Job) -> None:
        self.finished[job.job_id] = job
        self.finished.move_to_end(job.job_id)
        if job.idempotency_key is not None:
            self.keys[job.idempotency_key] = job.job_id
        while len(self.finished) > FINISHED_CACHE:
            _, old = self.finished.popitem(last=False)
            if old.idempotency_key is not None and self.keys.get(old.idempotency_key) == old.job_id:
                del self.keys[old.idempotency_key]

    def _lookup(self, job_id: str) -> Job | None:
        """Any job by id: active, recently finished, or read back from the store."""
        job = self.jobs.get(job_id)
        if job is not None:
            return job
        job = self.finished.get(job_id)
        if job is not None:
            return job
        job = self.store.get(job_id)
        if job is not None and job.state in TERMINAL:
            self._remember_finished(job)
        return job

    def _lookup_key(self, key: str) -> Job | None:
        job_id = self.keys.get(key)
        if job_id is not None:
            return self._lookup(job_id)
        job = self.store.find_by_key(key)
        if job is not None and job.state in TERMINAL:
            self._remember_finished(job)
        return job

    # ---- the one transition method ---------------------------------------------------

    def _transition(self, job: Job, target: JobState, now_millis: int, *, due_at: int | None = None,
                    session: Session | None = None, event: str | None = "") -> None:
        """Move an active job to ``target`` and keep every index in step with it.

        Leaving QUEUED leaves the queue; leaving RUNNING frees the lease holder's slot.
        Entering QUEUED joins the job's type queue; RETRY_WAIT and SCHEDULED take
        ``due_at`` and join the due heap; RUNNING takes ``session`` and issues a new lease
        with its deadline; a terminal state leaves the active set (freeing its admission
        slot) for the finished cache. The per-state counts follow, the move is written to
        the job's timeline (``event``: "" the state's own event, None none, or another
        name), and the job is marked dirty for the batch's commit.
        """
        source = job.state
        holder_id = job.worker_id  # the lease holder while RUNNING
        periodic = job.periodic is not None
        if source is JobState.RUNNING and holder_id is not None:
            holder = self.workers.get(holder_id)
            if holder is None and periodic:
                holder = self.pworkers.get(holder_id)
            if holder is not None:
                holder.running.discard(job.job_id)
        elif source is JobState.QUEUED and not periodic:
            self.queued.discard(job.job_id)
        job.move_to(target, now_millis + self.drift)
        counts = self.counts
        key = (source, job.task_type, job.priority, periodic)
        counts[key] -= 1
        if not counts[key]:
            del counts[key]
        if target is JobState.QUEUED:
            if source is JobState.SCHEDULED and job.wake_at is not None:
                job.ready_at = job.wake_at  # it became due at its run-at time, not when the sweep saw it
            if not periodic:
                self.queued.add(job.job_id, job.task_type, job.priority.level, job.ready_at, job.seq)
        elif target is JobState.RUNNING:
            assert session is not None, "an assignment needs a worker"
            job.attempts += 1
            # Unique per assignment: attempts only grows, and is durable before any send.
            job.attempt_id = "%s.%d" % (job.job_id, job.attempts)
            job.worker_id = session.worker_id
            job.deadline = now_millis + (job.execution_timeout or self.config.task_timeout_millis)
            heapq.heappush(self.deadline_heap, (job.deadline, job.job_id, job.attempt_id))
            session.running.add(job.job_id)
            holder_id = session.worker_id
        elif target is JobState.RETRY_WAIT or target is JobState.SCHEDULED:
            assert due_at is not None, "a waiting job needs its due time"
            if target is JobState.RETRY_WAIT:
                job.retry_at = due_at + self.drift
                self.stats.retries += 1
            else:
                job.run_at = due_at + self.drift
            self._wait_until(job, due_at)
        if target in TERMINAL:
            self.jobs.pop(job.job_id, None)
            self._remember_finished(job)
            self.finished_counts[target] += 1
            if self.waiters:
                self.waiters.wake_job(job.job_id)  # answered after this batch's commit
        else:
            counts[(target, job.task_type, job.priority, periodic)] += 1
        if periodic:
            self._periodic_moved(job, source, target, now_millis)
        if event is None:
            self._touch(job)
        elif target is JobState.RUNNING or (source is JobState.RUNNING and target in _ABOUT_THE_LEASE):
            self._event(job, now_millis, event or TRANSITION_EVENTS[target], None, None, job.attempts, holder_id)
        else:
            detail = job.error if target is JobState.FAILED else None
            self._event(job, now_millis, event or TRANSITION_EVENTS[target], detail, due_at)

    def _wait_until(self, job: Job, wake_at: int) -> None:
        """Put a SCHEDULED or RETRY_WAIT job on the due heap for ``wake_at`` (core time)."""
        job.wake_at = wake_at
        heapq.heappush(self.due_heap, (wake_at, job.job_id))

    def observe_wall(self, now_millis: int, wall_millis: int) -> None:
        """The wall clock reads ``wall_millis`` at core time ``now_millis``. After a step
        of more than a second, SCHEDULED jobs (due at wall-clock instants) are re-timed;
        durations (heartbeats, deadlines, backoff) are core time and do not move."""
        drift = wall_millis - now_millis
        step = drift - self.drift
        self.drift = drift
        if abs(step) <= WALL_STEP_MILLIS:
            return
        log.warning("the wall clock stepped by %+d ms; timeouts are unaffected, scheduled jobs follow it", step)
        for job in self.jobs.values():
            if job.state is JobState.SCHEDULED and job.run_at is not None:
                self._wait_until(job, job.run_at - drift)

    # ---- recovery ------------------------------------------------------------------

    def recover(self, now_millis: int) -> dict[str, int]:
        """Load non-terminal jobs and known task types from the store (before any listener opens).

        RUNNING jobs lost their worker and their attempt's outcome is unknown: requeue
        them if budget remains, else fail them. Their old deadline is discarded; the next
        assignment stamps a fresh one. SCHEDULED jobs keep their time; those that fell
        due while the coordinator was down are queued now.
        """
        # queued: QUEUED after recovery, including the requeued and those due while down
        stats = {"queued": 0, "scheduled": 0, "retry_wait": 0, "requeued": 0, "due": 0, "failed": 0}
        self.known_types.update(self.store.load_task_types())
        wall = now_millis + self.drift
        for job in self.store.load_active():
            self.jobs[job.job_id] = job
            job.ready_at = job.due_at - self.drift
            self.counts[(job.state, job.task_type, job.priority, job.periodic is not None)] += 1
            if job.idempotency_key is not None:
                self.keys[job.idempotency_key] = job.job_id
            if job.periodic is not None:
                self._periodic_adopt(job)
            state = job.state
            if state is JobState.RUNNING:
                if job.periodic is not None or job.attempts < job.max_attempts:
                    self._event(job, now_millis, "RECOVERED", "coordinator restarted: attempt %d requeued"
                                % job.attempts, attempt=job.attempts, worker_id=job.worker_id)
                    self._transition(job, JobState.QUEUED, now_millis, event=None)
                    stats["requeued"] += 1
                    stats["queued"] += 1
                else:
                    job.error = "coordinator restarted during the final attempt (%d of %d)" % (
                        job.attempts, job.max_attempts)
                    self._event(job, now_millis, "RECOVERED", job.error, attempt=job.attempts,
                                worker_id=job.worker_id)
                    self._transition(job, JobState.FAILED, now_millis)
                    stats["failed"] += 1
            elif state is JobState.QUEUED:
                if job.periodic is None:
                    self.queued.add(job.job_id, job.task_type, job.priority.level, job.ready_at, job.seq)
                else:
                    self._periodic_enter(job, self._pfunc(job.task_type))
                stats["queued"] += 1
            elif state is JobState.SCHEDULED and (job.run_at is None or job.run_at <= wall):
                self._event(job, now_millis, "RECOVERED", "fell due while the coordinator was down")
                self._transition(job, JobState.QUEUED, now_millis)
                stats["due"] += 1
                stats["queued"] += 1
            else:  # RETRY_WAIT, or SCHEDULED in the future
                due = _due_time(job)
                if due is None:  # an older or hand-edited row: due now
                    due = wall
                    job.retry_at = due
                    self._touch(job)
                self._wait_until(job, due - self.drift)
                if job.periodic is not None:
                    self._periodic_enter(job, self._pfunc(job.task_type))
                stats["retry_wait" if state is JobState.RETRY_WAIT else "scheduled"] += 1
        self.next_seq = self.store.max_seq() + 1
        return stats

    # ---- worker events -------------------------------------------------------------------

    def on_worker_registered(self, now_millis: int, conn: Any, msg: m.WorkerRegister) -> None:
        worker_id, capacity = msg.worker_id, msg.capacity
        if not 1 <= capacity <= 1024:
            self._refuse(conn, "capacity must be 1..1024, got %s" % quote(capacity))
            return
        if not worker_id or len(worker_id) > MAX_WORKER_ID_CHARS:
            self._refuse(conn, "workerId must be 1..%d characters" % MAX_WORKER_ID_CHARS)
            return
        if self.workers.by_conn(conn) is not None:
            self._refuse(conn, "this connection is already registered")
            return
        if self.workers.get(worker_id) is not None:
            log.warning("refused duplicate registration worker=%s", worker_id)
            self._refuse(conn, "worker id %s belongs to a live session" % quote(worker_id))
            return
        types = BUILTIN_TYPES if msg.task_types is None else frozenset(msg.task_types)
        for name in sorted(types - self.known_types):
            self.known_types.add(name)
            self._new_types.append((name, now_millis + self.drift))  # durable before the registration is answered
            log.info("new task type declared type=%s worker=%s", name, worker_id)
        session = Session(worker_id, capacity, conn, now_millis, types)
        self.workers.add(session)
        for name in types:
            self.workers_by_type.setdefault(name, set()).add(session)
        self._send(conn, m.WorkerRegistered(worker_id))
        log.info("worker registered worker=%s capacity=%d types=%s", worker_id, capacity, ",".join(sorted(types)))

    def _refuse(self, conn: Any, reason: str) -> None:
        self._send(conn, m.Error(reason))
        self._send(conn, None)

    def on_heartbeat(self, now_millis: int, conn: Any, worker_id: str) -> None:
        session = self.workers.by_conn(conn)
        if session is not None and session.worker_id == worker_id and now_millis > session.last_heartbeat:
            session.last_heartbeat = now_millis

    def on_task_result(self, now_millis: int, conn: Any, res: m.TaskResult) -> None:
        session = self.workers.by_conn(conn)
        job = self.jobs.get(res.job_id)
        if (
            session is None
            or session.worker_id != res.worker_id
            or job is None
            or job.state is not JobState.RUNNING
            or job.attempt_id != res.attempt_id
            or job.worker_id != res.worker_id
        ):
            log.warning("stale result dropped job=%s attempt=%s worker=%s", res.job_id, res.attempt_id, res.worker_id)
            self.stats.stale_results += 1
            if session is not None and self._stale_flood(session, now_millis):
                return
            if job is not None:
                self._event(job, now_millis, "STALE_RESULT", "a result for a lease that had ended was dropped",
                            attempt=_attempt_number(job.job_id, res.attempt_id), worker_id=res.worker_id)
            return
        if res.success:
            result = res.result if res.result is not None else {}
            if too_deep(result):
                self._retry_or_fail(job, now_millis, "result nested deeper than %d levels" % MAX_NESTING,
                                    "ATTEMPT_FAILED")
                return
            if not is_finite_json(result):
                self._retry_or_fail(job, now_millis, "result holds NaN or Infinity, which JSON does not allow",
                                    "ATTEMPT_FAILED")
                return
            if len(ujson.dumps(result)) > MAX_RESULT_BYTES:
                self._retry_or_fail(job, now_millis, "result larger than %d bytes" % MAX_RESULT_BYTES, "ATTEMPT_FAILED")
                return
            job.result = result
            self._transition(job, JobState.COMPLETED, now_millis)
            log.debug("completed job=%s attempt=%d", job.job_id, job.attempts)
        else:
            error = (res.error or "task failed without an error message")[:MAX_ERROR_CHARS]
            self._retry_or_fail(job, now_millis, error, "ATTEMPT_FAILED")

    def _stale_flood(self, session: Session, now_millis: int) -> bool:
        """Count a session's stale results; more than MAX_STALE_PER_SECOND in a second
        is a flood (or forgery): the connection is closed."""
        if now_millis - session.stale_since >= 1000:
            session.stale_since, session.stale_count = now_millis, 0
        session.stale_count += 1
        if session.stale_count <= MAX_STALE_PER_SECOND:
            return False
        log.warning("closing worker=%s: more than %d results a second for leases it does not hold",
                    session.worker_id, MAX_STALE_PER_SECOND)
        self._refuse(session.conn, "more than %d results a second for leases this worker does not hold"
                     % MAX_STALE_PER_SECOND)
        session.stale_count = -10**9  # refused once is enough
        return True

    def on_worker_disconnected(self, now_millis: int, conn: Any) -> None:
        session = self.workers.by_conn(conn)
        if session is None:
            return
        log.warning("worker disconnected worker=%s running=%d", session.worker_id, len(session.running))
        self._drop_session(session, now_millis, "worker %s disconnected" % session.worker_id)

    def _drop_session(self, session: Session, now_millis: int, reason: str) -> None:
        self.workers.remove(session)
        self.stats.workers_lost += 1
        for name in session.task_types:
            able = self.workers_by_type.get(name)
            if able is not None:
                able.discard(session)
                if not able:
                    del self.workers_by_type[name]
        for job_id in sorted(session.running):
            job = self.jobs.get(job_id)
            if job is not None and job.state is JobState.RUNNING and job.worker_id == session.worker_id:
                self._retry_or_fail(job, now_millis, "attempt %d lost: %s" % (job.attempts, reason), "WORKER_LOST")
        session.running.clear()

    # ---- outcomes ---------------------------------------------------------------------

    def _revoke_lease(self, job: Job, why: str) -> None:
        """Tell the owning worker to stop this attempt (best effort); the transition that
        follows frees its slot."""
        session = self.workers.get(job.worker_id) if job.worker_id else None
        if session is not None and job.attempt_id is not None:
            self._send(session.conn, m.TaskCancel(job.job_id, job.attempt_id))
        log.debug("revoked lease job=%s attempt=%s why=%s", job.job_id, job.attempt_id, why)

    def _retry_or_fail(self, job: Job, now_millis: int, error: str, cause: str) -> None:
        """An attempt ended without a result (``cause``: ATTEMPT_FAILED, LEASE_EXPIRED or
        WORKER_LOST, written to the timeline): RETRY_WAIT while attempts remain, else FAILED."""
        job.error = error
        self._event(job, now_millis, cause, error, attempt=job.attempts, worker_id=job.worker_id)
        if job.periodic is not None:
            self._periodic_retry(job, now_millis, error)
            return
        if job.attempts < job.max_attempts:
            delay = scheduler.retry_delay_millis(job.attempts, self.config.retry_base_millis, self.config.retry_cap_millis)
            self._transition(job, JobState.RETRY_WAIT, now_millis, due_at=now_millis + delay)
            log.info("retry job=%s attempt=%d/%d in=%dms error=%s", job.job_id, job.attempts, job.max_attempts, delay, error)
        else:
            self._transition(job, JobState.FAILED, now_millis)
            log.info("failed job=%s attempts=%d error=%s", job.job_id, job.attempts, error)

    # ---- sweep -----------------------------------------------------------------------

    def after_batch(self, now_millis: int) -> None:
        """Work after each batch: schedule, and keep purging while the last pass was full."""
        self.schedule_queued_jobs(now_millis)
        if self._pready:
            self.dispatch_periodic(now_millis)
        if self._purge_backlog:
            self.purge_expired(now_millis, PURGE_BATCH)


    def sweep(self, now_millis: int) -> None:
        """Dead workers, then expired deadlines, then due jobs, then scheduling, then
        retention, then waits whose time is up."""
        self.detect_dead_workers(now_millis)
        self.detect_expired_deadlines(now_millis)
        self.promote_due_jobs(now_millis)
        self.schedule_queued_jobs(now_millis)
        if self._pready:
            self.dispatch_periodic(now_millis)
        self.purge_expired(now_millis)
        self.expire_waits(now_millis)
        if self._pwait_heap:
            self.expire_periodic_waits(now_millis)

    def detect_dead_workers(self, now_millis: int) -> None:
        limit = self.config.heartbeat_timeout_millis
        for session in self.workers:
            silent = now_millis - session.last_heartbeat
            if silent > limit:
                log.warning("worker presumed dead worker=%s silent=%dms running=%d",
                            session.worker_id, silent, len(session.running))
                self._send(session.conn, None)
                self._drop_session(
                    session, now_millis, "worker %s presumed dead (no heartbeat for %d ms)" % (session.worker_id, silent)
                )

    def _compact_deadlines(self) -> None:
        """Drop heap entries of leases that already ended, once they outnumber live ones.

        Every assignment pushes an entry that otherwise stays until its deadline passes
        (10 minutes by default); at thousands of assignments a second that would be
        gigabytes. Rebuilding costs O(running), amortised over as many ended leases.
        """
        sessions: list[Session] = list(itertools.chain(self.workers, self.pworkers.values()))
        running = sum(len(s.running) for s in sessions)
        if len(self.deadline_heap) <= 2 * running + 1024:
            return
        live: list[tuple[int, str, str]] = []
        for session in sessions:
            for job_id in session.running:
                job = self.jobs.get(job_id)
                if (job is not None and job.state is JobState.RUNNING and job.deadline is not None
                        and job.attempt_id is not None):
                    live.append((job.deadline, job_id, job.attempt_id))
        heapq.heapify(live)
        self.deadline_heap = live

    def detect_expired_deadlines(self, now_millis: int) -> None:
        self._compact_deadlines()
        heap = self.deadline_heap
        while heap and heap[0][0] <= now_millis:
            _, job_id, attempt_id = heapq.heappop(heap)
            job = self.jobs.get(job_id)
            if job is None or job.state is not JobState.RUNNING or job.attempt_id != attempt_id:
                continue  # that lease already ended
            timeout = job.execution_timeout or self.config.task_timeout_millis
            log.warning("deadline expired job=%s attempt=%s worker=%s", job_id, attempt_id, job.worker_id)
            self.stats.deadline_expiries += 1
            self._revoke_lease(job, "deadline")
            self._retry_or_fail(
                job, now_millis, "attempt %d exceeded its execution deadline of %d ms" % (job.attempts, timeout),
                "LEASE_EXPIRED",
            )

    def _compact_due(self) -> None:
        """Drop due-heap entries of jobs no longer waiting for that time (cancelled ones),
        once they outnumber the jobs that still wait."""
        heap = self.due_heap
        if len(heap) <= 2 * len(self.jobs) + 1024:
            return
        live = [(t, job_id) for t, job_id in heap
                if (job := self.jobs.get(job_id)) is not None and job.wake_at == t and _due_time(job) is not None]
        heapq.heapify(live)
        self.due_heap = live

    def promote_due_jobs(self, now_millis: int) -> None:
        """SCHEDULED and RETRY_WAIT jobs whose time has come become QUEUED (one time-ordered heap)."""
        if self.paused:
            return
        self._compact_due()
        heap = self.due_heap
        while heap and heap[0][0] <= now_millis:
            due, job_id = heapq.heappop(heap)
            job = self.jobs.get(job_id)
            if job is None or job.wake_at != due or _due_time(job) is None:
                continue  # cancelled, or waiting for another time now
            self._transition(job, JobState.QUEUED, now_millis)

    def schedule_queued_jobs(self, now_millis: int) -> int:
        """Assign queued jobs, best first, each to the least-loaded free worker that runs its type.

        Only the types some free worker declared are candidates, so a job no free worker
        can run never holds back one that a free worker can run. Draining or paused, it
        assigns nothing.
        """
        queued = self.queued
        if not len(queued) or self.draining or self.paused:
            return 0
        free = [s for s in self.workers if len(s.running) < s.capacity]
        if not free:
            return 0
        runnable: Counter[str] = Counter()  # type -> free workers that run it
        for session in free:
            runnable.update(session.task_types)
        assigned = 0
        step = self.config.aging_step_millis
        while free and len(queued):
            picked = queued.pop_best(now_millis, step, runnable)
            if picked is None:
                break
            job_id, task_type = picked
            worker = scheduler.least_loaded(
                (s for s in free if task_type in s.task_types), lambda s: len(s.running), lambda s: s.capacity
            )
            assert worker is not None, "runnable counts a free worker for this type"
            job = self.jobs[job_id]
            self._transition(job, JobState.RUNNING, now_millis, session=worker)
            self._send(worker.conn, m.TaskAssign(job.job_id, job.attempt_id or "", job.attempts, job.task_type,
                                                 job.payload))
            log.debug("assigned job=%s attempt=%s worker=%s", job.job_id, job.attempt_id, worker.worker_id)
            assigned += 1
            if len(worker.running) >= worker.capacity:
                free.remove(worker)
                for name in worker.task_types:
                    runnable[name] -= 1
                    if runnable[name] <= 0:
                        del runnable[name]  # no free worker runs it any more
        return assigned
