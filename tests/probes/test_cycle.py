"""Probe cycles against the fake engine: coverage, A/B arms, memory, compile, failures."""

from __future__ import annotations

import random
import threading

from engine.errors import EngineError, Overloaded
from engine.protocol import GenerateResult, RuntimeFlags
from probes.cycle import STATUS_ERROR, STATUS_OK, STATUS_TIMEOUT, ProbeCycle, prompt_id
from tests.probes.fakes import FakeEngine

BUCKETS = ("16", "32", "64", "128", "256")


class Never(random.Random):
    """An rng whose A/B draws never fall within the share (the order draws still work)."""

    def random(self) -> float:
        return 0.999


def make_cycle(engine: FakeEngine, suites: dict, **kw: object) -> ProbeCycle:
    kw.setdefault("rng", random.Random(0))
    return ProbeCycle(engine, suites, instance_id="replica-a", canaries_per_bucket=2, **kw)


def test_cycle_measures_every_bucket_and_path(engine: FakeEngine, suites: dict) -> None:
    seen: list[GenerateResult] = []
    result = make_cycle(engine, suites, ab_share=0.0, observers=[seen.append]).run("in_domain")
    assert result.status == STATUS_OK and result.error is None
    assert result.buckets == BUCKETS
    assert result.missing_buckets == ()
    assert {g.key for g in result.groups} == {
        (b, "compiled", "speculative", "optimized") for b in BUCKETS}
    assert all(g.requests == 2 for g in result.groups)
    assert len(seen) == 10 and all(r.canary for r in seen)
    assert engine.state.canary_calls == 10
    g16 = result.groups[0]
    assert g16.acceptance_rate is not None and g16.acceptance_rate > 0.5  # in-domain
    assert g16.padded_length == 16 and 0 < g16.padding_waste < 1
    assert g16.latency.p50 is not None and g16.ttft.p95 is not None
    assert result.compile is not None and result.compile.recompiles == 0


def test_shifted_domain_lowers_acceptance(engine: FakeEngine, suites: dict) -> None:
    cycle = make_cycle(engine, suites, ab_share=0.0)
    ind, shf = cycle.run("in_domain"), cycle.run("shifted")
    assert shf.groups[0].acceptance_rate < ind.groups[0].acceptance_rate


def test_ab_arms_run_as_variants(engine: FakeEngine, suites: dict) -> None:
    result = make_cycle(engine, suites, ab_share=1.0).run("in_domain")
    assert result.ab
    variants = {(g.bucket, g.variant): g for g in result.groups}
    for b in BUCKETS:
        assert variants[(b, "eager")].path == "eager"
        assert variants[(b, "direct")].decoding == "direct"
        assert variants[(b, "exact")].path == "exact"
        # The fake's eager arm is slower: the A/B rows carry the speedup.
        assert variants[(b, "eager")].latency.p50 > variants[(b, "optimized")].latency.p50
    # The exact arm recompiles by design; it is kept apart from the cycle's own compiles.
    assert result.compile.recompiles == 0
    assert result.ab_compile is not None and result.ab_compile.recompiles > 0


def test_ab_share_is_deterministic_with_a_seeded_rng(engine: FakeEngine, suites: dict) -> None:
    def schedule(seed: int) -> list[bool]:
        cycle = make_cycle(engine, suites, ab_share=0.3, rng=random.Random(seed))
        return [cycle.run("in_domain").ab for _ in range(20)]

    first = schedule(7)
    assert first == schedule(7)
    assert 0 < sum(first) < 20


def test_speculation_off_measures_the_speculative_arm(suites: dict) -> None:
    from engine.protocol import InMemoryFlagProvider

    flags = InMemoryFlagProvider(RuntimeFlags(speculative={"32": False}))
    engine = FakeEngine(flags=flags)
    engine.warm_up()
    result = make_cycle(engine, suites, ab_share=1.0, ab_arms=("direct",)).run("in_domain")
    keys = {(g.bucket, g.decoding, g.variant) for g in result.groups}
    assert ("32", "direct", "optimized") in keys
    assert ("32", "speculative", "speculative") in keys
    assert ("64", "direct", "direct") in keys


def test_memory_growth_is_measured(suites: dict) -> None:
    engine = FakeEngine(leak_bytes_per_call=1000)
    engine.warm_up()
    result = make_cycle(engine, suites, ab_share=0.0).run("in_domain")
    assert result.rss_growth_bytes == 10 * 1000
    assert result.memory_before.rss_bytes < result.memory_after.rss_bytes


def test_bucketing_off_records_recompiles_with_reason(suites: dict) -> None:
    from engine.protocol import InMemoryFlagProvider

    engine = FakeEngine(flags=InMemoryFlagProvider(RuntimeFlags(bucketing=False)))
    engine.warm_up()
    result = make_cycle(engine, suites, ab_share=0.0).run("in_domain")
    assert result.compile.recompiles == 10
    assert all("size mismatch" in reason for reason in result.compile.recompile_reasons)


