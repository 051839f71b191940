"""A/B rows turn into measured speedups per optimization per bucket."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.orm import Session, sessionmaker

from engine.protocol import InMemoryFlagProvider, RuntimeFlags
from probes.ab import ab_speedups
from probes.cycle import ProbeCycle
from tests.probes.fakes import FakeEngine, FakeTimings, store


def test_speedups_from_stored_ab_cycles(sessionmaker: sessionmaker[Session], suites: dict) -> None:
    flags = InMemoryFlagProvider(RuntimeFlags(speculative={"16": False}))
    engine = FakeEngine(flags=flags, timings=FakeTimings(eager_factor=2.0))
    engine.warm_up()
    t = datetime(2026, 11, 30, 10, tzinfo=UTC)
    cycle = ProbeCycle(engine, suites, instance_id="a", canaries_per_bucket=2, ab_share=1.0,
                       ab_arms=("eager", "direct"), rng=random.Random(0), clock=lambda: t)
    for _ in range(3):
        store(sessionmaker, cycle.run("in_domain"))
    with sessionmaker() as s:
        got = {(x.bucket, x.arm): x for x in ab_speedups(s, t - timedelta(hours=1),
                                                          t + timedelta(hours=1))}
        assert ab_speedups(s, t, t + timedelta(hours=1), instance_id="other") == []
    eager = got[("64", "eager")]
    assert (eager.optimization, eager.runs) == ("compile", 3)
    assert eager.speedup == pytest.approx(eager.arm_p50_s / eager.optimized_p50_s)
    assert eager.speedup > 1.5  # the fake charges 2x per token in eager mode
    assert got[("64", "direct")].optimization == "speculative"
    assert got[("64", "direct")].speedup > 1  # in-domain acceptance 0.8: speculation pays
    # Bucket 16 has speculation off: its arm measures speculation switched back on.
    assert ("16", "direct") not in got
    assert got[("16", "speculative")].speedup > 1


def test_empty_window_is_refused(sessionmaker: sessionmaker[Session]) -> None:
    t = datetime(2026, 11, 30, tzinfo=UTC)
    with sessionmaker() as s, pytest.raises(ValueError, match="end"):
        ab_speedups(s, t, t)


def test_compiled_off_probes_the_compiled_path_as_a_reverse_arm(
        sessionmaker: sessionmaker[Session], suites: dict) -> None:
    flags = InMemoryFlagProvider(RuntimeFlags(compiled=False))
    engine = FakeEngine(flags=flags, timings=FakeTimings(eager_factor=2.0))
    engine.warm_up()
    t = datetime(2026, 11, 30, 10, tzinfo=UTC)
    cycle = ProbeCycle(engine, suites, instance_id="a", canaries_per_bucket=2, ab_share=1.0,
                       ab_arms=("eager",), rng=random.Random(0), clock=lambda: t)
    store(sessionmaker, cycle.run("in_domain"))
    with sessionmaker() as s:
        got = {(x.bucket, x.arm): x for x in ab_speedups(s, t - timedelta(hours=1),
                                                          t + timedelta(hours=1))}
    # The eager fallback is in force, so the arm measures compile switched back on.
    assert ("64", "eager") not in got
    compiled = got[("64", "compiled")]
    assert compiled.optimization == "compile"
    assert compiled.speedup == pytest.approx(compiled.optimized_p50_s / compiled.arm_p50_s)
    assert compiled.speedup > 1.5
