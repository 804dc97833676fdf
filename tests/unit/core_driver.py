"""The one driver of ``CoordinatorCore`` in unit tests: plain numbers for time, a real store.

A batch here is what the runtime does with one (``CoordinatorCore.apply_batch``, then
``loop.CoreLoop._commit_and_release``): each event goes through ``core.take_in``, the
batch ends with ``core.finish_batch`` (the very steps ``apply_batch`` takes), then the
rows are committed, then the outbound frames are released; the store reads held requests
began wake the driver as they would wake the runtime (``woken``; the runtime's
READS_DONE). An error the core logged and got past is raised here. After every commit
the driver checks the invariants that must hold between batches: the store holds exactly
what the core holds, no JSON worker runs more than its capacity, every running job has
exactly one lease and its holder knows it (or
recovery kept it for a worker to claim), every index agrees with each job's state, and
every live workflow is stored and knows its jobs' states.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator

from jobmesh.config import CoreConfig
from jobmesh.coordinator.core import events as ev
from jobmesh.coordinator.core.face import Applied, CoordinatorCore
from jobmesh.coordinator.core.waiters import Waiter
from jobmesh.protocol import messages as m
from jobmesh.protocol.jobs import TERMINAL, JobState
from jobmesh.store.columns import insert_row
from jobmesh.store.sqlite import SQLiteStore

DEFAULTS = dict(heartbeat_timeout_millis=1000, task_timeout_millis=10_000, max_active_jobs=1000,
                aging_step_millis=60_000, retry_base_millis=100, retry_cap_millis=1000, default_max_attempts=3)


class Conn:
    """A stand-in for a connection: hashable by identity, with a readable name."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return "Conn(%s)" % self.name


CLIENT = Conn("client")


class CoreDriver:
    def __init__(self, store: SQLiteStore | None = None, prefix: str = "id", ids: Iterator[int] | None = None,
                 **cfg: Any) -> None:
        config = dict(DEFAULTS)
        config.update(cfg)
        self.store = store if store is not None else SQLiteStore(":memory:")
        counter = ids if ids is not None else itertools.count(1)
        self.core = CoordinatorCore(self.store, CoreConfig(**config), new_id=lambda: "%s-%d" % (prefix, next(counter)))
        self.sent: list[tuple[Any, Any]] = []  # every frame released, in order
        self.answers: list[tuple[Waiter, m.Message]] = []  # waits answered, not yet taken
        self.batch = Applied()  # the batch under way
        self.woken = False  # a store read a held request waits for is done: READS_DONE is due

    # -- one batch ------------------------------------------------------------------------

    def apply(self, now: int, event: ev.Event) -> Any:
        """One event into the core as the runtime applies it (its reply, for a request);
        the batch goes on."""
        batch = self.batch
        replies = len(batch.replies)
        if type(event) is ev.ReadsDone:
            self.woken = False
        self.core.take_in(event, now, batch)
        self._raise(batch)
        return batch.replies[-1][1][0] if len(batch.replies) > replies else None

    def request(self, now: int, msg: Any, conn: Any = CLIENT) -> Any:
        return self.apply(now, ev.Request(conn, msg))

    def end_batch(self, now: int) -> list[tuple[Any, Any]]:
        """The end of the batch: the core's after-batch work, the commit, the checks, the
        release; the frames released."""
        batch, self.batch = self.batch, Applied()
        self.core.finish_batch(batch, now)
        self._raise(batch)
        self.answers.extend(batch.waits)
        self.store.write(self.core.take_dirty())
        self.check()
        out = self.core.take_outbound()
        self.sent.extend(out)
        for read in self.core.take_new_reads():  # none on SQLite: its reads answer at once
            read.then(self._read_done)
        return out

    def _read_done(self) -> None:
        self.woken = True

    @staticmethod
    def _raise(batch: Applied) -> None:
        """What the core logged and got past fails the test."""
        if batch.errors:
            raise batch.errors.pop()

    def take_answers(self) -> list[tuple[Waiter, m.Message]]:
        answers, self.answers = self.answers + self.core.requests.take_answers(), []
        return answers

    # -- between batches -----------------------------------------------------------------------

    def check(self) -> None:
        core = self.core
        table = core.table
        for job in list(table.jobs.values()) + list(table.finished.values()):
            stored = self.store.get(job.job_id)
            assert stored is not None, job.job_id
            assert insert_row(stored) == insert_row(job), job.job_id
        assert all(j.state not in TERMINAL for j in table.jobs.values())
        assert core.active_count == len(list(self.store.load_active()))
        stored = dict(self.store.load_schedules())
        assert stored.keys() == core.schedules.by_name.keys()
        for name, schedule in core.schedules.by_name.items():
            assert stored[name] == schedule.body(), name
        assert dict(self.store.load_limits()) == {name: limit.body() for name, limit in core.limits.by_type.items()}
        for workflow_id, flow in core.workflows.live.items():  # each live workflow stored, its states the jobs'
            assert self.store.load_workflow(workflow_id) is not None, workflow_id
            for job_id, state in zip(flow.job_ids, flow.states):
                job = table.jobs.get(job_id) or table.finished.get(job_id) or self.store.get(job_id)
                assert job is not None and job.state is state, job_id
                if state is JobState.WAITING:
                    assert flow.pending[flow.at[job.ref or ""]] > 0, job_id
        for session in core.json.workers:
            assert len(table.running(session)) <= session.capacity, session.worker_id
        for job_id, session in table.leases.items():
            assert job_id in table.running(session), job_id
        for job_id in table.unclaimed:
            assert table.jobs[job_id].state is JobState.RUNNING, job_id
        for job in table.jobs.values():
            if job.state is JobState.RUNNING:
                lease = table.leases.get(job.job_id)
                if lease is None:  # kept by recovery for a worker to claim: no session holds it
                    assert job.job_id in table.unclaimed and job.periodic is None, job.job_id
                else:
                    assert lease.worker_id == job.worker_id and job.job_id not in table.unclaimed, job.job_id
                assert job.attempt_id is not None and job.deadline is not None
            else:
                assert job.job_id not in table.leases, job.job_id
                assert job.worker_id is None and job.attempt_id is None and job.deadline is None
            assert (job.retry_at is not None) == (job.state is JobState.RETRY_WAIT)
            if job.periodic is None:
                assert (job.job_id in core.json.queued) == (job.state is JobState.QUEUED)
            if job.state in (JobState.SCHEDULED, JobState.RETRY_WAIT):
                assert job.wake_at is not None and (job.wake_at, job.job_id) in core.timers.due_heap
            if job.state is JobState.SCHEDULED:
                assert job.run_at is not None
