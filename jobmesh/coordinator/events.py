"""The typed items of the core's mailbox.

Connection handlers (``server.py``) and the sweep timer post these; the core greenlet
(``runtime.py``) dispatches each by its class through one table. A new kind of event is
a class here and a row in that table.
"""

from __future__ import annotations

from typing import Any

from jobmesh.protocol import messages as m


class Event:
    __slots__ = ()


class Registered(Event):
    """A WORKER_REGISTER arrived on a worker connection."""

    __slots__ = ("conn", "msg")

    def __init__(self, conn: Any, msg: m.WorkerRegister) -> None:
        self.conn = conn
        self.msg = msg


class Heartbeat(Event):
    __slots__ = ("conn", "worker_id")

    def __init__(self, conn: Any, worker_id: str) -> None:
        self.conn = conn
        self.worker_id = worker_id


class Result(Event):
    """A TASK_RESULT arrived."""

    __slots__ = ("conn", "msg")

    def __init__(self, conn: Any, msg: m.TaskResult) -> None:
        self.conn = conn
        self.msg = msg


class Disconnected(Event):
    """A registered worker's connection ended."""

    __slots__ = ("conn",)

    def __init__(self, conn: Any) -> None:
        self.conn = conn


class Refusal:
    """A request-shaped item whose answer is fixed: the ERROR for a protocol violation.

    It travels through the mailbox like a request so that it is written after the replies
    to everything the client sent before it; the connection closes once it is out.
    """

    __slots__ = ("error",)

    def __init__(self, message: str) -> None:
        self.error = m.Error(message)


class Request(Event):
    """A client request (or a Refusal), answered on ``conn`` in order."""

    __slots__ = ("conn", "msg")

    def __init__(self, conn: Any, msg: m.Message | Refusal) -> None:
        self.conn = conn
        self.msg = msg


class Sweep(Event):
    """Time for the sweep (at most one pending)."""


class Stop(Event):
    """Stop the core after this batch."""


SWEEP = Sweep()
STOP = Stop()
