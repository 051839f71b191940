"""No page for an incident that is over: a run confirmed after its cause ended is late.

The production evaluator on canary cycles: a slowdown whose cycles the evaluation did
not judge while it lasted (the evaluation itself starved, say), confirmed only once its
cycles were back to normal, records a `late` transition and pages nobody; the same
slowdown judged while it lasts pages once.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from alerts.baselines import BaselineConfig
from alerts.evaluator import EvaluationOptions, EvaluationReport, evaluate
from alerts.rule_file import load_rules, parse_rule
from alerts.webhooks import WebhookTarget
from storage.models import Alert, AlertTransition, Incident, WebhookDelivery
from tests.alerts.builders import add_cycle, judge_minute

T0 = datetime(2026, 11, 30, 0, 0, tzinfo=UTC)
P50 = parse_rule({"name": "p50", "metric": "p50_latency", "change": "+15%",
                  "resolve_change": "+5%", "for": 3, "resolve_for": 5, "min_samples": 2,
                  "baseline_window": "6h", "pool": 1})
TARGET = WebhookTarget(name="ops", url="http://127.0.0.1:9/hook", format="generic")
HISTORY = 90


def minute(i: int) -> datetime:
    return T0 + timedelta(minutes=i)


def write(sm: sessionmaker[Session], rng: random.Random, start: int, levels: list[float],
          noise: float = 0.15) -> int:
    """Write one canary cycle per level; the default noise is a noisy host's (a normal
    cycle moves the CUSUM little)."""
    with sm.begin() as s:
        for k, level in enumerate(levels):
            factor = max(0.3, 1 + rng.gauss(0, noise))
            add_cycle(s, minute(start + k) + timedelta(seconds=2), {"64": 0.1 * level * factor})
    return start + len(levels)


def judge(sm: sessionmaker[Session], i: int) -> EvaluationReport:
    return judge_minute(sm, T0, i, P50, TARGET)


@pytest.mark.parametrize("db_kind", ["sqlite"])
def test_a_run_confirmed_after_its_cause_ended_is_late_and_pages_nobody(
        sessionmaker: sessionmaker[Session]) -> None:
    rng = random.Random(4)
    i = write(sessionmaker, rng, 0, [1.0] * HISTORY)
    judge(sessionmaker, i - 1)
    i = write(sessionmaker, rng, i, [1.8] * 8)  # not judged while it lasts
    i = write(sessionmaker, rng, i, [1.0] * 3)
    report = judge(sessionmaker, i - 1)
    moved = [(t.from_state, t.to_state) for t in report.transitions]
    assert moved == [(None, "pending"), ("pending", "late")]
    assert "over: the latest cycles' own samples no longer breach" in report.transitions[1].reason
    assert report.notifications == 0 and report.incidents.opened == ()
    with sessionmaker() as s:
        (alert,) = s.scalars(select(Alert)).all()
        assert alert.state == "resolved" and alert.fired_at is None  # it never fired
        assert s.scalars(select(WebhookDelivery)).all() == []
        assert s.scalars(select(Incident)).all() == []
        late = s.scalars(select(AlertTransition).where(AlertTransition.to_state == "late")).one()
        assert late.alert_id == alert.id
    # The detector restarts after the late run: the next cycles do not confirm it again
    # (a noisy cycle may open a pending alert; none fires or is late).
    later = []
    for _ in range(5):
        i = write(sessionmaker, rng, i, [1.0])
        later += [t.to_state for t in judge(sessionmaker, i - 1).transitions]
    assert "late" not in later and "firing" not in later


@pytest.mark.parametrize("db_kind", ["sqlite"])
def test_the_same_slowdown_judged_while_it_lasts_pages_once(
        sessionmaker: sessionmaker[Session]) -> None:
    rng = random.Random(4)
    i = write(sessionmaker, rng, 0, [1.0] * HISTORY)
    judge(sessionmaker, i - 1)
    states = []
    for _ in range(8):
        i = write(sessionmaker, rng, i, [1.8])
        states += [t.to_state for t in judge(sessionmaker, i - 1).transitions]
    assert "firing" in states and "late" not in states
    with sessionmaker() as s:
        sent = s.scalars(select(WebhookDelivery)).all()
        assert [d.payload["status"] for d in sent] == ["firing"]
        assert sent[0].payload["kind"] == "incident"


@pytest.mark.parametrize("db_kind", ["sqlite"])
def test_a_pooled_p99_still_holding_an_ended_slowdown_is_late(
        sessionmaker: sessionmaker[Session]) -> None:
    """The shipped p99 rule pools 25 cycles of 4 canaries: the pool keeps the slow ones."""
    shipped = next(r for r in load_rules() if r.name == "p99_latency_regression")
    rng = random.Random(7)

    def cycles(start: int, levels: list[float]) -> int:
        with sessionmaker.begin() as s:
            for k, level in enumerate(levels):
                add_cycle(s, minute(start + k) + timedelta(seconds=2),
                          {"64": 0.1 * level * (1 + rng.gauss(0, 0.03))}, count=4)
        return start + len(levels)

    def run(i: int) -> EvaluationReport:
        with sessionmaker.begin() as s:
            return evaluate(
                s,
                EvaluationOptions(
                    [shipped], targets=[TARGET], baseline_config=BaselineConfig(warm_in_s=0)
                ),
                minute(i) + timedelta(seconds=30),
            )

    i = cycles(0, [1.0] * 120)
    run(i - 1)
    i = cycles(i, [2.0] * 8)  # not judged while it lasts
    i = cycles(i, [1.0] * 4)  # the 4th is still running when judged: 3 finished ones
    report = run(i - 1)
    assert [t.to_state for t in report.transitions] == ["pending", "late"], [
        t.reason for t in report.transitions]
    assert report.notifications == 0


@pytest.mark.parametrize(("latest", "paged"), [(1.10, False), (1.25, True)])
@pytest.mark.parametrize("db_kind", ["sqlite"])
def test_the_latest_cycles_must_reach_the_threshold_not_only_leave_the_band(
        sessionmaker: sessionmaker[Session], latest: float, paged: bool) -> None:
    """The rule (+15%, band +5%) confirms on a run still holding an unjudged slowdown.
    Its latest 3 cycles at +10% (outside the band, short of the threshold: they alone
    would confirm nothing) are late and page nobody; at +25% they still breach: a page."""
    rng = random.Random(9)
    i = write(sessionmaker, rng, 0, [1.0] * HISTORY, noise=0.02)
    judge(sessionmaker, i - 1)
    i = write(sessionmaker, rng, i, [1.8] * 8, noise=0.02)  # not judged while it lasts
    i = write(sessionmaker, rng, i, [latest] * 3, noise=0.02)
    report = judge(sessionmaker, i - 1)
    assert [t.to_state for t in report.transitions] == (
        ["pending", "firing"] if paged else ["pending", "late"]), [
        t.reason for t in report.transitions]
    with sessionmaker() as s:
        sent = s.scalars(select(WebhookDelivery)).all()
        (alert,) = s.scalars(select(Alert)).all()
        assert [d.payload["status"] for d in sent] == (["firing"] if paged else [])
        assert (alert.fired_at is not None) is paged
        assert len(s.scalars(select(Incident)).all()) == int(paged)
