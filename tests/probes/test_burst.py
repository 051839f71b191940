"""Burst probes: Poisson arrivals, client thread cap, engine admission control."""

from __future__ import annotations

import random

import pytest

from probes.burst import arrivals, run_burst
from tests.probes.fakes import FakeEngine, FakeTimings


def test_arrivals_are_bounded_and_reproducible() -> None:
    a = arrivals(random.Random(5), rate_per_s=50.0, duration_s=2.0)
    assert a == arrivals(random.Random(5), rate_per_s=50.0, duration_s=2.0)
    assert a == sorted(a) and all(0 <= t < 2.0 for t in a)
    assert 50 < len(a) < 150  # ~100 expected; Poisson spread


@pytest.mark.parametrize(("kw", "field"), [
    ({"rate_per_s": 0.0}, "burst_rate_per_s"), ({"duration_s": -1.0}, "burst_duration_s"),
    ({"concurrency": 0}, "burst_concurrency")])
def test_bad_settings_name_the_field(engine: FakeEngine, kw: dict, field: str) -> None:
    args = {"rate_per_s": 1.0, "duration_s": 1.0, "concurrency": 1, **kw}
    with pytest.raises(ValueError, match=field):
        run_burst(engine, ["p"], instance_id="a", **args)


def test_full_queue_makes_the_burst_report_rejections(suites: dict) -> None:
    # The engine admits one call at a time; each takes ~20 ms; arrivals every ~5 ms.
    engine = FakeEngine(capacity=1, timings=FakeTimings(sleep_scale=0.25))
    result = run_burst(engine, suites["in_domain"].prompts, instance_id="a",
                       rate_per_s=200.0, duration_s=0.3, concurrency=4,
                       rng=random.Random(1))
    assert result.status == "ok"
    assert result.rejected > 0
    assert result.completed > 0
    assert result.completed + result.rejected + result.errors == result.offered
    assert 0 < result.rejection_rate < 1
    assert result.latency.p99 >= result.latency.p50 > 0
    assert result.queue_wait.count == result.completed


def test_unbounded_engine_rejects_nothing(engine: FakeEngine, suites: dict) -> None:
    result = run_burst(engine, suites["shifted"].prompts, instance_id="a", rate_per_s=300.0,
                       duration_s=0.1, concurrency=2, rng=random.Random(2))
    assert result.rejected == 0 and result.completed == result.offered > 0
    assert {g.bucket for g in result.groups} <= {"16", "32", "64", "128", "256"}
    assert sum(g.requests for g in result.groups) == result.completed


def test_hung_engine_ends_the_burst_as_timeout(engine: FakeEngine, suites: dict) -> None:
    engine.hang.set()
    result = run_burst(engine, suites["in_domain"].prompts, instance_id="a", rate_per_s=100.0,
                       duration_s=0.05, concurrency=2, grace_s=0.1, rng=random.Random(4))
    engine.release.set()
    assert result.status == "timeout"
    assert result.unfinished > 0 and "did not finish" in result.error
