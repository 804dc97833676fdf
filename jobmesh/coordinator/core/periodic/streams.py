"""Run-and-wait and streaming on the Periodic port: RUN_JOB, RECV_DATA, WORK_DATA (PERIODIC.md 7.3, 7.19).

``Streams`` answers the three requests over the waiters of ``waits.py``: RUN_JOB stores
(or attaches to) the job of its name and waits for its end; RECV_DATA attaches to the
live job of its name, or the next one, and gets its chunks, then EOF; WORK_DATA from a
worker the job runs on goes to them. A wait whose time is up ends its job (RUN_JOB) or
gets its EOF (RECV_DATA).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from jobmesh.coordinator.core.figures import Counters
from jobmesh.coordinator.core.outbox import Outbox
from jobmesh.coordinator.core.periodic.index import FuncIndex, close_not_text
from jobmesh.coordinator.core.periodic.named import NamedJobs
from jobmesh.coordinator.core.periodic.waits import EXPIRED_ERROR, PeriodicWaits, wait_deadline
from jobmesh.coordinator.core.periodic.workers import WorkerSessions
from jobmesh.coordinator.core.table import JobTable
from jobmesh.periodic import codec as pc
from jobmesh.protocol.jobs import JobState

if TYPE_CHECKING:
    from jobmesh.coordinator.core.peers import OutboundConnection

log = logging.getLogger(__name__)


class Streams:
    def __init__(self, table: JobTable, index: FuncIndex, sessions: WorkerSessions, named: NamedJobs,
                 waits: PeriodicWaits, outbox: Outbox, counters: Counters) -> None:
        self.table = table
        self.index = index
        self.sessions = sessions
        self.named = named
        self.waits = waits
        self.outbox = outbox
        self.counters = counters

    def on_run(self, now: int, conn: OutboundConnection, msg: pc.RunJob, submitted_by: str | None) -> None:
        """RUN_JOB: NO_WORKER at once if no connected worker declared the func; else store
        (or attach to the job of that name) and answer when the job ends."""
        key, _job = self.index.live(pc.Handle(msg.job.func, msg.job.name))
        if key is None:
            close_not_text(self.outbox, conn)
            return
        func, name = key
        if not self.index.has_workers(func):
            self.outbox.send(conn, pc.encode_no_worker(msg.msgid))
            return
        if not self.waits.may_wait(conn):
            return
        problem = self.named.store(now, func, name, msg.job, submitted_by)
        if problem is not None:
            self.outbox.send(conn, pc.encode_data(msg.msgid, problem))
            return
        self.waits.add(key, conn, msg.msgid, False, wait_deadline(now, msg.job.timeout))

    def on_recv_data(self, now: int, conn: OutboundConnection, msg: pc.RecvData) -> None:
        """RECV_DATA: SUCCESS, then the job's WORK_DATA chunks, then EOF when it ends. It
        attaches to the live job of that name, or to the next one; one that ended moments
        ago (aio-periodic sends RECV_DATA after RUN_JOB) gets its EOF at once."""
        key, job = self.index.live(pc.Handle(msg.job.func, msg.job.name))
        if key is None:
            close_not_text(self.outbox, conn)
            return
        if not self.index.has_workers(key[0]):
            self.outbox.send(conn, pc.Paced(msg.msgid, pc.encode_no_worker(msg.msgid)))
            return
        if not self.waits.may_wait(conn):
            return
        self.outbox.send(conn, pc.Paced(msg.msgid, pc.encode_success(msg.msgid)))
        ended = job is None and self.waits.ended_lately(key, now)
        # chunks the job sent before this RECV_DATA was applied (its RUN_JOB kept them)
        for data in self.waits.take_kept(conn, key, now, live=not ended):
            self.outbox.send(conn, pc.Paced(msg.msgid, pc.encode_data(msg.msgid, data)))
        if ended:
            self.outbox.send(conn, pc.Paced(msg.msgid, pc.encode_data(msg.msgid, pc.STREAM_EOF)))
            return
        self.waits.add(key, conn, msg.msgid, True, wait_deadline(now, msg.job.timeout))

    def on_work_data(self, now: int, conn: OutboundConnection, msg: pc.WorkData) -> None:
        """WORK_DATA: the chunk goes to every RECV_DATA waiter of the job, if it comes from
        a worker the job runs on (anything else is stale, or forged, and dropped)."""
        key, job = self.index.live(msg.handle)
        if key is not None and job is not None and self.sessions.runs_on(job, self.sessions.of(conn)):
            self.waits.chunk(key, msg.data)
        elif key is not None:
            self.counters.stale_results += 1
            log.info("periodic WORK_DATA from a worker the job does not run on dropped func=%s name=%s", *key)
        self.outbox.send(conn, pc.encode_success(msg.msgid))

    def expire_waits(self, now: int) -> None:
        """RUN_JOB / RECV_DATA waits whose time is up: a RUN_JOB wait ends its job (every
        waiter hears ``expired`` / EOF); a RECV_DATA wait alone gets its EOF."""
        for waiter in self.waits.due(now):
            job = self.index.job_of(waiter.key)
            if not waiter.stream and job is not None:
                self.table.record(job, error="%s: no result within the RUN_JOB wait" % EXPIRED_ERROR)
                log.info("periodic run_job wait expired job=%s func=%s name=%s", job.job_id, *waiter.key)
                # the job's end answers every waiter; a job that never ran is cancelled, not failed
                self.table.transition(job, JobState.FAILED if job.state is JobState.RUNNING else JobState.CANCELLED,
                                      now)
            else:
                self.waits.give_up(waiter)

    def closed(self, conn: OutboundConnection) -> None:
        """A Periodic connection ended: its RUN_JOB / RECV_DATA waits are forgotten."""
        if self.waits.per_conn.get(conn):
            log.debug("dropped periodic waits=%d of a closed connection", self.waits.drop_conn(conn))
