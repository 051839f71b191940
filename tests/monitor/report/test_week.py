"""ISO week parsing and the scheduled job's choice of week."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from monitor.report.errors import InvalidWeek
from monitor.report.week import Week, last_complete_week, parse_week


def test_parse_week_gives_monday_to_monday_utc() -> None:
    w = parse_week("2026-W48")
    assert (w.start, w.end) == (datetime(2026, 11, 23, tzinfo=UTC), datetime(2026, 11, 30, tzinfo=UTC))
    assert w.label == "2026-W48" and w.previous() == Week(2026, 47)
    assert parse_week("2026-W53").start == datetime(2026, 12, 28, tzinfo=UTC)  # 2026 has 53


@pytest.mark.parametrize("value", ["2026-W54", "2025-W53", "2026-W00", "2026W48", "", "x"])
def test_bad_weeks_name_the_value(value: str) -> None:
    with pytest.raises(InvalidWeek, match="expected an ISO week") as exc:
        parse_week(value)
    assert isinstance(exc.value, ValueError) and exc.value.value == value


@pytest.mark.parametrize(("now", "label"), [
    (datetime(2026, 11, 30, 6, 0, tzinfo=UTC), "2026-W48"),  # Monday 06:00 after W48
    (datetime(2026, 12, 6, 23, 59, tzinfo=UTC), "2026-W48"),  # still W49: W48 ended last
    (datetime(2027, 1, 4, 6, 0, tzinfo=UTC), "2026-W53"),  # across the year boundary
])
def test_last_complete_week(now: datetime, label: str) -> None:
    assert last_complete_week(now).label == label
