"""Each step of `evaluate_rule` on its own: score, confirm, limit, recover, reason."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from alerts.detection import BaselineStats, llr
from alerts.rule_file import parse_rule
from alerts.rules import (
    Checks,
    Confirmation,
    Point,
    Rule,
    confirm,
    evaluate_rule,
    judged_points,
    limit_crossed,
    median_inside_band,
    own_samples_back,
    own_samples_cycles,
    reason,
    recovered,
    recovery_cycles,
    relative_changes,
    run_over,
    score_cycle,
    threshold_in_force,
    unjudgeable,
)
from storage.sketches import Sketch

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
BASE = BaselineStats(center=1.0, spread=0.05, cycles=500)


def rule(**kw: object) -> Rule:
    raw = {"name": "p50", "metric": "p50_latency", "change": "+15%", "resolve_change": "+5%",
           "for": 3, "resolve_for": 3, "min_samples": 2}
    raw.update(kw)
    return parse_rule(raw)


def pts(values: list[float | None], samples: int = 100) -> list[Point]:
    return [Point(T0 + timedelta(minutes=i), v, samples if v is not None else 0)
            for i, v in enumerate(values)]


def pooled_point(value: float, fresh: list[float], samples: int = 500) -> Point:
    sketch = Sketch()
    for x in fresh:
        sketch.add(x)
    return Point(T0, value, samples, fresh=sketch)


def test_threshold_in_force_widens_only_and_names_why():
    r = rule()
    assert threshold_in_force(r, None) == (r, "")
    tighter = BaselineStats(center=1.0, spread=0.05, cycles=500, threshold=0.10, widened="w")
    assert threshold_in_force(r, tighter) == (r, "")
    wider = BaselineStats(center=1.0, spread=0.05, cycles=500, threshold=0.30,
                          widened="budget widened to +30%")
    widened, suffix = threshold_in_force(r, wider)
    assert widened.threshold == 0.30 and r.threshold == 0.15
    assert suffix == "; budget widened to +30%"
    # The band keeps its share of the threshold: +5% of +15% -> +10% of +30%.
    assert widened.resolve_threshold == pytest.approx(0.10) and r.resolve_threshold == 0.05


def test_a_page_at_a_widened_threshold_resolves_inside_the_band_widened_alike():
    """The budget widened the threshold on this series' noise: a page on that noise whose
    series settles at +7% (noise at that width, over the configured +5% band) resolves."""
    r = rule()
    wider = BaselineStats(center=1.0, spread=0.02, cycles=500, threshold=0.30, widened="w")
    since_fired = [1.35] * 3 + [1.07] * 3
    assert evaluate_rule(r, {}, wider, pts(since_fired)).recovered
    assert not evaluate_rule(r, {}, wider, pts([1.35] * 3 + [1.12] * 3)).recovered
    # At the configured threshold the configured band holds.
    assert not evaluate_rule(r, {}, replace(wider, threshold=None), pts(since_fired)).recovered


def test_unjudgeable_names_empty_and_thin_cycles():
    assert unjudgeable(rule(), []) == (0, "empty window: 0 samples < min_samples 2")
    assert unjudgeable(rule(), pts([1.0, None]))[0] == 0  # type: ignore[index]
    assert unjudgeable(rule(), pts([1.0], samples=1)) == (
        1, "empty window: 1 samples < min_samples 2")
    thin = unjudgeable(rule(metric="p99_latency"), pts([1.0], samples=50))
    assert thin is not None and thin[1].startswith("insufficient_samples: 50 samples")
    assert unjudgeable(rule(), pts([1.0])) is None


def test_judged_points_drop_empty_and_thin_cycles():
    series = pts([1.0, None, 1.1]) + [Point(T0, 2.0, 1)]
    assert [p.value for p in judged_points(rule(), series)] == [1.0, 1.1]


def test_score_cycle_is_the_gaussian_llr_for_a_plain_cycle():
    r = rule()
    point = pts([1.2])[0]
    assert score_cycle(r, BASE, point, 0.2, 0.05) == llr(0.2, 0.15, 0.05)
    # Falling metrics score the change in their own direction.
    down = rule(change="-15%", resolve_change="-5%")
    assert score_cycle(down, BASE, point, -0.2, 0.05) == llr(0.2, 0.15, 0.05)


def test_score_cycle_scores_a_pooled_tail_cycle_on_its_own_samples():
    r = rule(name="p99", metric="p99_latency")
    quiet = pooled_point(1.3, [0.9] * 50)  # the pool still holds a slow cycle; none new
    slow = pooled_point(1.3, [1.5] * 50)
    assert score_cycle(r, BASE, quiet, 0.3, 0.05) < 0 < score_cycle(r, BASE, slow, 0.3, 0.05)
    assert score_cycle(r, BASE, quiet, 0.3, 0.05) != llr(0.3, 0.15, 0.05)


def test_confirm_needs_the_cusum_and_a_run_median_over_the_threshold():
    r = rule()
    steady = pts([1.0] * 10)
    assert confirm(r, BASE, steady, relative_changes([1.0] * 10, BASE), False) == Confirmation(
        statistic=0.0, run=(), change=None, fired=False)
    values = [1.0] * 10 + [1.3] * 8
    got = confirm(r, BASE, pts(values), relative_changes(values, BASE), False)
    assert got.fired and got.statistic >= r.cusum.h
    assert got.change is not None and abs(got.change - 0.3) < 1e-9 and len(got.run) >= 3
    # Between threshold / 2 and the threshold the CUSUM may rise; the median holds it.
    values = [1.0] * 10 + [1.12] * 20
    assert not confirm(r, BASE, pts(values), relative_changes(values, BASE), False).fired
    # No usable baseline: nothing to confirm.
    assert confirm(r, None, pts(values), relative_changes(values, None), False) == Confirmation()


def test_limit_crossed_needs_every_one_of_the_last_for_cycles():
    ceiling = rule(ceiling=2.0)
    assert limit_crossed(ceiling, [1.0, 2.5, 2.5, 2.5])
    assert not limit_crossed(ceiling, [2.5, 2.5, 1.0, 2.5])
    assert not limit_crossed(ceiling, [2.5, 2.5])  # fewer than `for` cycles
    assert limit_crossed(rule(floor=0.5), [0.1, 0.2, 0.3])
    assert not limit_crossed(rule(), [9.0, 9.0, 9.0])  # no limit at all


def test_median_inside_band_reads_the_run_not_each_cycle():
    r = rule()  # resolve_change +5%
    assert median_inside_band(r, [0.01, -0.02, 0.03])
    # A healthy noisy series: cycles stray above +5%, their median does not.
    assert median_inside_band(r, [0.12, -0.08, 0.02, 0.09, -0.04])
    assert not median_inside_band(r, [0.10, 0.06, 0.02])  # median +6%: not yet
    assert median_inside_band(r, [None, None])


def test_a_noisy_series_still_over_the_threshold_does_not_resolve_on_a_lucky_run():
    """Five cycles of a noisy series can read inside the band while it still sits over the
    threshold; resolving then fires it again (a second page). Its median is read over as
    many cycles as its noise needs (recovery_cycles) to tell the two apart."""
    r = rule(change="+10%", resolve_change="+3%", resolve_for=5)
    noisy = BaselineStats(center=1.0, spread=0.10, cycles=500)
    assert recovery_cycles(r, noisy) == 29  # (3 x 1.2533 x 10% / 7%) ** 2, rounded up
    assert recovery_cycles(r, BaselineStats(center=1.0, spread=0.02, cycles=500)) == 5
    assert recovery_cycles(r, None) == 5
    still = [1.15] * 24 + [1.0, 1.0, 1.0, 1.2, 1.2]  # still +15%; the last 5's median 0%
    changes = relative_changes(still, noisy)
    assert median_inside_band(r, changes[-5:])
    assert not recovered(r, noisy, pts(still), still, changes)
    back = [1.15] * 5 + [1.0, 0.95, 1.05, 1.1, 0.9] * 6  # back: the last 29's median 0%
    assert recovered(r, noisy, pts(back), back, relative_changes(back, noisy))
    # Too few cycles back to tell it (at 0%, 10% from the threshold: 12, see below): not yet.
    assert not recovered(r, noisy, pts(back[:16]), back[:16], relative_changes(back[:16], noisy))


def test_a_noisy_series_resolves_sooner_the_further_back_it_is():
    """The median of fewer cycles tells a series back when it lies further from the
    threshold: RECOVERY_Z standard errors of a median of that many (median_back)."""
    r = rule(change="+10%", resolve_change="+3%", resolve_for=5)
    noisy = BaselineStats(center=1.0, spread=0.10, cycles=500)  # recovery_cycles 29

    def cycles_to_resolve(levels: list[float]) -> int:
        series = [1.15] * 5 + levels
        return next(k for k in range(1, len(levels) + 1)
                    if recovered(r, noisy, pts(series[:5 + k]), series[:5 + k],
                                 relative_changes(series[:5 + k], noisy)))

    # Well under (-10%, 20% from the threshold; 3 errors of a median of 5 are 17%): the
    # resolve_for cycles' window, its oldest cycle still at +15%.
    assert cycles_to_resolve([0.9, 0.85, 0.95, 0.9, 0.8] * 6) == 4
    # Back at the baseline (10% from the threshold): a median of (3 x 1.2533 x 10% /
    # 10%) ** 2 = 14.1 cycles (here 15, 3 still at +15%), not the 29 the band needs.
    assert cycles_to_resolve([1.0, 0.95, 1.05, 1.1, 0.9] * 6) == 12
    # Just inside the band (+2%, 8% from the threshold): 22 cycles' median, 2 at +15%.
    assert cycles_to_resolve([1.02, 0.97, 1.07, 1.12, 0.92] * 6) == 20


def test_a_quiet_series_resolves_in_resolve_for_cycles_a_noisy_one_waits_for_its_noise():
    """The recovery reads the baseline's measured noise, not the detector's floored one.

    The canaries' output agreement is exactly 1.0: read at the detector's 2% floor, a
    -2% rule with a -0.5% band would read the whole lookback before resolving (the demo's
    quality step timed out waiting for it). A noisy series still at the threshold must
    not resolve on a run of lucky cycles (it would fire again: a second page).
    """
    agreement = rule(name="agreement", metric="output_agreement", change="-2%",
                     resolve_change="-0.5%", resolve_for=2, lookback=12, floor=0.99)
    flat = BaselineStats(center=1.0, spread=0.0, cycles=500)
    assert recovery_cycles(agreement, flat) == 2
    # The cycles since it fired (the detector restarts there): two still low, then back.
    since_fired = [0.9, 0.9] + [1.0] * 10
    back = [k for k in range(1, len(since_fired) + 1)
            if evaluate_rule(agreement, {}, flat, pts(since_fired[:k])).recovered]
    assert back[0] == 4  # resolve_for cycles after the canaries agree again

    noisy = rule(change="+10%", resolve_change="+3%", resolve_for=5, lookback=30)
    base = BaselineStats(center=1.0, spread=0.10, cycles=500)
    rng = random.Random(3)
    still = [1.13 + rng.gauss(0.0, 0.10) for _ in range(120)]  # still at +13%
    changes = relative_changes(still, base)
    # Some runs of 5 cycles read inside the band: resolving on them would flap.
    assert any(median_inside_band(noisy, changes[k - 5:k]) for k in range(5, 121))
    assert not any(evaluate_rule(noisy, {}, base, pts(still[max(0, k - 30):k])).recovered
                   for k in range(1, 121))


def test_own_samples_back_scores_the_new_samples_as_the_detector_does():
    r = rule(name="p99", metric="p99_latency")
    # q0 = 1.0. 32 new samples, none above: no change is over 20 times likelier (p0 1%,
    # p1 10%: 0.9 / 0.99 per sample). 20, none above: likelier, but not decisively (a
    # noise dip of 5 cycles reads so mid-regression). One above of 32: not back.
    assert own_samples_back(r, BASE, [pooled_point(1.4, [0.9] * 4) for _ in range(8)])
    assert not own_samples_back(r, BASE, [pooled_point(1.4, [0.9] * 4) for _ in range(5)])
    assert not own_samples_back(r, BASE, [pooled_point(1.4, [0.9] * 4)] * 7
                                + [pooled_point(1.4, [0.9] * 3 + [1.5])])
    # 300 new samples (real traffic): 3 above (p0) is back, 30 (p1) is not.
    assert own_samples_back(r, BASE, [pooled_point(1.4, [0.9] * 297 + [1.5] * 3)])
    assert not own_samples_back(r, BASE, [pooled_point(1.4, [0.9] * 270 + [1.5] * 30)])
    # A cycle without samples of its own, a median, a falling rule: nothing to score.
    assert not own_samples_back(r, BASE, [pooled_point(1.4, [0.9] * 4), pts([1.4])[0]])
    assert not own_samples_back(rule(), BASE, [pooled_point(1.4, [0.9] * 4)])
    assert not own_samples_back(rule(name="p99", metric="p99_latency", change="-15%",
                                     resolve_change="-5%"), BASE, [pooled_point(0.5, [0.9])])


def test_own_samples_are_read_over_enough_cycles_to_tell():
    p99 = rule(name="p99", metric="p99_latency")  # resolve_for 3
    canaries = [pooled_point(1.4, [0.9] * 4) for _ in range(12)]
    assert own_samples_cycles(p99, canaries) == 8  # 32 canaries
    assert own_samples_cycles(p99, canaries[:7]) is None  # not enough yet
    traffic = [pooled_point(1.4, [0.9] * 300) for _ in range(6)]
    assert own_samples_cycles(p99, traffic) == 3  # resolve_for: each cycle tells
    ttft = rule(name="ttft", metric="ttft", resolve_for=1)  # p95: p1 50%, 5 samples tell
    assert own_samples_cycles(ttft, canaries) == 2
    # A cycle without samples of its own in the read, or no quantile: nothing to read.
    assert own_samples_cycles(p99, canaries[:4] + pts([1.4]) + canaries[:5]) is None
    assert own_samples_cycles(rule(), canaries) is None


def test_recovered_needs_resolve_for_cycles_inside_band_and_limits():
    r = rule()
    values = [1.3] * 5 + [1.0] * 3
    assert recovered(r, BASE, pts(values), values, relative_changes(values, BASE))
    # One stray cycle of a quiet healthy series does not hold the alert; a run still above
    # the band (median +8%) does.
    quiet = BaselineStats(center=1.0, spread=0.02, cycles=500)
    values = [1.3] * 5 + [1.0, 1.1, 1.0]
    assert recovered(r, quiet, pts(values), values, relative_changes(values, quiet))
    values = [1.3] * 5 + [1.0, 1.1, 1.08]
    assert not recovered(r, quiet, pts(values), values, relative_changes(values, quiet))
    assert not recovered(r, BASE, pts([1.0] * 2), [1.0] * 2, relative_changes([1.0] * 2, BASE))
    ceiling = rule(ceiling=2.0)
    values = [2.5, 1.0, 2.5]
    assert not recovered(ceiling, None, pts(values), values, relative_changes(values, None))


def test_recovered_pooled_asks_whether_the_canaries_came_down():
    r = rule(name="p99", metric="p99_latency")
    body = BaselineStats(center=1.0, spread=0.05, cycles=500, body=0.5)
    down = [pooled_point(1.1, [0.5] * 50) for _ in range(3)]
    still_slow = [pooled_point(1.1, [0.9] * 50) for _ in range(3)]
    # The series breached earlier: its canaries must have come down to the body.
    changes: list[float | None] = [0.3, 0.1, 0.1, 0.1]
    assert recovered(r, body, [pts([1.3])[0], *down], [1.3, 1.1, 1.1, 1.1], changes)
    assert not recovered(r, body, [pts([1.3])[0], *still_slow], [1.3, 1.1, 1.1, 1.1], changes)
    # A series that never breached is not the regression: inside the band.
    assert recovered(r, body, still_slow, [1.1] * 3, [0.1] * 3)


def test_recovered_pooled_over_the_threshold_reads_the_new_samples():
    """A pool still holding an ended regression's samples reads over the threshold for up
    to `pool` cycles; the cycles' own samples back at the body resolve it meanwhile, once
    there are enough of them to tell (8 cycles of 4 canaries)."""
    r = rule(name="p99", metric="p99_latency")
    body = BaselineStats(center=1.0, spread=0.05, cycles=500, body=0.5)
    slow = [pooled_point(2.0, [1.0, 1.1, 1.2, 1.3])] * 3
    back = [pooled_point(2.0, [0.45, 0.5, 0.55, 0.6])] * 8
    values = [2.0] * 11
    changes: list[float | None] = [1.0] * 11
    assert recovered(r, body, slow + back, values, changes)
    assert not recovered(r, body, slow + back[:7], values[:10], changes[:10])
    # Still slow: one own sample above q0 in every cycle.
    assert not recovered(r, body, slow * 4, values[:12] + [2.0], changes + [1.0])
    # Under q0 but not back at the body (a regression the slow cycles' q0 hides).
    under = [pooled_point(2.0, [0.8, 0.85, 0.9, 0.95])] * 11
    assert not recovered(r, BaselineStats(center=1.0, spread=0.05, cycles=500, body=0.5),
                         under, values, changes)


def test_run_over_reads_the_latest_cycles_own_samples_not_the_run_median():
    """A confirmation is over (late, no page) unless its latest `for` cycles still reach
    the threshold, whatever the run's median or a pooled value still holds."""
    r = rule()
    # The run's median still reads the ended slowdown; the latest 3 cycles are back.
    values = [1.0] * 10 + [1.4] * 8 + [1.0, 1.02, 1.01]
    res = evaluate_rule(r, {}, BASE, pts(values))
    assert res.fired and res.over
    assert "over: the latest cycles' own samples no longer breach" in res.reason
    # Between the band (+5%) and the threshold (+15%): outside the band, but these cycles
    # alone would confirm nothing. Over: late, no page.
    values = [1.0] * 10 + [1.4] * 8 + [1.08] * 3
    res = evaluate_rule(r, {}, BASE, pts(values))
    assert res.fired and res.over
    # Still over the threshold: not over, it pages.
    values = [1.0] * 10 + [1.4] * 8 + [1.2] * 3
    res = evaluate_rule(r, {}, BASE, pts(values))
    assert res.fired and not res.over
    # Judged while it lasts: fired, not over.
    res = evaluate_rule(r, {}, BASE, pts([1.0] * 10 + [1.4] * 8))
    assert res.fired and not res.over
    # The step on its own, on the latest cycles only.
    for latest, over in (([1.0, 1.02, 1.01], True), ([1.08] * 3, True), ([1.2] * 3, False)):
        assert run_over(r, pts(latest), relative_changes(latest, BASE), BASE, False) is over


