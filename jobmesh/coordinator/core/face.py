"""CoordinatorCore: the single writer of all coordinator state, composed from parts.

A plain class: no gevent, no sockets, no clock. Every event is applied with the time
(``now``, core time: monotonic, ``clock.py``) read by its caller, so every duration
(heartbeat timeouts, deadlines, backoff) is immune to wall-clock steps; instants people
give or read are wall-clock, core time plus the table's ``drift``, kept current from the
wall clock each sweep carries (``observe_wall``).

The parts, each owning its state (docs/ARCHITECTURE.md):

* ``table`` (``table.py``): every job, the one ``admit`` and the one ``transition``,
  the rows to commit, counts, leases, timelines; it tells its listeners of every move;
* ``timers`` (``timers.py``): the due heap (SCHEDULED, RETRY_WAIT) and lease deadlines;
* ``json`` (``json_jobs.py``): typed queues, worker sessions, the scheduling pass;
* ``periodic`` (``periodic/jobs.py`` and the parts it composes): the Periodic port's funcs, names, tokens, locks, waits;
* ``requests`` (``requests.py``): the client requests, WAIT_JOB waiters and retention;
* ``schedules`` (``schedules.py``): recurring schedules, their fire times and policies;
* ``limits`` (``limits.py``): limits per task type, their counts and buckets, unique keys;
* ``workflows`` (``workflows.py``): workflows, their jobs' dependencies, releases, WAIT_WORKFLOW waiters.

``apply(event, now)`` dispatches a mailbox event (``events.py``) through one table and
returns a client request's reply; ``end_batch(now)`` does the work after each batch
(schedule, keep purging) and hands over the waits answered in it. The core commits
nothing itself: the runtime takes the dirty rows of a batch (``take_dirty``) and commits
them in one transaction *before* it releases the batch's replies and outbound frames
(``take_outbound``), so nothing is observable before it is durable.

Nothing here scans all jobs: queued jobs live in per-type, per-priority heaps, due times
and deadlines in time-ordered heaps, finished jobs leave memory through an LRU and are
read back from the store on demand.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, NamedTuple

from jobmesh.config import CoreConfig
from jobmesh.coordinator.core import events as ev
from jobmesh.coordinator.core.figures import Counters, Figures, Recovery, stats_message
from jobmesh.coordinator.core.json_jobs import JsonJobs
from jobmesh.coordinator.core.limits import Limits
from jobmesh.coordinator.core.outbox import Frame, Outbox
from jobmesh.coordinator.core.periodic.jobs import PeriodicJobs
from jobmesh.coordinator.core.requests import ClientRequests
from jobmesh.coordinator.core.schedules import SCHEDULES_NOT_APPLIED as SCHEDULES_NOT_APPLIED, Schedules
from jobmesh.store.base import Batch, LeadershipLost, Read, Store
from jobmesh.store.job import Job
from jobmesh.coordinator.core.table import JobTable, ReadPending, due_time
from jobmesh.coordinator.core.timers import Timers
from jobmesh.coordinator.core.waiters import Slot as Slot, Waiter as Waiter  # the face's own words too
from jobmesh.coordinator.core.workflows import FlowWaiter, Workflows
from jobmesh.periodic import codec as pc
from jobmesh.protocol import messages as m
from jobmesh.protocol.jobs import JobState

if TYPE_CHECKING:
    from jobmesh.coordinator.core.peers import OutboundConnection, ReplyConnection

log = logging.getLogger(__name__)

PURGE_BATCH = 256  # finished jobs purged per batch while more are due
WALL_STEP_MILLIS = 1000  # a change of the wall clock against core time beyond this is a step

Reply = m.Message | Slot  # a client request's answer: now, or a place for it later
INTERNAL_ERROR = m.Error("internal coordinator error; see the coordinator log")
# The client requests that change nothing stored: answered while storage fails. Every
# other request (a new one too, until it is listed here) is refused then, unapplied.
# A handler's refusals (ev.Refusal, ev.Forbidden) keep their own answer.
READ_REQUESTS = frozenset({m.GetJobStatus, m.ListJobs, m.ListWorkers, m.GetJobEvents, m.GetStats, m.WaitJob,
                           m.GetJobPayload, m.ScheduleGet, m.ScheduleList, m.SchedulePreview,
                           m.LimitGet, m.LimitList, m.WorkflowStatus, m.WaitWorkflow, ev.Refusal, ev.Forbidden})


class Deadlines(NamedTuple):
    """The earliest instants (core time) the shell must wake the core at, each None when
    nothing waits for it: a WAIT_JOB's timeout, a recurring schedule's fire time (None
    while fires are held back: the sweep catches up), a rate limit's next token."""

    waits: int | None
    fires: int | None
    tokens: int | None