def test_hung_engine_call_times_out_and_never_stacks(engine: FakeEngine, suites: dict) -> None:
    cycle = make_cycle(engine, suites, ab_share=0.0, timeout_s=0.2)
    engine.hang.set()
    first = cycle.run("in_domain")
    assert first.status == STATUS_TIMEOUT
    assert "cycle_timeout_s=0.2" in first.error and "bucket 16" in first.error
    second = cycle.run("in_domain")  # the first worker is still stuck in the engine
    assert second.status == STATUS_TIMEOUT and "still waiting" in second.error
    assert threading.active_count() < 50
    engine.hang.clear()
    engine.release.set()
    for t in threading.enumerate():
        if t.name.startswith("probe-cycle"):
            t.join(5)
    assert cycle.run("in_domain").status == STATUS_OK


def test_engine_error_is_reported_not_raised(engine: FakeEngine, suites: dict) -> None:
    engine.fail_with = EngineError("CUDA error: device-side assert triggered")
    result = make_cycle(engine, suites).run("in_domain")
    assert result.status == STATUS_ERROR
    assert result.error == "EngineError: CUDA error: device-side assert triggered"


def test_overloaded_canaries_are_counted(engine: FakeEngine, suites: dict) -> None:
    engine.fail_with = Overloaded("queue full")
    result = make_cycle(engine, suites, ab_share=0.0).run("in_domain")
    assert result.status == STATUS_OK
    assert result.rejected == 10 and result.groups == ()


def test_observer_failure_does_not_fail_the_cycle(engine: FakeEngine, suites: dict) -> None:
    def broken(_: GenerateResult) -> None:
        raise RuntimeError("metrics down")

    assert make_cycle(engine, suites, observers=[broken]).run("in_domain").status == STATUS_OK


def _variant_of(r: GenerateResult) -> str:
    """Return which arm ran `r` (the fake's paths and decodings tell them apart)."""
    if r.path == "eager":
        return "eager"
    return "direct" if r.decoding == "direct" else "optimized"


def test_ab_arms_run_back_to_back_in_a_seeded_order_per_prompt(engine: FakeEngine,
                                                               suites: dict) -> None:
    calls: list[tuple[int, str]] = []
    cycle = make_cycle(engine, suites, ab_share=1.0, ab_arms=("eager", "direct"),
                       observers=[lambda r: calls.append((r.input_tokens, _variant_of(r)))])
    first, second = cycle.run("in_domain"), cycle.run("in_domain")
    # A bucket's first prompt ever runs optimized first (its flags decide the arms); every
    # later prompt draws where the optimized request goes among its arms.
    assert [p.order for p in first.pairs] == [
        ("optimized", "eager", "direct"), ("direct", "eager", "optimized"),
        ("optimized", "eager", "direct"), ("optimized", "direct", "eager"),
        ("optimized", "eager", "direct"), ("direct", "optimized", "eager"),
        ("optimized", "direct", "eager"), ("direct", "optimized", "eager"),
        ("optimized", "direct", "eager"), ("optimized", "eager", "direct")]
    assert [p.order for p in second.pairs] == [
        ("eager", "optimized", "direct"), ("direct", "optimized", "eager"),
        ("eager", "optimized", "direct"), ("optimized", "eager", "direct"),
        ("direct", "optimized", "eager"), ("optimized", "direct", "eager"),
        ("direct", "optimized", "eager"), ("optimized", "eager", "direct"),
        ("optimized", "direct", "eager"), ("eager", "direct", "optimized")]
    # Back to back: the engine saw each prompt's three calls in a row, in the pair's order.
    prompts = [tuple(calls[i:i + 3]) for i in range(0, len(calls), 3)]
    orders = [p.order for p in (*first.pairs, *second.pairs)]
    assert [tuple(v for _, v in chunk) for chunk in prompts] == orders
    assert all(len({n for n, _ in chunk}) == 1 for chunk in prompts)
    pair = second.pairs[0]
    assert pair.bucket == "16" and len(pair.prompt) == 12
    assert pair.prompt == prompt_id(suites["in_domain"].prompts[0])
    assert set(pair.latency_s) == {"optimized", "eager", "direct"}
    assert pair.latency_s["eager"] > pair.latency_s["optimized"]
    same = make_cycle(engine, suites, ab_share=1.0, ab_arms=("eager", "direct"))
    assert [p.order for p in same.run("in_domain").pairs] == [p.order for p in first.pairs]


def test_non_ab_cycles_store_no_pairs_and_run_optimized_only(engine: FakeEngine,
                                                            suites: dict) -> None:
    result = make_cycle(engine, suites, ab_share=0.0).run("in_domain")
    assert result.pairs == () and result.ab_compile is None
    assert {g.variant for g in result.groups} == {"optimized"}