def test_run_over_on_pooled_cycles_merges_their_own_samples():
    p99 = rule(name="p99", metric="p99_latency")
    body = BaselineStats(center=1.0, spread=0.05, cycles=500, body=0.5)
    # A pooled p99 still holding the slowdown (1.3): the cycles' own samples decide.
    came_down = [pooled_point(1.3, [0.5] * 50) for _ in range(3)]
    still_slow = [pooled_point(1.3, [0.5] * 49 + [1.5]) for _ in range(3)]
    assert run_over(p99, came_down, [0.3] * 3, body, True)
    assert not run_over(p99, still_slow, [0.3] * 3, body, True)
    # Own samples under the baseline p99 but their median well above the body: not over.
    assert not run_over(p99, [pooled_point(1.3, [0.9] * 50) for _ in range(3)], [0.3] * 3,
                        body, True)
    # A cycle without its own samples cannot say the run ended.
    assert not run_over(p99, [*came_down[:2], pts([1.3])[0]], [0.3] * 3, body, True)
    # A pooled quantile scored as a plain one (no tail): the merged own samples' quantile.
    p50 = rule()
    base = BaselineStats(center=1.0, spread=0.05, cycles=500)
    back = [pooled_point(1.3, [1.0] * 10, samples=40) for _ in range(3)]
    slow = [pooled_point(1.3, [1.3] * 10, samples=40) for _ in range(3)]
    between = [pooled_point(1.3, [1.1] * 10, samples=40) for _ in range(3)]  # +10%
    assert run_over(p50, back, [0.3] * 3, base, False)
    assert run_over(p50, between, [0.3] * 3, base, False)
    assert not run_over(p50, slow, [0.3] * 3, base, False)


