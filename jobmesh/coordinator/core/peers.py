"""Connections as the core, the mailbox and the shell see them: three protocols, and
nothing more of a connection is used outside its port.

* ``Connection``: what the mailbox needs of anything that posts events: its own queue
  of events not yet taken (``inbox``) and ``drained()``, called when the core took some;
* ``ReplyConnection``: a connection whose requests the core answers in order with
  ``reply(data, count, close)`` after the batch's commit: a client-port connection
  (``ports/server.ClientConn``) or the metrics port's in-process one (``ports/http.LocalConn``);
* ``OutboundConnection``: a connection the core sends messages or frames to through
  ``core.outbound`` (the shell calls ``send_many`` after the commit): a worker-port
  connection (``ports/server.WorkerConn``) or a Periodic one (``ports/periodic.PeriodicConn``).
  Its handler stamps ``last_arrival`` for every frame it reads and sets ``paused`` while
  it stops reading because the core is behind on it: the sweep's liveness by arrival.

The core treats a connection as an opaque key (sessions, waiters, ``outbound`` pairs);
only the shell and the mailbox call these methods.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol


class Connection(Protocol):
    """Anything whose events go through the mailbox (``mailbox.py``)."""

    inbox: deque[Any]  # its events not yet taken by the core, in order

    def drained(self) -> None:
        """The core took events from ``inbox``."""


class ReplyConnection(Connection, Protocol):
    """A connection answered in request order (the client port, the metrics port's reads)."""

    def reply(self, data: bytes, count: int, close: bool = False) -> None:
        """Write the encoded replies to ``count`` requests; with ``close``, close after them."""

    def held_back(self, count: int) -> None:
        """``count`` of its unanswered requests wait for a pending WAIT_JOB (their replies
        are held in order behind it); the rest are on their way."""


class OutboundConnection(Connection, Protocol):
    """A connection the core sends to through ``core.outbound`` (worker and Periodic ports)."""

    last_arrival: float  # when its last frame was read (clock.monotonic)
    paused: bool  # its handler is not reading because the core is behind on it

    def send_many(self, msgs: list[Any]) -> None:
        """Messages (or frames) in order, with one write; a None among them closes after what precedes it."""

    def abort(self) -> None:
        """Shut the connection down now; its handler then exits."""
