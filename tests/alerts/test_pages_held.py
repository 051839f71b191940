"""A series too young to state its false pages fires warnings, not pages, and says so; once
its estimate is made it pages (SQLite and PostgreSQL, the production configuration)."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from alerts.config import AlertsConfig, load_config
from alerts.detection import HELD_SUFFIX, NO_BASELINE, BaselineStats
from alerts.evaluator import EvaluationOptions, evaluate
from alerts.rule_file import load_rules
from alerts.rules import Point, evaluate_rule
from alerts.settings import AlertSettings
from monitor.jobs import refresh_sensitivity
from storage.models import Alert
from storage.queries import sensitivity as queries
from tests.alerts.builders import add_traffic

T0 = datetime(2026, 11, 2, tzinfo=UTC)
BUCKET = "64"


def config() -> AlertsConfig:
    """Return the shipped configuration with only the acceptance rule (severity page)."""
    c = load_config(AlertSettings())
    return replace(c, rules=tuple(r for r in c.rules if r.name == "acceptance_drop"))


def run(sm: sessionmaker[Session], quiet: int, *, job: bool,
        job_at: int | None = None) -> tuple[str, str]:
    """Store `quiet` minutes of steady traffic acceptance, then a 60% drop, evaluating each
    minute as the service does (the sensitivity job once before the drop when `job`, at
    minute `job_at`, default 2 minutes before the drop); return the fired alert's severity
    and the reason of its firing result."""
    cfg = config()
    rng = random.Random(0)
    opts = EvaluationOptions(cfg.rules, baseline_config=cfg.baselines)
    fired: list[str] = []
    for i in range(quiet + 15):
        acceptance = 0.8 * (1 + rng.gauss(0.0, 0.02)) * (0.4 if i >= quiet else 1.0)
        with sm.begin() as s:
            add_traffic(s, T0 + timedelta(minutes=i), BUCKET, acceptance=acceptance)
        now = T0 + timedelta(minutes=i + 1, seconds=30)
        if i >= quiet - 40:
            with sm.begin() as s:
                report = evaluate(s, opts, now)
            fired += [r.reason for r in report.results if r.fired]
        if job and i == (quiet - 2 if job_at is None else job_at):
            refresh_sensitivity(sm, cfg, lambda now=now: now)  # type: ignore[misc]
    with sm() as s:
        [alert] = s.scalars(select(Alert).where(Alert.rule == "acceptance_drop")).all()
    assert fired, "the drop was not confirmed"
    return alert.severity, fired[0]


def test_a_young_series_fires_a_warning_and_says_why(sessionmaker: sessionmaker[Session]) -> None:
    # Not estimated yet: judged by its baseline's own history.
    severity, why = run(sessionmaker, 90, job=False)
    assert severity == "warning"
    assert "; pages held as warnings: insufficient history: " in why
    assert why.endswith("(not estimated yet)")


def test_an_estimate_made_before_the_baseline_was_usable_says_nothing_of_its_history(
        sessionmaker: sessionmaker[Session]) -> None:
    # The job ran at minute 8, while the baseline still warmed: its estimate
    # says "no usable baseline yet", which is no longer true once the series alerts on one.
    severity, why = run(sessionmaker, 45, job=True, job_at=8)
    with sessionmaker() as s:
        [st] = queries.listing(s)
    assert NO_BASELINE in st.reason
    assert severity == "warning"
    assert NO_BASELINE not in why and why.endswith("(not estimated yet)")


def test_the_estimate_states_the_hold_and_the_evaluation_follows_it(
        sessionmaker: sessionmaker[Session]) -> None:
    severity, why = run(sessionmaker, 90, job=True)
    with sessionmaker() as s:
        [st] = queries.listing(s)
    assert st.status == "insufficient history" and st.threshold == st.configured_threshold
    assert st.reason.endswith("; pages held as warnings until then")
    assert queries.describe(st) == f"{st.reason}; threshold -20% kept"
    assert severity == "warning"
    assert why.endswith(f"; pages held as warnings: {st.reason.removesuffix(HELD_SUFFIX)}")


def test_a_series_with_its_estimate_pages(sessionmaker: sessionmaker[Session]) -> None:
    severity, why = run(sessionmaker, 7 * 60, job=True)
    with sessionmaker() as s:
        [st] = queries.listing(s)
    assert st.status == "ok" and "held" not in st.reason
    assert severity == "page" and "held" not in why


def test_budget_off_keeps_paging_from_the_first_cycle(
        sessionmaker: sessionmaker[Session]) -> None:
    # Opted out of the budget: the configured threshold, whatever the noise, as before.
    cfg = load_config(AlertSettings(false_page_budget_per_30d=None))
    assert cfg.baselines.hold_cycles == 0 and cfg.baselines.hold_s == 0


def test_the_minimum_history_in_cycles_is_a_setting() -> None:
    cfg = load_config(AlertSettings(sensitivity_min_history_cycles=60,
                                    sensitivity_min_history_s=3600.0))
    assert cfg.sensitivity.min_history == 60 and cfg.baselines.hold_cycles == 60
    assert cfg.baselines.hold_s == 3600.0
    with pytest.raises(ValidationError, match="sensitivity_min_history_cycles"):
        AlertSettings(sensitivity_min_history_cycles=5)


def test_a_minimum_history_longer_than_the_history_read_is_refused() -> None:
    with pytest.raises(ValidationError, match="sensitivity_min_history_s"):
        AlertSettings(sensitivity_history_s=3600.0)  # 6 h asked of 1 h


def test_an_absolute_limit_still_pages_while_held() -> None:
    rule = replace({r.name: r for r in load_rules()}["acceptance_drop"], lookback_cycles=10)
    base = BaselineStats(0.8, 0.01, 100, held="insufficient history: 100 of 360 cycles")
    pts = [Point(T0 + timedelta(minutes=i), 0.1, 20) for i in range(10)]
    res = evaluate_rule(rule, {}, base, pts)
    assert res.fired and res.severity == "page"  # under the floor 0.2 for 3 cycles
    relative = evaluate_rule(replace(rule, floor=None), {}, base, pts)
    assert relative.fired and relative.severity == "warning"
    assert relative.reason.endswith(
        "; pages held as warnings: insufficient history: 100 of 360 cycles")
