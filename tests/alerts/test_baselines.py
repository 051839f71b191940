"""Cohort baselines, incremental refresh, seasonality, pending cycles and pinned spread."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from alerts.baselines import BaselineConfig, baselines_for_rule, list_baselines, pin
from alerts.evaluator import EvaluationOptions, evaluate
from alerts.rule_file import parse_rule
from alerts.series import RowCache, cohort_series
from storage.models import Alert, SeriesChunk
from storage.queries.series import NO_COHORT
from tests.alerts.builders import add_cycle

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)  # a Monday
RULE = parse_rule({"name": "p99", "metric": "p99_latency", "change": "+15%",
                   "resolve_change": "+5%", "for": 3, "resolve_for": 3, "min_samples": 2,
                   "lookback": 10, "baseline_window": "2h", "min_baseline_cycles": 20,
                   "severity": "page"})


def minute(i: int) -> datetime:
    return T0 + timedelta(minutes=i)


def fill(sm: sessionmaker[Session], start: int, stop: int, p64: float, *, noise: float = 0.02,
         seed: int = 0, **kw: object) -> None:
    rng = random.Random(f"{seed}-{start}-{kw.get('model_version')}")
    with sm.begin() as s:
        for i in range(start, stop):
            add_cycle(s, minute(i) + timedelta(seconds=2),
                      {"16": 0.05 * (1 + rng.gauss(0, noise)),
                       "64": p64 * (1 + rng.gauss(0, noise))}, **kw)


def run(sm: sessionmaker[Session], i: int, rules=(RULE,), **kw: object):
    kw.setdefault("baseline_config", BaselineConfig(warm_in_s=0))
    with sm.begin() as s:
        return evaluate(s, EvaluationOptions(list(rules), **kw), minute(i) + timedelta(seconds=30))


def by_bucket(report, bucket: str):
    return next(r for r in report.results if r.labels == {"bucket": bucket})


def test_two_cohorts_probing_keep_detection_on_and_the_new_ones_regression_fires(
        sessionmaker: sessionmaker[Session]):
    cfg = BaselineConfig(warm_in_s=1800)  # the new cohort's own baseline is 50 min away
    old = {"model_version": "m1", "instance": "i1"}
    new = {"model_version": "m2", "instance": "i2"}
    fill(sessionmaker, -60, 40, 0.1, **old)
    run(sessionmaker, 40, baseline_config=cfg)
    # Rollout: m2 starts on a second replica; both probe every minute.
    fill(sessionmaker, 40, 70, 0.1, **old)
    fill(sessionmaker, 40, 50, 0.1, **new)
    fill(sessionmaker, 50, 70, 0.2, **new)  # 2x p99 on the new version, bucket 64
    fired_at = None
    for i in range(41, 60):
        rep = run(sessionmaker, i, baseline_config=cfg)
        assert rep.errors == ()
        r16 = by_bucket(rep, "16")
        assert not r16.no_data, r16.reason  # detection stays on, nothing warms in
        if fired_at is None and any(t.to_state == "firing" for t in rep.transitions):
            fired_at = i
            r64 = by_bucket(rep, "64")
            assert "m2/c1" in r64.reason and "inherited from m1/c1" in r64.reason
            assert r64.relative_change == pytest.approx(1.0, abs=0.1)
    # Cycles 50, 51, 52 are the for=3 cycles: confirmed at the evaluation after the third,
    # as for any other regression (tests/alerts/test_evaluator.py).
    assert fired_at == 53
    with sessionmaker() as s:
        (alert,) = s.scalars(select(Alert)).all()
        assert alert.labels == {"bucket": "64"} and alert.state == "firing"


@pytest.mark.parametrize("rollout", [False, True])
def test_a_new_versions_regression_on_few_canaries_fires_as_soon_as_any_other(
        sessionmaker: sessionmaker[Session], rollout: bool):
    """No blind window with 4 canaries a cycle: the new cohort's p99 borrows the scope's
    other samples until it has 100 of its own (it waited 25 cycles for them before)."""
    cfg = BaselineConfig(warm_in_s=1800)
    both = [{"instance": "i1"}, {"instance": "i2"}]
    for kw in both:
        fill(sessionmaker, -60, 50, 0.1, count=4, **kw)
    run(sessionmaker, 50, baseline_config=cfg)
    slow = {"instance": "i2", "model_version": "m2" if rollout else "m1"}
    fill(sessionmaker, 50, 70, 0.1, count=4, instance="i1")
    fill(sessionmaker, 50, 70, 0.2, count=4, **slow)  # 2x on i2 (its new version or not)
    fired_at = None
    for i in range(51, 70):
        rep = run(sessionmaker, i, baseline_config=cfg)
        assert rep.errors == ()
        r64 = by_bucket(rep, "64")
        assert "insufficient_samples" not in r64.reason, (i, r64.reason)
        if fired_at is None and any(t.to_state == "firing" and t.rule == RULE.name
                                    for t in rep.transitions):
            fired_at = i
            assert ("m2/c1" in r64.reason) == rollout
    assert fired_at == 53  # cycles 50-52 are the for=3 cycles, rollout or not
    with sessionmaker() as s:
        # Values pooled partly from m1's samples stay out of m2's own baseline chunks.
        assert not s.scalars(select(SeriesChunk).where(SeriesChunk.model_version == "m2")).all()


def test_new_cohort_warms_in_on_its_own_while_the_old_stays_in_force(
        sessionmaker: sessionmaker[Session]):
    fill(sessionmaker, -60, 80, 0.1, model_version="m1")
    fill(sessionmaker, 40, 80, 0.108, model_version="m2", instance="i2")  # +8%: in threshold
    for i in range(40, 81, 5):
        rep = run(sessionmaker, i, baseline_config=BaselineConfig(warm_in_s=600))
        assert not rep.transitions
    with sessionmaker() as s:
        views = [v for v in list_baselines(s, "p99_latency") if v.scope["bucket"] == "64"]
        mine = {v.model_version: v for v in views}
        assert set(mine) == {"m1", "m2"}
        assert mine["m1"].value == pytest.approx(0.1, rel=0.03)
        # m2's own window starts at its first run + warm-in (minute 50).
        assert mine["m2"].window_start == minute(40) + timedelta(seconds=602)
        assert mine["m2"].value == pytest.approx(0.108, rel=0.03)


def test_evaluation_reads_a_bounded_amount_not_the_history(sessionmaker: sessionmaker[Session]):
    """Finding 7: rows read per evaluation do not grow with the stored history."""
    rule = parse_rule({"name": "p99", "metric": "p99_latency", "change": "+15%", "for": 3,
                       "min_samples": 2, "lookback": 10, "baseline_window": "6h",
                       "min_baseline_cycles": 20})
    fill(sessionmaker, -360, 0, 0.1)
    first = run(sessionmaker, 0, rules=[rule])  # builds the hourly chunks once
    assert first.rows_read > 6 * 60
    with sessionmaker() as s:
        hours = s.scalar(select(func.count()).select_from(SeriesChunk)
                         .where(SeriesChunk.scope_key == ""))
        assert hours == 6
    fill(sessionmaker, 0, 3, 0.1)
    bound = 2 * (rule.lookback_cycles + rule.pool_cycles) + 10  # 2 buckets, plus cohort spans
    # Forced refresh of every baseline: read from chunks plus the current hour only.
    forced = BaselineConfig(refresh_s=0, warm_in_s=0)
    reads = [run(sessionmaker, i, rules=[rule], baseline_config=forced).rows_read
             for i in (1, 2, 3)]
    assert max(reads) <= 2 * 60 + bound  # the current hour's raw cycles, never 6 h
    fill(sessionmaker, 3, 5, 0.1)
    # Fresh baselines: only the detector's window (lookback plus the quantile pool) is read.
    assert run(sessionmaker, 5, rules=[rule]).rows_read <= bound
    with sessionmaker() as s:
        v = {v.scope["bucket"]: v for v in list_baselines(s, "p99_latency")}["64"]
        assert v.samples >= 6 * 60 - 2  # the whole window, from the chunks


def test_a_quantile_baseline_keeps_its_body_from_the_chunks_and_a_pin_copies_it(
        sessionmaker: sessionmaker[Session]):
    """The body (median of the cycles' own median samples; the canaries sit at 0.8 x the
    p99 in these cycles) is stored beside the p99's centre, from the hourly chunks and the
    current hour, and a pin keeps the one measured when it was pinned."""
    rule = parse_rule({"name": "p99", "metric": "p99_latency", "change": "+15%", "for": 3,
                       "min_samples": 2, "lookback": 10, "baseline_window": "6h",
                       "min_baseline_cycles": 20})
    fill(sessionmaker, -360, 0, 0.1)
    run(sessionmaker, 0, rules=[rule])
    with sessionmaker() as s:
        chunk = s.scalars(select(SeriesChunk).where(SeriesChunk.scope_key != "")).first()
        assert chunk is not None and all(len(c) == 4 for c in chunk.values)
        v = {v.scope["bucket"]: v for v in list_baselines(s, "p99_latency")}["64"]
    assert v.value == pytest.approx(0.1, rel=0.03)
    assert v.body == pytest.approx(0.08, rel=0.03)
    with sessionmaker.begin() as s:
        pinned = pin(s, "p99_latency", "bucket=64", "ana", value=0.12, now=minute(1))
    assert pinned.body == pytest.approx(v.body)
    now = minute(1) + timedelta(seconds=30)
    with sessionmaker.begin() as s:
        cache = RowCache(s)
        per = cohort_series(rule, cache, now - timedelta(minutes=10), now)
        out = baselines_for_rule(s, rule, [rule], now, cache,
                                 {k: list(x) for k, x in per.items()}, BaselineConfig(warm_in_s=0))
    b = out[(("bucket", "64"),)][("m1", "c1")]
    assert b.origin == "pinned" and b.stats is not None and b.stats.body == pytest.approx(v.body)


_SEASONAL = {"for": 3, "min_samples": 2, "window": "10m", "lookback": 6,
             "baseline_window": "15d", "min_baseline_cycles": 5}


def _two_weeks(sm: sessionmaker[Session], rules, level, *, acceptance: bool = False,
               seed: int = 3, days: int = 14):
    """Write `days` days and 12 h of 10-minute cycles at `level(t)` (2% noise; p99 seconds,
    or the acceptance rate), then evaluate `rules` once at Monday 14:41."""
    rng = random.Random(seed)
    with sm.begin() as s:
        t = T0 - timedelta(days=days, hours=12)
        while t < T0 + timedelta(hours=2, minutes=40):
            v = level(t) * (1 + rng.gauss(0, 0.02))
            if acceptance:
                add_cycle(s, t + timedelta(seconds=2), {"64": 0.1}, acceptance={"64": v})
            else:
                add_cycle(s, t + timedelta(seconds=2), {"64": v})
            t += timedelta(minutes=10)
    with sm.begin() as s:
        rep = evaluate(
            s,
            EvaluationOptions(
                rules, baseline_config=BaselineConfig(warm_in_s=0, backfill_hours=200)
            ),
            T0 + timedelta(hours=2, minutes=41),
        )
    assert rep.errors == ()
    return {r.rule: r for r in rep.results}


def test_daily_peak_with_hour_of_week_baseline_does_not_page(sessionmaker: sessionmaker[Session]):
    """Finding 8: a regular peak (here weekly: Monday 14h) against its own hour of week
    (two weeks of history: a season counts once it was seen twice)."""
    raw = {"metric": "p99_latency", "change": "+30%", **_SEASONAL}
    seasonal = parse_rule({"name": "seasonal", "seasonality": "hour_of_week", **raw})
    plain = parse_rule({"name": "plain", **raw})
    res = _two_weeks(sessionmaker, [seasonal, plain],
                     lambda t: 0.2 if t.hour == 14 and t.weekday() == 0 else 0.1)
    assert res["plain"].fired  # against the week's median the peak pages
    assert not res["seasonal"].fired and not res["seasonal"].breaching, res["seasonal"].reason
    assert res["seasonal"].baseline == pytest.approx(0.2, rel=0.05)


@pytest.mark.parametrize(("metric", "change", "daily", "mondays", "other"), [
    # A daily p99 peak at 14h; the two Mondays 14h of history happened to read low.
    ("p99_latency", "+15%", 0.2, 0.08, 0.1),
    # Acceptance dips daily at 14h; the two Mondays 14h of history read high.
    ("acceptance_rate", "-15%", 0.5, 0.7, 0.8),
])
def test_the_more_lenient_seasonal_centre_is_in_force(
        sessionmaker: sessionmaker[Session], metric, change, daily, mondays, other):
    """Once both seasons are in force, the hour of week counts only where it is more
    lenient than the hour of day (for a rising metric higher, for a falling one lower):
    an hour of week that merely read quiet does not page the daily level."""
    rule = parse_rule({"name": "seasonal", "seasonality": "hour_of_week", "metric": metric,
                       "change": change, **_SEASONAL})

    def level(t: datetime) -> float:
        if t.hour != 14:
            return other
        return mondays if t.weekday() == 0 and t < T0 else daily

    res = _two_weeks(sessionmaker, [rule], level, acceptance=metric == "acceptance_rate")
    r = res["seasonal"]
    assert not r.fired and not r.breaching, r.reason
    assert r.baseline == pytest.approx(daily, rel=0.05)
    assert "hour_of_day" in r.reason


@pytest.mark.parametrize(("days", "pages"), [(2, False), (8, True)])
def test_a_young_season_only_relaxes_the_plain_baseline(
        sessionmaker: sessionmaker[Session], days: int, pages: bool):
    """Hour 14 read 20% low on each earlier day. Seen on two days that is a few hours of
    noise: the ordinary level today does not page against it (the plain baseline is in
    force, and the reason says why). Seen on eight days it is the hour's level: the same
    reading is +25% for that hour and pages."""
    rule = parse_rule({"name": "seasonal", "seasonality": "hour_of_week",
                       "metric": "p99_latency", "change": "+15%", **_SEASONAL})
    res = _two_weeks(sessionmaker, [rule],
                     lambda t: 0.08 if t.hour == 14 and t < T0 else 0.1, days=days)
    r = res["seasonal"]
    assert r.fired == pages, r.reason
    if pages:
        assert r.baseline == pytest.approx(0.08, rel=0.05) and "baseline hour_of_" in r.reason
    else:
        assert r.baseline == pytest.approx(0.1, rel=0.05)
        assert "hour_of_day young" in r.reason and not r.breaching


def test_pending_and_firing_cycles_stay_out_of_the_baseline(sessionmaker: sessionmaker[Session]):
    fill(sessionmaker, 0, 40, 0.1)
    run(sessionmaker, 40)
    fill(sessionmaker, 40, 44, 0.3)
    fill(sessionmaker, 44, 60, 0.1)
    forced = BaselineConfig(refresh_s=0, warm_in_s=0)
    for i in range(41, 61):
        run(sessionmaker, i, baseline_config=forced)
    with sessionmaker() as s:
        alert = s.scalars(select(Alert)).one()
        assert alert.state == "resolved"
        v = {v.scope["bucket"]: v for v in list_baselines(s, "p99_latency")}["64"]
    # Cycles 0..59 exist (the first is partial: 1..59 count); the run from the first
    # breaching cycle (40, pending) to resolution is out, the 0.3 cycles included.
    resolved = (alert.resolved_at - T0).total_seconds() // 60
    assert v.samples == 59 - (resolved - 40)
    assert v.value == pytest.approx(0.1, rel=0.03)


def test_pinned_baseline_keeps_the_spread_measured_at_pin_time(
        sessionmaker: sessionmaker[Session]):
    fill(sessionmaker, 0, 40, 0.1, noise=0.10)
    run(sessionmaker, 40)
    with sessionmaker.begin() as s:
        pinned = pin(s, "p99_latency", "bucket=64", "ana", value=0.1, now=minute(40))
    assert pinned.spread is not None and pinned.spread > 0.005  # 10% noise, not the 2% floor
    # Later the rolling spread shrinks (a quiet hour); the pinned one is what rules use.
    fill(sessionmaker, 40, 100, 0.1, noise=0.001)
    now = minute(100) + timedelta(seconds=30)
    with sessionmaker.begin() as s:
        cache = RowCache(s)
        per = cohort_series(RULE, cache, now - timedelta(minutes=10), now)
        out = baselines_for_rule(s, RULE, [RULE], now, cache,
                                 {k: list(v) for k, v in per.items()},
                                 BaselineConfig(refresh_s=0, warm_in_s=0))
    b = out[(("bucket", "64"),)][("m1", "c1")]
    assert b.origin == "pinned" and b.stats is not None
    assert b.stats.spread == pytest.approx(pinned.spread)
    assert NO_COHORT not in out[(("bucket", "64"),)]


def test_backfill_is_spread_over_evaluations_newest_hours_first(
        sessionmaker: sessionmaker[Session]):
    rule = parse_rule({"name": "p99", "metric": "p99_latency", "change": "+15%",
                       "min_samples": 2, "baseline_window": "6h"})
    fill(sessionmaker, -360, 2, 0.1)
    step = BaselineConfig(warm_in_s=0, backfill_hours=2)

    def hours() -> list[int]:
        with sessionmaker() as s:
            starts = s.scalars(select(SeriesChunk.start).where(SeriesChunk.scope_key == ""))
            return sorted(int((t - T0).total_seconds() // 3600) for t in starts)

    run(sessionmaker, 0, rules=[rule], baseline_config=step)
    assert hours() == [-2, -1]
    run(sessionmaker, 1, rules=[rule], baseline_config=step)
    assert hours() == [-4, -3, -2, -1]
    # Until the window is complete every baseline is refreshed: then it rests on all of it.
    run(sessionmaker, 2, rules=[rule], baseline_config=step)
    assert hours() == [-6, -5, -4, -3, -2, -1]
    with sessionmaker() as s:
        v = {v.scope["bucket"]: v for v in list_baselines(s, "p99_latency")}["64"]
        assert v.samples >= 6 * 60 - 2


def test_a_young_baseline_is_refreshed_as_its_data_doubles(sessionmaker: sessionmaker[Session]):
    """A slow start (caches, neighbours) must not set the level for an hour (demo step 2)."""
    rule = parse_rule({"name": "p99", "metric": "p99_latency", "change": "+50%", "for": 2,
                       "min_samples": 2, "lookback": 10, "min_baseline_cycles": 5,
                       "cusum": {"min_cycles": 2}})
    fill(sessionmaker, 0, 6, 0.2)  # the first minutes after start are slow
    fill(sessionmaker, 6, 40, 0.1)
    fill(sessionmaker, 40, 45, 0.2)  # then a real 2x regression
    fired = [i for i in range(6, 46)
             if any(t.to_state == "firing" for t in run(sessionmaker, i, rules=[rule]).transitions)]
    assert fired[:1] == [44]  # against 0.1; the frozen 0.2 of the first cycles never fired
    with sessionmaker() as s:
        v = {v.scope["bucket"]: v for v in list_baselines(s, "p99_latency")}["64"]
        assert v.value == pytest.approx(0.1, rel=0.05) and v.samples > 20
