"""The scheduled evaluation's two phases: scoring holds no write lock, the write phase
moves alerts from their stored state (alerts.evaluator.evaluate_split)."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session, sessionmaker

from alerts.baselines import BaselineConfig
from alerts.evaluator import EvaluationOptions, Scoring, evaluate_split
from storage.db import make_engine, make_sessionmaker
from storage.models import Alert, Baseline, ProbeRun
from tests.alerts.builders import add_cycle
from tests.alerts.test_evaluator import RULE, TARGET, fill, minute

OPTIONS = EvaluationOptions([RULE], targets=[TARGET], baseline_config=BaselineConfig(warm_in_s=0))


def _other(engine: Engine) -> sessionmaker[Session]:
    """Return sessions on a second engine that does not wait for a lock (SQLite: busy 0)."""
    return make_sessionmaker(make_engine(engine.url, busy_timeout_s=0.0))


def _at(i: int):
    return minute(i) + timedelta(seconds=30)


def test_another_connection_writes_while_the_evaluation_scores(
        db_engine: Engine, sessionmaker: sessionmaker[Session]) -> None:
    fill(sessionmaker, 0, 40, 0.1)
    other = _other(db_engine)
    seen: list[Scoring] = []

    def write_meanwhile(scoring: Scoring) -> None:
        # BEGIN IMMEDIATE, an insert and a commit, failing at once if a lock were held.
        with other.begin() as s:
            add_cycle(s, minute(40) + timedelta(seconds=2), {"16": 0.05, "64": 0.1})
        seen.append(scoring)

    try:
        report = evaluate_split(sessionmaker, OPTIONS, _at(40), scored=write_meanwhile)
    finally:
        other.kw["bind"].dispose()
    # The scoring had computed the rule's baselines before the write ran, and stored them.
    assert [sorted(s.per_rule) for s in seen] == [["p99"]]
    assert seen[0].writes.rows and report.errors == ()
    assert {r.labels["bucket"] for r in report.results} == {"16", "64"}
    with sessionmaker() as s:
        assert s.scalar(select(Baseline.id).where(Baseline.active).limit(1)) is not None
        assert len(s.scalars(select(ProbeRun)).all()) == 41  # the write went through


def test_the_write_phase_moves_alerts_from_their_stored_state(
        db_engine: Engine, sessionmaker: sessionmaker[Session]) -> None:
    fill(sessionmaker, 0, 40, 0.1)
    evaluate_split(sessionmaker, OPTIONS, _at(40))
    fill(sessionmaker, 40, 50, 0.13)  # +30% in bucket 64
    for i in range(41, 44):
        evaluate_split(sessionmaker, OPTIONS, _at(i))
    with sessionmaker() as s:
        (alert,) = s.scalars(select(Alert)).all()
        assert alert.state == "firing"
    other = _other(db_engine)
    resolved_at = _at(44) - timedelta(seconds=10)

    def resolve_meanwhile(scoring: Scoring) -> None:
        # Another writer resolves the alert after the scoring read it as firing.
        with other.begin() as s:
            s.execute(update(Alert).where(Alert.id == alert.id)
                      .values(state="resolved", resolved_at=resolved_at))

    try:
        report = evaluate_split(sessionmaker, OPTIONS, _at(44), scored=resolve_meanwhile)
    finally:
        other.kw["bind"].dispose()
    assert report.errors == ()
    with sessionmaker() as s:
        stored = s.get(Alert, alert.id)
        assert stored is not None
        # Not written back as firing from what the read phase saw.
        assert (stored.state, stored.resolved_at) == ("resolved", resolved_at)
    # Judged from the stored state: its detector restarts after that resolution, so this
    # evaluation neither moves the old alert nor fires again on the run that fired it.
    assert [t for t in report.transitions if t.alert_id == alert.id] == []
    assert not any(r.fired for r in report.results)


def test_a_warming_baseline_is_stored_once_per_cycle_not_per_evaluation(
        sessionmaker: sessionmaker[Session]) -> None:
    # 5 cycles < RULE.min_baseline_cycles (20): warming in, refreshed as cycles end.
    fill(sessionmaker, 0, 7, 0.1)

    def rows() -> int:
        with sessionmaker() as s:
            return len(s.scalars(select(Baseline.id)).all())

    evaluate_split(sessionmaker, OPTIONS, _at(5))
    first = rows()
    assert first > 0
    # Evaluations every few seconds within the same cycle store nothing new.
    for seconds in (35, 40, 50):
        evaluate_split(sessionmaker, OPTIONS, minute(5) + timedelta(seconds=seconds))
    assert rows() == first
    evaluate_split(sessionmaker, OPTIONS, _at(6))  # cycle 5 ended: one more cycle to rest on
    assert rows() == 2 * first
