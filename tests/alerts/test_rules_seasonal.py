"""A seasonal rule whose hour of the week lacks history says it falls back."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy.orm import Session, sessionmaker

from alerts.baselines import BaselineConfig
from alerts.evaluator import EvaluationOptions, evaluate
from alerts.rule_file import parse_rule
from tests.alerts.builders import add_cycle

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def test_a_young_hour_of_week_falls_back_to_the_plain_baseline_and_says_so(
        sessionmaker: sessionmaker[Session]) -> None:
    rule = parse_rule({"name": "seasonal", "metric": "p50_latency", "change": "+30%",
                       "seasonality": "hour_of_week", "min_baseline_cycles": 30})
    with sessionmaker.begin() as s:
        for i in range(125):  # two hours and five minutes of cycles
            add_cycle(s, T0 + timedelta(minutes=i, seconds=2), {"64": 0.1})
    with sessionmaker.begin() as s:
        rep = evaluate(
            s,
            EvaluationOptions([rule], baseline_config=BaselineConfig(warm_in_s=0)),
            T0 + timedelta(minutes=125, seconds=30),
        )
    assert rep.errors == ()
    (r,) = rep.results
    assert r.baseline is not None and not r.no_data
    # One hour holds 60 one-minute cycles: a season counts once it was seen twice (61+).
    assert "baseline plain (hour_of_week: 5 of 61 cycles, hour_of_day: 5 of 61 cycles)" \
        in r.reason, r.reason


def test_a_daily_peak_in_the_first_week_is_judged_against_its_hour_of_day(
        sessionmaker: sessionmaker[Session]) -> None:
    """Three days of history: each hour of the week was seen once, each hour of day thrice."""
    raw = {"metric": "p50_latency", "change": "+30%", "for": 3, "min_samples": 2,
           "window": "10m", "lookback": 6, "baseline_window": "7d", "min_baseline_cycles": 5}
    seasonal = parse_rule({"name": "seasonal", "seasonality": "hour_of_week", **raw})
    plain = parse_rule({"name": "plain", **raw})
    now = T0 + timedelta(hours=2, minutes=41)  # 14:41, in the daily peak (14h-15h)
    with sessionmaker.begin() as s:
        t = T0 - timedelta(days=3)
        while t < now - timedelta(minutes=1):
            add_cycle(s, t + timedelta(seconds=2), {"64": 0.2 if t.hour == 14 else 0.1})
            t += timedelta(minutes=10)
    with sessionmaker.begin() as s:
        rep = evaluate(
            s,
            EvaluationOptions(
                [seasonal, plain], baseline_config=BaselineConfig(warm_in_s=0, backfill_hours=200)
            ),
            now,
        )
    assert rep.errors == ()
    res = {r.rule: r for r in rep.results}
    assert res["plain"].breaching  # against the three days' median the peak is +100%
    assert not res["seasonal"].breaching, res["seasonal"].reason
    # The hour's own level (its pooled p50 reaches into 13h's last cycles), not the days'.
    assert res["seasonal"].baseline > 1.5 * res["plain"].baseline, res["seasonal"].baseline
    assert "baseline hour_of_day" in res["seasonal"].reason, res["seasonal"].reason


def test_an_hourly_baseline_judges_only_the_cycles_of_its_hour() -> None:
    from alerts.baselines import HOUR_OF_WEEK, CohortBaseline
    from alerts.cohorts import judge
    from alerts.detection import BaselineStats
    from alerts.rules import Point

    rule = parse_rule({"name": "p50", "metric": "p50_latency", "change": "+15%",
                       "seasonality": "hour_of_week", "min_baseline_cycles": 5})
    # A regular peak (+25%) ended at 16:00; 16:00's own baseline is the quiet level.
    peak = [Point(T0 + timedelta(hours=3, minutes=35 + i), 1.25, 4) for i in range(25)]
    after = [Point(T0 + timedelta(hours=4, minutes=i), 1.0, 4) for i in range(3)]
    quiet = CohortBaseline(BaselineStats.of([1.0] * 60), HOUR_OF_WEEK)
    r = judge(rule, {"bucket": "64"}, {("m1", "c1"): peak + after}, {("m1", "c1"): quiet}, None)
    assert not r.fired and not r.breaching, r.reason
