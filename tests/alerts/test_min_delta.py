"""`min_delta`: a relative threshold of a baseline near zero is noise; a cycle must also move
by an absolute amount to breach, in the evaluation and in the sensitivity estimate alike."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from alerts.detection import BaselineStats
from alerts.errors import RuleError
from alerts.rule_file import load_rules, parse_rule
from alerts.rules import Point, Rule, evaluate_rule, with_min_delta, with_threshold
from alerts.sensitivity import SensitivityConfig, estimate

T0 = datetime(2026, 11, 30, tzinfo=UTC)
MB = 1_000_000
MIB_32 = 32 * 1024 * 1024
# A healthy process's RSS growth per hour: about 1 MB/h, give or take as much.
QUIET = BaselineStats(center=1 * MB, spread=1 * MB, cycles=500)


def memory_rule(**kw: object) -> Rule:
    return replace({r.name: r for r in load_rules()}["memory_growth"], **kw)  # type: ignore[arg-type]


def growth(values: list[float]) -> list[Point]:
    return [Point(T0 + timedelta(minutes=10 * i), v, 6) for i, v in enumerate(values)]


def healthy(n: int, mean: float, seed: int = 3) -> list[float]:
    """Growth per hour of a healthy process: `mean`, jittered by a megabyte."""
    rng = random.Random(seed)
    return [mean + rng.gauss(0.0, 1 * MB) for _ in range(n)]


def fired(rule: Rule, values: list[float]) -> bool:
    """Return whether the rule fires on some prefix of the series (as each cycle ends)."""
    pts = growth(values)
    return any(evaluate_rule(rule, {"instance": "i1"}, QUIET, pts[max(0, i - 29):i + 1]).fired
               for i in range(len(pts)))


def test_a_near_zero_baseline_breaches_on_noise_without_the_floor_only() -> None:
    # 4 MB/h against a baseline of 1 MB/h: +300%, far past +50%, and still a healthy process.
    values = healthy(30, 4 * MB)
    bare = memory_rule(min_delta=0.0)
    last = evaluate_rule(bare, {"instance": "i1"}, QUIET, growth(values))
    assert last.breaching and fired(bare, values)
    shipped = memory_rule()
    assert shipped.min_delta == MIB_32
    last = evaluate_rule(shipped, {"instance": "i1"}, QUIET, growth(values))
    assert not last.breaching and not fired(shipped, values)
    # The threshold it asks of this baseline is said, and reported as the one in force.
    floor = MIB_32 / (1 * MB)
    assert last.threshold == pytest.approx(floor)
    assert f"threshold +50% -> +{floor:.0%} (min_delta {MIB_32:g})" in last.reason
    # A leak past the floor still fires (far under the ceiling's 256 MiB/h).
    leak = healthy(10, 1 * MB) + healthy(20, 1 * MB + 2 * MIB_32, seed=4)
    assert fired(shipped, leak)


def test_the_floor_leaves_a_baseline_far_from_zero_to_the_relative_threshold() -> None:
    rule = memory_rule()
    big = BaselineStats(center=200 * MIB_32, spread=MIB_32, cycles=500)
    assert with_min_delta(rule, big) is rule  # +50% of it is far more than 32 MiB/h
    assert with_min_delta(rule, None) is rule
    assert with_min_delta(rule, replace(big, center=0.0)) is rule  # limits alone apply
    floored = with_min_delta(rule, QUIET)
    # The band keeps its share of the threshold, as a budget's widening keeps it.
    assert floored.resolve_threshold / floored.threshold \
        == pytest.approx(rule.resolve_threshold / rule.threshold)
    # Simulated thresholds (the false-page budget) keep the floor.
    assert with_threshold(rule, 0.9).min_delta == MIB_32


def wandering(n: int, seed: int, phi: float = 0.9) -> list[float]:
    """Growth per hour of a healthy process, about 1 MB/h: each cycle's trailing hour
    overlaps the last's, so it wanders (AR(1)) by a megabyte."""
    rng, x, out = random.Random(seed), 0.0, []
    for _ in range(n):
        x = phi * x + rng.gauss(0.0, 1 * MB * (1 - phi * phi) ** 0.5)
        out.append(1 * MB + x)
    return out


def test_the_sensitivity_estimate_replays_the_floor() -> None:
    # Days of a healthy process's growth, its baseline near zero: without the floor the
    # rule pages on that noise and the budget widens it; with it (the rule the evaluation
    # runs), the configured threshold pages on none of it and holds.
    values = wandering(600, seed=5)
    base = BaselineStats.of(values)
    assert base is not None
    cfg = SensitivityConfig(trials=20, cpu_s=600.0, min_history_s=3600.0)
    bare = estimate(memory_rule(min_delta=0.0), growth(values), base, cfg)
    shipped = estimate(memory_rule(), growth(values), base, cfg)
    assert bare.false_pages_configured is not None and bare.false_pages_configured > 0.5
    assert bare.threshold > 0.5 and bare.reason.startswith("threshold +50% -> ")
    assert shipped.false_pages_configured == 0.0
    assert shipped.threshold == 0.5 and shipped.reason == ""


def test_min_delta_round_trips_through_the_rule_file(tmp_path: Path) -> None:
    raw = {"name": "rss", "metric": "memory_growth", "per": ["instance"], "change": "+50%",
           "window": "10m", "min_delta": 33554432}
    assert parse_rule(raw).min_delta == MIB_32
    assert parse_rule({**raw, "min_delta": 0.5}).min_delta == 0.5
    assert parse_rule({k: v for k, v in raw.items() if k != "min_delta"}).min_delta == 0.0
    user = tmp_path / "rules.yaml"
    user.write_text("rules:\n  - name: memory_growth\n    metric: memory_growth\n"
                    "    per: [instance]\n    change: '+50%'\n    window: 10m\n"
                    "    min_delta: 16777216\n")
    mine = {r.name: r for r in load_rules(str(user))}["memory_growth"]
    assert mine.min_delta == 16 * 1024 * 1024 and mine.window_s == 600.0


@pytest.mark.parametrize("bad", [-1, "32MiB", True, float("nan"), float("inf"), None])
def test_a_bad_min_delta_names_the_field(bad: object) -> None:
    raw = {"name": "rss", "metric": "memory_growth", "change": "+50%", "min_delta": bad}
    with pytest.raises(RuleError) as info:
        parse_rule(raw, "user.yaml")
    assert isinstance(info.value, ValueError) and info.value.field == "min_delta"
    assert "user.yaml: rule 'rss': min_delta: must be a finite number >= 0" \
        in str(info.value)
