"""ISO weeks, and the last seven days, as UTC half-open intervals.

The scheduled job reviews the ISO week that ended (`Week`, stored once per week); a
review run by hand defaults to the last seven days up to today (`Window`), so a fresh
install has data to show on day one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from monitor.report.errors import InvalidWeek

_WEEK_RE = re.compile(r"^(\d{4})-W(\d{2})$")


@dataclass(frozen=True)
class Week:
    """One ISO week: [start, end) in UTC, Monday 00:00 to the next Monday 00:00."""

    year: int
    number: int

    @property
    def label(self) -> str:
        """Return the week as YYYY-Www."""
        return f"{self.year:04d}-W{self.number:02d}"

    @property
    def start(self) -> datetime:
        """Return Monday 00:00 UTC of this week."""
        d = date.fromisocalendar(self.year, self.number, 1)
        return datetime(d.year, d.month, d.day, tzinfo=UTC)

    @property
    def end(self) -> datetime:
        """Return the next Monday 00:00 UTC (exclusive)."""
        return self.start + timedelta(days=7)

    def days(self) -> tuple[datetime, ...]:
        """Return the start of each of the seven days."""
        return tuple(self.start + timedelta(days=i) for i in range(7))

    def previous(self) -> Week:
        """Return the week before this one."""
        return week_of(self.start - timedelta(seconds=1))

    def __str__(self) -> str:
        return self.label


def parse_week(value: str) -> Week:
    """Parse YYYY-Www into a Week; raise InvalidWeek naming the value."""
    if not isinstance(value, str):
        raise InvalidWeek(value, "is not a string")
    m = _WEEK_RE.match(value.strip())
    if m is None:
        raise InvalidWeek(value, "is not of the form YYYY-Www")
    year, number = int(m.group(1)), int(m.group(2))
    try:
        date.fromisocalendar(year, number, 1)
    except ValueError:
        raise InvalidWeek(value, f"has no week {number} in {year}") from None
    return Week(year, number)


def week_of(moment: datetime) -> Week:
    """Return the ISO week holding `moment` (naive datetimes are taken as UTC)."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    iso = moment.astimezone(UTC).isocalendar()
    return Week(iso.year, iso.week)


def last_complete_week(now: datetime) -> Week:
    """Return the ISO week that ended most recently before `now`."""
    return week_of(now).previous()


@dataclass(frozen=True)
class Window:
    """Seven whole UTC days ending with the day of `end` - 1 s: [start, end)."""

    start: datetime
    end: datetime

    @property
    def label(self) -> str:
        """Return the window as first..last day, e.g. 2026-11-24..2026-11-30."""
        last = self.end - timedelta(days=1)
        return f"{self.start.date().isoformat()}..{last.date().isoformat()}"

    def days(self) -> tuple[datetime, ...]:
        """Return the start of each of the seven days."""
        return tuple(self.start + timedelta(days=i) for i in range(7))

    def previous(self) -> Window:
        """Return the seven days before this window."""
        return Window(self.start - timedelta(days=7), self.start)

    def __str__(self) -> str:
        return self.label


Period = Week | Window


def last_seven_days(now: datetime) -> Window:
    """Return the seven UTC days that end with today (today's data so far included)."""
    if now.tzinfo is None:
        now = now.replace(tzinfo=UTC)
    today = now.astimezone(UTC).date()
    end = datetime(today.year, today.month, today.day, tzinfo=UTC) + timedelta(days=1)
    return Window(end - timedelta(days=7), end)
