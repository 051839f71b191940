"""Canary quantiles pool cycles until they rest on enough samples, and say when they don't."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy.orm import Session, sessionmaker

from alerts.detection import BaselineStats
from alerts.rule_file import parse_rule
from alerts.rules import Point, evaluate_rule
from alerts.series import RowCache, series
from tests.alerts.builders import add_cycle

T0 = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
RULE = parse_rule({"name": "p99", "metric": "p99_latency", "change": "+15%", "for": 3,
                   "min_samples": 2, "min_baseline_cycles": 5})


def minute(i: float) -> datetime:
    return T0 + timedelta(minutes=i)


def test_a_four_sample_p99_is_refused_not_read_as_a_max() -> None:
    base = BaselineStats.of([1.0] * 40)
    assert base is not None
    pts = [Point(minute(i), 1.0, 4) for i in range(30)] + [Point(minute(30 + i), 2.0, 4)
                                                          for i in range(10)]
    r = evaluate_rule(RULE, {}, base, pts)
    assert not r.fired and r.no_data and r.reason.startswith("insufficient_samples")
    assert "needs 100" in r.reason


def test_p99_pools_the_latest_cycles_until_100_samples(sessionmaker: sessionmaker[Session]):
    with sessionmaker.begin() as s:
        for i in range(40):  # 4 canaries per cycle, as probes.canaries_per_bucket 4 sends
            add_cycle(s, minute(i) + timedelta(seconds=2), {"64": 0.1 if i < 35 else 0.2},
                      count=4)
    with sessionmaker() as s:
        pts = series(RULE, RowCache(s), minute(30), minute(40))[(("bucket", "64"),)]
    # Every point rests on 25 cycles x 4 canaries: its samples say so.
    assert [p.samples for p in pts] == [100] * 10
    # The p99 of the pool (a quarter of each cycle's canaries at its "p99" value): 0.1
    # until the slower cycles reach the top of the pool, then 0.2.
    assert abs(pts[0].value - 0.1) / 0.1 <= 0.01  # type: ignore[operator]
    assert abs(pts[-1].value - 0.2) / 0.2 <= 0.01  # type: ignore[operator]


def test_a_short_history_reports_its_sample_count(sessionmaker: sessionmaker[Session]):
    with sessionmaker.begin() as s:
        for i in range(3):
            add_cycle(s, minute(i) + timedelta(seconds=2), {"64": 0.1}, count=4)
    with sessionmaker() as s:
        pts = series(RULE, RowCache(s), minute(0), minute(3))[(("bucket", "64"),)]
    assert [p.samples for p in pts] == [4, 8, 12]
    r = evaluate_rule(RULE, {"bucket": "64"}, None, pts)
    assert r.no_data and r.reason.startswith("insufficient_samples: 12 samples")
