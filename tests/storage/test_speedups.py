"""storage.queries.speedups: stored prompt pairs turn into speedups per optimization."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from engine.protocol import InMemoryFlagProvider, RuntimeFlags
from probes.canaries import CanarySuite
from probes.cycle import CycleResult, ProbeCycle, PromptPair
from probes.sink import add_cycle
from storage.models import ProbeRun
from storage.queries.speedups import (
    ALL_BUCKETS,
    PairRecord,
    ab_speedups,
    instance_speedups,
    load_pairs,
    median_ci,
    overall,
    scheduled,
    speedups,
)
from tests.probes.fakes import FakeEngine, FakeTimings, placeholder_suites, store

T = datetime(2026, 11, 30, 10, tzinfo=UTC)
HOUR = timedelta(hours=1)


@pytest.fixture
def suites() -> dict[str, CanarySuite]:
    """Return placeholder in_domain and shifted suites covering every bucket."""
    return placeholder_suites(per_bucket=2)


def _pair(bucket: str, run_id: int = 1, **latency: float) -> PairRecord:
    return PairRecord(run_id, "a", T, bucket, "abc", latency)


def test_median_and_ci_on_known_ratios() -> None:
    # 9 pairs: P(B <= 1) = 10/512 <= 2.5% < P(B <= 2) = 46/512, so the CI is x_(2), x_(8).
    ratios = [0.5, 0.8, 0.9, 1.0, 1.2, 1.3, 1.5, 2.0, 4.0]
    assert median_ci(ratios) == (pytest.approx(1.2), 0.8, 2.0)
    # Even count: the geometric mean of the middle two (the median of the logarithms).
    mid, lo, hi = median_ci([1.0, 2.0, 8.0, 8.0, 8.0, 8.0])
    assert mid == pytest.approx(8.0) and (lo, hi) == (1.0, 8.0)  # 6 pairs: k = 1
    assert median_ci([1.0, 4.0, 9.0, 9.0])[0] == pytest.approx(6.0)
    assert median_ci([1.5, 2.0, 3.0, 4.0, 5.0]) == (pytest.approx(3.0), None, None)  # < 6
    # Large n: the CI is the order statistics around n/2 -+ 1.96 sqrt(n)/2 (about).
    xs = [1 + i / 1000 for i in range(1000)]
    _, lo, hi = median_ci(xs)
    assert lo == xs[468] and hi == xs[531]
    # Past 1000 pairs the tail is summed from 8 sd below the mean: the same rank as the
    # full sum (2431 for n = 5000, summed from zero).
    xs = [1 + i / 5000 for i in range(5000)]
    _, lo, hi = median_ci(xs)
    assert lo == xs[2430] and hi == xs[5000 - 2431]
    with pytest.raises(ValueError, match="ratios"):
        median_ci([])


def test_speedups_pair_within_prompts_and_orient_reverse_arms() -> None:
    pairs = [_pair("16", run_id=i, optimized=0.1, eager=0.1 * r, direct=0.05)
             for i, r in enumerate((1.2, 1.5, 1.6, 1.8, 2.0, 2.5, 3.0), start=1)]
    pairs += [_pair("64", run_id=9, optimized=0.2, speculative=0.1),  # speculation off there
              _pair("64", run_id=9, eager=0.3),  # the optimized call failed: no pair
              _pair("64", run_id=10, optimized=0.2, eager=0.5)]
    got = {(s.bucket, s.optimization): s for s in speedups(pairs)}
    e16 = got[("16", "compile")]
    assert (e16.arms, e16.pairs, e16.runs) == (("eager",), 7, 7)
    assert e16.speedup == pytest.approx(1.8)
    assert (e16.ci_low, e16.ci_high) == (pytest.approx(1.2), pytest.approx(3.0))  # k = 1
    assert e16.optimized_p50_s == pytest.approx(0.1) and e16.arm_p50_s == pytest.approx(0.18)
    assert got[("16", "speculative")].speedup == pytest.approx(0.5)  # slower than direct
    # The reverse arm measures speculation switched on: optimized (direct) / arm.
    assert got[("64", "speculative")].speedup == pytest.approx(2.0)
    assert got[("64", "speculative")].arms == ("speculative",)
    assert got[("64", "compile")].pairs == 1 and got[("64", "compile")].speedup == 2.5
    # Forward and reverse arms measure the same optimization: pooled over all buckets.
    spec = got[(ALL_BUCKETS, "speculative")]
    assert (spec.arms, spec.pairs) == (("direct", "speculative"), 8)
    assert spec.speedup == pytest.approx(0.5)
    every = got[(ALL_BUCKETS, "compile")]
    assert every.pairs == 8
    assert every.speedup == pytest.approx(math.sqrt(1.8 * 2.0))  # median of 8 ratios
    assert [s.bucket for s in speedups(pairs)][-2:] == [ALL_BUCKETS] * 2


def test_an_arms_filter_reads_only_those_arms() -> None:
    pairs = [_pair("16", optimized=0.1, compiled_step=0.12, direct=0.05),
             _pair("16", run_id=2, optimized=0.1, native_step=0.05)]
    got = speedups(pairs, arms=("compiled_step",))
    assert [(s.bucket, s.optimization, s.arms, s.pairs) for s in got] == [
        ("16", "native_step", ("compiled_step",), 1),
        (ALL_BUCKETS, "native_step", ("compiled_step",), 1)]
    assert got[0].speedup == pytest.approx(1.2)
    assert speedups(pairs, arms=("bogus",)) == []


# sessionmaker runs on SQLite and PostgreSQL.
def test_speedups_from_pairs_stored_by_the_sink(sessionmaker: sessionmaker[Session],
                                                suites: dict) -> None:
    flags = InMemoryFlagProvider(RuntimeFlags(speculative={"16": False}))
    engine = FakeEngine(flags=flags, timings=FakeTimings(eager_factor=2.0))
    engine.warm_up()
    cycle = ProbeCycle(engine, suites, instance_id="a", canaries_per_bucket=2, ab_share=1.0,
                       ab_arms=("eager", "direct"), rng=random.Random(0), clock=lambda: T)
    results = [cycle.run("in_domain") for _ in range(3)]
    for r in results:
        store(sessionmaker, r)
    store(sessionmaker, ProbeCycle(engine, suites, instance_id="a", ab_share=0.0,
                                   clock=lambda: T).run("in_domain"))  # no pairs: skipped
    with sessionmaker() as s:
        got = {(x.bucket, x.optimization): x for x in ab_speedups(s, T - HOUR, T + HOUR)}
        assert ab_speedups(s, T, T + HOUR, instance_id="other") == []
        assert ab_speedups(s, T + HOUR, T + 2 * HOUR) == []
        stored = load_pairs(s, T - HOUR, T + HOUR)
        assert all("pairs" not in (r.details or {}) for r in s.query(ProbeRun)
                   if not (r.details or {}).get("ab"))
    assert len(stored) == 30 and {p.prompt for p in stored} == {
        p.prompt for r in results for p in r.pairs}
    # What was read back is what the cycles measured, pair by pair.
    ratios = [p.latency_s["eager"] / p.latency_s["optimized"]
              for r in results for p in r.pairs if p.bucket == "64"]
    eager = got[("64", "compile")]
    assert (eager.arms, eager.pairs, eager.runs) == (("eager",), 6, 3)
    assert eager.speedup == pytest.approx(math.exp(statistics.median(map(math.log, ratios))))
    assert eager.ci_low == pytest.approx(min(ratios)) and eager.ci_high == pytest.approx(
        max(ratios))
    assert eager.speedup > 1.5  # the fake charges 2x per token in eager mode
    assert got[("64", "speculative")].arms == ("direct",)
    assert got[("64", "speculative")].speedup > 1  # in-domain acceptance 0.8: speculation pays
    # Bucket 16 has speculation off: its arm measures speculation switched back on.
    assert got[("16", "speculative")].arms == ("speculative",)
    assert got[("16", "speculative")].speedup > 1
    assert got[(ALL_BUCKETS, "compile")].pairs == 30
    assert got[(ALL_BUCKETS, "speculative")].arms == ("direct", "speculative")


def test_pairs_in_shapes_the_sink_never_writes_are_skipped(
        sessionmaker: sessionmaker[Session]) -> None:
    good = {"bucket": "16", "prompt": "abc", "order": ["optimized", "eager"],
            "latency_s": {"optimized": 0.1, "eager": 0.2}}
    junk = [{"bucket": 16, "latency_s": {"optimized": 0.1, "eager": 0.2}},  # bucket not a str
            {"bucket": "16", "latency_s": [0.1, 0.2]},
            {"bucket": "16", "latency_s": {"optimized": "fast", "eager": 0.2}},
            {"bucket": "16", "latency_s": {"optimized": 0.1, "eager": None, "bogus": 1.0}},
            "not a pair"]
    with sessionmaker.begin() as s:
        s.add(ProbeRun(started_at=T, instance_id="a", kind="cycle",
                       details={"ab": True, "pairs": [good, *junk]}))
        s.add(ProbeRun(started_at=T, instance_id="a", kind="cycle", details={"ab": True}))
        s.add(ProbeRun(started_at=T, instance_id="a", kind="burst", details={"pairs": [good]}))
    with sessionmaker() as s:
        (only,) = ab_speedups(s, T - HOUR, T + HOUR)[:1]
        # The good pair and the two with bad values load; speedups() skips those values.
        assert len(load_pairs(s, T - HOUR, T + HOUR)) == 3
    assert (only.bucket, only.optimization, only.pairs, only.speedup) == ("16", "compile", 1, 2.0)


def test_pairs_keep_why_their_cycle_ran_the_arms(sessionmaker: sessionmaker[Session],
                                                 suites: dict) -> None:
    engine = FakeEngine()
    engine.warm_up()
    cycle = ProbeCycle(engine, suites, instance_id="a", canaries_per_bucket=1, ab_share=1.0,
                       ab_arms=("eager",), rng=random.Random(0), clock=lambda: T)
    drawn = cycle.run("in_domain")
    requested = cycle.run("in_domain", ab=True)
    assert (drawn.ab_reason, requested.ab_reason) == ("drawn", "requested")
    ids = {reason: store(sessionmaker, r) for reason, r in (
        ("drawn", drawn), ("requested", requested),
        # As the schedule stores a cycle run after a slow one, and a reason not known here.
        ("slowdown", replace(drawn, ab_reason="slowdown")),
        ("later", replace(drawn, ab_reason="later")))}
    old = {"bucket": "16", "prompt": "abc", "order": ["optimized", "eager"],
           "latency_s": {"optimized": 0.1, "eager": 0.2}}
    with sessionmaker.begin() as s:  # stored before the reason was: counts as drawn
        run = ProbeRun(started_at=T, instance_id="a", kind="cycle",
                       details={"ab": True, "pairs": [old]})
        s.add(run)
        s.flush()
        ids[""] = run.id
    with sessionmaker() as s:
        pairs = load_pairs(s, T - HOUR, T + HOUR)
    # Every A/B cycle's pairs (what the incident cause reads), each with its cycle's reason.
    assert {p.run_id: p.ab_reason for p in pairs} == {i: r for r, i in ids.items()}
    kept, on_demand = scheduled(pairs)
    assert {p.ab_reason for p in kept} == {"", "drawn", "requested"}
    assert {p.ab_reason for p in on_demand} == {"slowdown", "later"}
    assert len(kept) + len(on_demand) == len(pairs)


def test_empty_window_is_refused(sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker() as s, pytest.raises(ValueError, match="end"):
        ab_speedups(s, T, T)


def test_compiled_off_probes_the_compiled_path_as_a_reverse_arm(
        sessionmaker: sessionmaker[Session], suites: dict) -> None:
    flags = InMemoryFlagProvider(RuntimeFlags(compiled=False))
    engine = FakeEngine(flags=flags, timings=FakeTimings(eager_factor=2.0))
    engine.warm_up()
    cycle = ProbeCycle(engine, suites, instance_id="a", canaries_per_bucket=2, ab_share=1.0,
                       ab_arms=("eager",), rng=random.Random(0), clock=lambda: T)
    store(sessionmaker, cycle.run("in_domain"))
    with sessionmaker() as s:
        got = {(x.bucket, x.optimization): x for x in ab_speedups(s, T - HOUR, T + HOUR)}
    # The eager fallback is in force, so the arm measures compile switched back on.
    compiled = got[("64", "compile")]
    assert compiled.arms == ("compiled",)
    assert compiled.speedup == pytest.approx(compiled.optimized_p50_s / compiled.arm_p50_s)
    assert compiled.speedup > 1.5


def test_the_c_step_is_measured_by_the_compiled_step_arm_and_its_reverse(
        sessionmaker: sessionmaker[Session], suites: dict) -> None:
    flags = InMemoryFlagProvider(RuntimeFlags())
    engine = FakeEngine(flags=flags, native_step=True,
                        timings=FakeTimings(compiled_step_factor=1.5))
    engine.warm_up()
    cycle = ProbeCycle(engine, suites, instance_id="a", canaries_per_bucket=2, ab_share=1.0,
                       ab_arms=(), rng=random.Random(0), clock=lambda: T)
    on = cycle.run("in_domain")
    # The C step serves the optimized requests: each prompt's pair has the compiled_step arm.
    assert {p.order and frozenset(p.order) for p in on.pairs} == {
        frozenset({"optimized", "compiled_step"})}
    store(sessionmaker, on)
    with sessionmaker() as s:
        got = {(x.bucket, x.optimization): x for x in ab_speedups(s, T - HOUR, T + HOUR)}
    step = got[(ALL_BUCKETS, "native_step")]
    assert (step.arms, step.pairs) == (("compiled_step",), len(on.pairs))
    assert step.speedup == pytest.approx(1.5)
    # The native_step flag off (the policy's fallback): the arm switches the C step back on.
    flags.set(RuntimeFlags(native_step=False))
    off = cycle.run("in_domain")
    assert {frozenset(p.order) for p in off.pairs} == {frozenset({"optimized", "native_step"})}
    later = T + timedelta(minutes=1)
    store(sessionmaker, ProbeCycle(engine, suites, instance_id="a", canaries_per_bucket=2,
                                   ab_share=1.0, ab_arms=(), rng=random.Random(1),
                                   clock=lambda: later).run("in_domain"))
    with sessionmaker() as s:
        back = {(x.bucket, x.optimization): x
                for x in ab_speedups(s, later, later + HOUR)}[(ALL_BUCKETS, "native_step")]
    assert back.arms == ("native_step",) and back.speedup == pytest.approx(1.5)


def test_instance_speedups_pool_each_instances_buckets(
        sessionmaker: sessionmaker[Session], suites: dict) -> None:
    for inst, factor in (("a", 1.5), ("b", 0.8)):
        engine = FakeEngine(native_step=True, timings=FakeTimings(compiled_step_factor=factor))
        engine.warm_up()
        store(sessionmaker, ProbeCycle(engine, suites, instance_id=inst, canaries_per_bucket=2,
                                       ab_share=1.0, ab_arms=("eager",), rng=random.Random(0),
                                       clock=lambda: T).run("in_domain"))
    with sessionmaker() as s:
        got = instance_speedups(s, T - HOUR, T + HOUR, "native_step",
                                arms=("compiled_step",))
        assert instance_speedups(s, T - HOUR, T + HOUR, "native_step", instance_id="b",
                                 arms=("compiled_step",)).keys() == {"b"}
        assert instance_speedups(s, T - HOUR, T + HOUR, "int8") == {}
        every = ab_speedups(s, T - HOUR, T + HOUR, instance_id="a")
    assert {i: round(m.speedup, 6) for i, m in got.items()} == {"a": 1.5, "b": 0.8}
    assert got["a"].bucket == ALL_BUCKETS and got["a"].arms == ("compiled_step",)
    # The same number as the instance's row over all buckets, eager pairs left out.
    assert got["a"] == overall(every, "native_step")


def test_requests_the_c_step_does_not_serve_get_no_step_arm(suites: dict) -> None:
    engine = FakeEngine(native_step=False)
    engine.warm_up()
    cycle = ProbeCycle(engine, suites, instance_id="a", canaries_per_bucket=2, ab_share=1.0,
                       ab_arms=(), rng=random.Random(0), clock=lambda: T)
    assert {frozenset(p.order) for p in cycle.run("in_domain").pairs} == {
        frozenset({"optimized"})}


def test_pooled_forward_and_reverse_arms_report_latency_without_and_with_the_optimization(
        sessionmaker: sessionmaker[Session], suites: dict) -> None:
    # Speculation slower than direct (0.4 s vs 0.2 s in 16), measured by the `direct` arm
    # while it is on and by the reverse `speculative` arm while its flag is off in 16:
    # the optimized request is speculative in the first cycle, direct in the others.
    flags = InMemoryFlagProvider(RuntimeFlags())
    engine = FakeEngine(flags=flags, timings=FakeTimings(total_s={
        ("16", "compiled", "speculative"): 0.4, ("16", "compiled", "direct"): 0.2}))
    engine.warm_up()
    for i, off in enumerate((False, True, True, True)):
        flags.set(RuntimeFlags(speculative={"16": False} if off else {}))
        at = T + timedelta(minutes=i)
        store(sessionmaker, ProbeCycle(engine, suites, instance_id="a", canaries_per_bucket=2,
                                       ab_share=1.0, ab_arms=("direct",), rng=random.Random(i),
                                       clock=lambda at=at: at).run("in_domain"))
    with sessionmaker() as s:
        spec = {(x.bucket, x.optimization): x
                for x in ab_speedups(s, T - HOUR, T + HOUR)}[("16", "speculative")]
    assert spec.arms == ("direct", "speculative") and spec.pairs == 8
    assert spec.speedup == pytest.approx(0.5)
    # Without speculation is faster, with it slower, whichever side ran as "optimized".
    assert (spec.off_p50_s, spec.on_p50_s) == (pytest.approx(0.2), pytest.approx(0.4))
    # The optimized request ran direct in 6 of the 8 pairs: its median is the fast side.
    assert spec.optimized_p50_s < spec.arm_p50_s


# sessionmaker runs on SQLite and PostgreSQL.
def test_a_pair_is_dated_by_when_its_cycle_finished(sessionmaker: sessionmaker[Session]) -> None:
    # The incident cause counts a pair where its cycle's canary rows are: when it finished
    # (alerts.cause.paired_changes); a run with no finish stored, when it started.
    pair = PromptPair("64", "abc", ("optimized", "eager"), {"optimized": 0.3, "eager": 0.6})
    with sessionmaker.begin() as s:
        for started in (T, T + HOUR / 2):
            add_cycle(s, CycleResult(suite="in_domain", instance_id="a", started_at=started,
                                     finished_at=started + timedelta(seconds=40),
                                     status="ok", ab=True, pairs=(pair,)))
        s.flush()
        s.execute(update(ProbeRun).where(ProbeRun.started_at == T + HOUR / 2)
                  .values(finished_at=None))
    with sessionmaker() as s:
        first, second = load_pairs(s, T - HOUR, T + HOUR)
    assert (first.started_at, first.finished_at, first.at) == (
        T, T + timedelta(seconds=40), T + timedelta(seconds=40))
    assert (second.finished_at, second.at) == (None, T + HOUR / 2)
