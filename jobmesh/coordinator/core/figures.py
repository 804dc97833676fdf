"""The coordinator's figures and the one registry of the metrics they are exported as.

Three plain records, read at scrape time and never locked:

* ``Counters``: what the core counts since the process started, one slotted int
  attribute each (``counters.retries += 1``; a misspelled name raises ``AttributeError``);
* ``Figures``: what ``core.metrics()`` returns, a copy of the counters and the series the
  core keeps (O(series), never O(jobs));
* ``RuntimeFigures``: what the runtime keeps beside the core (inbox depth, connections,
  the plain commit and batch histograms).

``METRICS`` is the registry: one ``Metric`` per exported family, with its name, help text,
kind, label names, and the attribute path it is read from. The Prometheus collector
(``http.py``) iterates it; the dashboard's ``/api/summary`` takes the metrics that name a
``summary`` key; GET_STATS (``stats_message``) the ones that name a ``stats`` field of
``messages.Stats``. Every path is checked against the records' attributes when this module
is imported, so a misspelled metric fails at once, never reads as 0.

Label values come from ``protocol.jobs`` (``JobState``, ``TERMINAL``, ``Priority``) and
``PORTS``; every labelled series lists all of them, zeros included. The ``schedule`` label
is the exception: its values are the recurring schedules that counted since the start.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any, Callable, Protocol

from jobmesh.protocol import messages as m
from jobmesh.protocol.jobs import ACTIVE_STATES, TERMINAL_STATES, JobState, Priority

PORTS = ("worker", "client", "metrics", "periodic")  # label values of jobmesh_connections
PRIORITIES = tuple(p.value for p in sorted(Priority, key=lambda p: -p.level))  # HIGH, NORMAL, LOW
ACTIVE = tuple(s.value for s in ACTIVE_STATES)
FINISHED = tuple(s.value for s in TERMINAL_STATES)
WORKFLOW_STATES = ("RUNNING",) + FINISHED  # label values of jobmesh_workflows


@dataclass(slots=True)
class Counters:
    """The core's counters since the process started (a storage reload carries them over)."""

    submitted: int = 0  # jobs created (rejected submits and idempotent repeats are not)
    rejected: int = 0  # submits refused at the active-job limit
    retries: int = 0  # attempts that ended and were scheduled for a retry
    deadline_expiries: int = 0  # attempts that passed their deadline
    workers_lost: int = 0  # worker sessions lost (dead or disconnected)
    stale_results: int = 0  # results for an old lease, dropped
    purged: int = 0  # finished jobs deleted by retention or PURGE_JOBS
    progress_reports: int = 0  # TASK_PROGRESS frames applied (kept as their job's progress)
    progress_dropped: int = 0  # TASK_PROGRESS frames dropped: a lease not held, or out of bounds

    def add(self, other: Counters) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass(frozen=True, slots=True)
