"""Job states, the transition table and priorities (the job snapshot on the wire is ``Job.snapshot``).

::

    SCHEDULED ──due──▶ QUEUED ──assign──▶ RUNNING ──success──────────────▶ COMPLETED
        ▲                ▲  │               │ │ └─failure, budget left──▶ RETRY_WAIT ──due──▶ QUEUED
        │                │  │               │ └───failure, no budget───▶ FAILED
        │                │  │               ├─restart, budget left──────▶ QUEUED
        └────────────────┼──┼───────────────┴─put back for later (Periodic SCHED_LATER)
                         │  └──────cancel──────────────────────────────▶ CANCELLED
                                   (also from SCHEDULED, RUNNING, RETRY_WAIT)

A pending Periodic job resubmitted under its name with a later sched_at moves from
QUEUED or RETRY_WAIT to SCHEDULED (REPLACED).

A workflow's job whose dependencies have not all completed is WAITING; it moves to QUEUED
(or SCHEDULED, if its run-at time is later) when the last one completes, to CANCELLED when
one fails or is cancelled (or it is cancelled itself), and to FAILED when its parents'
results are too large to hand it.

QUEUED, SCHEDULED, RUNNING, RETRY_WAIT and WAITING are the non-terminal states.
"""

from __future__ import annotations

from enum import Enum

from jobmesh.errors import IllegalTransition
from jobmesh.protocol.messages import quote


class JobState(str, Enum):
    QUEUED = "QUEUED"
    SCHEDULED = "SCHEDULED"
    RUNNING = "RUNNING"
    RETRY_WAIT = "RETRY_WAIT"
    WAITING = "WAITING"  # a workflow's job whose dependencies have not all completed
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


TERMINAL: frozenset[JobState] = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED})
ACTIVE: frozenset[JobState] = frozenset(JobState) - TERMINAL
# The same two sets in declaration order, for whatever lists states (metrics, the
# dashboard, ``jobmesh top``): a new state shows up there without another edit.
ACTIVE_STATES: tuple[JobState, ...] = tuple(s for s in JobState if s not in TERMINAL)
TERMINAL_STATES: tuple[JobState, ...] = tuple(s for s in JobState if s in TERMINAL)

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.CANCELLED, JobState.SCHEDULED}),
    JobState.SCHEDULED: frozenset({JobState.QUEUED, JobState.CANCELLED}),
    JobState.RUNNING: frozenset(
        {JobState.COMPLETED, JobState.RETRY_WAIT, JobState.FAILED, JobState.CANCELLED, JobState.QUEUED,
         JobState.SCHEDULED}
    ),
    JobState.RETRY_WAIT: frozenset({JobState.QUEUED, JobState.CANCELLED, JobState.SCHEDULED}),
    JobState.WAITING: frozenset({JobState.QUEUED, JobState.SCHEDULED, JobState.CANCELLED, JobState.FAILED}),
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
            raise ValueError("priority must be one of HIGH, NORMAL, LOW, got %s" % quote(value)) from None


_LEVELS = {Priority.LOW: 0, Priority.NORMAL: 1, Priority.HIGH: 2}
_BY_NAME = {p.value: p for p in Priority}
MAX_LEVEL = 2
