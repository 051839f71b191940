"""A series too noisy for its band resolves once its detector's window is read, not never.

The production evaluator, judged between cycle boundaries as the service judges: a
lookback window then holds one finished cycle fewer than the lookback (its oldest cycle
was unfinished at the window's start). Recovery on a noisy plain series reads as many
cycles as its noise needs, at most the window; asked for the lookback itself it waited
for a cycle the window never holds, and the alert (and its incident) stayed open after
its cause ended (bench.incidents --service: host-wide 2x, noise as recorded).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from alerts.detection import BaselineStats
from alerts.evaluator import EvaluationReport
from alerts.rule_file import parse_rule
from alerts.rules import recovery_cycles
from alerts.webhooks import WebhookTarget
from storage.models import Alert, Incident, WebhookDelivery
from storage.queries.baselines import active_baselines
from tests.alerts.builders import add_cycle, judge_minute

T0 = datetime(2026, 11, 30, 0, 0, tzinfo=UTC)
LOOKBACK = 12
P50 = parse_rule({"name": "p50", "metric": "p50_latency", "change": "+15%",
                  "resolve_change": "+5%", "for": 3, "resolve_for": 5, "min_samples": 2,
                  "baseline_window": "6h", "pool": 1, "lookback": LOOKBACK})
TARGET = WebhookTarget(name="ops", url="http://127.0.0.1:9/hook", format="generic")
# A noisy host's cycles, repeating: median 1.0, robust spread about 15%.
NOISE = [1.0, 1.2, 0.8, 1.1, 0.9]
HISTORY = 120


def minute(i: int) -> datetime:
    return T0 + timedelta(minutes=i)


def write(sm: sessionmaker[Session], start: int, levels: list[float]) -> int:
    with sm.begin() as s:
        for k, level in enumerate(levels):
            i = start + k
            add_cycle(s, minute(i) + timedelta(seconds=2),
                      {"64": 0.1 * level * NOISE[i % len(NOISE)]})
    return start + len(levels)


def judge(sm: sessionmaker[Session], i: int) -> EvaluationReport:
    return judge_minute(sm, T0, i, P50, TARGET)


@pytest.mark.parametrize("db_kind", ["sqlite", "postgresql"])
def test_a_noisy_series_resolves_after_its_window_once_its_cause_ended(
        sessionmaker: sessionmaker[Session]) -> None:
    i = write(sessionmaker, 0, [1.0] * HISTORY)
    judge(sessionmaker, i)
    with sessionmaker() as s:
        [base] = [b for b in active_baselines(s, "p50_latency") if b.spread is not None]
    # The series is noisy enough that recovery reads the whole lookback.
    assert recovery_cycles(P50, BaselineStats(base.value, base.spread, base.samples)) == LOOKBACK
    states: list[tuple[int, str | None, str]] = []
    for level in [1.8] * 6 + [1.0] * (3 * LOOKBACK):
        i = write(sessionmaker, i, [level])
        states += [(i, t.from_state, t.to_state) for t in judge(sessionmaker, i).transitions]
    end = HISTORY + 6
    fired = [at for at, _, state in states if state == "firing"]
    # (A noisy cycle may open a pending alert that resolves unconfirmed: no page.)
    resolved = [at for at, was, state in states if was == "firing" and state == "resolved"]
    assert len(fired) == 1 and fired[0] <= end, states
    # Resolved once the window (LOOKBACK - 1 finished cycles) since the firing is read.
    assert len(resolved) == 1 and resolved[0] <= fired[0] + LOOKBACK, states
    with sessionmaker() as s:
        (alert,) = s.scalars(select(Alert).where(Alert.fired_at.is_not(None))).all()
        assert alert.state == "resolved"
        (incident,) = s.scalars(select(Incident)).all()
        assert incident.state == "resolved"
        sent = s.scalars(select(WebhookDelivery).order_by(WebhookDelivery.id)).all()
        assert [d.payload["incident"]["notification"] for d in sent] == ["firing", "resolved"]