class Figures:
    """The core's figures at one moment (``core.metrics()``).

    ``jobs`` counts the non-terminal jobs by (state, task type or Periodic func, base
    priority, protocol "json" or "periodic"), string values; a key whose count fell to 0
    may stay. ``finished`` counts the jobs that ended, by terminal state, every one listed.
    """

    counters: Counters
    jobs: Mapping[tuple[str, str, str, str], int]
    finished: Mapping[str, int]
    workers: int  # live JSON worker sessions
    capacity: int  # their slots
    busy_slots: int  # slots running an attempt
    periodic_workers: int  # live Periodic worker connections
    waits: int  # pending WAIT_JOBs and Periodic RUN_JOB / RECV_DATA callers
    # By recurring schedule name, since the process started: fires that made a job, fire
    # times skipped (overlap), fire times missed (down, or outside the catch-up policy).
    schedule_fires: Mapping[str, int] = field(default_factory=dict)
    schedule_skips: Mapping[str, int] = field(default_factory=dict)
    schedule_misses: Mapping[str, int] = field(default_factory=dict)
    # QUEUED jobs a limit holds back, by (task type, reason) (coordinator/limits.py).
    jobs_held: Mapping[tuple[str, str], int] = field(default_factory=dict)
    # Workflows by state: RUNNING the live ones, the others those that ended since the process started.
    workflows: Mapping[str, int] = field(default_factory=dict)

    @property
    def workflows_by_state(self) -> dict[str, int]:
        """Workflows by state, every state listed (RUNNING, COMPLETED, FAILED, CANCELLED)."""
        return {state: self.workflows.get(state, 0) for state in WORKFLOW_STATES}

    @property
    def jobs_by_state(self) -> dict[str, int]:
        """Non-terminal jobs by state, every such state listed, in ``JobState`` order."""
        out = dict.fromkeys(ACTIVE, 0)
        for (state, _task_type, _priority, _protocol), n in self.jobs.items():
            out[state] += n
        return out

    @property
    def jobs_by_type(self) -> dict[tuple[str, str, str], int]:
        """Non-terminal jobs by (state, task type, protocol), sorted; zero counts left out."""
        out: dict[tuple[str, str, str], int] = {}
        for (state, task_type, _priority, protocol), n in self.jobs.items():
            if n:
                key = (state, task_type, protocol)
                out[key] = out.get(key, 0) + n
        return dict(sorted(out.items()))

    @property
    def queued_by_priority(self) -> dict[str, int]:
        """QUEUED jobs by base priority, every priority listed."""
        out = dict.fromkeys(PRIORITIES, 0)
        for (state, _task_type, priority, _protocol), n in self.jobs.items():
            if state == JobState.QUEUED.value:
                out[priority] += n
        return out

    @property
    def finished_by_state(self) -> dict[str, int]:
        """Jobs that ended, by terminal state, every one listed in ``JobState`` order."""
        return {state: self.finished[state] for state in FINISHED}


# The core's figures before there is a core (standing by, recovering): every count zero.
NO_FIGURES = Figures(counters=Counters(), jobs={}, finished=dict.fromkeys(FINISHED, 0), workers=0, capacity=0,
                     busy_slots=0, periodic_workers=0, waits=0)


class BucketCounts(Protocol):
    """A plain histogram (``housekeeping.Histogram``): per-bucket counts, overflow last."""

    bounds: tuple[float, ...]
    counts: list[int]
    sum: float


@dataclass(frozen=True, slots=True)
class RuntimeFigures:
    """The runtime's own figures (``Coordinator.figures()``), O(1) to take."""

    inbox_depth: int  # events waiting in the core's mailbox
    max_active_jobs: int  # the admission limit
    connections: Mapping[str, int]  # open connections by port name (a port not open: absent)
    commit_seconds: BucketCounts
    commit_rows: BucketCounts
    batch_events: BucketCounts
    storage_available: int = 1  # 1 while writes work, 0 during a storage outage
    leading: int = 1  # 1 while this process leads its store, 0 while it stands by
    auth_failures: int = 0  # failed authentications (--auth-file) since the process started

    @property
    def connections_by_port(self) -> dict[str, int]:
        return {port: self.connections.get(port, 0) for port in PORTS}


class Kind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


def _check_path(root: type, path: str) -> None:
    """Raise ``ValueError`` unless ``path`` (dotted) names a field or property of ``root``,
    through fields whose declared type is again such a record."""
    cls: Any = root
    parts = path.split(".")
    for i, part in enumerate(parts):
        if not isinstance(cls, type):
            raise ValueError("metric path %r: %s is not a record" % (path, ".".join(parts[:i])))
        hints = typing.get_type_hints(cls)
        if dataclasses.is_dataclass(cls) and part in {f.name for f in fields(cls)}:
            cls = hints.get(part)
        elif isinstance(getattr(cls, part, None), property):
            cls = None
        else:
            raise ValueError("metric path %r: %s has no figure %r" % (path, cls.__name__, part))