def checks(**kw: object) -> Checks:
    fields: dict[str, object] = {
        "current": 1.0, "change": 0.0, "samples": 100, "pooled": False, "limit_fired": False,
        "confirmation": Confirmation(), "breaching": False, "zero_baseline": False}
    fields.update(kw)
    return Checks(**fields)  # type: ignore[arg-type]


def test_reason_names_the_numbers_of_each_outcome():
    r = rule(ceiling=2.0)
    assert reason(r, 1.0, checks()) == "p50_latency 1 within threshold (+0.0%)"
    assert reason(r, 1.0, checks(current=2.5, change=1.5, limit_fired=True)) == (
        "p50_latency 2.5 beyond absolute ceiling 2 for 3 cycles")
    assert reason(r, 1.0, checks(current=1.3, change=0.3, breaching=True,
                                 confirmation=Confirmation(statistic=2.0))) == (
        "p50_latency 1.3 breaches (+30.0%) but is not confirmed yet (CUSUM 2.0 of 14, "
        "3 cycles needed)")
    fired = Confirmation(statistic=16.0, run=(0.3, 0.3, 0.3), change=0.3, fired=True)
    assert reason(r, 1.0, checks(current=1.3, change=0.3, breaching=True,
                                 confirmation=fired)) == (
        "p50_latency 1.3 vs baseline 1 (+30.0%; median +30.0% over 3 cycles, threshold "
        "+15%), CUSUM 16.0 >= 14 over 3 cycles")
    assert "pooled over 100 samples" in reason(r, 1.0, checks(confirmation=fired, pooled=True))
    assert reason(r, 0.0, checks(change=None, zero_baseline=True)) == (
        "p50_latency 1: zero baseline, only absolute limits apply")
