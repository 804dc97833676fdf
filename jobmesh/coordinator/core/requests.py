"""The core's client requests: submit, status, timelines, waits, listings, retry, purge
and cancel (docs/PROTOCOL.md), and retention.

``ClientRequests`` is a plain class over the job table and the two protocol parts, on
the core greenlet. Every request method returns its reply message (``wait_job`` may
return a Slot: its reply comes later, from ``take_answers``); state changes go through
the table and commit with the batch like everything else. Nothing here scans all jobs:
listings read the store a page at a time. Pending WAIT_JOBs (``waiters.py``) are its
own; as the table's listener it answers them when their job ends.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

import ujson

from jobmesh.coordinator.core.figures import Counters
from jobmesh.store.job import MAX_RUN_AT_MILLIS, Job
from jobmesh.coordinator.core.json_jobs import JsonJobs
from jobmesh.coordinator.core.limits import Limits, check_key
from jobmesh.coordinator.core.periodic.jobs import PeriodicJobs
from jobmesh.store.base import Read, Store
from jobmesh.store.columns import load_events
from jobmesh.coordinator.core.table import JobTable
from jobmesh.coordinator.core.waiters import MAX_WAIT_MILLIS, Slot, Waiter, Waiters
from jobmesh.errors import PayloadError
from jobmesh.auth import type_refusal
from jobmesh.protocol import messages as m
from jobmesh.protocol.framing import MAX_FRAME
from jobmesh.protocol.jobs import TERMINAL, JobState, Priority
from jobmesh.protocol.messages import quote
from jobmesh.protocol.payloads import (MAX_ATTEMPTS_LIMIT, MAX_NESTING, MAX_TIMEOUT_MILLIS, MAX_TTL_MILLIS, TASK_SPECS,
                                       is_finite_json, too_deep, validate_payload)

if TYPE_CHECKING:
    from jobmesh.coordinator.core.peers import ReplyConnection

log = logging.getLogger(__name__)

MAX_KEY_CHARS = 1024
MAX_PAYLOAD_BYTES = MAX_FRAME - 4096  # leaves room for TASK_ASSIGN's other fields
LIST_DEFAULT = 100
LIST_MAX = 1000
LIST_MAX_BYTES = 900 * 1024  # keep JOB_LIST below the 1 MiB frame limit
PURGE_SWEEP = 1000  # finished jobs purged per sweep at most (retention)
PURGE_REQUEST_MAX = 10_000  # per PURGE_JOBS request
SCHEDULE_KEYS = "schedule:"  # the idempotency keys of jobs that schedules make (schedules.py)
EVENT_FIELDS = ("atMillis", "event", "attempt", "workerId", "detail", "retryAtMillis")  # one stored event


class Prepared(NamedTuple):
    """A SUBMIT_JOB (or a workflow's job) checked, as ``ClientRequests.create`` makes it."""

    task_type: str
    payload: dict[str, Any]
    payload_json: str | None  # None: encoded when first needed (a retry's)
    max_attempts: int
    priority: Priority
    key: str | None  # idempotencyKey
    run_at: int | None
    submitted_by: str | None
    timeout: int | None
    result_ttl: int | None
    keys: tuple[str | None, str | None]  # concurrencyKey, uniqueKey


def rejected(table: JobTable, why: str = "coordinator is at its active-job limit; retry later") -> m.SubmitRejected:
    """A submit refused at the active-job limit (--max-active-jobs), counted as rejected."""
    table.counters.rejected += 1
    return m.SubmitRejected(why, table.active_count, table.config.max_active_jobs, True)


Membership = tuple[str, str, list[str]]  # a workflow's job: the workflow id, its ref, the refs it depends on


class ClientRequests:
    """The core's client requests; see the module docstring."""

    def __init__(self, table: JobTable, json: JsonJobs, periodic: PeriodicJobs, counters: Counters,
                 limits: Limits) -> None:
        self.table = table
        self.limits = limits
        self.config = table.config
        self.json = json
        self.periodic = periodic
        self.counters = counters
        self.waiters = Waiters()  # pending WAIT_JOB requests
        self.purge_backlog = False  # the last retention walk stopped early: more may be due
        self._purge_cursor = 0  # where the next retention walk starts
        self._retention: Read[Retention] | None = None  # retention's store reads, while in flight
        table.listen_moves(self)  # a job's end answers its waits

    # ---- the table's listener: a job that ends answers its waits ---------------------------

    def moved(self, job: Job, source: JobState, target: JobState, now_millis: int) -> None:
        if target in TERMINAL and self.waiters:
            self.waiters.wake_job(job.job_id)  # answered after this batch's commit

    def check_payload(self, task_type: str, payload: dict[str, Any]) -> str | None:
        """Why ``payload`` cannot be submitted as ``task_type``; None if it can."""
        if task_type in TASK_SPECS:
            try:
                validate_payload(task_type, payload)
            except PayloadError as exc:
                return str(exc)
            return None
        if task_type not in self.table.known_types:
            known = sorted(self.table.known_types)
            listed = ", ".join(known[:20]) + (" and %d more" % (len(known) - 20) if len(known) > 20 else "")
            return "unknown task type %s: no worker has declared it (known: %s)" % (quote(task_type), listed)
        if too_deep(payload):
            return "%s payload nested deeper than %d levels" % (task_type, MAX_NESTING)
        if not is_finite_json(payload):
            return "%s payload holds NaN or Infinity, which JSON does not allow" % task_type
        return None

    def _run_at(self, now_millis: int, req: m.SubmitJob) -> tuple[int | None, str | None]:
        """(run-at time or None, error or None) from a submit's runAtMillis/delayMillis."""
        run_at, delay = req.run_at_millis, req.delay_millis
        if run_at is not None and delay is not None:
            return None, "give runAtMillis or delayMillis, not both"
        if delay is not None:
            if delay < 0:
                return None, "delayMillis must be a non-negative integer, got %s" % quote(delay)
            run_at = now_millis + self.table.drift + delay
        elif run_at is not None and run_at < 0:
            return None, "runAtMillis must be a non-negative integer, got %s" % quote(run_at)
        if run_at is not None and run_at > MAX_RUN_AT_MILLIS:
            return None, "the run-at time must be before the year 10000"
        return run_at, None

    def prepare(self, now_millis: int, req: m.SubmitJob) -> Prepared | m.Error:
        """A submit checked: what ``create`` makes of it, or the ERROR that refuses it
        (everything but its idempotency and unique keys' bindings, which depend on other jobs)."""
        try:
            priority = Priority.parse(req.priority)
        except ValueError as exc:
            return m.Error(str(exc))
        max_attempts = req.max_attempts if req.max_attempts > 0 else self.table.max_attempts_of(req.task_type)
        if max_attempts > MAX_ATTEMPTS_LIMIT:
            return m.Error("maxAttempts must be at most %d, got %s" % (MAX_ATTEMPTS_LIMIT, quote(max_attempts)))
        timeout, ttl = req.timeout_millis, req.result_ttl_millis
        if timeout is not None and not 1 <= timeout <= MAX_TIMEOUT_MILLIS:
            return m.Error("timeoutMillis must be 1..%d (7 days), got %s" % (MAX_TIMEOUT_MILLIS, quote(timeout)))
        if ttl is not None and not 0 <= ttl <= MAX_TTL_MILLIS:
            return m.Error("resultTtlMillis must be 0..%d (ten years), got %s" % (MAX_TTL_MILLIS, quote(ttl)))
        problem = self.check_payload(req.task_type, req.payload)
        if problem is not None:
            return m.Error(problem)
        run_at, problem = self._run_at(now_millis, req)
        if problem is not None:
            return m.Error(problem)
        # The payload travels again inside TASK_ASSIGN, which must fit in one frame too.
        payload_json = ujson.dumps(req.payload, ensure_ascii=False, escape_forward_slashes=False)
        if len(payload_json) * 4 > MAX_PAYLOAD_BYTES:  # UTF-8 takes at most 4 bytes a character
            size = len(payload_json.encode("utf-8"))
            if size > MAX_PAYLOAD_BYTES:
                return m.Error("payload is %d bytes encoded; at most %d fit in a task assignment" % (
                    size, MAX_PAYLOAD_BYTES))
        if req.concurrency_key is not None or req.unique_key is not None:
            problem = check_key("concurrencyKey", req.concurrency_key) or check_key("uniqueKey", req.unique_key)
            if problem is not None:
                return m.Error(problem)
        key = req.idempotency_key
        if key is not None:
            if len(key) > MAX_KEY_CHARS:
                return m.Error("idempotencyKey must be at most %d characters" % MAX_KEY_CHARS)
            if "\x00" in key:  # PostgreSQL's text cannot hold it: two keys would become one there
                return m.Error("idempotencyKey must not contain the NUL character (\\u0000)")
            if key.startswith(SCHEDULE_KEYS):  # a fire's key taken by a submit would stop that fire's commit
                return m.Error("idempotencyKey %s: keys beginning %r belong to recurring schedules"
                               % (quote(key), SCHEDULE_KEYS))
        return Prepared(req.task_type, req.payload, payload_json, max_attempts, priority, key, run_at,
                        req.submitted_by, timeout, ttl, (req.concurrency_key, req.unique_key))

    def submit_job(self, now_millis: int, req: m.SubmitJob) -> m.Message:
        new = self.prepare(now_millis, req)
        if isinstance(new, m.Error):
            return new
        key = new.key
        if key is not None:
            existing = self.table.lookup_key(key)
            if existing is not None:
                if existing.same_request(new.task_type, new.payload, new.max_attempts, new.priority):
                    return m.JobSubmitted(existing.job_id)
                log.warning("idempotency conflict key=%s job=%s", quote(key), existing.job_id)
                return m.Error(
                    "idempotencyKey %s is already bound to job %s with a different request "
                    "(taskType, payload, maxAttempts or priority differ)" % (quote(key), existing.job_id)
                )
        if req.unique_key is not None:  # after the idempotency key: a resend of a submit answers its own job
            live = self.limits.unique.get((req.task_type, req.unique_key))
            if live is not None:
                return m.JobSubmitted(live, duplicate=True)
            self.limits.listen()  # the job's end frees its key
        return self.create(now_millis, new)

    def create(self, now_millis: int, new: Prepared, flow: Membership | None = None,
               retry_of: str | None = None) -> m.Message:
        """Admit and create a checked submit's job (SUBMITTED, then QUEUED or SCHEDULED, or
        WAITING for its dependencies); the reply to its submit. ``flow``: the job belongs to
        a workflow (its id, its ref, the refs it depends on: WAITING while there are some).
        ``retry_of``: the finished job it retries. ``new.submitted_by`` is the name of the token
        that asked (auth on), which the SUBMITTED event names too; ``new.keys`` its
        concurrencyKey and uniqueKey. ``new.timeout`` and the retry backoff not given come
        from the task type's declared defaults (``JobTable.give_defaults``)."""
        (task_type, payload, payload_json, max_attempts, priority, key, run_at, submitted_by, timeout, result_ttl,
         keys) = new
        if self.table.active_count >= self.config.max_active_jobs:
            return rejected(self.table)
        later = run_at is not None and run_at > now_millis + self.table.drift
        state = JobState.SCHEDULED if later else JobState.QUEUED
        if flow is not None and flow[2]:
            state = JobState.WAITING
        job = self.table.new_job(now_millis, task_type, payload, max_attempts, priority, state, key, None,
                                 payload_json, run_at, retry_of)
        self.table.give_defaults(job, timeout)
        job.result_ttl = result_ttl
        job.concurrency_key, job.unique_key = keys
        if flow is not None:
            job.workflow_id, job.ref, depends_on = flow
            job.depends_on = depends_on or None
        detail = None if retry_of is None else "retry of %s" % retry_of
        if submitted_by is not None:
            job.submitted_by = submitted_by
            detail = "by %s" % submitted_by if detail is None else "%s by %s" % (detail, submitted_by)
        self.table.admit(job, now_millis, detail)
        log.debug("submitted job=%s type=%s priority=%s run_at=%s", job.job_id, task_type, priority.value, run_at)
        return m.JobSubmitted(job.job_id)

    def _waiting(self, job: Job) -> str:
        """Why a QUEUED job is not running: its part knows."""
        return self.json.waiting_reason(job) if job.periodic is None else self.periodic.waiting_reason(job)

    def _revoke(self, job: Job) -> None:
        if job.periodic is None:
            self.json.revoke_lease(job, "cancelled")

    def snapshot(self, job: Job) -> dict[str, Any]:
        """A job's wire snapshot, with its waiting reason."""
        return job.snapshot(self._waiting(job) if job.state is JobState.QUEUED else None)

    def get_job_status(self, now_millis: int, job_id: str) -> m.Message:
        job = self.table.lookup(job_id)
        if job is None:
            return m.Error("unknown job %s" % quote(job_id))
        return m.JobStatus(self.snapshot(job))

    def get_job_payload(self, now_millis: int, job_id: str) -> m.Message:
        """The job's payload (GET_JOB_PAYLOAD, also the dashboard's job view; the snapshot has
        none); null for a Periodic job, whose workload is bytes."""
        job = self.table.lookup(job_id)
        if job is None:
            return m.Error("unknown job %s" % quote(job_id))
        return m.JobPayload(job_id, job.payload if job.periodic is None else None)

    def get_job_events(self, now_millis: int, job_id: str) -> m.Message:
        """The job's timeline: what the store holds, then this batch's events not committed yet."""
        job = self.table.lookup(job_id)
        if job is None:
            return m.Error("unknown job %s" % quote(job_id))
        events = []
        for stored in load_events(job.events):
            item = {name: value for name, value in zip(EVENT_FIELDS, stored) if value is not None}
            if "attempt" in item:
                item["attemptId"] = "%s.%d" % (job_id, item["attempt"])  # attempt ids are <jobId>.<n>
            events.append(item)
        return m.JobEvents(job_id, events)

    def wait_job(self, now_millis: int, conn: ReplyConnection, req: m.WaitJob, slot: Slot | None = None
                 ) -> m.Message | Slot:
        """WAIT_JOB: the JOB_STATUS reply now if the job has ended (or the timeout is 0),
        else a Slot (``slot`` if given: the request was held for a store read): the
        reply's place on ``conn``, filled by ``take_answers`` once the job ends or
        ``timeoutMillis`` has passed."""
        timeout = req.timeout_millis
        if not 0 <= timeout <= MAX_WAIT_MILLIS:
            return m.Error("timeoutMillis must be 0..%d, got %s" % (MAX_WAIT_MILLIS, quote(timeout)))
        job = self.table.lookup(req.job_id)
        if job is None:
            return m.Error("unknown job %s" % quote(req.job_id))
        if job.state in TERMINAL or timeout == 0:
            return m.JobStatus(self.snapshot(job))
        slot = slot or Slot()
        self.waiters.add(Waiter(conn, slot, job.job_id, now_millis + timeout))
        return slot

    def expire_waits(self, now_millis: int) -> None:
        """Answer the waits whose time is up, with their job as it stands."""
        if self.waiters:
            self.waiters.expire(now_millis)

    def next_wait_deadline(self) -> int | None:
        """When the earliest pending wait times out (core time), or None."""
        return self.waiters.next_deadline() if self.waiters else None

    def on_client_closed(self, now_millis: int, conn: ReplyConnection) -> None:
        """A client connection ended with requests unanswered: forget its waits."""
        dropped = self.waiters.drop_conn(conn)
        if dropped:
            log.debug("dropped waits=%d of a closed client connection", dropped)

    def has_answers(self) -> bool:
        """Whether waits were answered since the last ``take_answers`` (checked every batch)."""
        return self.waiters.answered

    def take_answers(self) -> list[tuple[Waiter, m.Message]]:
        """The waits answered since the last call, each with its reply: the job's
        snapshot as it stands now (the end of the batch, which is what gets committed)."""
        answers: list[tuple[Waiter, m.Message]] = []
        for waiter in self.waiters.take():
            job = self.table.lookup(waiter.job_id)
            answers.append((waiter, m.JobStatus(self.snapshot(job)) if job is not None
                            else m.Error("unknown job %s" % quote(waiter.job_id))))
        return answers

    def adopt_waiters(self, now_millis: int, waiters: list[Waiter]) -> None:
        """Waits carried over from a core that was thrown away (a reload): each waits on
        this core's state, keeping its deadline; a job that ended, or that this state
        does not hold, is answered at the next ``take_answers``."""
        for waiter in waiters:
            job = self.table.lookup(waiter.job_id)
            self.waiters.add(waiter)
            if job is None or job.state in TERMINAL:
                self.waiters.wake_job(waiter.job_id)

    def retry_job(self, now_millis: int, job_id: str, submitted_by: str | None = None,
                  task_types: tuple[str, ...] | None = None) -> m.Message:
        """A new job with a finished job's type, payload, priority and budget; ``retryOf`` names it.
        A token limited to ``task_types`` may retry only jobs of those types."""
        job = self.table.lookup(job_id)
        if job is None:
            return m.Error("unknown job %s" % quote(job_id))
        if job.state not in TERMINAL:
            return m.Error("job %s is %s; only a finished job can be retried (cancel it first)"
                           % (job_id, job.state.value))
        if job.periodic is not None:
            return m.Error("job %s is a Periodic job; submit it again on the Periodic port (SUBMIT_JOB)" % job_id)
        refused = type_refusal(submitted_by, task_types, job.task_type)
        if refused is not None:
            return m.Error(refused)
        problem = self.check_payload(job.task_type, job.payload)
        if problem is not None:
            return m.Error("job %s cannot be retried: %s" % (job_id, problem))
        reply = self.create(now_millis, Prepared(job.task_type, job.payload, None, job.max_attempts, job.priority,
                                                 None, None, submitted_by, job.execution_timeout, job.result_ttl,
                                                 (job.concurrency_key, None)), retry_of=job_id)
        if isinstance(reply, m.JobSubmitted):
            log.info("retry submitted job=%s retry_of=%s", reply.job_id, job_id)
        return reply

    def purge_jobs(self, now_millis: int, req: m.PurgeJobs) -> m.Message:
        """Delete finished jobs last updated more than ``olderThanMillis`` ago (PURGE_JOBS), or
        with ``dryRun`` count them and delete nothing."""
        if req.older_than_millis < 0:
            return m.Error("olderThanMillis must be a non-negative integer, got %s" % quote(req.older_than_millis))
        limit = PURGE_REQUEST_MAX if req.limit is None else req.limit
        if not 1 <= limit <= PURGE_REQUEST_MAX:
            return m.Error("limit must be 1..%d, got %s" % (PURGE_REQUEST_MAX, quote(limit)))
        cutoff = now_millis + self.table.drift - req.older_than_millis
        store = self.table.store
        # The whole walk is one store read (the cutoff of the request's first application),
        # and what it found is forgotten at once: the purge commits in one batch.
        found = self.table.awaited(("purge", req.older_than_millis, limit, req.dry_run),
                                   lambda: store.later(partial(purge_scan, store, cutoff, limit)))
        purged = len(found) if req.dry_run else self.table.forget(found)
        if not req.dry_run:
            log.info("purged finished jobs count=%d older_than_millis=%d", purged, req.older_than_millis)
        return m.JobsPurged(purged, purged == limit)

    def purge_expired(self, now_millis: int, limit: int = PURGE_SWEEP) -> None:
        """Retention: purge finished jobs older than ``retain_finished_millis``, and those
        whose own time to live (resultTtlMillis) has passed, in small steps (each sweep,
        and each batch while more are due), so the database stops growing under a steady
        load without one large delete ever stalling the core.

        A job with a time to live is found by the store's expiry index, whatever its
        place in the sequence, and only there; the others by the walk in sequence order.

        The reads are one ``Store.later``: on a store whose reads finish later, this call
        starts them and a later one (the next sweep, or batch while more are due) forgets
        what they found; a finished job stays finished meanwhile."""
        read = self._retention
        if read is None:
            store, retain = self.table.store, self.config.retain_finished_millis
            read = store.later(partial(retention_reads, store, now_millis + self.table.drift,
                                       retain, self._purge_cursor, limit))
        if not read.ready():
            self._retention = read
            return
        self._retention = None
        expired, walk = read.result()
        if expired:
            self.table.forget(expired)
        if walk is None:  # no retention: only the jobs' own times to live
            self.purge_backlog = len(expired) >= limit
            return
        found, self._purge_cursor = walk
        self.table.forget(found)
        # Keep purging every batch only while walks find plenty (a walk that steps over
        # active jobs finds little, and waits for the next sweep).
        self.purge_backlog = (bool(self._purge_cursor) and len(found) * 2 >= limit) or len(expired) >= limit

    def list_workers(self, now_millis: int) -> m.Message:
        """Every live worker session: JSON workers, then Periodic ones (``protocol`` tells)."""
        drift, running = self.table.drift, self.table.running
        return m.WorkerList(fit_workers([s.snapshot(len(running(s)), drift) for s in self.json.workers]
                                        + [s.snapshot(len(running(s)), drift) for s in self.periodic.workers.values()]))

    def list_jobs(self, now_millis: int, req: m.ListJobs) -> m.Message:
        limit = LIST_DEFAULT if req.limit is None else req.limit
        if limit < 1:
            return m.Error("limit must be at least 1, got %s" % quote(limit))
        limit = min(limit, LIST_MAX)
        state = req.state
        if state is not None and state not in JobState.__members__:
            return m.Error("unknown state %s (one of %s)" % (quote(state), ", ".join(JobState.__members__)))
        before = None
        if req.cursor is not None:
            try:
                before = int(req.cursor)
                if not 1 <= before < 2**63:  # a rowid; anything else did not come from us
                    raise ValueError
            except ValueError:
                return m.Error("invalid cursor %s" % quote(req.cursor))
        store = self.table.store
        rows = self.table.awaited(("page", limit + 1, state, before, req.task_type),
                                  lambda: store.later(partial(store.list_page, limit + 1, state, before, req.task_type)))
        jobs: list[dict[str, Any]] = []
        size = 0
        next_cursor = None
        for i, (rowid, stored) in enumerate(rows):
            if i == limit:
                next_cursor = str(rows[i - 1][0])
                break
            live = self.table.current(stored)
            if state is not None and live.state.value != state:
                continue  # moved on since its last commit; it belongs to another state now
            snap = self.snapshot(live)
            size += len(ujson.dumps(snap)) + 1
            if size > LIST_MAX_BYTES and jobs:
                next_cursor = str(rows[i - 1][0])
                break
            jobs.append(snap)
        return m.JobList(jobs, next_cursor)

    def cancel_job(self, now_millis: int, job_id: str) -> m.Message:
        job = self.table.jobs.get(job_id)
        if job is None:
            done = self.table.lookup(job_id)
            if done is None:
                return m.Error("unknown job %s" % quote(job_id))
            return m.JobCancel(False, self.snapshot(done))
        self.cancel(job, now_millis)
        return m.JobCancel(True, self.snapshot(job))

    def cancel(self, job: Job, now_millis: int, detail: str | None = None) -> None:
        """Cancel an active job (its running attempt gets TASK_CANCEL); ``detail``: why, in its timeline."""
        if job.state is JobState.RUNNING:
            self._revoke(job)
        if detail is None:
            self.table.transition(job, JobState.CANCELLED, now_millis)
        else:
            self.table.transition(job, JobState.CANCELLED, now_millis, event=None)
            self.table.event(job, now_millis, "CANCELLED", detail)
        log.info("cancelled job=%s", job.job_id)


Found = list[tuple[str, str | None]]  # (job id, idempotency key) of finished jobs to purge
Retention = tuple[Found, tuple[Found, int] | None]  # expired jobs, and the walk's (found, next cursor)


def purge_scan(store: Store, cutoff_millis: int, limit: int) -> Found:
    """PURGE_JOBS's walk, whole: from the oldest row until ``limit`` finished jobs last
    updated before ``cutoff_millis`` are found or none are left (``Store.purgeable``)."""
    found: Found = []
    cursor = 0
    while len(found) < limit:
        page, cursor = store.purgeable(cursor, cutoff_millis, limit - len(found))
        found += page
        if not cursor:
            break
    return found


def retention_reads(store: Store, wall: int, retain: int, cursor: int, limit: int) -> Retention:
    """Retention's reads: the jobs whose own time to live has passed, and (with
    ``retain`` > 0) a step of the walk from ``cursor`` over the jobs without one."""
    expired = store.expired(wall, limit)
    # A job with a time to live of its own is kept that long, however long retention keeps the others.
    return expired, (store.purgeable(cursor, wall - retain, limit, False) if retain > 0 else None)


def fit_workers(items: list[dict[str, Any]], budget: int = LIST_MAX_BYTES) -> list[dict[str, Any]]:
    """WORKER_LIST's items within ``budget`` bytes, so the reply fits a frame whatever the
    workers declared: when their task types would pass it, each item keeps as many of its
    (sorted) ``taskTypes`` as its share of the budget holds and says how many it left out
    (``taskTypesOmitted``); workers past the budget even without their types are left out."""
    if sum(len(ujson.dumps(item)) + 1 for item in items) <= budget:
        return items
    fitted: list[dict[str, Any]] = []
    used = 0
    for item in items:
        bare = dict(item, taskTypes=[], taskTypesOmitted=len(item["taskTypes"]))
        size = len(ujson.dumps(bare)) + 1
        if used + size > budget:
            break
        fitted.append(bare)
        used += size
    share = (budget - used) // max(1, len(fitted))
    for bare, item in zip(fitted, items):
        kept, size = bare["taskTypes"], 0
        for name in item["taskTypes"]:
            size += len(ujson.dumps(name)) + 1
            if size > share:
                break
            kept.append(name)
        bare["taskTypesOmitted"] -= len(kept)
        if not bare["taskTypesOmitted"]:
            del bare["taskTypesOmitted"]
    return fitted