def test_compile_attribution_is_exact_per_side(suites: dict) -> None:
    from engine.protocol import InMemoryFlagProvider

    # Bucketing off on a cold engine: the optimized and the direct arm share each prompt's
    # exact shape, so whichever of the two runs first compiles it.
    engine = FakeEngine(flags=InMemoryFlagProvider(RuntimeFlags(bucketing=False)))
    result = make_cycle(engine, suites, ab_share=1.0, ab_arms=("eager", "direct"),
                        rng=random.Random(3)).run("in_domain")
    opt_first = sum(p.order.index("optimized") < p.order.index("direct") for p in result.pairs)
    assert 0 < opt_first < len(result.pairs)  # both sides compiled something
    assert result.compile.graphs == 2 * opt_first
    assert result.ab_compile.graphs == 2 * (len(result.pairs) - opt_first)
    # Every new length after the very first recompiles, on whichever side ran it.
    assert result.compile.recompiles + result.ab_compile.recompiles == 9
    first_by_direct = result.pairs[0].order.index("direct") < result.pairs[0].order.index(
        "optimized")
    assert result.compile.recompiles == opt_first - (0 if first_by_direct else 1)
    assert sum(result.compile.recompile_reasons.values()) == result.compile.recompiles


def test_compile_deltas_add_up() -> None:
    from engine.protocol import CompileDelta

    a = CompileDelta(1, 2, {"x": 2}, 0, {}, 0.5, 0, 0)
    b = CompileDelta(3, 1, {"x": 1, "y": 1}, 1, {"b": 1}, 0.25, 1, 1)
    assert a.plus(b) == CompileDelta(4, 3, {"x": 3, "y": 1}, 1, {"b": 1}, 0.75, 1, 1)
    assert a.plus(CompileDelta.none()) == a
    assert a.plus(b).minus(b) == a


def test_the_optimized_call_decides_the_arms_when_flags_change(engine: FakeEngine,
                                                               suites: dict) -> None:
    cycle = make_cycle(engine, suites, ab_share=1.0, ab_arms=("eager", "direct"))
    cycle.run("in_domain")  # plans direct arms for every bucket
    engine.flag_provider.update(speculative={"64": False})
    result = cycle.run("in_domain")
    p64 = [p for p in result.pairs if p.bucket == "64"]
    # Speculation is off in 64: its arm is speculation switched back on, never `direct`
    # (a planned direct call that ran before the optimized one is dropped, not stored).
    assert [set(p.order) for p in p64] == [{"optimized", "eager", "speculative"}] * 2
    assert ("64", "direct") not in {(g.bucket, g.variant) for g in result.groups}
    assert ("64", "speculative") in {(g.bucket, g.variant) for g in result.groups}
    assert {tuple(sorted(p.order)) for p in result.pairs if p.bucket != "64"} == {
        ("direct", "eager", "optimized")}


def test_jobs_during_a_cycle_come_from_the_activity_seam(engine: FakeEngine,
                                                         suites: dict) -> None:
    jobs = {"evaluate": (3, True), "retention": (1, False), "report": (0, False)}

    def job_started(_: GenerateResult) -> None:
        jobs["retention"] = (2, False)  # started and finished while the cycle ran

    cycle = make_cycle(engine, suites, ab_share=0.0, observers=[job_started],
                       activity=lambda: dict(jobs))
    assert cycle.run("in_domain").jobs_during == ("evaluate", "retention")
    jobs["evaluate"] = (3, False)
    assert make_cycle(engine, suites, ab_share=0.0,
                      activity=lambda: dict(jobs)).run("in_domain").jobs_during == ()
    assert make_cycle(engine, suites).run("in_domain").jobs_during == ()

    def broken() -> dict[str, tuple[int, bool]]:
        raise RuntimeError("scheduler gone")

    result = make_cycle(engine, suites, activity=broken).run("in_domain")
    assert result.status == STATUS_OK and result.jobs_during == ()


def test_a_cycle_after_a_slow_one_runs_the_arms_whatever_the_draw(engine: FakeEngine,
                                                                 suites: dict) -> None:
    cycle = make_cycle(engine, suites, ab_share=0.25, ab_arms=("eager", "direct"),
                       rng=Never())
    assert [cycle.run("in_domain").ab for _ in range(6)] == [False] * 6
    engine.timings.per_output_token_s *= 1.5  # the host slows: every arm alike
    # Seen once it ran, and slow once it held for two cycles (AbSchedule.confirm).
    for _ in range(2):
        slow = cycle.run("in_domain")
        assert not slow.ab and slow.ab_reason == ""
    after = cycle.run("in_domain")
    assert after.ab and after.ab_reason == "slowdown"
    assert {g.variant for g in after.groups} == {"optimized", "eager", "direct"}
    assert len(after.pairs) == 2 * len(BUCKETS)


def test_no_arms_on_demand_when_the_setting_is_off(engine: FakeEngine, suites: dict) -> None:
    cycle = make_cycle(engine, suites, ab_share=0.25, ab_on_slowdown=0.0, rng=Never())
    for _ in range(6):
        cycle.run("in_domain")
    engine.timings.per_output_token_s *= 1.5
    assert [cycle.run("in_domain").ab for _ in range(3)] == [False] * 3


def test_a_requested_cycle_says_so(engine: FakeEngine, suites: dict) -> None:
    cycle = make_cycle(engine, suites, ab_share=1.0)
    assert cycle.run("in_domain").ab_reason == "drawn"
    assert cycle.run("in_domain", ab=True).ab_reason == "requested"
    forced_off = cycle.run("in_domain", ab=False)
    assert not forced_off.ab and forced_off.ab_reason == ""
