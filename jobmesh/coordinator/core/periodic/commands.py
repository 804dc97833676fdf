"""The Periodic command table: each decoded request type and the part that answers it.

PERIODIC.md section 5 lists the commands; the connection handler (``ports/periodic.py``)
answers PING, SLEEP and the like itself and posts the rest, which ``on_packet`` hands
to their part: a worker's declarations, grab tokens and gave-backs to the sessions
(``workers.py``), its locks to ``locking.py``, submits, removals, DUMP / LOAD and
outcomes to the named jobs (``named.py``), RUN_JOB / RECV_DATA / WORK_DATA to
``streams.py``, STATUS to the func index. Also here: which requests write (refused,
unapplied, while storage fails) and their refusal.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from jobmesh.coordinator.core.outbox import Outbox
from jobmesh.coordinator.core.periodic.index import FuncIndex
from jobmesh.coordinator.core.periodic.locking import JobLocks
from jobmesh.coordinator.core.periodic.named import NamedJobs
from jobmesh.coordinator.core.periodic.streams import Streams
from jobmesh.coordinator.core.periodic.workers import WorkerSessions
from jobmesh.periodic import codec as pc

if TYPE_CHECKING:
    from jobmesh.coordinator.core.peers import OutboundConnection

log = logging.getLogger(__name__)

# The client requests that store jobs or end them; refused while storage fails. (A worker's
# outcomes write nothing then: no Periodic job runs while the core is paused.)
WRITES = frozenset({pc.SubmitJob, pc.RunJob, pc.RemoveJob, pc.DropFunc, pc.Load})


class PeriodicCommands:
    def __init__(self, outbox: Outbox, index: FuncIndex, sessions: WorkerSessions, locking: JobLocks,
                 named: NamedJobs, streams: Streams) -> None:
        self.outbox = outbox
        # The requests that create jobs take the name of the token that sent them too.
        self._creators: dict[type, Callable[[int, OutboundConnection, Any, str | None], None]] = {
            pc.SubmitJob: named.on_submit, pc.RunJob: streams.on_run, pc.Load: named.on_load}
        self._handlers: dict[type, Callable[[int, OutboundConnection, Any], None]] = {
            pc.RecvData: streams.on_recv_data, pc.WorkData: streams.on_work_data,
            pc.Status: lambda now, conn, msg: outbox.send(conn, index.status(now, msg.msgid)),
            pc.RemoveJob: named.on_remove, pc.DropFunc: named.on_drop_func, pc.Dump: named.on_dump,
            pc.CanDo: sessions.on_can_do, pc.Broadcast: sessions.on_can_do, pc.CantDo: sessions.on_can_do,
            pc.GrabJob: sessions.on_grab, pc.JobUnassigned: sessions.on_unassigned,
            pc.WorkDone: named.on_outcome, pc.WorkFail: named.on_outcome, pc.SchedLater: named.on_outcome,
            pc.Acquire: locking.on_acquire, pc.Release: locking.on_release,
        }

    def on_packet(self, now: int, conn: OutboundConnection, msg: Any, submitted_by: str | None = None) -> None:
        """One decoded Periodic request (``jobmesh.periodic.codec``) the connection handler
        does not answer itself. Replies are frames on ``conn``, after this batch's commit;
        a func or name that is not UTF-8 closes the connection (None). ``submitted_by``:
        the name of the token the connection registered with (types 3 and 4), which the
        jobs it creates carry."""
        creator = self._creators.get(type(msg))
        if creator is not None:
            creator(now, conn, msg, submitted_by)
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            log.warning("periodic request %s not handled by the core", type(msg).__name__)
            self.outbox.send(conn, pc.encode_unknown(msg.msgid))
            return
        handler(now, conn, msg)

    @staticmethod
    def writes(msg: Any) -> bool:
        """Whether the request may store or end a job (refused while storage fails)."""
        return type(msg) in WRITES

    def refuse(self, conn: OutboundConnection, msg: Any, reason: str) -> None:
        """A write refused while storage fails: DATA with the reason, as a SUBMIT_JOB
        refused at the active-job limit is answered."""
        self.outbox.send(conn, pc.encode_data(msg.msgid, reason.encode("utf-8")))
