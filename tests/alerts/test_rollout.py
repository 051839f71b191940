"""Rollout analysis: Mann-Whitney U, pass / fail verdicts, the rollout_regression alert."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from alerts.baselines import BaselineConfig
from alerts.evaluator import EvaluationOptions, evaluate
from alerts.rollout import ROLLOUT_RULE, mann_whitney_p, verdict_of
from alerts.rule_file import parse_rule
from alerts.webhooks import WebhookTarget
from storage.models import Alert, WebhookDelivery
from storage.queries.series import list_verdicts
from tests.alerts.builders import add_cycle

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
RULE = parse_rule({"name": "p99", "metric": "p99_latency", "change": "+15%", "for": 3,
                   "min_samples": 2, "lookback": 10, "baseline_window": "2h",
                   "min_baseline_cycles": 20, "severity": "page"})
TARGET = WebhookTarget(name="ops", url="http://127.0.0.1:9/hook", format="alertmanager")


def test_mann_whitney_matches_the_normal_approximation_by_hand():
    new, old = list(range(11, 21)), list(range(1, 11))
    # Fully separated, n1 = n2 = 10: U = 100, mean 50, variance 10*10*21/12 = 175.
    z = (100 - 50 - 0.5) / math.sqrt(175)
    assert mann_whitney_p(new, old, +1) == pytest.approx(0.5 * math.erfc(z / math.sqrt(2)))
    assert mann_whitney_p(new, old, -1) > 0.99  # not smaller
    assert mann_whitney_p(old, new, -1) == pytest.approx(mann_whitney_p(new, old, +1))
    same = [1.0, 2.0, 2.0, 3.0] * 5
    assert mann_whitney_p(same, same, +1) > 0.4  # ties: variance corrected, no signal
    assert mann_whitney_p([1.0] * 10, [1.0] * 10, +1) == 1.0  # all tied: no variance


def test_verdicts():
    assert verdict_of(0.001, 0.5, +1, 0.15, 0.01) == "fail"
    assert verdict_of(0.001, 0.05, +1, 0.15, 0.01) == "marginal"
    assert verdict_of(0.2, 0.5, +1, 0.15, 0.01) == "marginal"
    assert verdict_of(0.2, 0.01, +1, 0.15, 0.01) == "pass"
    assert verdict_of(0.001, -0.5, -1, 0.2, 0.01) == "fail"  # a drop where lower is worse


def fill(sm: sessionmaker[Session], start: int, stop: int, p64: float, **kw: object) -> None:
    rng = random.Random(f"{start}-{kw}")
    with sm.begin() as s:
        for i in range(start, stop):
            add_cycle(s, T0 + timedelta(minutes=i, seconds=2),
                      {"64": p64 * (1 + rng.gauss(0, 0.03))}, **kw)


def evaluate_at(sm: sessionmaker[Session], i: int):
    with sm.begin() as s:
        return evaluate(
            s,
            EvaluationOptions(
                [RULE], targets=[TARGET], baseline_config=BaselineConfig(warm_in_s=0)
            ),
            T0 + timedelta(minutes=i, seconds=30),
        )


@pytest.mark.parametrize(("new_p99", "verdict"), [(0.1, "pass"), (0.2, "fail")])
def test_rollout_verdict_on_synthetic_cohorts(sessionmaker: sessionmaker[Session],
                                              new_p99: float, verdict: str):
    fill(sessionmaker, -60, 30, 0.1, model_version="v1", instance="a")
    fill(sessionmaker, 0, 30, new_p99, model_version="v2", instance="b")
    rep = evaluate_at(sessionmaker, 30)
    assert rep.errors == ()
    with sessionmaker() as s:
        (v,) = [v for v in list_verdicts(s) if v.metric == "p99_latency"]
        assert (v.new, v.old, v.bucket, v.source) == (("v2", "c1"), ("v1", "c1"), "64", "canary")
        assert v.verdict == verdict and v.new_cycles == v.old_cycles == 29  # whole cycles
        assert v.relative_change == pytest.approx(new_p99 / 0.1 - 1, abs=0.05)
        alerts = s.scalars(select(Alert).where(Alert.rule == ROLLOUT_RULE)).all()
        if verdict == "pass":
            assert v.p_value is not None and v.p_value > 0.01 and alerts == []
            return
        assert v.p_value is not None and v.p_value < 1e-6
        (a,) = alerts
        assert a.state == "firing" and a.labels == {
            "bucket": "64", "metric": "p99_latency", "source": "canary", "new": "v2/c1",
            "old": "v1/c1"}
        assert "Mann-Whitney" in a.annotations["description"]
        sent = s.scalars(select(WebhookDelivery).where(WebhookDelivery.alert_id == a.id)).all()
        assert [d.payload["status"] for d in sent] == ["firing"]
    # The new version is rolled back: only v1 serves, the rollout alert resolves (notified).
    fill(sessionmaker, 30, 62, 0.1, model_version="v1", instance="a")
    rep = evaluate_at(sessionmaker, 62)
    assert [(t.rule, t.to_state) for t in rep.transitions if t.rule == ROLLOUT_RULE] == [
        (ROLLOUT_RULE, "resolved")]
    with sessionmaker() as s:
        a = s.scalars(select(Alert).where(Alert.rule == ROLLOUT_RULE)).one()
        sent = s.scalars(select(WebhookDelivery).where(WebhookDelivery.alert_id == a.id)
                         .order_by(WebhookDelivery.id)).all()
        assert [d.payload["status"] for d in sent] == ["firing", "resolved"]


def test_a_cohort_every_instance_left_is_no_longer_judged(sessionmaker: sessionmaker[Session]):
    fill(sessionmaker, -60, 40, 0.1, model_version="v1", instance="a")
    fill(sessionmaker, 0, 30, 0.2, model_version="v2", instance="b")
    evaluate_at(sessionmaker, 30)
    with sessionmaker() as s:
        assert s.scalars(select(Alert.state).where(Alert.rule == ROLLOUT_RULE)).all() == [
            "firing"]
    # b goes back to v1: v2's 25 cycles are still in the window, but no one serves v2.
    fill(sessionmaker, 30, 35, 0.1, model_version="v1", instance="b")
    rep = evaluate_at(sessionmaker, 35)
    (moved,) = [t for t in rep.transitions if t.rule == ROLLOUT_RULE]
    assert moved.to_state == "resolved" and moved.reason.startswith("rollout over")
    with sessionmaker() as s:
        assert s.scalars(select(Alert.state).where(Alert.rule == ROLLOUT_RULE)).all() == [
            "resolved"]
