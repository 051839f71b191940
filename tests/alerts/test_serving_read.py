"""One evaluation reads the cohorts the instances serve once: the rollout check (its
window) and the incidents (an hour) share the read (alerts.cohorts.ServingCohorts)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, event
from sqlalchemy.orm import Session, sessionmaker

from alerts.cohorts import ServingCohorts
from alerts.evaluator import EvaluationOptions, evaluate
from alerts.incidents import group
from alerts.lifecycle import Lifecycle, fingerprint, open_alerts
from alerts.rule_file import parse_rule
from alerts.rules import RuleResult
from storage.models import Incident
from storage.queries.runs import serving_cohorts
from tests.alerts.builders import add_cycle

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
P99 = parse_rule({"name": "p99", "metric": "p99_latency", "change": "+15%",
                  "min_samples": 2, "severity": "page"})
RECOMPILES = parse_rule({"name": "recompiles_per_hour", "metric": "recompiles_per_hour",
                         "change": "+50%", "per": ["instance"], "severity": "page"})


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


@pytest.fixture
def serving_reads(db_engine: Engine) -> Iterator[list[str]]:
    """Record the statements that read each instance's latest canary cycle."""
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        flat = " ".join(statement.lower().split())
        if "max(probe_runs.started_at) as at" in flat:
            seen.append(statement)

    event.listen(db_engine, "before_cursor_execute", record)
    yield seen
    event.remove(db_engine, "before_cursor_execute", record)


def open_incident(s: Session, now: datetime) -> None:
    """Fire a recompile alert on i1 (pending, then firing) and group it: an open incident
    whose cause is unknown, measured again (its scope read) on each evaluation."""
    labels = {"instance": "i1"}
    life = Lifecycle(s, now, per_alert=False)
    life.apply(RECOMPILES, RuleResult(RECOMPILES.name, labels, 1.0, 3.0, 2.0, 0.5, False,
                                      "pending", breaching=True, severity="page"), None)
    current = open_alerts(s)[fingerprint(RECOMPILES.name, labels)]
    life.apply(RECOMPILES, RuleResult(RECOMPILES.name, labels, 1.0, 3.0, 2.0, 0.5, True,
                                      "fired", breaching=True, severity="page"), current)
    group(s, now, life)


def test_one_evaluation_reads_the_serving_cohorts_once(
        sessionmaker: sessionmaker[Session], serving_reads: list[str]) -> None:
    with sessionmaker.begin() as s:
        for i in range(10):
            add_cycle(s, at(i), {"64": 0.1}, instance="i1")
            add_cycle(s, at(i), {"64": 0.1}, instance="i2", model_version="m2")
        open_incident(s, at(9))
    with sessionmaker() as s:
        [inc] = s.query(Incident).all()
        assert inc.state == "open" and inc.cause == "unknown"
    serving_reads.clear()
    with sessionmaker.begin() as s:
        report = evaluate(s, EvaluationOptions([P99, RECOMPILES]), at(10))
    assert not report.errors
    with sessionmaker() as s:
        [inc] = s.query(Incident).all()
    # Both asked (the rollout check every evaluation, the incident measured again), one read.
    assert inc.cohorts == ["m1/c1"] and len(serving_reads) == 1


def test_each_lookback_is_answered_as_its_own_read_would(
        sessionmaker: sessionmaker[Session], serving_reads: list[str]) -> None:
    with sessionmaker.begin() as s:
        add_cycle(s, at(0), {"64": 0.1}, instance="i1")
        add_cycle(s, at(40), {"64": 0.1}, instance="i1", model_version="m2")
        add_cycle(s, at(20), {"64": 0.1}, instance="i2")
    now = at(60)
    with sessionmaker() as s:
        expected = {lookback: serving_cohorts(s, now - timedelta(seconds=lookback), now)
                    for lookback in (1800.0, 3600.0, 7200.0)}
        serving_reads.clear()
        cohorts = ServingCohorts(s, now, 3600.0)
        assert cohorts.within(1800.0) == expected[1800.0] == {"i1": ("m2", "c1")}
        assert cohorts.within(3600.0) == expected[3600.0]
        assert len(serving_reads) == 1
        # A longer lookback than read: read again, once.
        assert cohorts.within(7200.0) == expected[7200.0]
        assert cohorts.within(1800.0) == expected[1800.0]
        assert len(serving_reads) == 2
