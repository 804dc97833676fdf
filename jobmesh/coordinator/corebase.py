"""What the parts of ``CoordinatorCore`` written in other files use of it.

The core is one class written in several files (core.py, requests.py, periodic_jobs.py,
periodic_waits.py). ``CoreBase`` declares, for mypy only, the state and the methods
core.py defines and the other parts use; at run time it is an empty base class. mypy
checks core.py's definitions against these declarations, so the parts cannot drift apart.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jobmesh.config import CoreConfig
    from jobmesh.coordinator import scheduler
    from jobmesh.coordinator.figures import Counters
    from jobmesh.coordinator.job import Job
    from jobmesh.coordinator.registry import Session, WorkerRegistry
    from jobmesh.coordinator.store import JobStore
    from jobmesh.coordinator.waiters import Waiters
    from jobmesh.periodic import codec as pc
    from jobmesh.protocol import messages as m
    from jobmesh.protocol.jobs import JobState, Priority


class CoreBase:
    if TYPE_CHECKING:
        store: JobStore
        config: CoreConfig
        jobs: dict[str, Job]
        finished: OrderedDict[str, Job]
        keys: dict[str, str]
        queued: scheduler.TypedQueues
        workers: WorkerRegistry
        workers_by_type: dict[str, set[Session]]
        known_types: set[str]
        next_seq: int
        drift: int
        waiters: Waiters
        counts: Counter[tuple[JobState, str, Priority, bool]]
        stats: Counters
        finished_counts: dict[JobState, int]
        draining: bool
        paused: bool
        _dirty: dict[str, Job]
        _new: set[str]
        _purges: list[str]
        _purge_backlog: bool
        _purge_cursor: int

        @property
        def active_count(self) -> int: ...
        def _job_id(self, seq: int) -> str: ...
        def _lookup(self, job_id: str) -> Job | None: ...
        def _lookup_key(self, key: str) -> Job | None: ...
        def _event(self, job: Job, now_millis: int, event: str, detail: str | None = None,
                   retry_at: int | None = None, attempt: int | None = None,
                   worker_id: str | None = None) -> None: ...
        def _transition(self, job: Job, target: JobState, now_millis: int, *, due_at: int | None = None,
                        session: Session | None = None, event: str | None = "") -> None: ...
        def _wait_until(self, job: Job, wake_at: int) -> None: ...
        def _send(self, conn: Any, msg: m.Message | bytes | pc.Paced | None) -> None: ...
        def _retry_or_fail(self, job: Job, now_millis: int, error: str, cause: str) -> None: ...
        def _revoke_lease(self, job: Job, why: str) -> None: ...
