"""Evaluation cost: the reads of a steady evaluation do not grow with rules or scopes.

Every shipped rule reads its detector window from one row set per kind (alerts.series
RowCache), and the stored baselines, chunked hours and resolved alerts every rule needs
are read once per evaluation. Per-rule or per-bucket reads would make the SELECT count
grow with the rules or the buckets; this counts them on the real evaluator.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.orm import Session, sessionmaker

from alerts.baselines import BaselineConfig
from alerts.evaluator import EvaluationOptions, EvaluationReport, evaluate
from alerts.policy import load_policy
from alerts.rule_file import load_rules
from alerts.rules import Rule
from tests.alerts.builders import add_cycle, add_traffic

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
MINUTES = 40
# Everything chunked on the first evaluation; no refresh due on the second.
CONFIG = BaselineConfig(refresh_s=1e9, warm_in_s=0, backfill_hours=24)


def _rules(copies: int) -> list[Rule]:
    """Return the shipped rules `copies` times (renamed), on a 2-hour baseline window."""
    return [dataclasses.replace(r, name=f"{r.name}_{i}" if i else r.name,
                                baseline_window_s=7200.0, min_baseline_cycles=1)
            for i in range(copies) for r in load_rules()]


def _fill(sm: sessionmaker[Session], buckets: list[str]) -> None:
    rng = random.Random(0)
    with sm.begin() as s:
        for i in range(MINUTES):
            at = T0 + timedelta(minutes=i)
            add_cycle(s, at + timedelta(seconds=2),
                      {b: 0.05 * (1 + rng.gauss(0, 0.02)) for b in buckets})
            for b in buckets:
                add_traffic(s, at, b, latency_s=0.1 * (1 + rng.gauss(0, 0.02)))


@contextmanager
def _selects(engine: Engine) -> Iterator[list[str]]:
    seen: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            seen.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", count)


def _steady_selects(sm: sessionmaker[Session], rules: list[Rule],
                    at: int) -> tuple[int, EvaluationReport]:
    """Return the SELECTs of an evaluation a minute after a first one at minute `at`."""
    policy = load_policy()
    engine = sm.kw["bind"]
    for minute in (at, at + 1):
        with _selects(engine) as seen, sm.begin() as s:
            report = evaluate(
                s,
                EvaluationOptions(rules, policy=policy, baseline_config=CONFIG),
                T0 + timedelta(minutes=minute, seconds=30),
            )
        assert report.errors == ()
    return len(seen), report


def test_steady_evaluation_reads_do_not_grow_with_rules_or_buckets(
        sessionmaker: sessionmaker[Session]) -> None:
    _fill(sessionmaker, ["16", "64"])
    few, small = _steady_selects(sessionmaker, _rules(1), MINUTES)
    # Three times the rules over three times the buckets: the same statements.
    _fill_more(sessionmaker)
    many, big = _steady_selects(sessionmaker, _rules(3), MINUTES + 2)
    assert len(big.results) > 4 * len(small.results)  # it did judge more scopes
    assert not small.transitions and not big.transitions  # same path: nothing moved
    assert many == few, f"{few} SELECTs with 1x rules on 2 buckets, {many} with 3x on 6"
    assert few <= 40  # one per row kind and per shared read, not per rule (16 rules)


def _fill_more(sm: sessionmaker[Session]) -> None:
    """Add four more buckets over the same minutes."""
    _fill(sm, ["32", "128", "256", "512"])