@dataclass(frozen=True)
class Metric:
    """One exported family.

    ``path`` is read from ``Figures`` (or from ``RuntimeFigures`` when ``runtime``); it
    gives a number, a histogram, or for a labelled family a dict from label value (a
    tuple of them for several labels) to number. ``summary`` is its key in the
    dashboard's ``/api/summary``; ``stats`` its field of ``messages.Stats`` (GET_STATS,
    which the core answers alone, so never a runtime figure).
    """

    name: str
    help: str
    kind: Kind
    path: str
    labels: tuple[str, ...] = ()
    runtime: bool = False
    summary: str | None = None
    stats: str | None = None
    read: Callable[[Any], Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_path(RuntimeFigures if self.runtime else Figures, self.path)
        if self.stats is not None and self.runtime:
            raise ValueError("metric %s: GET_STATS is answered by the core, which has no runtime figures" % self.name)
        object.__setattr__(self, "read", attrgetter(self.path))

    def value(self, core: Figures, runtime: RuntimeFigures | None = None) -> Any:
        return self.read(runtime if self.runtime else core)


C, G, H = Kind.COUNTER, Kind.GAUGE, Kind.HISTOGRAM

METRICS: tuple[Metric, ...] = (
    # The names, and the Stats fields, are the contract's (CONTRACT.md, docs/PROTOCOL.md).
    Metric("jobmesh_jobs", "Non-terminal jobs by state.", G, "jobs_by_state", ("state",),
           summary="jobs", stats="jobs"),
    Metric("jobmesh_jobs_by_type", "Non-terminal jobs by state and task type (a Periodic func for "
           "protocol=\"periodic\").", G, "jobs_by_type", ("state", "task_type", "protocol")),
    Metric("jobmesh_queue_depth", "QUEUED jobs by base priority.", G, "queued_by_priority", ("priority",),
           summary="queuedByPriority"),
    Metric("jobmesh_jobs_submitted_total", "Jobs created (rejected submits and idempotent repeats are not).", C,
           "counters.submitted", summary="submitted", stats="submitted"),
    Metric("jobmesh_jobs_finished_total", "Jobs that reached a terminal state.", C, "finished_by_state", ("state",),
           summary="finished", stats="finished"),
    Metric("jobmesh_submits_rejected_total", "Submits refused at the active-job limit.", C, "counters.rejected",
           summary="rejected", stats="rejected"),
    Metric("jobmesh_retries_total", "Attempts that ended and were scheduled for a retry.", C, "counters.retries",
           summary="retries", stats="retries"),
    Metric("jobmesh_deadline_expiries_total", "Attempts that passed their deadline.", C,
           "counters.deadline_expiries", summary="deadlineExpiries"),
    Metric("jobmesh_workers_lost_total", "Worker sessions lost (dead or disconnected).", C, "counters.workers_lost",
           summary="workersLost"),
    Metric("jobmesh_stale_results_total", "Results for an old lease, dropped.", C, "counters.stale_results",
           summary="staleResults"),
    Metric("jobmesh_progress_reports_total", "TASK_PROGRESS reports applied (each replaces its running job's "
           "progress, in memory).", C, "counters.progress_reports"),
    Metric("jobmesh_progress_dropped_total", "TASK_PROGRESS reports dropped: for a lease the worker does not "
           "hold, or out of bounds.", C, "counters.progress_dropped"),
    Metric("jobmesh_jobs_purged_total", "Finished jobs deleted (retention and PURGE_JOBS).", C, "counters.purged"),
    Metric("jobmesh_workers", "Live worker sessions (JSON workers).", G, "workers", summary="workers",
           stats="workers"),
    Metric("jobmesh_periodic_workers", "Live Periodic worker connections (that declared a func or grabbed).", G,
           "periodic_workers", summary="periodicWorkers", stats="periodic_workers"),
    Metric("jobmesh_waits", "Pending waits: WAIT_JOB requests and Periodic RUN_JOB / RECV_DATA callers.", G,
           "waits", summary="waits", stats="waits"),
    Metric("jobmesh_worker_slots", "Task slots of the live workers (their capacity).", G, "capacity",
           summary="capacity", stats="capacity"),
    Metric("jobmesh_worker_slots_busy", "Task slots running an attempt.", G, "busy_slots", summary="busySlots",
           stats="busy_slots"),
    Metric("jobmesh_schedule_fires_total", "Jobs made by each recurring schedule's fires and triggers.", C,
           "schedule_fires", ("schedule",)),
    Metric("jobmesh_schedule_skipped_total", "Fire times that made no job because the schedule's last job had not "
           "ended (overlap=skip).", C, "schedule_skips", ("schedule",)),
    Metric("jobmesh_schedule_missed_total", "Fire times that made no job because the coordinator was down or held "
           "back, or that fell outside the schedule's missed policy.", C, "schedule_misses", ("schedule",)),
    Metric("jobmesh_jobs_held", "QUEUED jobs held back by their type's limit, by the reason shown "
           "(TYPE_PAUSED, CONCURRENCY_LIMIT, KEY_CONCURRENCY_LIMIT, RATE_LIMIT).", G, "jobs_held",
           ("taskType", "reason")),
    Metric("jobmesh_workflows", "Workflows by state: RUNNING those not ended; COMPLETED, FAILED and CANCELLED "
           "those that ended since the process started.", G, "workflows_by_state", ("state",)),
    Metric("jobmesh_connections", "Open connections by port.", G, "connections_by_port", ("port",), runtime=True,
           summary="connections"),
    Metric("jobmesh_active_jobs_limit", "The admission limit on non-terminal jobs (--max-active-jobs).", G,
           "max_active_jobs", runtime=True),
    Metric("jobmesh_storage_available", "1 while the database takes writes, 0 during a storage outage (writes "
           "are refused, unapplied, until a probe write succeeds).", G, "storage_available", runtime=True,
           summary="storageAvailable"),
    Metric("jobmesh_leading", "1 while this coordinator leads its database, 0 while it stands by for another "
           "(a shared PostgreSQL store; it serves only the metrics port then).", G, "leading", runtime=True,
           summary="leading"),
    Metric("jobmesh_core_inbox_depth", "Events waiting in the core's mailbox.", G, "inbox_depth", runtime=True,
           summary="inboxDepth"),
    Metric("jobmesh_commit_seconds", "Group commits: from the start of a batch's transaction until the core has "
           "its result.", H, "commit_seconds", runtime=True),
    Metric("jobmesh_commit_batch_rows", "Job rows written per group commit.", H, "commit_rows", runtime=True),
    Metric("jobmesh_core_batch_events", "Mailbox events applied per core batch.", H, "batch_events", runtime=True),
    Metric("jobmesh_auth_failures_total", "Failed authentications (a wrong or missing token) on every port, "
           "with --auth-file.", C, "auth_failures", runtime=True, summary="authFailures"),
)

# (key, metric) of the metrics that GET_STATS and /api/summary carry.
STATS_FIELDS = tuple((metric.stats, metric) for metric in METRICS if metric.stats is not None)
SUMMARY_KEYS = tuple((metric.summary, metric) for metric in METRICS if metric.summary is not None)


def stats_message(figures: Figures, at_millis: int) -> m.Stats:
    """GET_STATS's reply: the registry's ``stats`` metrics, by keyword."""
    return m.Stats(at_millis=at_millis, **{name: metric.value(figures) for name, metric in STATS_FIELDS})


@dataclass(frozen=True, slots=True)
class Recovery:
    """What ``CoordinatorCore.recover`` found and did, for the recovery log line: the jobs
    by what became of them, and the state recovered beside them."""

    queued: int = 0  # QUEUED after recovery: the requeued and those due while down included
    scheduled: int = 0
    retry_wait: int = 0
    requeued: int = 0  # RUNNING when the coordinator stopped, queued again
    due: int = 0  # SCHEDULED, and fell due while the coordinator was down
    failed: int = 0  # RUNNING in their final attempt: failed
    damaged: int = 0  # rows that do not decode
    kept: int = 0  # RUNNING, kept on their leases for their workers to claim (lease grace)
    waiting: int = 0  # WAITING for their dependencies (workflows)
    active: int = 0  # jobs not finished
    task_types: int = 0
    next_seq: int = 0
    schedules: int = 0
    workflows: int = 0  # workflows with jobs not finished
