"""The typed items of the core's mailbox.

Connection handlers (``server.py``) and the shell's timers post these; the core greenlet
(``shell/loop.py``) hands them to the core, which dispatches each by its class through
one table. A new kind of event is a class here and a row in that table.
"""

from __future__ import annotations

from typing import Any, Callable

from jobmesh.coordinator.core.peers import Connection, OutboundConnection, ReplyConnection
from jobmesh.protocol import messages as m

LIST_ROWS_PER_COST = 4  # a LIST_JOBS page of 1000 rows costs about as much to build as 250 submits
# A WORKFLOW reply may hold a frame's worth of jobs (10,000 short ones): it costs at least a
# LIST_JOBS page of 1000 rows, so a batch holds few of them, whatever a workflow's size.
WORKFLOW_PAGE_COST = 1 + 1000 // LIST_ROWS_PER_COST


class Event:
    __slots__ = ()
    conn: Connection | None = None  # the connection an event came from; None for the core's own (sweep, stop)
    cost = 1  # its share of a batch's budget (mailbox.py)


class Registered(Event):
    """A WORKER_REGISTER arrived on a worker connection."""

    __slots__ = ("conn", "msg")
    conn: OutboundConnection

    def __init__(self, conn: OutboundConnection, msg: m.WorkerRegister) -> None:
        self.conn = conn
        self.msg = msg


class Result(Event):
    """A TASK_RESULT arrived."""

    __slots__ = ("conn", "msg")
    conn: OutboundConnection

    def __init__(self, conn: OutboundConnection, msg: m.TaskResult) -> None:
        self.conn = conn
        self.msg = msg


class Progress(Event):
    """A TASK_PROGRESS arrived."""

    __slots__ = ("conn", "msg")
    conn: OutboundConnection

    def __init__(self, conn: OutboundConnection, msg: m.TaskProgress) -> None:
        self.conn = conn
        self.msg = msg


class Disconnected(Event):
    """A registered worker's connection ended."""

    __slots__ = ("conn",)
    conn: OutboundConnection

    def __init__(self, conn: OutboundConnection) -> None:
        self.conn = conn


class Refusal:
    """A request-shaped item whose answer is fixed: the ERROR for a protocol violation.

    It travels through the mailbox like a request so that it is written after the replies
    to everything the client sent before it; the connection closes once it is out.
    """

    __slots__ = ("error",)

    def __init__(self, message: str) -> None:
        self.error = m.Error(message)


class Forbidden(Refusal):
    """A request-shaped item for a request the connection's token may not make: answered
    ``ERROR forbidden: ...`` in order, like a Refusal, but the connection stays open."""

    __slots__ = ()


class Request(Event):
    """A client request (or a Refusal), answered on ``conn`` in order.

    ``cost`` is its share of a batch's budget (``mailbox.py``): 1, except a LIST_JOBS
    page, which costs by the rows it may read, a SUBMIT_WORKFLOW, a submit's for each of its
    jobs, and a request answered with a WORKFLOW, which may be a page of a frame's size."""

    __slots__ = ("conn", "msg", "cost")
    conn: ReplyConnection

    def __init__(self, conn: ReplyConnection, msg: m.Message | Refusal | Forbidden) -> None:
        self.conn = conn
        self.msg = msg
        self.cost = 1
        kind = type(msg)
        if kind in _COSTLY:  # one lookup for the common requests
            if kind is m.ListJobs:
                assert isinstance(msg, m.ListJobs)
                rows = 100 if msg.limit is None else min(max(msg.limit, 0), 1000)
                self.cost += rows // LIST_ROWS_PER_COST
            elif kind is m.SubmitWorkflow:  # each of its jobs is about a submit's work
                assert isinstance(msg, m.SubmitWorkflow)
                self.cost = max(1, len(msg.jobs))
            else:
                self.cost = WORKFLOW_PAGE_COST


_COSTLY = frozenset({m.ListJobs, m.SubmitWorkflow, m.WorkflowStatus, m.WorkflowCancel, m.WaitWorkflow})


class ClientClosed(Event):
    """A client connection ended with requests still unanswered (pending WAIT_JOBs):
    nobody is left to answer. Posted after its requests, so it follows them."""

    __slots__ = ("conn",)
    conn: ReplyConnection

    def __init__(self, conn: ReplyConnection) -> None:
        self.conn = conn


class Sweep(Event):
    """Time for the sweep (at most one pending).

    What the sweep needs of the world travels on it, read when the core applies it:
    ``arrival(conn)``, the core time of the last frame a worker connection's handler read
    (liveness by arrival), and ``wall()``, the wall clock in milliseconds. The shell posts
    one that reads both; a bare ``Sweep()`` (``SWEEP``) observes neither."""

    __slots__ = ("arrival", "wall")

    def __init__(self, arrival: Callable[[OutboundConnection], int] | None = None,
                 wall: Callable[[], int] | None = None) -> None:
        self.arrival = arrival
        self.wall = wall


class Expire(Event):
    """The earliest pending WAIT_JOB's time is up (at most one pending)."""


class ReadsDone(Event):
    """A store read a held request waits for has finished (at most one pending)."""


class Fire(Event):
    """A recurring schedule's fire time has come (at most one pending)."""


class TokensDue(Event):
    """A rate-limited task type or key has its next token (at most one pending)."""


class Stop(Event):
    """Stop the core after this batch."""


SWEEP = Sweep()
EXPIRE = Expire()
STOP = Stop()
READS_DONE = ReadsDone()
FIRE = Fire()
TOKENS_DUE = TokensDue()


class PeriodicPacket(Event):
    """A decoded Periodic request (``jobmesh.periodic.codec``) from a Periodic connection
    that the core must apply (docs/PERIODIC.md)."""

    __slots__ = ("conn", "msg", "cost", "submitted_by")
    conn: OutboundConnection

    def __init__(self, conn: OutboundConnection, msg: Any, cost: int = 1, submitted_by: str | None = None) -> None:
        self.conn = conn
        self.msg = msg
        self.cost = cost  # DUMP, STATUS and LOAD cost by their size (ports/periodic.PeriodicPort.cost_of)
        self.submitted_by = submitted_by  # the name of the token the connection registered with (types 3, 4)


class PeriodicClosed(Event):
    """A Periodic connection ended (posted after its packets, so it follows them)."""

    __slots__ = ("conn",)
    conn: OutboundConnection

    def __init__(self, conn: OutboundConnection) -> None:
        self.conn = conn


class SchedulesFile(Event):
    """The schedules file was read again (SIGHUP): its definitions, as parsed tables."""

    __slots__ = ("definitions",)

    def __init__(self, definitions: list[dict[str, Any]]) -> None:
        self.definitions = definitions
