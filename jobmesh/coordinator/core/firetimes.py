"""When a recurring schedule fires: cron expressions in a time zone, or fixed intervals. Pure.

A ``Rule`` answers "the fire times after an instant" in epoch milliseconds. Cron rules use
``cronsim``, which follows Debian cron's semantics, with the standard library's
``zoneinfo``: an expression's times are wall-clock times in the rule's zone, so on a
spring-forward day a time the gap skips fires at the first instant after the gap, and on
a fall-back day a fixed time that occurs twice fires once, at its first occurrence, while
an expression whose hour field is ``*`` fires in both repeated hours (as Debian's cron
does; croniter fires ``30 2 * * *`` twice on such a day). Interval rules fire at
``anchor + k * every_millis``, k >= 1 (the anchor is the schedule's creation time).

``jitter_delay`` is a pure function of (name, fire time), so a restart recomputes the
same run-at time for the same fire.
"""

from __future__ import annotations

import hashlib
import re
from datetime import datetime, timezone
from typing import Iterator
from zoneinfo import ZoneInfo

from cronsim import CronSim, CronSimError

NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}\Z")
MIN_EVERY_MILLIS = 1000
ALIASES = {"@hourly": "0 * * * *", "@daily": "0 0 * * *", "@midnight": "0 0 * * *", "@weekly": "0 0 * * 0",
           "@monthly": "0 0 1 * *", "@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *"}
MAX_STEPS = 10_000  # cron fire times walked at most to count one span (see ``Rule.span``)


class RuleError(ValueError):
    """A cron expression, interval or time zone that cannot make a rule; the message says why."""


def zone(name: str) -> ZoneInfo:
    """The IANA zone ``name``; ``RuleError`` if there is none by that name."""
    try:
        return ZoneInfo(name)
    except (ValueError, KeyError, OSError):
        raise RuleError("unknown time zone %r (an IANA name such as Europe/Paris or UTC)" % name[:200]) from None


class Rule:
    """The fire times of a cron expression in a zone, or of an interval from an anchor."""

    __slots__ = ("cron", "every_millis", "anchor", "tz", "_expr")

    def __init__(self, cron: str | None, every_millis: int | None, tz_name: str = "UTC", anchor: int = 0) -> None:
        if (cron is None) == (every_millis is None):
            raise RuleError("give exactly one of cron and everyMillis")
        self.cron = cron
        self.every_millis = every_millis
        self.anchor = anchor
        self.tz = zone(tz_name)
        self._expr = ""
        if every_millis is not None:
            if every_millis < MIN_EVERY_MILLIS:
                raise RuleError("everyMillis must be at least %d, got %d" % (MIN_EVERY_MILLIS, every_millis))
            return
        assert cron is not None
        expr = ALIASES.get(cron.strip().lower(), cron.strip())
        if len(expr.split()) != 5:
            raise RuleError("cron must have five fields (minute hour day-of-month month day-of-week) or be one of %s,"
                            " got %r" % (", ".join(sorted(ALIASES)), cron[:200]))
        try:
            CronSim(expr, datetime(2000, 1, 1, tzinfo=self.tz))
        except (CronSimError, ValueError) as exc:
            raise RuleError("bad cron expression %r: %s" % (cron[:200], exc)) from None
        self._expr = expr

    def after(self, instant: int) -> int | None:
        """The first fire time strictly after ``instant`` (epoch ms); None if there is none
        within 50 years (a cron date that never comes, such as 30 February)."""
        every = self.every_millis
        if every is not None:
            k = max(1, (instant - self.anchor) // every + 1)
            return self.anchor + k * every
        return next(self._walk(instant), None)

    def _walk(self, instant: int) -> Iterator[int]:
        """Cron fire times after ``instant``, in order (epoch ms)."""
        try:  # a local date past the year 9999 has no fire time (datetime's range ends there)
            start = datetime.fromtimestamp(instant // 1000, timezone.utc).astimezone(self.tz)
            for moment in CronSim(self._expr, start):
                fire = int(moment.timestamp()) * 1000
                # Debian's fixed-time rules walk local time, which can land before the start in
                # a repeated hour: only later instants count.
                if fire > instant:
                    yield fire
        except (StopIteration, OverflowError, ValueError):
            return

    def upcoming(self, instant: int, count: int) -> list[int]:
        """The next ``count`` fire times after ``instant``."""
        if self.every_millis is None:
            out = []
            for fire in self._walk(instant):
                out.append(fire)
                if len(out) >= count:
                    break
            return out
        first = self.after(instant)
        assert first is not None
        return [first + i * self.every_millis for i in range(count)]

    def span(self, after: int, until: int, keep: int) -> tuple[int, list[int]]:
        """Fire times in (``after``, ``until``]: how many, and the last ``keep`` of them,
        oldest first. Intervals count by arithmetic; a cron rule walks at most MAX_STEPS
        times, then counts only from ``until`` - (the last ``keep`` times' reach): the count
        of a very long span is a lower bound."""
        if until <= after:
            return 0, []
        every = self.every_millis
        if every is not None:
            first = self.after(after)
            assert first is not None
            if first > until:
                return 0, []
            count = (until - first) // every + 1
            last = first + (count - 1) * every
            n = min(keep, count)
            return count, [last - (n - 1 - i) * every for i in range(n)]
        kept: list[int] = []
        count = 0
        for fire in self._walk(after):
            if fire > until:
                break
            count += 1
            kept.append(fire)
            if len(kept) > keep:
                del kept[0]
            if count >= MAX_STEPS:  # skip ahead: keep the newest within a day of ``until``
                rest, tail = self.span(max(fire, until - 86_400_000), until, keep)
                return count + rest, (kept + tail)[-keep:] if keep else []
        return count, kept


def jitter_delay(name: str, fire: int, jitter_millis: int) -> int:
    """The delay in [0, ``jitter_millis``) of the job a schedule makes for ``fire``: a hash
    of (name, fire time), the same in every process."""
    if jitter_millis <= 0:
        return 0
    digest = hashlib.blake2b(("%s\0%d" % (name, fire)).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % jitter_millis
