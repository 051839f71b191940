"""The sensitivity job reads each series back as far as its rule's cadence needs: a rule of
ten-minute cycles (memory_growth) gets an estimate from days of history, a season reads
only its own hours, and a read that can never hold the cycles says so."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker

from alerts.baselines import hour_of_day, hour_of_week, rule_scope
from alerts.config import load_config
from alerts.detection import BaselineStats
from alerts.rule_file import load_rules
from alerts.rules import Rule
from alerts.sensitivity import (
    INSUFFICIENT,
    SensitivityConfig,
    merge_spans,
    reach_s,
    read_limit,
    readable_cycles,
    refresh,
    season_spans,
)
from alerts.series import sliced_cohort_series
from alerts.settings import AlertSettings
from monitor.jobs import refresh_sensitivity
from storage.models import Baseline, MemorySample, scope_key
from storage.queries import sensitivity as queries
from tests.alerts.builders import add_traffic

T0 = datetime(2026, 11, 2, tzinfo=UTC)
DAYS = 3
NOW = T0 + timedelta(days=DAYS)
DAY_S = 86400.0


def memory_rule() -> Rule:
    return {r.name: r for r in load_rules()}["memory_growth"]


def fill_memory(sm: sessionmaker[Session], rule: Rule) -> None:
    """Store DAYS of one instance's RSS, a sample a minute, growing a few MB an hour with
    jitter, and the rolling baseline of its ten-minute cycles."""
    rng = random.Random(7)
    with sm.begin() as s:
        for i in range(DAYS * 1440):
            rss = 10**9 + i * 50_000 + int(rng.gauss(0.0, 300_000))
            s.add(MemorySample(at=T0 + timedelta(minutes=i, seconds=5), instance_id="i1",
                               rss_bytes=rss))
    with sm() as s:
        series, _ = sliced_cohort_series(rule, s, T0, NOW)
    [per_cohort] = series.values()
    [pts] = per_cohort.values()
    stats = BaselineStats.of(p.value for p in pts if p.value is not None)
    assert stats is not None and stats.center > 0
    scope = rule_scope(rule, {"instance": "i1"})
    with sm.begin() as s:
        s.add(Baseline(metric=rule.metric, scope=scope, scope_key=scope_key(scope),
                       value=stats.center, spread=stats.spread, samples=stats.cycles,
                       kind="rolling", created_at=NOW, active=True))


def test_a_ten_minute_rule_is_estimated_from_days_of_history(
        sessionmaker: sessionmaker[Session]) -> None:
    # A day holds 144 of memory_growth's ten-minute cycles, and its estimate needs 360:
    # read a day only, it said insufficient history for ever and its budget never applied.
    rule = memory_rule()
    fill_memory(sessionmaker, rule)
    config = load_config(AlertSettings())  # the shipped settings: a day of history
    # A loaded host must not turn this into a timing test (the CPU bound has its own).
    config = replace(config, rules=(rule,),
                     sensitivity=replace(config.sensitivity, cpu_s=600.0))
    done = refresh_sensitivity(sessionmaker, config, lambda: NOW)
    assert done.estimated == 1 and not done.errors
    with sessionmaker() as s:
        [st] = queries.listing(s)
    assert st.rule == "memory_growth" and st.status != INSUFFICIENT, st.reason
    assert st.cycles > 360  # more than a day's 144: the read reached back for them
    assert st.false_pages_30d is not None


def test_each_rule_reads_back_for_the_cycles_it_needs_at_its_cadence() -> None:
    cfg = SensitivityConfig()  # 360 cycles, at most 14 days back
    minute = {r.name: r for r in load_rules()}["acceptance_drop"]
    memory = memory_rule()
    burst = {r.name: r for r in load_rules()}["burst_p99_regression"]
    assert reach_s(minute, None, cfg, DAY_S) == DAY_S  # a day holds 1440: read a day
    assert reach_s(memory, None, cfg, DAY_S) == 2 * 360 * 600.0  # 5 days, twice over
    assert reach_s(burst, None, cfg, DAY_S) == 2 * 360 * 900.0
    for r in (minute, memory, burst):
        assert readable_cycles(r, None, cfg, DAY_S) >= 2 * 360
        assert read_limit(r, None, cfg, DAY_S) == ""
    # A season's cycles: one hour a day (12 days hold 720 of them), or one a week, whose
    # 720 would take 12 weeks: bounded by the raw retention, and said.
    assert reach_s(minute, "hod5", cfg, DAY_S) == 12 * DAY_S
    assert read_limit(minute, "hod5", cfg, DAY_S) == ""
    assert reach_s(minute, "how5", cfg, DAY_S) == 14 * DAY_S
    assert readable_cycles(minute, "how5", cfg, DAY_S) == 2 * 60
    assert "hold at most 120 cycles of its season (how5): not estimated within it" \
        in read_limit(minute, "how5", cfg, DAY_S)
    # An hour-long plain cycle: 14 days hold 336 of the 360 needed.
    hourly = replace(minute, window_s=3600.0)
    assert readable_cycles(hourly, None, cfg, DAY_S) == 336
    assert "hold at most 336 cycles: not estimated within it" \
        in read_limit(hourly, None, cfg, DAY_S)


def test_a_season_is_estimated_from_its_own_hours_of_many_days(
        sessionmaker: sessionmaker[Session]) -> None:
    # Traffic at 05h UTC only, on 7 days from a Monday: the hour of the day holds 420 of
    # its cycles, a day's read 60. The hour of the week (Monday 05h) holds 60, and 14 days
    # of history could hold 120 of its 360: said.
    rule = replace({r.name: r for r in load_rules()}["acceptance_drop"],
                   seasonality="hour_of_week")
    rng, values = random.Random(2), []
    with sessionmaker.begin() as s:
        for day in range(7):
            for minute in range(60):
                v = 0.6 + rng.gauss(0.0, 0.03)
                values.append(v)
                add_traffic(s, T0 + timedelta(days=day, hours=5, minutes=minute), "64",
                            acceptance=v)
        stats = BaselineStats.of(values)
        assert stats is not None
        for season in ("hod5", "how5"):
            scope = {**rule_scope(rule, {"bucket": "64"}), "season": season}
            s.add(Baseline(metric=rule.metric, scope=scope, scope_key=scope_key(scope),
                           value=stats.center, spread=stats.spread, samples=stats.cycles,
                           kind="rolling", created_at=T0, active=True))
    now = T0 + timedelta(days=7)
    with sessionmaker.begin() as s:
        done = refresh(s, [rule], SensitivityConfig(cpu_s=600.0), now, history_s=DAY_S)
    assert done.estimated == 2 and not done.errors
    assert done.rows_held <= 60  # an hour of its season at a time, never the days between
    with sessionmaker() as s:
        got = {st.scope["season"]: st for st in queries.listing(s)}
    assert got["hod5"].status != INSUFFICIENT and got["hod5"].cycles == 420
    assert got["how5"].status == INSUFFICIENT and got["how5"].cycles == 60
    assert got["how5"].reason.startswith("insufficient history: 60 of 360 cycles")
    assert "hold at most 120 cycles of its season (how5)" in got["how5"].reason


@pytest.mark.parametrize(("season", "of", "period"), [("how13", hour_of_week, 7),
                                                      ("hod13", hour_of_day, 1)])
def test_a_season_reads_its_own_hours_only(season: str, of: object, period: int) -> None:
    now = datetime(2026, 11, 25, 15, 20, tzinfo=UTC)  # a Wednesday: hour of week 63
    since = now - timedelta(days=3 * period, hours=1)
    spans = season_spans(season, since, now)
    assert [hi - lo for lo, hi in spans] == [timedelta(hours=1)] * 3
    assert all(of(lo) == 13 and lo.minute == 0 for lo, _ in spans)  # type: ignore[operator]
    assert [b[0] - a[0] for a, b in zip(spans, spans[1:], strict=False)] \
        == [timedelta(days=period)] * 2
    assert spans[-1][1] <= now and spans[0][0] >= since
    assert season_spans(None, since, now) == [(since, now)]
    # A season's hour inside the plain read is read once, with it.
    plain = (spans[-1][0] - timedelta(minutes=30), now)
    assert merge_spans([*spans, plain]) == [*spans[:-1], plain]


def test_the_history_settings_stay_coherent() -> None:
    cfg = load_config(AlertSettings(sensitivity_max_history_s=7 * DAY_S))
    assert cfg.sensitivity.max_history_s == 7 * DAY_S
    with pytest.raises(ValidationError, match="sensitivity_max_history_s"):
        AlertSettings(sensitivity_max_history_s=3600.0)  # under the day read
    with pytest.raises(ValueError, match="max_history_s"):
        SensitivityConfig(max_history_s=3600.0)  # under the 6 h an estimate spans
