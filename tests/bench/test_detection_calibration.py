"""bench.detection's calibration states a series' sensitivity and checks it on a replay."""

from __future__ import annotations

import random

import pytest

from alerts.detection import BaselineStats
from alerts.rule_file import load_rules
from bench.detection import calibrate, traffic_acceptance


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
