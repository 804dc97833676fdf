"""The shell's markers (``marker.py``) and its reply order (``replies.py``), driven directly.

Markers: at most one of each kind waits in the mailbox; a batch takes them all; a timer
is armed for the earliest instant asked. Replies: a connection's replies queue behind a
pending wait and go out in request order, with one write, once it is answered; a
connection that ended with waits pending is forgotten.
"""

from __future__ import annotations

from collections import deque

import gevent
import gevent.event

from jobmesh.coordinator.core import events as ev
from jobmesh.coordinator.core.face import Applied, Slot, Waiter
from jobmesh.coordinator.shell.clock import now_millis
from jobmesh.coordinator.shell.marker import Marker
from jobmesh.coordinator.shell.replies import Replies
from jobmesh.protocol import messages as m
from jobmesh.protocol.framing import FrameDecoder


class Posted:
    def __init__(self) -> None:
        self.items: list[ev.Event] = []
        self.arrived = gevent.event.Event()

    def __call__(self, item: ev.Event) -> None:
        self.items.append(item)
        self.arrived.set()

    def next(self) -> ev.Event:
        assert self.arrived.wait(10), "no marker posted"
        self.arrived.clear()
        return self.items[-1]


def test_one_marker_of_a_kind_is_pending_until_a_batch_takes_it():
    posted = Posted()
    marker = Marker(posted)
    marker.post(ev.READS_DONE)
    marker.post(ev.READS_DONE)
    marker.post(ev.FIRE)
    assert posted.items == [ev.READS_DONE, ev.FIRE]
    assert marker.taken() is False  # no sweep among them
    marker.post(ev.READS_DONE)
    sweep = ev.Sweep()
    marker.post(sweep)
    marker.post(ev.Sweep())
    assert posted.items == [ev.READS_DONE, ev.FIRE, ev.READS_DONE, sweep]
    assert marker.taken() is True
    marker.stop()
    marker.post(ev.READS_DONE)
    assert len(posted.items) == 4


def test_a_timer_is_armed_for_the_earliest_instant_and_none_while_its_marker_is_pending():
    posted = Posted()
    marker = Marker(posted)
    try:
        marker.arm(ev.EXPIRE, now_millis() + 60_000)
        marker.arm(ev.EXPIRE, now_millis() + 20)  # earlier: replaces it
        marker.arm(ev.EXPIRE, now_millis() + 30_000)  # later: ignored
        assert posted.next() is ev.EXPIRE
        marker.arm(ev.EXPIRE, now_millis())  # pending: nothing more until a batch takes it
        gevent.sleep(0.05)
        assert posted.items == [ev.EXPIRE]
        marker.taken()
        marker.arm(ev.EXPIRE, now_millis())
        assert posted.next() is ev.EXPIRE
        marker.every(ev.SWEEP, 0.01)
        assert posted.next() is ev.SWEEP
        assert marker.taken() is True
    finally:
        marker.stop()


class Client:
    """A client connection as the shell sees it: what it was written, in order."""

    def __init__(self) -> None:
        self.inbox: deque = deque()
        self.writes: list[tuple[list[dict], bool]] = []
        self.held = 0

    def drained(self) -> None:
        pass

    def reply(self, data: bytes, count: int, close: bool = False) -> None:
        decoder = FrameDecoder()
        decoder.feed(data)
        frames = [decoder.next_payload() for _ in range(count)]
        assert decoder.next_payload() is None  # exactly ``count`` replies
        self.writes.append(([frame["type"] for frame in frames if frame is not None], close))

    def held_back(self, count: int) -> None:
        self.held = count


OK = m.JobSubmitted("job-0")


def batch(replies: list, waits: list | None = None, closed: list | None = None) -> Applied:
    applied = Applied()
    applied.replies = replies
    applied.waits = waits or []
    applied.closed = closed or []
    return applied


def test_replies_behind_a_pending_wait_go_out_in_order_once_it_is_answered():
    replies = Replies()
    c, other = Client(), Client()
    slot = Slot()
    waiter = Waiter(c, slot, "job-1", 0)
    stats = m.Stats(at_millis=1)
    replies.write(batch([(c, (OK, False)), (c, (slot, False)), (other, (stats, False)), (c, (stats, False))]))
    assert c.writes == [(["JOB_SUBMITTED"], False)] and c.held == 2  # the wait and the reply behind it
    assert other.writes == [(["STATS"], False)]
    replies.write(batch([(c, (OK, True))]))  # a later batch: queued behind the wait too
    assert c.writes == [(["JOB_SUBMITTED"], False)] and c.held == 3
    replies.write(batch([], [(waiter, m.Error("unknown job job-1"))]))
    assert c.writes == [(["JOB_SUBMITTED"], False), (["ERROR", "STATS", "JOB_SUBMITTED"], True)] and c.held == 0
    replies.write(batch([(c, (OK, False))]))  # nothing pending: the plain path again
    assert c.writes[-1] == (["JOB_SUBMITTED"], False)


def test_a_connection_that_ended_with_waits_pending_is_forgotten():
    replies = Replies()
    c = Client()
    slot = Slot()
    replies.write(batch([(c, (slot, False)), (c, (OK, False))]))
    assert c.writes == [] and c.held == 2
    replies.write(batch([], [(Waiter(c, slot, "job-1", 0), m.Error("late"))], closed=[c]))
    assert c.writes == []  # nobody reads it
