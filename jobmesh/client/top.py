"""``jobmesh top``: a live view of a coordinator, redrawn in place until Ctrl-C.

Each refresh takes one *sample* over the client port, with requests every coordinator
answers (no metrics port needed):

- LIST_JOBS per non-terminal state (limit 1000): the count of each (``1000+`` past a page)
  and, from the QUEUED and RETRY_WAIT pages, the jobs waiting longest;
- LIST_JOBS unfiltered (limit 1000, newest first): the ids of the newest jobs. The jobs
  submitted since the previous sample are those ahead of the newest id that sample saw;
- LIST_WORKERS: the live workers and their slots.

Rates come from two successive samples: submitted = new jobs / seconds between them, and
finished = submitted - (change of the active count), since every job that arrives either
is still active or has finished (COMPLETED, FAILED or CANCELLED). A rate that cannot be
known (the first sample, a state past a page) reads ``-``; a lower bound reads ``>=``.

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

ACTIVE_STATES = ("QUEUED", "SCHEDULED", "RUNNING", "RETRY_WAIT")
WAITING_STATES = ("QUEUED", "RETRY_WAIT")
PAGE = 1000
OLDEST = 10
CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen


@dataclass
class Sample:
    """What one refresh saw; ``at`` is monotonic seconds, ``at_millis`` the wall clock."""

    at: float
    at_millis: int
    counts: dict[str, int]
    capped: frozenset[str]          # states with more jobs than one page holds
    newest_ids: list[str]           # newest first
    waiting: list[dict[str, Any]]   # QUEUED and RETRY_WAIT jobs, longest waiting first
    workers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def active(self) -> int:
        return sum(self.counts.values())


def take_sample(client: CoordinatorClient) -> Sample:
    counts: dict[str, int] = {}
    capped = set()
    waiting: list[dict[str, Any]] = []
    for state in ACTIVE_STATES:
        jobs, cursor = client.list_jobs(PAGE, state)
        counts[state] = len(jobs)
        if cursor is not None:
            capped.add(state)
        if state in WAITING_STATES:
            waiting.extend(jobs)
    newest, _cursor = client.list_jobs(PAGE)
    workers = client.workers()
    waiting.sort(key=lambda j: (j.get("updatedAtMillis") or 0, j.get("createdAtMillis") or 0))
    return Sample(time.monotonic(), int(time.time() * 1000), counts, frozenset(capped),
                  [str(j.get("jobId")) for j in newest], waiting[:OLDEST], workers)


def new_since(previous_ids: list[str], ids: list[str]) -> tuple[int, bool]:
    """How many of ``ids`` (newest first) are newer than every id in ``previous_ids``;
    True with it when that is only a lower bound (a full page, none of it seen before)."""
    seen = set(previous_ids)
    for index, job_id in enumerate(ids):
        if job_id in seen:
            return index, False
    return len(ids), bool(previous_ids) and len(ids) >= PAGE


def rates(previous: Sample | None, current: Sample) -> tuple[str, str]:
    """``(submitted, finished)`` per second between two samples, as text."""
    if previous is None or current.at <= previous.at:
        return render.MISSING, render.MISSING
    seconds = current.at - previous.at
    submitted, lower_bound = new_since(previous.newest_ids, current.newest_ids)
    mark = ">=" if lower_bound else ""
    submitted_text = "%s%.1f/s" % (mark, submitted / seconds)
    if previous.capped or current.capped:
        return submitted_text, render.MISSING
    finished = max(0, submitted - (current.active - previous.active))
    return submitted_text, "%s%.1f/s" % (mark, finished / seconds)


def count_text(sample: Sample, state: str) -> str:
    return "%d%s" % (sample.counts.get(state, 0), "+" if state in sample.capped else "")


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
        "jobs      " + "  ".join("%s %s" % (s.lower(), count_text(sample, s)) for s in ACTIVE_STATES)
        + "  (active %d%s)" % (sample.active, "+" if sample.capped else ""),
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
            console.out(CLEAR + frame(sample, previous, target, interval_millis))
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
