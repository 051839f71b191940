"""bench.detection's calibration states a series' sensitivity and checks it on a replay."""

from __future__ import annotations

import random

import pytest

from alerts.detection import BaselineStats
from alerts.rule_file import load_rules
from bench.detection import (
    binomial_interval,
    calibrate,
    replay_within_bounds,
    traffic_acceptance,
)


@pytest.mark.slow
def test_acceptance_statement_replays_within_bounds() -> None:
    rule = {r.name: r for r in load_rules()}["acceptance_drop"]
    rng = random.Random(0)
    history = [traffic_acceptance(rng) for _ in range(600)]
    base = BaselineStats.of(history)
    assert base is not None
    est, in_force, ok, line = calibrate(rule, traffic_acceptance, 20, list(history), base,
                                        trials=200, seed=0)
    assert est.status == "ok" and not est.widened and in_force == base
    assert est.detectable_change is not None and est.detectable_change >= rule.threshold
    assert ok is True, line
    assert "within bounds" in line and "threshold -20% as configured" in line


def test_binomial_interval_is_the_exact_clopper_pearson_one() -> None:
    # Known values: 40 of 40 gives 0.025 ** (1 / 40) as its lower end; 95 of 100 the
    # textbook [0.8872, 0.9836]; none seen, the mirror image.
    low, high = binomial_interval(40, 40)
    assert low == pytest.approx(0.025 ** (1 / 40), abs=1e-6) and high == 1.0
    assert binomial_interval(95, 100) == pytest.approx((0.8872, 0.9836), abs=1e-4)
    assert binomial_interval(0, 40) == pytest.approx((0.0, 1 - 0.025 ** (1 / 40)), abs=1e-6)
    with pytest.raises(ValueError, match="hits"):
        binomial_interval(41, 40)


def test_a_calibrated_rate_seen_in_a_short_replay_is_within_bounds() -> None:
    # A statement confirmed at a true 95% shows 40 of 40 in 13% of 40-trial replays:
    # consistent with the 90-98% bounds, so not out of them.
    assert replay_within_bounds(full=40, half=4, trials=40, at_threshold=False)
    assert replay_within_bounds(full=36, half=4, trials=40, at_threshold=False)


def test_an_overclaim_or_an_undersold_half_is_out_of_bounds() -> None:
    # 30 of 40: no rate of 90% or more gives that (its interval ends at 87%).
    assert not replay_within_bounds(full=30, half=4, trials=40, at_threshold=False)
    # Stated too high: half of it is confirmed as surely as the bound asks of the whole.
    assert not replay_within_bounds(full=40, half=40, trials=40, at_threshold=False)
    # Stated too high on a long replay: 200 of 200 excludes every rate up to 98%.
    assert not replay_within_bounds(full=200, half=4, trials=200, at_threshold=False)
    # Stated at the threshold in force: the rate steps to all there, only the floor holds.
    assert replay_within_bounds(full=200, half=0, trials=200, at_threshold=True)