class Applied:
    """A batch as the core applied it (``apply_batch``): each request's reply with whether
    the connection closes after it, in order; the waits answered, written after them; the
    client connections that ended; and, once a STOP came, the events left unapplied."""

    __slots__ = ("replies", "waits", "closed", "stop", "unapplied", "errors")

    def __init__(self) -> None:
        self.replies: list[tuple[ReplyConnection, tuple[Reply, bool]]] = []
        self.waits: list[tuple[Waiter, m.Message]] = []
        self.closed: list[ReplyConnection] = []
        self.stop = False
        self.unapplied: list[ev.Event] = []
        self.errors: list[Exception] = []  # what an event (or the end of the batch) raised, logged


class CoordinatorCore:
    def __init__(self, store: Store, config: CoreConfig, new_id: Callable[[], str] | None = None) -> None:
        self.store = store
        self.config = config
        self.counters = Counters()
        self.outbox = Outbox()
        self.table = JobTable(store, config, self.counters, new_id)
        self.timers = Timers(self.table)
        self.limits = Limits(self.table, lambda name: name in self.table.known_types or name in self.periodic.funcs)
        # Worker ids are one namespace: each port's part refuses or skips the other's.
        self.json = JsonJobs(self.table, self.outbox, self.counters, self.limits,
                             lambda worker_id: worker_id in self.periodic.workers)
        self.periodic = PeriodicJobs(self.table, self.outbox, self.counters, self.limits,
                                     lambda worker_id: self.json.workers.get(worker_id) is not None)
        self.requests = ClientRequests(self.table, self.json, self.periodic, self.counters, self.limits)
        self.schedules = Schedules(self.table, self.requests.check_payload)
        self.workflows = Workflows(self.table, self.requests, self.limits)
        self._draining = False
        self._refusal: m.Error | None = None  # storage fails: what a write is answered
        self._regrace = False  # storage works again: kept leases get their grace again (expire_deadlines)
        # Requests held for a store read (``ReadPending``), in arrival order, with the
        # Slot their reply fills; reads the runtime has not been told of; replies of
        # held requests applied again in this batch.
        self._held: list[tuple[Read[Any], ev.Request, Slot]] = []
        self._new_reads: list[Read[Any]] = []
        self._resumed: list[tuple[Waiter, m.Message]] = []
        requests, schedules, limits, workflows = self.requests, self.schedules, self.limits, self.workflows
        self._answers: dict[type, Callable[[int, Any], m.Message]] = {
            m.SubmitJob: requests.submit_job,
            m.GetJobStatus: lambda now, r: requests.get_job_status(now, r.job_id),
            m.ListJobs: requests.list_jobs,
            m.ListWorkers: lambda now, r: requests.list_workers(now),
            m.CancelJob: lambda now, r: requests.cancel_job(now, r.job_id),
            m.GetJobEvents: lambda now, r: requests.get_job_events(now, r.job_id),
            m.GetJobPayload: lambda now, r: requests.get_job_payload(now, r.job_id),
            m.RetryJob: lambda now, r: requests.retry_job(now, r.job_id, r.submitted_by, r.task_types),
            m.PurgeJobs: requests.purge_jobs,
            m.GetStats: lambda now, _req: self.get_stats(now),
            m.SchedulePut: schedules.put,
            m.ScheduleGet: lambda now, r: schedules.get(now, r.name),
            m.ScheduleList: schedules.list_schedules,
            m.SchedulePause: lambda now, r: schedules.set_paused(now, r.name, True),
            m.ScheduleResume: lambda now, r: schedules.set_paused(now, r.name, False),
            m.ScheduleDelete: lambda now, r: schedules.delete(now, r.name),
            m.ScheduleTrigger: lambda now, r: schedules.trigger(now, r.name, r.submitted_by, r.task_types),
            m.SchedulePreview: schedules.preview,
            m.LimitPut: limits.put,
            m.LimitGet: limits.get,
            m.LimitList: limits.list_limits,
            m.LimitDelete: limits.delete,
            m.TypePause: lambda now, r: limits.set_paused(now, r.task_type, True),
            m.TypeResume: lambda now, r: limits.set_paused(now, r.task_type, False),
            m.SubmitWorkflow: workflows.submit,
            m.WorkflowStatus: workflows.status,
            m.WorkflowCancel: workflows.cancel,
            ev.Refusal: lambda now, r: r.error,
            ev.Forbidden: lambda now, r: r.error,
        }
        json, periodic = self.json, self.periodic
        self._dispatch: dict[type, Callable[[Any, int], Reply | None]] = {
            ev.Request: self._request,
            ev.Registered: lambda e, now: json.on_registered(now, e.conn, e.msg),
            ev.Result: lambda e, now: json.on_result(now, e.conn, e.msg),
            ev.Progress: lambda e, now: json.on_progress(now, e.conn, e.msg),
            ev.Disconnected: lambda e, now: json.on_disconnected(now, e.conn),
            ev.PeriodicPacket: lambda e, now: periodic.on_packet(now, e.conn, e.msg, e.submitted_by),
            ev.PeriodicClosed: lambda e, now: periodic.on_closed(now, e.conn),
            ev.Sweep: self._on_sweep,
            ev.Expire: lambda e, now: self.expire_waits(now),
            ev.ClientClosed: lambda e, now: self.on_client_closed(now, e.conn),
            ev.ReadsDone: lambda e, now: self.resume_held(now),
            ev.SchedulesFile: lambda e, now: self.on_schedules_file(now, e.definitions),
            ev.Fire: lambda e, now: self.fire_schedules(now),
            ev.TokensDue: lambda e, now: limits.wake(now),
        }
        self._sweep_steps: tuple[Callable[[int], Any], ...] = (
            json.detect_dead_workers, self.expire_deadlines, self.promote_due_jobs, self.fire_schedules, limits.wake,
            json.schedule,
            periodic.dispatch, self._purge, self.expire_waits, periodic.expire_waits, periodic.forget_idle)

    # ---- applying events ----------------------------------------------------------------

    def apply(self, event: ev.Event, now: int) -> Reply | None:
        """Apply one mailbox event at core time ``now``; a client request's reply (a Slot
        for a WAIT_JOB answered later), None for every other event. While storage fails,
        an event that would write is refused instead, unapplied (``refusal``)."""
        if self._refusal is not None and self._writes(event):
            return self._refuse(event, self._refusal)
        return self._dispatch[type(event)](event, now)

    def _writes(self, event: Any) -> bool:
        """Whether applying ``event`` while storage fails could change a stored row.

        Nothing runs then (no assignment, and a reload ended every session), so results
        are stale and worker events write nothing, but for a registration that declares
        a new task type and a result's STALE_RESULT event; sweeps and timers write
        nothing while paused. What this misses still works: its commit fails, and state
        is reloaded as after any failed commit."""
        kind = type(event)
        if kind is ev.Request:
            return type(event.msg) not in READ_REQUESTS
        if kind is ev.PeriodicPacket:
            return self.periodic.writes(event.msg)
        if kind is ev.Registered:
            return self.json.registration_writes(event.msg)
        return kind is ev.Result or kind is ev.SchedulesFile

    def _refuse(self, event: Any, refusal: m.Error) -> Reply | None:
        """A write refused while storage fails: a request gets ``refusal``, a Periodic one
        its DATA, a registration the ERROR and its close, a schedules file (SIGHUP) a line
        in the log; a result is dropped."""
        kind = type(event)
        if kind is ev.Request:
            return refusal
        if kind is ev.PeriodicPacket:
            self.periodic.refuse(event.conn, event.msg, refusal.message)
        elif kind is ev.Registered:
            self.json.refuse_registration(event.conn, event.msg, refusal.message)
        elif kind is ev.SchedulesFile:
            log.error(SCHEDULES_NOT_APPLIED + "; send SIGHUP again once writes resume", refusal.message)
        else:
            self.json.drop_result(event.msg)
        return None

    def _request(self, event: ev.Request, now: int) -> Reply:
        msg = event.msg
        try:
            if type(msg) is m.WaitJob:  # the requests that need their connection
                return self.requests.wait_job(now, event.conn, msg)
            if type(msg) is m.WaitWorkflow:
                return self.workflows.wait(now, event.conn, msg)
            return self._answers[type(msg)](now, msg)
        except ReadPending as pending:  # its reply waits, in order, for the read
            slot = Slot()
            self._hold_for(pending.read, event, slot)
            return slot

    def _answer(self, event: ev.Request, now: int, slot: Slot | None = None) -> Reply:
        msg = event.msg
        if type(msg) is m.WaitJob:  # the requests that need their connection
            return self.requests.wait_job(now, event.conn, msg, slot)
        if type(msg) is m.WaitWorkflow:
            return self.workflows.wait(now, event.conn, msg, slot)
        return self._answers[type(msg)](now, msg)

    def _hold_for(self, read: Read[Any], event: ev.Request, slot: Slot) -> None:
        self._held.append((read, event, slot))
        self._new_reads.append(read)

    def resume_held(self, now: int) -> None:
        """Apply again, in arrival order, the held requests whose store read is done;
        their replies fill their Slots at the end of the batch."""
        held, self._held = self._held, []
        for read, event, slot in held:
            if not read.ready():
                self._held.append((read, event, slot))
                continue
            answer: Reply
            try:
                if self._refusal is not None and self._writes(event):
                    answer = self._refusal
                else:
                    answer = self._answer(event, now, slot)
            except ReadPending as pending:  # another read: wait for that one too
                self._hold_for(pending.read, event, slot)
                continue
            except LeadershipLost:
                raise  # the read found this process no longer leads: the runtime stops (exit 75)
            except Exception:
                log.exception("error while applying a held %s; continuing", type(event.msg).__name__)
                answer = INTERNAL_ERROR
            if not isinstance(answer, Slot):  # (a WAIT_JOB now waiting for its job fills the slot later)
                self._resumed.append((Waiter(event.conn, slot, "", 0), answer))

    def take_new_reads(self) -> list[Read[Any]]:
        """Store reads requests began to wait for since the last call (the runtime asks
        each to wake it when done); none on a store that answers reads at once."""
        reads, self._new_reads = self._new_reads, []
        return reads

    def held_requests(self) -> list[Waiter]:
        """Requests still held for a store read, as waiters of their Slots (a stop answers them)."""
        return [Waiter(event.conn, slot, "", 0) for _read, event, slot in self._held]

    def end_batch(self, now: int) -> list[tuple[Waiter, m.Message]]:
        """After each batch: schedule, keep purging while the last pass was full; the waits
        answered in the batch with their replies (as the jobs stand at its end)."""
        self.workflows.release(now)  # before scheduling: a job released in this batch may run at once
        self.json.send_acks()
        self.json.schedule(now)
        self.periodic.end_batch(now)
        requests = self.requests
        if requests.purge_backlog and self._refusal is None:
            requests.purge_expired(now, PURGE_BATCH)
        answers = self.take_answers() if requests.has_answers() or self.workflows.waiters.answered else []
        if self._resumed:
            answers += self._resumed
            self._resumed = []
        return answers

    def sweep(self, now: int) -> None:
        """Dead workers, then expired deadlines, then due jobs, then
        scheduling, then retention, then waits whose time is up, then idle Periodic funcs."""
        for step in self._sweep_steps:
            try:
                step(now)
            except LeadershipLost:
                raise  # a read found this process no longer leads: the runtime stops (exit 75)
            except Exception:  # one step's error must not skip the others
                log.exception("error in the sweep's %s; the sweep goes on", step.__name__)

    def _purge(self, now: int) -> None:
        if self._refusal is None:
            self.requests.purge_expired(now)

    def expire_deadlines(self, now: int) -> None:
        """Attempts past their deadline: revoked, then retried or failed by their part. None
        while storage fails: the move could not commit (and no result is applied then
        either); they expire once a probe write says storage is back."""
        if self._refusal is not None:
            return
        unclaimed = self.table.unclaimed
        if self._regrace:
            # Storage failed while leases kept by recovery waited for their workers, whose
            # registrations naming them were refused then: each gets the whole grace again.
            self._regrace = False
            until = now + self.config.lease_grace_millis
            for job_id in list(unclaimed):
                job = self.table.jobs.get(job_id)
                if job is not None and (job.deadline is None or job.deadline < until):
                    self.table.keep_unclaimed(job, until)
        for job in self.timers.expired(now):
            if job.job_id in unclaimed:  # kept by recovery, and no worker claimed it in time
                self._recover_running(job, now, self.config.lease_grace_millis)
                continue
            timeout = job.execution_timeout or self.config.task_timeout_millis
            log.warning("deadline expired job=%s attempt=%s worker=%s", job.job_id, job.attempt_id, job.worker_id)
            self.counters.deadline_expiries += 1
            error = "attempt %d exceeded its execution deadline of %d ms" % (job.attempts, timeout)
            if job.periodic is None:
                self.json.revoke_lease(job, "deadline")
                self.json.attempt_failed(job, now, error, "LEASE_EXPIRED")
            else:
                self.periodic.attempt_failed(job, now, error, "LEASE_EXPIRED")

    def promote_due_jobs(self, now: int) -> None:
        """SCHEDULED and RETRY_WAIT jobs whose time has come become QUEUED."""
        if self._refusal is not None:
            return
        for job in self.timers.due(now):
            self.table.transition(job, JobState.QUEUED, now)

    def fire_schedules(self, now: int) -> None:
        """Recurring schedules whose fire time has come make their jobs (none while paused:
        the times that pass meanwhile follow each schedule's ``missed`` policy), nor while storage
        fails."""
        if self._refusal is not None:  # storage fails: a fire could not commit its job
            self.schedules.hold()
        else:
            self.schedules.fire_due(now)

    def apply_schedules_file(self, now: int, definitions: list[dict[str, Any]]) -> str | None:
        """The schedules file's set (at start and on SIGHUP): the reason it was refused, or
        None once applied (``Schedules.apply_file``)."""
        problem = self.schedules.apply_file(now, definitions)
        if problem is None and not self.schedules.waiting_for():
            log.info("schedules file applied: %d schedules from it", len(definitions))
        return problem

    def on_schedules_file(self, now: int, definitions: list[dict[str, Any]]) -> None:
        """SIGHUP: the file read again; a file with an error is logged and changes nothing."""
        problem = self.apply_schedules_file(now, definitions)
        if problem is not None:
            log.error(SCHEDULES_NOT_APPLIED, problem)

    def _on_sweep(self, event: ev.Sweep, now: int) -> None:
        """The sweep, after what it carries is observed: each JSON worker's last arrival,
        then the wall clock."""
        arrival = event.arrival
        if arrival is not None:
            self.observe_arrivals(now, {s.conn: arrival(s.conn) for s in self.json.workers})
        if event.wall is not None:
            self.observe_wall(now, event.wall())
        self.sweep(now)

    def observe_arrivals(self, now: int, arrivals: dict[OutboundConnection, int]) -> None:
        """Liveness by arrival, before a sweep: each worker connection's last frame arrived
        at ``arrivals[conn]`` (core time), as its handler stamped it."""
        self.json.stamp_arrivals(now, arrivals)

    def observe_wall(self, now: int, wall: int) -> None:
        """The wall clock reads ``wall`` at core time ``now``. After a step of more than a
        second, SCHEDULED jobs (due at wall-clock instants) are re-timed; durations
        (heartbeats, deadlines, backoff) are core time and do not move."""
        drift = wall - now
        step = drift - self.table.drift
        self.table.drift = drift
        if abs(step) > WALL_STEP_MILLIS:
            log.warning("the wall clock stepped by %+d ms; timeouts are unaffected, scheduled jobs follow it", step)
            self.timers.retime_scheduled()
            if step > 0:  # fire times jumped over follow each schedule's ``missed`` policy
                self.schedules.hold()

    # ---- set by the runtime between batches --------------------------------------------

    @property
    def draining(self) -> bool:
        """A graceful stop in progress: assign nothing, let running attempts finish."""
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        self._hold()

    @property
    def refusal(self) -> m.Error | None:
        """Set while storage fails, to what a write is answered: assign nothing, make no
        change of the core's own accord (no due promotion, no retention purge), and
        refuse every event that would write before applying it (``apply``), so nothing
        asks for a commit until storage works again (None)."""
        return self._refusal

    @refusal.setter
    def refusal(self, value: m.Error | None) -> None:
        if value is None and self._refusal is not None and self.table.unclaimed:
            self._regrace = True  # no worker could claim a kept lease meanwhile: see expire_deadlines
        self._refusal = value
        self._hold()

    def _hold(self) -> None:
        self.json.hold = self.periodic.hold = self._draining or self._refusal is not None

    # ---- what the runtime takes after each batch -------------------------------------------

    def take_dirty(self) -> Batch:
        batch = self.table.take_dirty()
        schedules = self.schedules.take_dirty()
        limits = self.limits.take_dirty()
        workflows = self.workflows.take_dirty()
        if not schedules and not limits and not workflows:
            return batch
        return Batch(batch.inserts, batch.updates, batch.task_types, batch.purges, schedules, limits,
                     batch.task_defaults, workflows)

    def take_outbound(self) -> list[tuple[OutboundConnection, Frame]]:
        return self.outbox.take()

    @property
    def running_attempts(self) -> int:
        """Attempts whose lease a live worker holds (JSON and Periodic): O(workers)."""
        return self.json.running_attempts + self.periodic.running_attempts

    @property
    def active_count(self) -> int:
        return self.table.active_count

    # ---- recovery ------------------------------------------------------------------

    def recover(self, now: int, replacing: CoordinatorCore | None = None) -> Recovery:
        """Load non-terminal jobs and known task types from the store (before any listener
        opens); what it found and did. ``replacing``: the core a reload throws away, whose
        known offset of the wall clock this one keeps.

        RUNNING jobs lost their worker and their attempt's outcome is unknown: requeue
        them if budget remains, else fail them. Their old deadline is discarded; the next
        assignment stamps a fresh one. With ``lease_grace_millis`` a RUNNING JSON job
        instead stays on its lease, held by no worker, until the grace ends: a worker
        that registers again naming it keeps it (``JsonJobs``), else the sweep requeues
        or fails it then (``expire_deadlines``). SCHEDULED jobs keep their time; those
        that fell due while the coordinator was down are queued now.

        Each job is taken in as the store hands it over: PostgreSQL's a slice at a time,
        letting other greenlets run in between (its writer's keepalive: a recovery of a
        million jobs outlasts the session timeout), so this loop keeps no list of its own.
        """
        # queued: QUEUED after recovery, including the requeued and those due while down;
        # kept: RUNNING on their old lease for the grace
        stats = {"queued": 0, "scheduled": 0, "retry_wait": 0, "requeued": 0, "due": 0, "failed": 0, "damaged": 0,
                 "kept": 0, "waiting": 0}
        flows: set[str] = set()  # the workflows of the active jobs
        table = self.table
        if replacing is not None:
            table.drift = replacing.table.drift
        grace = self.config.lease_grace_millis
        table.known_types.update(self.store.load_task_types())
        table.load_defaults(self.store.load_task_defaults())
        self.limits.load(self.store, now)  # before the jobs: the RUNNING ones count against them
        wall = now + table.drift
        for job in self.store.load_active():
            state = job.state
            if job.workflow_id is not None:
                flows.add(job.workflow_id)
            repaired = state is JobState.RETRY_WAIT and job.retry_at is None
            if repaired:  # an older or hand-edited row: due now
                job.retry_at = wall
            table.adopt(job, now)
            if repaired:
                table.touch(job)
            if job.damaged is not None:  # a row that does not decode: it cannot run; the rest can
                job.error = "the stored row could not be read (%s); the job cannot run" % job.damaged
                log.error("recovered a damaged row job=%s: %s; it ends %s", job.job_id, job.damaged,
                          "FAILED" if state is JobState.RUNNING else "CANCELLED")
                table.transition(job, JobState.FAILED if state is JobState.RUNNING else JobState.CANCELLED, now)
                stats["damaged"] += 1
            elif state is JobState.RUNNING:
                if grace > 0 and job.periodic is None and job.attempt_id is not None:
                    table.keep_unclaimed(job, now + grace)
                    stats["kept"] += 1
                elif self._recover_running(job, now):
                    stats["requeued"] += 1
                    stats["queued"] += 1
                else:
                    stats["failed"] += 1
            elif state is JobState.QUEUED:
                stats["queued"] += 1
            elif state is JobState.WAITING:
                stats["waiting"] += 1
            elif state is JobState.SCHEDULED and (job.run_at is None or job.run_at <= wall):
                table.event(job, now, "RECOVERED", "fell due while the coordinator was down")
                table.transition(job, JobState.QUEUED, now)
                stats["due"] += 1
                stats["queued"] += 1
            else:  # RETRY_WAIT, or SCHEDULED in the future
                assert due_time(job) is not None
                stats["retry_wait" if state is JobState.RETRY_WAIT else "scheduled"] += 1
        table.next_seq = self.store.max_seq() + 1
        self.limits.settle()
        workflows = self.workflows.recover(now, flows)  # after the jobs: releases what a cut-short batch would have
        self.schedules.load(self.store, now)  # and the fire times that passed while down follow ``missed``
        if stats["kept"]:
            log.info("kept %d running jobs on their leases for %d ms, for their workers to claim", stats["kept"], grace)
        return Recovery(**stats, active=table.active_count, task_types=len(table.known_types),
                        next_seq=table.next_seq, schedules=len(self.schedules.by_name), workflows=workflows)

    def _recover_running(self, job: Job, now: int, grace: int = 0) -> bool:
        """A RUNNING job whose worker is gone since a restart: requeued while attempts remain
        (True), else failed; its timeline says RECOVERED either way. ``grace``: how long
        it waited, kept on its lease, for a worker to claim it (0: it did not)."""
        unclaimed = ", and no worker claimed it within %d ms" % grace if grace else ""
        if job.periodic is not None or job.attempts < job.max_attempts:
            self.table.event(job, now, "RECOVERED", "coordinator restarted%s: attempt %d requeued"
                             % (unclaimed, job.attempts), attempt=job.attempts, worker_id=job.worker_id)
            self.table.transition(job, JobState.QUEUED, now, event=None)
            return True
        job.error = "coordinator restarted during the final attempt (%d of %d)%s" % (
            job.attempts, job.max_attempts, unclaimed)
        self.table.event(job, now, "RECOVERED", job.error, attempt=job.attempts, worker_id=job.worker_id)
        self.table.transition(job, JobState.FAILED, now)
        return False

    # ---- figures ---------------------------------------------------------------------

    def metrics(self) -> Figures:
        """Plain figures for the metrics port: O(series), never O(jobs)."""
        jobs = {(state.value, task_type, priority.value, "periodic" if periodic else "json"): n
                for (state, task_type, priority, periodic), n in self.table.counts.items()}
        capacity = busy = 0
        running = self.table.running
        for session in self.json.workers:
            capacity += session.capacity
            busy += len(running(session))
        return Figures(counters=replace(self.counters), jobs=jobs,
                       finished={state.value: n for state, n in self.table.finished_counts.items()},
                       workers=len(self.json.workers), capacity=capacity, busy_slots=busy,
                       periodic_workers=len(self.periodic.workers),
                       waits=len(self.requests.waiters) + self.periodic.waits.live,
                       schedule_fires=dict(self.schedules.fires), schedule_skips=dict(self.schedules.skips),
                       schedule_misses=dict(self.schedules.misses), jobs_held=self.limits.held(),
                       workflows=self.workflows.figures())

    def get_stats(self, now: int) -> m.Message:
        """GET_STATS: the figures the metrics port shows, from counters (O(series))."""
        return stats_message(self.metrics(), now + self.table.drift)

    # ---- what the ports ask of the core ------------------------------------------------

    def periodic_cost(self, kind: type) -> int:
        """The share of a core batch a Periodic request of ``kind`` costs (mailbox.py): a
        DUMP by the live Periodic jobs it lists, a STATUS by the funcs, as a LIST_JOBS page
        costs by its rows; 1 for any other kind (O(funcs))."""
        if kind is pc.Dump or kind is pc.Status:
            jobs, funcs = self.periodic.sizes()
            return 1 + (jobs if kind is pc.Dump else funcs) // ev.LIST_ROWS_PER_COST
        return 1

    # ---- the face the shell drives ------------------------------------------------------

    def apply_batch(self, events: Iterable[ev.Event], clock: Callable[[], int]) -> Applied:
        """A batch as the shell runs it: each event applied at its own ``clock()`` reading
        (``take_in``), then the end of the batch (``finish_batch``). Events after a STOP
        are not applied (``Applied.unapplied``)."""
        applied = Applied()
        now = clock()
        for event in events:
            if type(event) is ev.Stop:
                applied.stop = True
            elif applied.stop:
                applied.unapplied.append(event)
            else:
                now = clock()
                self.take_in(event, now, applied)
        self.finish_batch(applied, now)
        return applied

    def take_in(self, event: ev.Event, now: int, applied: Applied) -> None:
        """One event of a batch: applied, a request's reply added to ``applied`` (with
        whether its connection closes after it: a protocol violation's Refusal). An error
        costs only its event: logged, and a request is answered ``INTERNAL_ERROR``; an
        error that says this process no longer leads its store is raised."""
        try:
            answer = self.apply(event, now)
        except LeadershipLost:
            raise
        except Exception as exc:
            log.exception("error while handling %s; continuing", type(event).__name__)
            applied.errors.append(exc)
            if type(event) is ev.Request:
                applied.replies.append((event.conn, (INTERNAL_ERROR, False)))
            return
        if type(event) is ev.Request:
            assert answer is not None
            applied.replies.append((event.conn, (answer, type(event.msg) is ev.Refusal)))
        elif type(event) is ev.ClientClosed:
            applied.closed.append(event.conn)

    def finish_batch(self, applied: Applied, now: int) -> None:
        """The end of a batch (``end_batch``) at ``now``: the waits answered in it go into
        ``applied``. An error is logged and the waits answered so far still go out."""
        try:
            applied.waits = self.end_batch(now)
        except Exception as exc:
            log.exception("error while scheduling; continuing")
            applied.errors.append(exc)
            applied.waits = self.take_answers()

    def take_answers(self) -> list[tuple[Waiter, m.Message]]:
        """The WAIT_JOBs and WAIT_WORKFLOWs answered since the last call, with their replies."""
        return self.requests.take_answers() + self.workflows.take_answers()

    def expire_waits(self, now: int) -> None:
        """Answer the WAIT_JOBs and WAIT_WORKFLOWs whose time is up."""
        self.requests.expire_waits(now)
        if self.workflows.waiters:
            self.workflows.waiters.expire(now)

    def on_client_closed(self, now: int, conn: ReplyConnection) -> None:
        """A client connection ended with requests unanswered: its waits are forgotten."""
        self.requests.on_client_closed(now, conn)
        self.workflows.waiters.drop_conn(conn)

    def next_deadlines(self) -> Deadlines:
        """When the shell must wake the core next (one heap peek each; ``Deadlines``)."""
        fires = None
        if self._refusal is None and not self.schedules.behind:  # paused, or held back: the sweep catches up
            due = self.schedules.next_due()
            if due is not None:
                fires = due - self.table.drift
        waits = self.requests.next_wait_deadline()
        if self.workflows.waiters:
            flows = self.workflows.waiters.next_deadline()
            if flows is not None and (waits is None or flows < waits):
                waits = flows
        return Deadlines(waits, fires, self.limits.next_wake())

    def pending_waits(self) -> list[Waiter]:
        """Every request not answered yet: the pending WAIT_JOBs, then the requests held for
        a store read, as waiters of their Slots (a stop answers them all)."""
        return self.requests.waiters.pending() + self.workflows.waiters.pending() + self.held_requests()

    def adopt_from(self, old: CoordinatorCore, now: int, answered: list[Waiter]) -> list[tuple[Waiter, m.Message]]:
        """A reload replaced ``old`` with this state: the process-lifetime totals go on
        counting; the requests ``old`` held for store reads are applied here once their
        reads are done; its pending waits, and ``answered`` (waits it answered by changes
        that were never committed), wait again here, keeping their deadlines. Returns the
        waits this state answers at once (their jobs ended, or it does not hold them)."""
        self.counters.add(old.counters)
        self.table.carry_totals(old.table)
        self.schedules.carry_totals(old.schedules)
        self.workflows.carry_totals(old.workflows)
        self._held = old._held + self._held
        waits = old.requests.waiters.pending() + old.workflows.waiters.pending() + answered
        self.requests.adopt_waiters(now, [w for w in waits if not isinstance(w, FlowWaiter)])
        self.workflows.adopt_waiters(w for w in waits if isinstance(w, FlowWaiter))
        return self.take_answers()
