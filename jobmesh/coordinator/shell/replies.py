"""Releasing a committed batch: client replies in request order, worker frames after them.

Replies go out only after their batch's commit (``loop.py``), each connection's with one
write. A WAIT_JOB the core cannot answer at once is a ``Slot`` in its connection's reply
order: replies to later requests on that connection queue behind it (``Held``) and go
out, in order, once the core answers the wait (its job ended, or its time is up).
Connections with nothing pending take the plain path: one write per batch.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from jobmesh.coordinator.core import events as ev
from jobmesh.coordinator.core.face import INTERNAL_ERROR, Applied, Reply, Slot, Waiter
from jobmesh.coordinator.core.peers import ReplyConnection
from jobmesh.coordinator.ports.server import SHUTTING_DOWN
from jobmesh.errors import ProtocolError
from jobmesh.protocol import messages as m
from jobmesh.protocol.framing import encode_frame

log = logging.getLogger("jobmesh.coordinator.shell.runtime")  # one logger for the runtime's lines


class Held:
    """A connection's replies held behind pending waits: ``(reply or Slot, close)`` in
    request order, and how many of its Slots are not yet answered and written."""

    __slots__ = ("queue", "slots")

    def __init__(self) -> None:
        self.queue: deque[tuple[Reply, bool]] = deque()
        self.slots = 0


def by_conn(pairs: list[tuple[Any, Any]]) -> dict[Any, list[Any]]:
    """The items of ``(conn, item)`` pairs grouped by connection, each group in order."""
    groups: dict[Any, list[Any]] = {}
    for conn, item in pairs:
        group = groups.get(conn)
        if group is None:
            groups[conn] = [item]
        else:
            group.append(item)
    return groups


def encode_reply(msg: m.Message) -> bytes:
    try:
        return encode_frame(msg.to_wire())
    except ProtocolError as exc:  # a bug upstream; answer rather than leave the client waiting
        log.error("could not encode a %s reply: %s", msg.TYPE, exc)
        return encode_frame(INTERNAL_ERROR.to_wire())


def send_outbound(outbound: list[tuple[Any, Any]]) -> None:
    """Worker frames of a committed batch: one write per worker connection, in order."""
    for conn, msgs in by_conn(outbound).items():
        conn.send_many(msgs)


def refuse(event: ev.Event) -> None:
    """A client request the core will not apply (stopping): answer it and close."""
    if type(event) is ev.Request:
        event.conn.reply(encode_frame(SHUTTING_DOWN.to_wire()), 1, close=True)


class Replies:
    """The reply order of every client connection with a pending wait."""

    def __init__(self) -> None:
        self._held: dict[ReplyConnection, Held] = {}
        self._workflow: tuple[m.Message, bytes] | None = None  # the WORKFLOW reply encoded last, and its frame

    def _workflow_frame(self, msg: m.Message) -> bytes:
        """A WORKFLOW reply's frame: a page the core gave to many readers is encoded once."""
        last = self._workflow
        if last is None or last[0] is not msg:
            last = self._workflow = (msg, encode_reply(msg))
        return last[1]

    def write(self, applied: Applied) -> None:
        """Encode a batch's replies and write each connection's with one write, in order.

        A connection with a pending wait has its replies queued behind it (``_release``
        writes what is ready); the waits answered in the batch come last. A connection
        that ended with waits pending is forgotten first: nobody reads its answers."""
        held = self._held
        for closed in applied.closed:
            held.pop(closed, None)
        for conn, replies in by_conn(applied.replies).items():
            waiting = held.get(conn) if held else None
            if waiting is None:
                data, close = b"", False
                for msg, closes in replies:
                    if type(msg) is Slot:  # a wait: this connection's replies queue from here on
                        waiting = held[conn] = Held()
                        break
                    data += encode_reply(msg) if type(msg) is not m.Workflow else self._workflow_frame(msg)
                    close = close or closes
                else:
                    conn.reply(data, len(replies), close)
                    continue
            waiting.slots += sum(1 for msg, _closes in replies if type(msg) is Slot)
            waiting.queue.extend(replies)
            self._release(conn, waiting)
        self.answer(applied.waits)

    def answer(self, waits: list[tuple[Waiter, m.Message]]) -> None:
        """Fill the Slots of answered waits and write what each connection has ready."""
        held = self._held
        for waiter, msg in waits:
            slot = waiter.token
            if slot.msg is None:
                slot.msg = msg
            waiting = held.get(waiter.conn)
            if waiting is not None:  # None: the client has gone
                self._release(waiter.conn, waiting)

    def _release(self, conn: ReplyConnection, held: Held) -> None:
        """Write the longest ready prefix of a connection's held replies, in one write."""
        queue = held.queue
        data, count, close = b"", 0, False
        while queue:
            reply, closes = queue[0]
            if type(reply) is Slot:
                if reply.msg is None:
                    break
                held.slots -= 1
                msg = reply.msg
            else:
                assert isinstance(reply, m.Message)
                msg = reply
            queue.popleft()
            data += encode_reply(msg) if type(msg) is not m.Workflow else self._workflow_frame(msg)
            count += 1
            close = close or closes
        if count:
            conn.reply(data, count, close)
        conn.held_back(len(queue))
        if not queue and not held.slots:
            del self._held[conn]
