"""Rows the alert tests build by hand (tests/alerts/builders) have the writers' shape.

The writers are the production path (probes.sink through the storage Writer, the traffic
recorder's flush); a hand-built row that fills a column the writer leaves empty, or
leaves empty one the writer fills, would test a shape production never writes.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import inspect, select
from sqlalchemy.orm import Session, sessionmaker

from probes.cycle import ProbeCycle
from probes.traffic import TrafficRecorder
from storage.models import ProbeResult, ProbeRun, TrafficRollup
from storage.writer import Writer
from tests.alerts import builders
from tests.probes.fakes import FakeEngine, store
from tests.probes.test_traffic import Clock, served

T0 = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)


def filled(row: Any) -> set[str]:
    """Return the names of the row's columns that hold a value (not NULL)."""
    return {c.key for c in inspect(row).mapper.column_attrs if getattr(row, c.key) is not None}


def test_hand_built_cycles_fill_the_columns_the_sink_fills(
        sessionmaker: sessionmaker[Session], suites: dict) -> None:
    cycle = ProbeCycle(FakeEngine(), suites, instance_id="a", canaries_per_bucket=2,
                       rng=random.Random(0))
    real_id = store(sessionmaker, cycle.run("in_domain"))
    with sessionmaker.begin() as s:
        run = builders.add_cycle(s, T0, {"32": 0.1})
        s.flush()
        built_id = run.id
    with sessionmaker() as s:
        real, built = s.get(ProbeRun, real_id), s.get(ProbeRun, built_id)
        assert built.kind == real.kind
        assert filled(built) == filled(real)
        real_results = s.scalars(select(ProbeResult).where(ProbeResult.run_id == real_id)).all()
        built_results = s.scalars(select(ProbeResult)
                                  .where(ProbeResult.run_id == built_id)).all()
        assert {r.variant for r in built_results} <= {r.variant for r in real_results}
        shapes = {frozenset(filled(r)) for r in real_results}
        for r in built_results:
            assert any(filled(r) == shape for shape in shapes), (
                sorted(filled(r) - min(shapes, key=lambda x: len(x ^ filled(r)))),
                sorted(min(shapes, key=lambda x: len(x ^ filled(r))) - filled(r)))


def test_hand_built_traffic_fills_the_columns_the_recorder_fills(
        sessionmaker: sessionmaker[Session]) -> None:
    rec = TrafficRecorder("replica-a", clock=Clock())
    writer = Writer(sessionmaker)
    try:
        rec.record(served())
        rec.flush(writer)
        assert writer.flush(timeout=30)
    finally:
        writer.close()
    with sessionmaker.begin() as s:
        builders.add_traffic(s, T0, "64")
    with sessionmaker() as s:
        real, built = sorted(s.scalars(select(TrafficRollup)).all(),
                             key=lambda r: r.instance_id != "replica-a")
        assert filled(built) == filled(real)
