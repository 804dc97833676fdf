"""The core's inbox: fair service per connection, not per lane.

Every event that comes from a connection is queued on that connection (``conn.inbox``);
the mailbox keeps a ring of the connections that have events waiting, one ring for
worker connections and one for client connections, plus a queue of the core's own
items (the sweep, STOP). A batch takes the core's own items, then serves the rings
round-robin, at most ``PER_CONN`` events from one connection per turn:

* worker connections first, since their events free capacity, but while clients wait
  they get at most half of the batch, so a flood on one worker connection cannot
  exclude client requests (nor, with the round robin, other workers);
* each event has a cost (``events.Request.cost``: a LIST_JOBS page costs by its size),
  and a batch stops at ``budget``, so an expensive request mix still lets the core
  commit, write replies and yield every few milliseconds.

A connection's own events keep their order (one queue each), which is all the protocol
asks. Handlers stop reading while their connection has too many events queued
(``server.py``), so no peer can grow the inbox without bound.
"""

from __future__ import annotations

from collections import deque

import gevent.event

from jobmesh.coordinator.core.peers import Connection
from jobmesh.coordinator.core.events import Event

PER_CONN = 16  # events of one connection per turn of the round robin


class Mailbox:
    def __init__(self) -> None:
        self._own: deque[Event] = deque()  # the core's own items: sweep, stop
        self._workers: deque[Connection] = deque()  # worker connections with events waiting
        self._clients: deque[Connection] = deque()  # client connections with events waiting
        self._count = 0
        self._wake = gevent.event.Event()

    def __len__(self) -> int:
        return self._count

    def put(self, item: Event) -> None:
        """A client request (an event with a ``conn``), or one of the core's own items."""
        self._enqueue(item, self._clients)

    def put_urgent(self, item: Event) -> None:
        """A worker event (an event with a ``conn``), or one of the core's own items."""
        self._enqueue(item, self._workers)

    def _enqueue(self, item: Event, ring: deque[Connection]) -> None:
        conn = item.conn
        if conn is None:  # the sweep, STOP
            self._own.append(item)
            self._count += 1
            self._wake.set()
            return
        inbox = conn.inbox
        if not inbox:
            ring.append(conn)
        inbox.append(item)
        self._count += 1
        self._wake.set()

    def take(self, budget: int) -> list[Event]:
        """A fair batch of at most ``budget`` cost (at least one item); blocks while empty."""
        while not self._count:
            self._wake.clear()
            self._wake.wait()
        batch: list[Event] = []
        own = self._own
        while own:
            batch.append(own.popleft())
        spent = len(batch)
        share = budget if not self._clients else budget // 2
        spent += self._serve(self._workers, batch, share - spent)
        spent += self._serve(self._clients, batch, budget - spent)
        spent += self._serve(self._workers, batch, budget - spent)
        self._count -= len(batch)
        return batch

    @staticmethod
    def _serve(ring: deque[Connection], batch: list[Event], budget: int) -> int:
        """Round-robin over ``ring`` until ``budget`` is spent; returns what was spent.

        Each connection gets up to PER_CONN events per turn, then goes to the back of the
        ring. One whose next event does not fit in what is left of the budget is passed
        over (to the back), so cheap requests still get into a batch full of expensive
        ones; the turn ends when every waiting connection was passed over in a row."""
        spent = 0
        passed = 0
        while ring and passed < len(ring) and (spent < budget or not batch):
            conn = ring.popleft()
            inbox = conn.inbox
            taken = 0
            while inbox and taken < PER_CONN:
                cost = inbox[0].cost
                if spent + cost > budget and batch:
                    break
                batch.append(inbox.popleft())
                spent += cost
                taken += 1
            if taken:
                conn.drained()
                passed = 0
            else:
                passed += 1
            if inbox:
                ring.append(conn)
        return spent

    def take_all(self) -> list[Event]:
        """Everything left (the core is stopping)."""
        batch = list(self._own)
        self._own.clear()
        for ring in (self._workers, self._clients):
            while ring:
                conn = ring.popleft()
                batch.extend(conn.inbox)
                conn.inbox.clear()
        self._count = 0
        return batch
