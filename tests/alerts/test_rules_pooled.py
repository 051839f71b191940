"""A pooled quantile's detector scores each cycle's new samples once.

Scoring every pooled value counted one slow cycle in up to 25 consecutive values (43-410
false alerts per 30 days in bench.detection); these tests fail if it comes back.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from sqlalchemy.orm import Session, sessionmaker

from alerts.detection import BaselineStats
from alerts.rule_file import parse_rule
from alerts.rules import Point, RuleResult, evaluate_rule
from alerts.series import RowCache, series
from storage.sketches import Sketch
from tests.alerts.builders import add_cycle

T0 = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
RULE = parse_rule({"name": "p99", "metric": "p99_latency", "change": "+15%", "for": 3,
                   "min_samples": 2, "min_baseline_cycles": 5})
SCOPE = (("bucket", "64"),)


def minute(i: float) -> datetime:
    return T0 + timedelta(minutes=i)


def judged(sm: sessionmaker[Session], levels: list[float]) -> list[RuleResult]:
    """Write one 4-canary cycle per level; return the rule's result after each of the last
    40, read through the production series (pooled to 100 samples)."""
    with sm.begin() as s:
        for i, v in enumerate(levels):
            add_cycle(s, minute(i) + timedelta(seconds=2), {"64": v}, count=4)
    base = BaselineStats.of([0.1] * 60)
    out = []
    with sm() as s:
        cache = RowCache(s)
        for end in range(len(levels) - 39, len(levels) + 1):
            pts = series(RULE, cache, minute(end - 30), minute(end))[SCOPE]
            out.append(evaluate_rule(RULE, dict(SCOPE), base, pts))
    return out


def test_one_slow_cycle_in_the_pool_never_fires(sessionmaker: sessionmaker[Session]) -> None:
    results = judged(sessionmaker, [0.1] * 70 + [0.3] + [0.1] * 29)
    # The stall sits in the pooled p99 for 25 cycles (+140%) ...
    assert sum(r.relative_change is not None and r.relative_change > 1.0 for r in results) >= 20
    # ... but its 4 samples count once: the CUSUM never confirms.
    assert not any(r.fired for r in results)
    assert max(r.statistic for r in results) <= RULE.cusum.cap + 1e-9


def test_a_sustained_shift_fires_from_the_new_samples(sessionmaker: sessionmaker[Session]):
    results = judged(sessionmaker, [0.1] * 70 + [0.13] * 30)
    fired = [i for i, r in enumerate(results) if r.fired]
    assert fired and fired[0] - 10 <= 3  # the shift starts at the 11th result
    r = results[fired[0]]
    assert r.samples == 100 and "new samples" in r.reason
    assert abs(r.current - 0.13) / 0.13 < 0.01  # type: ignore[operator]  # the pooled p99


def _cycle(i: int, value: float, fresh: list[float]) -> Point:
    return Point(minute(i), value, 100, fresh=Sketch.of(fresh))


def test_pooled_recovery_reads_the_cycles_own_samples() -> None:
    base = BaselineStats.of([1.0] * 40)
    rule = parse_rule({"name": "p99", "metric": "p99_latency", "change": "+15%",
                       "resolve_change": "+5%", "resolve_for": 5, "min_baseline_cycles": 5})
    # Since the alert fired the canaries ran slow; now the pooled p99 is still +10% (the
    # regression's samples leave the pool slowly), but every new canary of 8 cycles (enough
    # to tell) is back under the baseline p99 and the canaries came down: recovered.
    slow = [_cycle(i, 1.25, [1.1, 1.15, 1.2, 1.3]) for i in range(5)]
    back = slow + [_cycle(5 + i, 1.10, [0.8, 0.85, 0.9, 0.95]) for i in range(8)]
    assert evaluate_rule(rule, {}, base, back).recovered
    assert not evaluate_rule(rule, {}, base, back[:-1]).recovered  # 7 cycles: not yet
    # One of the last cycles' own samples still above it: not yet.
    still = back[:-1] + [_cycle(13, 1.10, [0.8, 0.85, 0.9, 1.2])]
    assert not evaluate_rule(rule, {}, base, still).recovered
    # Over the threshold: never recovered, whatever the new samples say.
    over = [_cycle(i, 1.20, [0.8, 0.85, 0.9, 0.95]) for i in range(10)]
    assert not evaluate_rule(rule, {}, base, over).recovered


def test_a_regression_under_a_p99_that_slow_cycles_set_stays_firing() -> None:
    # The baseline p99 (1.0) is set by a few slow cycles; the other canaries regressed from
    # ~0.65 to ~0.85 and go on there: no new sample above 1.0, and a pool without a slow
    # cycle reads under the threshold (+10%). Not recovered: the canaries did not come
    # down since the alert fired (otherwise such an alert resolves mid-incident and fires
    # again: two pages for one incident).
    # The baseline's body (its cycles' median canary) is where the canaries were: 0.65.
    base = replace(BaselineStats.of([1.0] * 40), body=0.65)  # type: ignore[type-var]
    rule = parse_rule({"name": "p99", "metric": "p99_latency", "change": "+15%",
                       "resolve_change": "+5%", "resolve_for": 5, "min_baseline_cycles": 5})
    # Since it fired, a pool holding a slow cycle read +30%; then one without it +10%.
    going_on = [_cycle(0, 1.30, [0.8, 0.85, 0.9, 1.3])] + [
        _cycle(1 + i, 1.10, [0.8, 0.85, 0.9, 0.95]) for i in range(11)]
    result = evaluate_rule(rule, {}, base, going_on)
    assert not result.recovered and not result.fired
    # Too few cycles since it fired to tell: the pool must come back inside the band.
    assert not evaluate_rule(rule, {}, base, going_on[:6]).recovered
    # Inside resolve_change needs no comparison.
    inside = [_cycle(i, 1.03, [0.8, 0.85, 0.9, 0.95]) for i in range(5)]
    assert evaluate_rule(rule, {}, base, inside).recovered
    # A series that never breached since the detector's start (a scope's other cohort,
    # while the one that regressed is gone) recovers as before.
    assert evaluate_rule(rule, {}, base, going_on[1:]).recovered


def test_an_alert_that_fired_near_the_end_recovers_against_the_baseline_body() -> None:
    """A short incident: the alert fired on its last two cycles, and the pool kept their
    samples for 20 more; now it reads +10% (outside resolve_change) with every new canary
    back. The cycles since firing are mostly normal, so the canaries never came down from
    them; against the baseline's body they are back, without waiting for the pool to
    fall inside +5%."""
    rule = parse_rule({"name": "p99", "metric": "p99_latency", "change": "+15%",
                       "resolve_change": "+5%", "resolve_for": 5, "min_baseline_cycles": 5})
    normal = [0.8, 0.85, 0.9, 0.95]
    pts = ([_cycle(i, 1.30, [1.1, 1.15, 1.2, 1.3]) for i in range(2)]
           + [_cycle(2 + i, 1.25, normal) for i in range(20)]
           + [_cycle(22 + i, 1.10, normal) for i in range(5)])
    base = BaselineStats.of([1.0] * 40)
    assert base is not None and base.body is None
    assert not evaluate_rule(rule, {}, base, pts).recovered  # no body: only the pool
    with_body = replace(base, body=0.86)
    assert evaluate_rule(rule, {}, with_body, pts).recovered
    # Canaries still ~15% above the body (a regression going on): not recovered.
    assert not evaluate_rule(rule, {}, replace(base, body=0.75), pts).recovered


def test_a_dip_in_a_regression_that_goes_on_is_no_recovery() -> None:
    """A ramp held at +25%: its canaries dip for a few cycles (noise comes in runs) to
    +13% over the baseline's body, 8% under the cycles since firing, with no new sample
    above the baseline p99. Against the earlier cycles they came down; against the body
    they did not, and the body decides (bench.incidents: the ramp resolved mid-incident
    and paged again)."""
    rule = parse_rule({"name": "p99", "metric": "p99_latency", "change": "+15%",
                       "resolve_change": "+5%", "resolve_for": 5, "min_baseline_cycles": 5})
    base = replace(BaselineStats.of([1.0] * 40), body=0.80)  # type: ignore[type-var]
    going_on = [_cycle(i, 1.19, [0.96, 0.98, 1.0, 1.02]) for i in range(5)]
    dip = [_cycle(5 + i, 1.19, [0.88, 0.9, 0.91, 0.93]) for i in range(8)]
    assert not evaluate_rule(rule, {}, base, going_on + dip).recovered
    # Back at the body: recovered, the pool still at +19%.
    back = [_cycle(5 + i, 1.19, [0.76, 0.79, 0.81, 0.84]) for i in range(8)]
    assert evaluate_rule(rule, {}, base, going_on + back).recovered


def test_a_pooled_median_still_fires_on_its_relative_change() -> None:
    # One canary per cycle: the p50 pools earlier cycles. Exceedance scoring would give a
    # median no evidence (p1 = p0 = 1/2): it is scored on its relative change instead.
    base = BaselineStats.of([1.0] * 40)
    rule = parse_rule({"name": "p50", "metric": "p50_latency", "change": "+50%",
                       "resolve_change": "+10%", "for": 2, "min_baseline_cycles": 5})
    before = [_cycle(i, 1.0, [1.0]) for i in range(10)]
    slowed = [_cycle(10 + i, 3.0, [3.0]) for i in range(6)]
    result = evaluate_rule(rule, {}, base, before + slowed)
    assert result.fired and "median" in result.reason
    # Back to normal: half the new samples sit above the baseline median by definition,
    # which must not hold the alert open.
    after = [_cycle(16 + i, 1.0, [1.05]) for i in range(10)]
    assert evaluate_rule(rule, {}, base, before + slowed + after).recovered
