"""The coordinator's mutable job record, owned by the core.

Only ``CoordinatorCore`` changes a ``Job``, and every state change goes through the
core's one transition method, which calls ``move_to`` here (so the state machine of
``protocol/jobs.py`` is enforced in one place) and keeps the core's indexes in step.
Other components see jobs as wire snapshots (plain dicts), never as these objects.

The record lives with the store because the store builds it from rows; the stored
columns of a job are declared once, in ``store.columns.COLUMNS``, and the attributes
here are the record itself (plus ``payload_json`` and ``result_json``, the payload and
the result as already encoded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobmesh.protocol.jobs import JobState, Priority, check_transition

MAX_RUN_AT_MILLIS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z: the latest run-at time accepted


@dataclass(slots=True, eq=False)
class Job:
    job_id: str
    seq: int
    task_type: str
    payload: dict[str, Any]
    max_attempts: int
    priority: Priority
    created_at: int
    idempotency_key: str | None = None
    state: JobState = JobState.QUEUED
    attempts: int = 0
    worker_id: str | None = None
    attempt_id: str | None = None
    result: dict[str, Any] | None = None
    error: str | None = None
    updated_at: int = -(1 << 62)  # unset: the creation time
    retry_at: int | None = None  # RETRY_WAIT: when the next attempt is due (epoch millis)
    execution_timeout: int | None = None  # each attempt's deadline (ms), fixed at creation
    deadline: int | None = None
    run_at: int | None = None  # when the job was asked to run (runAtMillis), None: at once
    retry_of: str | None = None  # the finished job this one retries (RETRY_JOB)
    submitted_by: str | None = None  # the name of the token that submitted it (None without --auth-file)
    concurrency_key: str | None = None  # maxRunningPerKey counts running jobs by this (None: not limited by it)
    unique_key: str | None = None  # no two live jobs of a type hold the same one (None: none)
    # The timeline as stored (store.columns.event_fragment, comma-joined): text, so that a job's
    # events cost one string, not a list of tuples, and the row needs no re-encoding.
    events: str = ""
    event_count: int = -1  # events in ``events``; -1: not counted yet (a job read back from the store)
    event_last_at: int = 0  # the wall-clock time of the last one
    payload_json: str | None = None  # the payload as stored, when already encoded
    result_json: str | None = None  # the result as stored, when encoded with it (a JSON job's TASK_RESULT)
    # A Periodic job (docs/PERIODIC.md): its name (unique per func among live jobs) and
    # its Periodic fields {workload, b64, count, timeout, sched}; both None for JSON jobs.
    name: str | None = None
    periodic: dict[str, Any] | None = None
    # A job a recurring schedule made: the schedule's name and the nominal fire time (epoch millis).
    schedule_name: str | None = None
    scheduled_for: int | None = None
    # What the job asked for besides its budget, fixed at creation: how long a finished job
    # is kept (resultTtlMillis; None: the coordinator's retention), and its retry backoff
    # (its task type's declared one; None: the coordinator's --retry-base/cap-millis).
    result_ttl: int | None = None
    retry_base: int | None = None
    retry_cap: int | None = None
    # A workflow's job (docs/PROTOCOL.md, "Workflows"): the workflow, the job's ref in it,
    # the refs it depends on (None: none), and its direct dependencies' results by ref,
    # given to it when the last one completed (None until then, once it has ended, and for
    # other jobs).
    workflow_id: str | None = None
    ref: str | None = None
    depends_on: list[str] | None = None
    parents: dict[str, Any] | None = None
    # Not stored; core time (monotonic, see coordinator/shell/clock.py), set by the core:
    ready_at: int = 0  # when the job first became due: priority aging and queue order count from here
    wake_at: int | None = None  # SCHEDULED / RETRY_WAIT: when it becomes due
    damaged: str | None = None  # why its stored row did not decode (columns.read_row); None: it did
    # Not stored either: the running attempt's last progress report, as the snapshot shows it
    # ({fraction, message, atMillis}); None until one arrives, and again after every move.
    progress: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.updated_at is None or self.updated_at == -(1 << 62):
            self.updated_at = self.created_at

    @property
    def due_at(self) -> int:
        """When the job first became due, on the wall clock: its submission, or its run-at
        time if later (``ready_at`` is the same moment in core time)."""
        run_at = self.run_at
        return self.created_at if run_at is None or run_at < self.created_at else run_at

    def move_to(self, target: JobState, now_millis: int) -> None:
        """Apply one state-machine transition; ``IllegalTransition`` means a core bug."""
        check_transition(self.state, target)
        self.state = target
        self.updated_at = now_millis
        self.progress = None  # reported by an attempt: a new attempt starts without one
        if target is not JobState.RUNNING:
            # The lease and its deadline live exactly as long as RUNNING does.
            self.worker_id = None
            self.attempt_id = None
            self.deadline = None
        if target is not JobState.RETRY_WAIT:
            self.retry_at = None

    def same_request(self, task_type: str, payload: dict[str, Any], max_attempts: int, priority: Priority) -> bool:
        """Whether a resubmission under this job's idempotency key asks for the same thing."""
        return (
            self.task_type == task_type
            and self.payload == payload
            and self.max_attempts == max_attempts
            and self.priority is priority
        )

    def snapshot(self, waiting: str | None = None) -> dict[str, Any]:
        """The wire snapshot (field names of the protocol). ``waiting`` is the reason a
        QUEUED job is not running, which only the core can tell; the other states' reasons
        follow from the state itself."""
        state = self.state
        if state is JobState.SCHEDULED:
            waiting = "SCHEDULED"
        elif state is JobState.RETRY_WAIT:
            waiting = "RETRY_BACKOFF"
        elif state is JobState.WAITING:
            waiting = "DEPENDENCIES"
        elif state is not JobState.QUEUED:
            waiting = None
        snapshot = {
            "jobId": self.job_id,
            "taskType": self.task_type,
            "state": self.state.value,
            "attempts": self.attempts,
            "maxAttempts": self.max_attempts,
            "workerId": self.worker_id,
            "result": self.result,
            "error": self.error,
            "createdAtMillis": self.created_at,
            "updatedAtMillis": self.updated_at,
            "priority": self.priority.value,
            "runAtMillis": self.run_at,
            "retryAtMillis": self.retry_at,
            "retryOf": self.retry_of,
            "waitingReason": waiting,
            "protocol": "json" if self.periodic is None else "periodic",
            "name": self.name,
            "submittedBy": self.submitted_by,
            "concurrencyKey": self.concurrency_key,
            "uniqueKey": self.unique_key,
            "progress": self.progress,
            "workflowId": self.workflow_id,
            "ref": self.ref,
        }
        if self.schedule_name is not None:  # only fired jobs carry these: other snapshots keep their fields
            snapshot["scheduleName"] = self.schedule_name
            snapshot["scheduledFor"] = self.scheduled_for
        if self.result_ttl is not None:  # only a job that asked for one: other snapshots keep their fields
            snapshot["resultTtlMillis"] = self.result_ttl
        return snapshot
