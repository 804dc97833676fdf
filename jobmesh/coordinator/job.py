"""The coordinator's mutable job record, owned by the core.

Only ``CoordinatorCore`` changes a ``Job``; every change goes through ``move_to`` so the
state machine of ``protocol/jobs.py`` is enforced in one place. Other components see
jobs as wire snapshots (plain dicts), never as these objects.
"""

from __future__ import annotations

from typing import Any

from jobmesh.protocol.jobs import JobState, Priority, check_transition


class Job:
    __slots__ = (
        "job_id", "seq", "task_type", "payload", "state", "attempts", "max_attempts", "priority",
        "worker_id", "attempt_id", "result", "error", "created_at", "updated_at", "retry_at",
        "idempotency_key", "execution_timeout", "deadline", "payload_json",
    )

    def __init__(
        self,
        job_id: str,
        seq: int,
        task_type: str,
        payload: dict[str, Any],
        max_attempts: int,
        priority: Priority,
        created_at: int,
        idempotency_key: str | None = None,
        state: JobState = JobState.QUEUED,
        attempts: int = 0,
        worker_id: str | None = None,
        attempt_id: str | None = None,
        result: dict[str, Any] | None = None,
        error: str | None = None,
        updated_at: int | None = None,
        retry_at: int | None = None,
        execution_timeout: int | None = None,
        deadline: int | None = None,
        payload_json: str | None = None,
    ) -> None:
        self.job_id = job_id
        self.seq = seq
        self.task_type = task_type
        self.payload = payload
        self.state = state
        self.attempts = attempts
        self.max_attempts = max_attempts
        self.priority = priority
        self.worker_id = worker_id
        self.attempt_id = attempt_id
        self.result = result
        self.error = error
        self.created_at = created_at
        self.updated_at = created_at if updated_at is None else updated_at
        self.retry_at = retry_at
        self.idempotency_key = idempotency_key
        self.execution_timeout = execution_timeout
        self.deadline = deadline
        self.payload_json = payload_json  # the payload as stored, when already encoded

    def move_to(self, target: JobState, now_millis: int) -> None:
        """Apply one state-machine transition; ``IllegalTransition`` means a core bug."""
        check_transition(self.state, target)
        self.state = target
        self.updated_at = now_millis
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

    def snapshot(self) -> dict[str, Any]:
        """The wire snapshot (field names of the protocol)."""
        return {
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
        }
