"""The scheduler's probe callables: run, store, and survive a database outage."""

from __future__ import annotations

import random

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from probes.prober import Prober
from storage import make_engine, make_sessionmaker
from storage.models import ProbeRun
from tests.probes.fakes import FakeEngine


def test_down_database_delays_probe_rows(sessionmaker: sessionmaker[Session],
                                         engine: FakeEngine, suites: dict) -> None:
    down = make_engine("postgresql://postgres@127.0.0.1:1/none", connect_timeout_s=1)
    prober = Prober(engine, make_sessionmaker(down), suites, instance_id="a",
                    canaries_per_bucket=1, burst_rate_per_s=200.0, burst_duration_s=0.05,
                    burst_concurrency=2, rng=random.Random(0))
    prober.run_cycle()
    prober.run_burst()
    assert prober.pending == 2
    prober.sessions = sessionmaker  # the database is back
    prober.run_cycle("shifted")
    assert prober.pending == 0 and prober.dropped == 0
    with sessionmaker() as s:
        runs = s.scalars(select(ProbeRun).order_by(ProbeRun.id)).all()
    assert [(r.kind, r.suite) for r in runs] == [
        ("cycle", "in_domain"), ("burst", "in_domain"), ("cycle", "shifted")]
    down.dispose()


def test_pending_queue_is_bounded(engine: FakeEngine, suites: dict) -> None:
    down = make_engine("postgresql://postgres@127.0.0.1:1/none", connect_timeout_s=1)
    prober = Prober(engine, make_sessionmaker(down), suites, instance_id="a",
                    canaries_per_bucket=1, pending_max=2, rng=random.Random(0))
    for _ in range(4):
        prober.run_cycle()
    assert prober.pending == 2 and prober.dropped == 2
    down.dispose()


def test_unknown_suite_names_the_setting(engine: FakeEngine, suites: dict) -> None:
    with pytest.raises(ValueError, match="probes.suite: unknown suite 'nope'"):
        Prober(engine, make_sessionmaker(make_engine("sqlite://")), suites, instance_id="a",
               suite="nope")


def test_real_traffic_recompiles_reach_sql_once(sessionmaker: sessionmaker[Session],
                                                engine: FakeEngine, suites: dict) -> None:
    from engine.protocol import FlagOverride, RuntimeFlags
    from storage.models import CompileEvent

    prober = Prober(engine, sessionmaker, suites, instance_id="a", canaries_per_bucket=1,
                    ab_share=0.0, rng=random.Random(0))
    assert prober.record_unprobed_compiles() is None  # nothing happened since the mark
    # Real traffic on exact shapes recompiles between cycles.
    for n in (5, 9, 13):
        engine.generate("x" * n, override=FlagOverride(bucketing=False))
    stored = prober.record_unprobed_compiles()
    assert stored is not None and stored.recompiles == 3
    # A cycle that recompiles stores its own event; the next sample must not repeat it.
    engine.flag_provider.set(RuntimeFlags(bucketing=False))  # type: ignore[attr-defined]
    cycle = prober.run_cycle()
    assert cycle.compile is not None and cycle.compile.recompiles > 0
    assert prober.record_unprobed_compiles() is None
    with sessionmaker() as s:
        events = s.scalars(select(CompileEvent).order_by(CompileEvent.id)).all()
    assert [(e.run_id is None, e.recompiles) for e in events] == [
        (True, 3), (False, cycle.compile.recompiles)]
