"""One page per incident: the production evaluator, lifecycle and outbox on SQLite.

Issue 14 finding 1: when a regression ended, the CUSUM and the run median still showed it
while the last cycles were inside the hysteresis band, so the alert resolved and re-fired
every few cycles (5 alerts and 10 webhooks for one 15-minute shift).
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from alerts.baselines import BaselineConfig
from alerts.evaluator import EvaluationOptions, evaluate
from alerts.rule_file import parse_rule
from alerts.webhooks import WebhookTarget
from storage.models import Alert, WebhookDelivery
from tests.alerts.builders import add_cycle

T0 = datetime(2026, 11, 30, 0, 0, tzinfo=UTC)
# The shipped canary p99 rule's thresholds and cycle counts.
RULE = parse_rule({"name": "p99", "metric": "p99_latency", "change": "+15%",
                   "resolve_change": "+5%", "for": 3, "resolve_for": 5, "min_samples": 2,
                   "baseline_window": "6h", "severity": "page"})
TARGET = WebhookTarget(name="ops", url="http://127.0.0.1:9/hook", format="alertmanager")
HISTORY = 120  # quiet cycles before the first evaluation


def minute(i: int) -> datetime:
    return T0 + timedelta(minutes=i)


class Replay:
    """One noisy canary cycle per minute, then the scheduled evaluation just after it."""

    def __init__(self, sm: sessionmaker[Session], seed: int) -> None:
        self.sm = sm
        self.rng = random.Random(seed)
        self.i = 0
        with sm.begin() as s:
            for _ in range(HISTORY):
                self._add(s, 1.0)

    def _add(self, s: Session, level: float) -> None:
        noise = max(0.2, 1 + self.rng.gauss(0, 0.10))
        add_cycle(s, minute(self.i) + timedelta(seconds=2), {"64": 0.1 * level * noise})
        self.i += 1

    def step(self, level: float = 1.0, cycles: int = 1) -> None:
        for _ in range(cycles):
            with self.sm.begin() as s:
                self._add(s, level)
            with self.sm.begin() as s:
                evaluate(
                    s,
                    EvaluationOptions(
                        [RULE], targets=[TARGET], baseline_config=BaselineConfig(warm_in_s=0)
                    ),
                    minute(self.i) + timedelta(seconds=30),
                )


def pages(sm: sessionmaker[Session]) -> tuple[int, list[str]]:
    with sm() as s:
        fired = s.scalars(select(Alert).where(Alert.fired_at.is_not(None))).all()
        sent = s.scalars(select(WebhookDelivery).order_by(WebhookDelivery.id)).all()
        return len(fired), [d.payload["status"] for d in sent]


@pytest.mark.parametrize("db_kind", ["sqlite"])
@pytest.mark.parametrize("seed", [1, 3])
def test_a_15_minute_shift_pages_once_and_resolves_once(sessionmaker: sessionmaker[Session],
                                                        seed: int) -> None:
    replay = Replay(sessionmaker, seed)
    replay.step(cycles=10)
    start = replay.i
    replay.step(1.3, 15)
    replay.step(cycles=120)  # 10% noise against a +5% band: resolving takes a while
    assert pages(sessionmaker) == (1, ["firing", "resolved"])
    with sessionmaker() as s:
        (alert,) = s.scalars(select(Alert).where(Alert.fired_at.is_not(None))).all()
        assert alert.state == "resolved"
        assert minute(start) < alert.fired_at < minute(start + 15)
        assert alert.resolved_at > minute(start + 15)


@pytest.mark.parametrize("db_kind", ["sqlite"])
@pytest.mark.parametrize("seed", [2])
def test_a_shift_that_comes_back_after_10_cycles_pages_twice(sessionmaker: sessionmaker[Session],
                                                             seed: int) -> None:
    replay = Replay(sessionmaker, seed)
    replay.step(cycles=10)
    replay.step(1.3, 15)
    for _ in range(120):
        replay.step()
        if pages(sessionmaker)[1] == ["firing", "resolved"]:
            break
    assert pages(sessionmaker) == (1, ["firing", "resolved"])
    replay.step(cycles=10)
    replay.step(1.3, 15)
    replay.step(cycles=120)
    assert pages(sessionmaker) == (2, ["firing", "resolved", "firing", "resolved"])


PER_INSTANCE = parse_rule({"name": "p99_instance", "metric": "p99_latency", "change": "+15%",
                           "resolve_change": "+5%", "per": ["instance"], "for": 3,
                           "min_samples": 2, "baseline_window": "6h", "severity": "page"})


def test_alerts_of_an_instance_that_stopped_reporting_resolve_as_stale(
        sessionmaker: sessionmaker[Session]) -> None:
    rng = random.Random(5)

    def tick(i: int, instances: dict[str, float]) -> list:
        with sessionmaker.begin() as s:
            for inst, level in instances.items():
                add_cycle(s, minute(i) + timedelta(seconds=2),
                          {"64": 0.1 * level * (1 + rng.gauss(0, 0.02))}, instance=inst)
        with sessionmaker.begin() as s:
            return list(
                evaluate(
                    s,
                    EvaluationOptions(
                        [PER_INSTANCE],
                        targets=[TARGET],
                        baseline_config=BaselineConfig(warm_in_s=0),
                        stale_after_s=600,
                    ),
                    minute(i + 1) + timedelta(seconds=30),
                ).transitions
            )

    for i in range(40):
        tick(i, {"i1": 1.0, "i2": 1.0})
    for i in range(40, 46):
        tick(i, {"i1": 1.5, "i2": 1.0})  # i1 regresses, then dies (OOM-killed)
    with sessionmaker() as s:
        (alert,) = s.scalars(select(Alert).where(Alert.fired_at.is_not(None))).all()
        assert alert.labels == {"instance": "i1"} and alert.state == "firing"
    stale_at = None
    for i in range(46, 60):
        moved = tick(i, {"i2": 1.0})
        if moved:
            assert [(t.to_state, t.labels) for t in moved] == [("resolved", {"instance": "i1"})]
            assert moved[0].reason.startswith("stale: instance i1 has not reported")
            stale_at = i
    # Last row at 45:02; the evaluation at 55:30 is the first more than 600 s later.
    assert stale_at == 54
    assert pages(sessionmaker) == (1, ["firing", "resolved"])
