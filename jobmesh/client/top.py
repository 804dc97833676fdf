"""``jobmesh top``: a live view of a coordinator, redrawn in place until Ctrl-C.

Each refresh takes one *sample* over the client port, with requests every coordinator
answers (no metrics port needed), none of which costs more than a page of jobs:

- GET_STATS: the jobs of each non-terminal state and the counters since the coordinator
  started (submitted, finished by state), from figures the core keeps;
- LIST_JOBS for QUEUED and for RETRY_WAIT (a page each): the jobs waiting longest among
  them, with why;
- LIST_WORKERS: the live workers and their slots;
- SCHEDULE_LIST (its first page): the recurring schedules that fire next.

Rates come from two successive samples: the change of the ``submitted`` and
``finished`` counters over the seconds between them. A rate that cannot be known (the
first sample, or a coordinator that restarted between two samples) reads ``-``.

The screen is cleared and redrawn with ANSI escapes (home, clear), so no curses is needed
and the output can be captured by tests (``--iterations=N`` stops after N refreshes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from jobmesh.client import render
from jobmesh.client.api import CoordinatorClient
from jobmesh.exitcodes import EXIT_FAILED, EXIT_OK
from jobmesh.protocol import messages as m
from jobmesh.protocol.jobs import ACTIVE_STATES, TERMINAL_STATES, JobState

WAITING_STATES = (JobState.QUEUED, JobState.RETRY_WAIT)  # the states whose oldest jobs are listed
PAGE = 1000
OLDEST = 10
NEXT_FIRES = 5
CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen


@dataclass
class Sample:
    """What one refresh saw; ``at`` is monotonic seconds, ``at_millis`` the wall clock."""

    at: float
    at_millis: int
    counts: dict[str, int]          # non-terminal jobs by state
    submitted: int                  # counters since the coordinator started
    finished: int
    waiting: list[dict[str, Any]]   # QUEUED and RETRY_WAIT jobs, longest waiting first
    workers: list[dict[str, Any]] = field(default_factory=list)
    ended: dict[str, int] = field(default_factory=dict)  # jobs finished since the start, by terminal state
    fires: list[dict[str, Any]] = field(default_factory=list)  # the schedules that fire next, soonest first

    @property
    def active(self) -> int:
        return sum(self.counts.values())


def take_sample(client: CoordinatorClient) -> Sample:
    stats = client.stats()
    waiting: list[dict[str, Any]] = []
    for state in WAITING_STATES:
        jobs, _cursor = client.list_jobs(PAGE, state.value)
        waiting.extend(jobs)
    workers = client.workers()
    schedules = client.request(m.ScheduleList(), m.ScheduleList, idempotent=True).schedules
    fires = sorted((s for s in schedules if s.get("nextFireMillis") is not None), key=lambda s: s["nextFireMillis"])
    waiting.sort(key=lambda j: (j.get("updatedAtMillis") or 0, j.get("createdAtMillis") or 0))
    return Sample(time.monotonic(), stats.at_millis,
                  {state.value: int(stats.jobs.get(state.value, 0)) for state in ACTIVE_STATES},
                  stats.submitted, sum(int(n) for n in stats.finished.values()), waiting[:OLDEST], workers,
                  {state.value: int(stats.finished.get(state.value, 0)) for state in TERMINAL_STATES},
                  fires[:NEXT_FIRES])


def rates(previous: Sample | None, current: Sample) -> tuple[str, str]:
    """``(submitted, finished)`` per second between two samples, as text."""
    if (previous is None or current.at <= previous.at or current.submitted < previous.submitted
            or current.finished < previous.finished):  # the first sample, or the coordinator restarted
        return render.MISSING, render.MISSING
    seconds = current.at - previous.at
    return ("%.1f/s" % ((current.submitted - previous.submitted) / seconds),
            "%.1f/s" % ((current.finished - previous.finished) / seconds))


def counts_text(counts: dict[str, int], states: tuple[JobState, ...]) -> str:
    return "  ".join("%s %d" % (s.value.lower(), counts.get(s.value, 0)) for s in states)


def frame(sample: Sample, previous: Sample | None, target: str, interval_millis: int) -> str:
    """One screenful of text (no escapes)."""
    now = sample.at_millis
    submitted, finished = rates(previous, sample)
    busy = sum(w.get("activeJobs") or 0 for w in sample.workers)
    slots = sum(w.get("capacity") or 0 for w in sample.workers)
    lines = [
        "jobmesh top  %s  %s  (every %.1fs, Ctrl-C to quit)"
        % (target, render.timestamp(now, zone=True), interval_millis / 1000.0),
        "",
        "jobs      " + counts_text(sample.counts, ACTIVE_STATES) + "  (active %d)" % sample.active,
        "ended     " + counts_text(sample.ended, TERMINAL_STATES) + "  (since the coordinator started)",
        "rates     submitted %s  finished %s" % (submitted, finished),
        "workers   %d live, %d/%d slots busy" % (len(sample.workers), busy, slots),
        "",
        render.worker_table(sample.workers, now),
        "",
        "oldest waiting jobs",
    ]
    if sample.waiting:
        lines.append(render.table(
            ("JOB", "TYPE", "STATE", "SINCE", "WAITING"),
            ((j.get("jobId"), j.get("taskType"), j.get("state"), render.age(j.get("updatedAtMillis"), now),
              render.waiting(j, now, sample.workers) if j.get("waitingReason") else render.MISSING)
             for j in sample.waiting)))
    else:
        lines.append("none")
    if sample.fires:
        lines += ["", "next schedule fires", render.table(
            ("SCHEDULE", "TYPE", "NEXT FIRE", "LAST JOB", "STATE"),
            ((s.get("name"), s.get("taskType"), render.when(s.get("nextFireMillis"), now), s.get("lastJobId"),
              s.get("lastJobState")) for s in sample.fires))]
    return "\n".join(lines)


def run(client: CoordinatorClient, console: Any, interval_millis: int, iterations: int) -> int:
    """Refresh every ``interval_millis`` until ``iterations`` refreshes (0: no limit) or Ctrl-C.

    ``CoordinatorUnavailable`` and ``RequestFailed`` propagate (exit 3 and 1, from the
    caller); anything else unexpected is one line on stderr and exit 1, never a traceback.
    """
    target = "%s:%d" % (client.host, client.port)
    previous: Sample | None = None
    shown = 0
    try:
        while True:
            sample = take_sample(client)
            console.screen(CLEAR, frame(sample, previous, target, interval_millis))
            previous = sample
            shown += 1
            if iterations and shown >= iterations:
                return EXIT_OK
            time.sleep(interval_millis / 1000.0)
    except KeyboardInterrupt:
        return EXIT_OK
    except (AttributeError, TypeError, ValueError, KeyError) as exc:  # a reply we cannot read
        console.error("top", "cannot show the reply: %s: %s" % (type(exc).__name__, exc))
        return EXIT_FAILED
