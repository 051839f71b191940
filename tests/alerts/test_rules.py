"""Rules and change detection on hand-built per-cycle series."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from alerts.detection import BaselineStats, Cusum, cusum_path
from alerts.errors import RuleError
from alerts.rule_file import load_rules, parse_rule
from alerts.rules import Point, Rule, RuleResult, evaluate_rule

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
BASE = BaselineStats(center=1.0, spread=0.05, cycles=500)


def pts(values: list[float | None], samples: int = 100) -> list[Point]:
    return [Point(T0 + timedelta(minutes=i), v, samples if v is not None else 0)
            for i, v in enumerate(values)]


def p99_rule(**kw: object) -> Rule:
    raw = {"name": "p99", "metric": "p99_latency", "change": "+15%", "resolve_change": "+5%",
           "for": 3, "resolve_for": 3, "min_samples": 2}
    raw.update(kw)
    return parse_rule(raw)


def run(rule: Rule, values: list[float | None], base: BaselineStats | None = BASE
        ) -> list[RuleResult]:
    """Evaluate the rule after each cycle, as the scheduler would."""
    series = pts(values)
    return [evaluate_rule(rule, {"bucket": "64"}, base, series[: i + 1])
            for i in range(len(series))]


def test_single_spike_never_fires_anywhere_in_the_series():
    rule = p99_rule()
    for at in range(0, 20):
        values = [1.0] * 20
        values[at] = 50.0  # a 50x outlier: one GC pause, one noisy neighbour
        results = run(rule, values)
        assert not any(r.fired for r in results), at
        assert results[at].breaching  # it is noticed (pending), just never confirmed


def test_single_spike_never_fires_even_with_for_2_and_prior_noise():
    # Noise just under the threshold charges the CUSUM; one spike must still not confirm,
    # nor two in a row (one cycle adds at most h / min_cycles).
    rule = p99_rule(**{"for": 2})
    assert not any(r.fired for r in run(rule, [1.12, 1.0, 1.13, 1.0, 9.0, 1.0]))
    assert not any(r.fired for r in run(rule, [1.0, 1.0, 9.0, 9.0, 1.0, 1.0]))


def test_sustained_20_percent_fires_after_for_cycles():
    rule = p99_rule()
    results = run(rule, [1.0] * 10 + [1.2] * 5)
    fired_at = [i for i, r in enumerate(results) if r.fired]
    assert fired_at[0] == 12  # the third cycle of the shift (for: 3, min_cycles: 3)
    first = results[12]
    assert first.relative_change == pytest.approx(0.2)
    assert first.threshold == pytest.approx(0.15)
    assert first.baseline == 1.0 and first.current == pytest.approx(1.2)
    assert "CUSUM" in first.reason
    assert results[10].breaching and not results[10].fired
    assert results[11].breaching and not results[11].fired


def test_noisy_series_waits_for_more_evidence():
    # Spread 0.15: +20% is 1.3 sigma per cycle, so two cycles are not proof yet.
    noisy = BaselineStats(center=1.0, spread=0.15, cycles=500)
    results = run(p99_rule(), [1.0] * 10 + [1.2] * 25, noisy)
    fired_at = [i for i, r in enumerate(results) if r.fired]
    # Each +20% cycle is worth 0.15 * (0.2 - 0.075) / 0.15**2 = 0.83 of h = 14.
    assert fired_at and 10 + 15 <= fired_at[0] <= 10 + 18


def test_below_threshold_shift_never_fires():
    # +10% charges the CUSUM (it is above threshold/2), but its median stays under +15%.
    results = run(p99_rule(), [1.0] * 10 + [1.1, 1.16, 1.1, 1.05] * 12)
    assert not any(r.fired for r in results)
    assert results[-1].statistic >= p99_rule().cusum.h


def test_hysteresis_resolves_once_the_last_resolve_for_cycles_sit_inside_band():
    rule = p99_rule()
    values = [1.0] * 5 + [1.3] * 4 + [1.1] * 4 + [1.02] * 3
    results = run(rule, values)
    assert results[8].fired
    # +10%: under the firing threshold, above the +5% resolve band: not recovered.
    assert not any(r.recovered for r in results[9:13])
    # On this series' noise (spread 5%) a median at the band reads 4 cycles
    # (recovery_cycles); one at +2%, 13% under the threshold, is told by 3 (median_back:
    # 3 x 1.2533 x 5% / sqrt(3) = 10.9%), one of them still at +10%.
    assert not results[13].recovered  # the last 3's median +10%
    assert results[14].recovered  # the last 3's median +2%


def test_down_direction_acceptance_drop():
    rule = parse_rule({"name": "acc", "metric": "acceptance_rate", "source": "traffic",
                       "change": "-20%", "for": 2})
    base = BaselineStats(center=0.8, spread=0.02, cycles=100)
    results = run(rule, [0.8] * 5 + [0.5] * 3, base)
    assert [r.fired for r in results[5:]] == [False, False, True]
    assert results[7].relative_change == pytest.approx(-0.375)
    # A rise in acceptance is good news, never an alert.
    assert not any(r.fired or r.breaching for r in run(rule, [0.8] * 5 + [1.0] * 5, base))


def test_zero_baseline_uses_only_absolute_limits():
    zero = BaselineStats(center=0.0, spread=0.0, cycles=100)
    plain = parse_rule({"name": "fail", "metric": "probe_failures", "change": "+100%"})
    results = run(plain, [0.0] * 5 + [0.5] * 5, zero)
    assert all(r.relative_change is None for r in results)
    assert not any(r.fired for r in results)
    assert "zero baseline" in results[-1].reason
    capped = parse_rule({"name": "fail", "metric": "probe_failures", "change": "+100%",
                         "ceiling": 0.2, "for": 2})
    results = run(capped, [0.0] * 5 + [0.5] * 3, zero)
    assert [r.fired for r in results[5:]] == [False, True, True]
    assert "ceiling 0.2" in results[6].reason


def test_absolute_floor_fires_without_baseline():
    rule = parse_rule({"name": "acc", "metric": "acceptance_rate", "change": "-20%",
                       "floor": 0.3, "for": 2})
    results = run(rule, [0.2, 0.2], base=None)
    assert results[1].fired and results[1].baseline is None


def test_empty_window_and_sparse_cycle_are_no_data():
    rule = p99_rule()
    assert evaluate_rule(rule, {}, BASE, []).no_data
    r = evaluate_rule(rule, {}, BASE, pts([1.3, 1.3, None]))
    assert r.no_data and not r.fired and "empty window" in r.reason
    few = [Point(T0, 1.3, 8), Point(T0 + timedelta(minutes=1), 1.3, 1)]  # 1 < min_samples 2
    assert evaluate_rule(rule, {}, BASE, few).no_data


def test_baseline_warming_in_is_quiet():
    young = BaselineStats(center=1.0, spread=0.05, cycles=5)
    results = run(p99_rule(), [2.0] * 6, young)
    assert all(r.no_data and not r.fired for r in results)
    assert "warming in" in results[-1].reason


def test_cusum_cap_keeps_one_cycle_below_h():
    with pytest.raises(ValueError, match="min_cycles"):
        Cusum(min_cycles=1)
    c = Cusum()
    path = cusum_path([1e9, 1e9, 1e9], c)
    assert path[0] < c.h and path[1] < c.h and path[2] >= c.h
    assert cusum_path([1e9, -1e9], c)[1] == 0.0


def test_robust_baseline_ignores_outliers():
    rng = random.Random(1)
    values = [1.0 + rng.gauss(0, 0.05) for _ in range(200)] + [30.0] * 5
    b = BaselineStats.of(values)
    assert b is not None and b.center == pytest.approx(1.0, abs=0.02)
    assert b.spread == pytest.approx(0.05, rel=0.3)


@pytest.mark.parametrize(("patch", "field"), [
    ({"metric": "p42"}, "metric"),
    ({"change": "15%"}, "change"),
    ({"change": "+0%"}, "change"),
    ({"resolve_change": "-5%"}, "resolve_change"),
    ({"resolve_change": "+20%"}, "resolve_change"),
    ({"for": 1}, "for"),
    ({"per": ["region"]}, "per"),
    ({"source": "burst"}, "source"),
    ({"severity": "urgent"}, "severity"),
    ({"window": "soon"}, "window"),
    ({"ceiling": "high"}, "ceiling"),
    ({"colour": "red"}, "colour"),
    ({"cusum": {"min_cycles": 1}}, "cusum"),
    ({"cusum": {"k": 0.5}}, "cusum"),
])
def test_invalid_rules_name_the_rule_and_field(patch: dict, field: str):
    raw = {"name": "p99", "metric": "p99_latency", "change": "+15%", **patch}
    with pytest.raises(RuleError) as info:
        parse_rule(raw, "user.yaml")
    assert info.value.field == field
    assert "rule 'p99'" in str(info.value) and "user.yaml" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_shipped_rules_load_and_user_file_overrides(tmp_path: Path):
    shipped = {r.name: r for r in load_rules()}
    assert shipped["p99_latency_regression"].threshold == pytest.approx(0.15)
    assert shipped["acceptance_drop"].direction == -1
    user = tmp_path / "rules.yaml"
    user.write_text("rules:\n  - name: p99_latency_regression\n    metric: p99_latency\n"
                    "    change: '+30%'\n  - name: mine\n    metric: ttft\n    change: '+50%'\n")
    merged = {r.name: r for r in load_rules(str(user))}
    assert merged["p99_latency_regression"].threshold == pytest.approx(0.30)
    assert "mine" in merged and len(merged) == len(shipped) + 1
    user.write_text("rules:\n  - name: a\n    metric: ttft\n    change: '+5%'\n"
                    "  - name: a\n    metric: ttft\n    change: '+5%'\n")
    with pytest.raises(RuleError, match="defined twice"):
        load_rules(str(user))
    with pytest.raises(RuleError, match="does not exist"):
        load_rules(str(tmp_path / "missing.yaml"))
