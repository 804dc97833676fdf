"""The core's time-ordered indexes: when waiting jobs fall due, when leases expire.

``Timers`` listens to the job table (JSON and Periodic jobs alike): a job entering
RETRY_WAIT or SCHEDULED joins the due heap at its due time, a job entering RUNNING joins
the deadline heap at its lease's deadline. The table also tells it of times that change
without a move (``retimed``): a lease recovery kept for its worker, the same lease once
claimed, a waiting job given another due time. Entries are never removed in place: a popped
entry that no longer describes its job (cancelled, re-timed, a lease that ended) is
skipped, and a heap is rebuilt from live work once dead entries outnumber live ones, so
its size follows running work rather than history. Pure: times are core time.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterator

from jobmesh.store.job import Job
from jobmesh.coordinator.core.table import JobTable, due_time
from jobmesh.protocol.jobs import JobState


class Timers:
    def __init__(self, table: JobTable) -> None:
        self.table = table
        self.due_heap: list[tuple[int, str]] = []  # (due time, job id): SCHEDULED and RETRY_WAIT jobs
        self.deadline_heap: list[tuple[int, str, str]] = []  # (deadline, job id, attempt id)
        table.listen(self)
        table.listen_times(self)

    # ---- the table's listener ----------------------------------------------------------

    def entered(self, job: Job, now: int) -> None:
        due = due_time(job)
        if due is not None:
            self._wake(job, due - self.table.drift)

    def moved(self, job: Job, source: JobState, target: JobState, now: int) -> None:
        if target is JobState.RUNNING:
            assert job.deadline is not None and job.attempt_id is not None
            heapq.heappush(self.deadline_heap, (job.deadline, job.job_id, job.attempt_id))
        elif target is JobState.RETRY_WAIT or target is JobState.SCHEDULED:
            due = due_time(job)
            assert due is not None
            self._wake(job, due - self.table.drift)

    def retimed(self, job: Job) -> None:
        """A lease's new deadline, or a waiting job's new due time: the entry of the old
        one is skipped when it comes up."""
        if job.state is JobState.RUNNING:
            assert job.deadline is not None and job.attempt_id is not None
            heapq.heappush(self.deadline_heap, (job.deadline, job.job_id, job.attempt_id))
            return
        due = due_time(job)
        if due is not None:
            self._wake(job, due - self.table.drift)

    # ---- due times --------------------------------------------------------------------

    def _wake(self, job: Job, wake_at: int) -> None:
        """Put a SCHEDULED or RETRY_WAIT job on the due heap for ``wake_at`` (core time)."""
        job.wake_at = wake_at
        heapq.heappush(self.due_heap, (wake_at, job.job_id))

    def retime_scheduled(self) -> None:
        """The wall clock stepped: SCHEDULED jobs wait for their wall-clock run-at time."""
        drift = self.table.drift
        for job in self.table.jobs.values():
            if job.state is JobState.SCHEDULED and job.run_at is not None:
                self._wake(job, job.run_at - drift)

    def due(self, now: int) -> Iterator[Job]:
        """The waiting jobs whose time has come, earliest first (each moves on as it is
        yielded: the caller transitions it before taking the next)."""
        self._compact_due()
        heap = self.due_heap
        jobs = self.table.jobs
        while heap and heap[0][0] <= now:
            at, job_id = heapq.heappop(heap)
            job = jobs.get(job_id)
            if job is None or job.wake_at != at or due_time(job) is None:
                continue  # cancelled, or waiting for another time now
            yield job

    def _compact_due(self) -> None:
        """Drop due-heap entries of jobs no longer waiting for that time (cancelled ones),
        once they outnumber the jobs that still wait."""
        heap = self.due_heap
        jobs = self.table.jobs
        if len(heap) <= 2 * len(jobs) + 1024:
            return
        live = [(t, job_id) for t, job_id in heap
                if (job := jobs.get(job_id)) is not None and job.wake_at == t and due_time(job) is not None]
        heapq.heapify(live)
        self.due_heap = live

    # ---- lease deadlines --------------------------------------------------------------

    def expired(self, now: int) -> Iterator[Job]:
        """RUNNING jobs whose current lease's deadline has passed, earliest first."""
        self._compact_deadlines()
        heap = self.deadline_heap
        jobs = self.table.jobs
        while heap and heap[0][0] <= now:
            deadline, job_id, attempt_id = heapq.heappop(heap)
            job = jobs.get(job_id)
            if (job is None or job.state is not JobState.RUNNING or job.attempt_id != attempt_id
                    or job.deadline != deadline):
                continue  # that lease already ended, or has another deadline now
            yield job

    def _compact_deadlines(self) -> None:
        """Drop heap entries of leases that already ended, once they outnumber live ones.

        Every assignment pushes an entry that otherwise stays until its deadline passes
        (10 minutes by default); at thousands of assignments a second that would be
        gigabytes. Rebuilding costs O(running), amortised over as many ended leases.
        """
        leases, unclaimed = self.table.leases, self.table.unclaimed
        if len(self.deadline_heap) <= 2 * (len(leases) + len(unclaimed)) + 1024:
            return
        jobs = self.table.jobs
        live: list[tuple[int, str, str]] = []
        for job_id in itertools.chain(leases, unclaimed):
            job = jobs.get(job_id)
            if job is not None and job.deadline is not None and job.attempt_id is not None:
                live.append((job.deadline, job_id, job.attempt_id))
        heapq.heapify(live)
        self.deadline_heap = live
