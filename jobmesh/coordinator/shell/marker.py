"""The core's wake-up markers: the items the shell posts to the mailbox so that the core
does something at a time rather than on an arrival.

* SWEEP, on a fixed cadence (``every``): the sweep, run inside the core loop under the
  same error handling as every event, so an error can kill neither;
* EXPIRE, FIRE and TOKENS_DUE, each at the earliest instant the core says it must wake
  for (``arm``: a pending WAIT_JOB's timeout, a recurring schedule's fire time, a rate
  limit's next token), so none waits for the next sweep;
* READS_DONE, when a store read a held request waits for has finished (``post``).

``Marker`` owns the one "pending" record: at most one marker of each kind is in the
mailbox. Markers are the core's own items, and every batch takes all of those first
(``mailbox.py``), so once a batch is taken (``taken``) none is pending.
"""

from __future__ import annotations

import time
from typing import Callable

import gevent

from jobmesh.coordinator.core import events as ev
from jobmesh.coordinator.shell.clock import now_millis


class Marker:
    def __init__(self, post: Callable[[ev.Event], None]) -> None:
        self._post = post
        self._pending: set[type] = set()  # kinds of markers in the mailbox
        self._armed: dict[type, tuple[int, gevent.Greenlet]] = {}  # kind -> (core time, its timer)
        self._stopped = False
        self._sweep: gevent.Greenlet | None = None  # the sweep's timer
        self._next_sweep = 0.0  # when it is due (time.monotonic)

    def post(self, marker: ev.Event) -> None:
        """Post ``marker`` unless one of its kind is pending (or the shell is stopping)."""
        kind = type(marker)
        if self._stopped or kind in self._pending:
            return
        self._pending.add(kind)
        self._post(marker)

    def taken(self) -> bool:
        """A batch was taken from the mailbox, with every marker in it; whether a sweep was."""
        swept = ev.Sweep in self._pending
        self._pending.clear()
        return swept

    def arm(self, marker: ev.Event, at: int | None) -> None:
        """Post ``marker`` at core time ``at`` (None: nothing to wait for). One timer per
        kind, for the earliest instant asked; none while one of its kind is pending."""
        kind = type(marker)
        if at is None or self._stopped or kind in self._pending:
            return
        armed = self._armed.get(kind)
        if armed is not None:
            if armed[0] <= at:
                return
            armed[1].kill(block=False)
        self._armed[kind] = (at, gevent.spawn_later(max(0.0, (at - now_millis()) / 1000.0), self._ring, marker))

    def _ring(self, marker: ev.Event) -> None:
        del self._armed[type(marker)]
        self.post(marker)

    def every(self, marker: ev.Sweep, interval: float) -> None:
        """Post ``marker`` every ``interval`` seconds, the first one interval from now; a
        period missed is skipped rather than bunched up with the next."""
        self._next_sweep = time.monotonic()
        self._repeat(marker, interval)

    def _repeat(self, marker: ev.Sweep, interval: float) -> None:
        now = time.monotonic()
        self._next_sweep += interval
        if self._next_sweep < now:
            self._next_sweep = now + interval
        self._sweep = gevent.spawn_later(self._next_sweep - now, self._tick, marker, interval)

    def _tick(self, marker: ev.Sweep, interval: float) -> None:
        if self._stopped:
            return
        self._repeat(marker, interval)
        self.post(marker)

    def stop(self) -> None:
        """Post nothing more; the timers end."""
        self._stopped = True
        if self._sweep is not None:
            self._sweep.kill(block=False)
        for _at, timer in self._armed.values():
            timer.kill(block=False)
        self._armed.clear()
