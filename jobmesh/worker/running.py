"""The worker's in-flight attempts: a bounded gevent Pool plus a table keyed by lease.

Each attempt runs in its own greenlet in a ``Pool(capacity)``. The table maps
``(job_id, attempt_id)`` to the attempt, so a TASK_CANCEL for a superseded attempt can
never touch a newer one (docs/PROTOCOL.md, TASK_CANCEL).

Invariants:

- ``start`` never blocks: a full pool means the coordinator over-assigned, and the
  caller answers with a failed TASK_RESULT instead.
- A finished attempt reports exactly once, through ``on_done``, and only if it was not
  cancelled or abandoned. The pool releases the slot before ``on_done`` runs (its link
  was registered first), so a result never reaches the coordinator while the slot still
  looks taken here.
- ``cancel`` and ``abandon_all`` return only once the greenlets are dead and their slots
  free, so an assignment that arrives right after a cancel finds room.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import gevent
from gevent.event import Event
from gevent.pool import Pool

log = logging.getLogger(__name__)

Key = tuple[str, str]


@dataclass
class Attempt:
    job_id: str
    attempt_id: str
    cancel_event: Event = field(default_factory=Event)
    cancelled: bool = False
    greenlet: gevent.Greenlet | None = None

    @property
    def key(self) -> Key:
        return (self.job_id, self.attempt_id)


class InFlight:
    """At most ``capacity`` attempts running at once, each in its own greenlet."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._pool = Pool(capacity)
        self._attempts: dict[Key, Attempt] = {}

    def __len__(self) -> int:
        return len(self._attempts)

    def __contains__(self, key: Key) -> bool:
        return key in self._attempts

    def leases(self) -> list[Key]:
        """The (job id, attempt id) of every attempt running, oldest first."""
        return list(self._attempts)

    def has_room(self) -> bool:
        return self._pool.free_count() > 0

    def start(
        self,
        job_id: str,
        attempt_id: str,
        body: Callable[[Attempt], Any],
        on_done: Callable[[Attempt, Any], None],
    ) -> Attempt | None:
        """Run ``body(attempt)`` in a pool greenlet; None if the pool is full or the lease runs.

        When the body returns, ``on_done(attempt, value)`` runs in the hub (it must not
        block), unless the attempt was cancelled or abandoned first. A body that raises
        is a bug in the body: it is logged and nothing is reported.
        """
        attempt = Attempt(job_id, attempt_id)
        if not self.has_room() or attempt.key in self._attempts:
            return None
        self._attempts[attempt.key] = attempt
        greenlet = self._pool.spawn(body, attempt)
        attempt.greenlet = greenlet

        def finished(g: gevent.Greenlet) -> None:
            if self._attempts.get(attempt.key) is attempt:
                del self._attempts[attempt.key]
            if attempt.cancelled:
                return
            if not g.successful():
                log.error("task greenlet crashed job=%s attempt=%s", job_id, attempt_id, exc_info=g.exc_info)
                return
            on_done(attempt, g.value)

        greenlet.rawlink(finished)
        return attempt

    def cancel(self, job_id: str, attempt_id: str) -> bool:
        """Stop the attempt with exactly this lease; False if none runs (nothing is touched)."""
        attempt = self._attempts.pop((job_id, attempt_id), None)
        if attempt is None:
            return False
        self._stop([attempt])
        return True

    def abandon_all(self) -> int:
        """Stop every attempt without reporting (their leases die with the connection)."""
        attempts = list(self._attempts.values())
        self._attempts.clear()
        self._stop(attempts)
        return len(attempts)

    def _stop(self, attempts: list[Attempt]) -> None:
        for attempt in attempts:
            attempt.cancelled = True
            attempt.cancel_event.set()
        greenlets = [a.greenlet for a in attempts if a.greenlet is not None]
        gevent.killall(greenlets, block=True, timeout=5)
        # A greenlet that is dead may still wait for its links (the pool's slot release
        # among them) to run on a later loop turn; release the slots now so an assignment
        # read right after this finds room. discard() also unlinks the pool's callback,
        # so no slot is released twice.
        for greenlet in greenlets:
            if greenlet in self._pool:
                self._pool.discard(greenlet)
