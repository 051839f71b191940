"""The scheduler's probe callables: run, store through the Writer, survive an outage."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from engine.protocol import GenerateResult
from probes.prober import Prober
from storage import make_engine, make_sessionmaker
from storage.migrate import upgrade
from storage.models import ProbeRun
from storage.writer import Writer
from tests.probes.fakes import FakeEngine


@pytest.fixture
def writer(sessionmaker: sessionmaker[Session]) -> Iterator[Writer]:
    """Return a storage Writer on the test database."""
    w = Writer(sessionmaker)
    yield w
    w.close()


def test_down_database_delays_probe_rows(tmp_path: Path, engine: FakeEngine,
                                         suites: dict) -> None:
    path = tmp_path / "later" / "tailwatch.db"  # no directory yet: every write fails
    db = make_engine(f"sqlite:///{path}", create_parent=False)
    writer = Writer(make_sessionmaker(db), initial_backoff_s=0.01, max_backoff_s=0.05)
    prober = Prober(engine, writer, suites, instance_id="a",
                    canaries_per_bucket=1, burst_rate_per_s=200.0, burst_duration_s=0.05,
                    burst_concurrency=2, rng=random.Random(0))
    try:
        prober.run_cycle()
        prober.run_burst()
        assert not writer.flush(timeout=0.3)
        assert writer.stats.pending == 2 and writer.stats.retries >= 1
        path.parent.mkdir()
        upgrade(f"sqlite:///{path}")  # the database is back
        prober.run_cycle("shifted")
        assert writer.flush(timeout=30)
        assert (writer.stats.pending, writer.stats.dropped, writer.stats.failed) == (0, 0, 0)
        with make_sessionmaker(db)() as s:
            runs = s.scalars(select(ProbeRun).order_by(ProbeRun.id)).all()
        assert [(r.kind, r.suite) for r in runs] == [
            ("cycle", "in_domain"), ("burst", "in_domain"), ("cycle", "shifted")]
    finally:
        writer.close(timeout=1)
        db.dispose()


def test_results_past_the_writer_bound_are_dropped_and_counted(
        tmp_path: Path, engine: FakeEngine, suites: dict) -> None:
    db = make_engine(f"sqlite:///{tmp_path / 'missing' / 'x.db'}", create_parent=False)
    writer = Writer(make_sessionmaker(db), max_pending=2, initial_backoff_s=0.01,
                    max_backoff_s=0.05)
    prober = Prober(engine, writer, suites, instance_id="a", canaries_per_bucket=1,
                    rng=random.Random(0))
    try:
        for _ in range(4):
            prober.run_cycle()
        assert writer.stats.pending == 2 and writer.stats.dropped == 2
    finally:
        assert writer.close(timeout=0.1) == 2  # left unwritten: the database never came
        db.dispose()


def test_unknown_suite_names_the_setting(writer: Writer, engine: FakeEngine,
                                         suites: dict) -> None:
    with pytest.raises(ValueError, match="probes.suite: unknown suite 'nope'"):
        Prober(engine, writer, suites, instance_id="a", suite="nope")


def test_real_traffic_recompiles_reach_sql_once(sessionmaker: sessionmaker[Session],
                                                writer: Writer, engine: FakeEngine,
                                                suites: dict) -> None:
    from engine.protocol import FlagOverride, RuntimeFlags
    from storage.models import CompileEvent

    prober = Prober(engine, writer, suites, instance_id="a", canaries_per_bucket=1,
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
    assert writer.flush(timeout=30)
    with sessionmaker() as s:
        events = s.scalars(select(CompileEvent).order_by(CompileEvent.id)).all()
    assert [(e.run_id is None, e.recompiles) for e in events] == [
        (True, 3), (False, cycle.compile.recompiles)]


def test_settings_prober_records_the_jobs_beside_each_cycle(
        sessionmaker: sessionmaker[Session], writer: Writer, engine: FakeEngine,
        suites: dict) -> None:
    from probes.prober import prober_from_settings
    from probes.settings import ProbeSettings

    jobs = {"evaluate": (1, True), "retention": (4, False)}
    prober = prober_from_settings(ProbeSettings(ab_share=1.0), engine, writer,
                                  instance_id="a", suites=suites, rng=random.Random(0),
                                  activity=lambda: dict(jobs))
    prober.run_cycle()
    jobs["evaluate"] = (1, False)
    prober.run_cycle()
    assert writer.flush(timeout=30)
    with sessionmaker() as s:
        runs = s.scalars(select(ProbeRun).order_by(ProbeRun.id)).all()
    assert [r.details["jobs_during"] for r in runs] == [["evaluate"], []]
    assert all(r.details["ab"] and r.details["pairs"] for r in runs)


def test_settings_prober_records_the_jobs_beside_each_burst(
        sessionmaker: sessionmaker[Session], writer: Writer, engine: FakeEngine,
        suites: dict) -> None:
    from probes.prober import prober_from_settings
    from probes.settings import ProbeSettings

    jobs = {"evaluate": (1, True), "retention": (4, False), "report": (2, False)}

    def retention_ran(_: GenerateResult) -> None:
        jobs["retention"] = (5, False)  # started and finished while the burst ran

    settings = ProbeSettings(burst_rate_per_s=400.0, burst_duration_s=0.05,
                             burst_concurrency=2, burst_unbatched=False)
    prober = prober_from_settings(settings, engine, writer, instance_id="a", suites=suites,
                                  rng=random.Random(0), observers=[retention_ran],
                                  activity=lambda: dict(jobs))
    assert prober.run_burst().jobs_during == ("evaluate", "retention")
    jobs["evaluate"] = (1, False)
    assert prober.run_burst().jobs_during == ()
    assert writer.flush(timeout=30)
    with sessionmaker() as s:
        runs = s.scalars(select(ProbeRun).order_by(ProbeRun.id)).all()
    assert [(r.kind, r.details["jobs_during"]) for r in runs] == [
        ("burst", ["evaluate", "retention"]), ("burst", [])]


def test_settings_prober_runs_the_arms_after_a_slow_cycle(
        sessionmaker: sessionmaker[Session], writer: Writer, engine: FakeEngine,
        suites: dict) -> None:
    from probes.prober import prober_from_settings
    from probes.settings import ProbeSettings

    class Never(random.Random):  # no cycle drawn: only the slowdown brings the arms
        def random(self) -> float:
            return 0.999

    settings = ProbeSettings()  # the shipped ab_share and ab_on_slowdown
    prober = prober_from_settings(settings, engine, writer, instance_id="a", suites=suites,
                                  rng=Never())
    for _ in range(6):
        prober.run_cycle()
    engine.timings.per_output_token_s *= 1.5  # latency steps up
    for _ in range(3):  # slow once it held for two cycles, the arms in the third
        prober.run_cycle()
    assert writer.flush(timeout=30)
    with sessionmaker() as s:
        runs = s.scalars(select(ProbeRun).order_by(ProbeRun.id)).all()
    assert [r.details["ab"] for r in runs] == [False] * 8 + [True]
    assert runs[-1].details["ab_reason"] == "slowdown" and runs[-1].details["pairs"]
