"""Job states, the transition table, priorities and the job snapshot on the wire.

::

    QUEUED ──assign──▶ RUNNING ──success──────────────▶ COMPLETED
      ▲  │               │ │ └─failure, budget left──▶ RETRY_WAIT ──due──▶ QUEUED
      │  │               │ └───failure, no budget───▶ FAILED
      │  │               └─restart, budget left──────▶ QUEUED
      │  └──────cancel─────────────────────────────▶ CANCELLED  (also from RUNNING, RETRY_WAIT)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from jobmesh.errors import IllegalTransition


class JobState(str, Enum):
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    RETRY_WAIT = "RETRY_WAIT"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


TERMINAL: frozenset[JobState] = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED})

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.CANCELLED}),
    JobState.RUNNING: frozenset(
        {JobState.COMPLETED, JobState.RETRY_WAIT, JobState.FAILED, JobState.CANCELLED, JobState.QUEUED}
    ),
    JobState.RETRY_WAIT: frozenset({JobState.QUEUED, JobState.CANCELLED}),
    JobState.COMPLETED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


def check_transition(current: JobState, target: JobState) -> None:
    """Raise ``IllegalTransition`` unless ``current -> target`` is in ``TRANSITIONS``."""
    if target not in TRANSITIONS[current]:
        raise IllegalTransition("illegal job transition %s -> %s" % (current.value, target.value))


class Priority(str, Enum):
    """Base scheduling priority; the wire carries the name, never the number."""

    LOW = "LOW"
    NORMAL = "NORMAL"
    HIGH = "HIGH"

    @property
    def level(self) -> int:
        return _LEVELS[self]

    @classmethod
    def parse(cls, value: str | None) -> "Priority":
        """None means NORMAL; anything but the three names raises ValueError."""
        if value is None:
            return cls.NORMAL
        try:
            return _BY_NAME[value]
        except (KeyError, TypeError):
            raise ValueError("priority must be one of HIGH, NORMAL, LOW, got %r" % (value,)) from None


_LEVELS = {Priority.LOW: 0, Priority.NORMAL: 1, Priority.HIGH: 2}
_BY_NAME = {p.value: p for p in Priority}
MAX_LEVEL = 2


@dataclass(frozen=True)
class JobSnapshot:
    """An immutable view of one job, as GET_JOB_STATUS and friends carry it."""

    job_id: str
    task_type: str
    state: JobState
    attempts: int
    max_attempts: int
    worker_id: str | None
    result: dict[str, Any] | None
    error: str | None
    created_at_millis: int
    updated_at_millis: int
    priority: Priority

    def to_wire(self) -> dict[str, Any]:
        return {
            "jobId": self.job_id,
            "taskType": self.task_type,
            "state": self.state.value,
            "attempts": self.attempts,
            "maxAttempts": self.max_attempts,
            "workerId": self.worker_id,
            "result": self.result,
            "error": self.error,
            "createdAtMillis": self.created_at_millis,
            "updatedAtMillis": self.updated_at_millis,
            "priority": self.priority.value,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "JobSnapshot":
        """Build from a wire dict (client side); raises KeyError/ValueError on bad input."""
        return cls(
            job_id=d["jobId"],
            task_type=d["taskType"],
            state=JobState(d["state"]),
            attempts=d["attempts"],
            max_attempts=d["maxAttempts"],
            worker_id=d.get("workerId"),
            result=d.get("result"),
            error=d.get("error"),
            created_at_millis=d["createdAtMillis"],
            updated_at_millis=d["updatedAtMillis"],
            priority=Priority.parse(d.get("priority")),
        )
