"""Issue 34: the C decode step earns its keep per instance, or the compiled step serves.

The real prober (A/B cycles with the compiled_step arm, outputs checked against the
reference path) stores through the production writer; the shipped rules and policy read
the rows; the engine reads the flag through the production SQL provider.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from sqlalchemy.orm import Session, sessionmaker

from alerts.evaluator import EvaluationOptions, evaluate
from alerts.flags import FlagStore, SqlFlagProvider
from alerts.policy import load_policy
from alerts.rule_file import load_rules
from probes.canaries import CanarySuite
from probes.prober import Prober
from probes.reference import OutputChecker
from storage.writer import Writer
from tests.probes.fakes import FakeEngine, FakeTimings, prompt_of

# Flags expire on the wall clock (the SQL provider reads them now): stay near it.
T0 = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(hours=2)


def _prober(sessions: sessionmaker[Session], instance: str, factor: float,
            now: list[datetime]) -> tuple[Prober, FakeEngine, Writer]:
    flags = SqlFlagProvider(sessions, ttl_s=0.0, instance_id=instance)
    engine = FakeEngine(flags=flags, native_step=True,
                        timings=FakeTimings(compiled_step_factor=factor))
    engine.warm_up()
    writer = Writer(sessions)
    # Two canaries in bucket 16 and two in 64 (bytes + EOS = tokens).
    suite = CanarySuite("in_domain", "in_domain",
                        tuple(prompt_of(n, seed=n) for n in (10, 12, 40, 45)), 12, "test")
    prober = Prober(engine, writer, {"in_domain": suite}, instance_id=instance,
                    canaries_per_bucket=2, ab_share=1.0, ab_arms=(), rng=random.Random(0),
                    clock=lambda: now[0],
                    checker=OutputChecker(engine, sessions=sessions, writer=writer))
    return prober, engine, writer


def _cycles(prober: Prober, writer: Writer, now: list[datetime], minutes: range) -> None:
    for m in minutes:
        now[0] = T0 + timedelta(minutes=m, seconds=5)
        prober.run_cycle()
    assert writer.flush(timeout=30) and writer.stats.failed == 0


def _native(sessions: sessionmaker[Session], at: datetime, instance: str) -> bool:
    with sessions() as s:
        return FlagStore(lambda: at).runtime_flags(s, instance).native_step


def test_a_slower_c_step_falls_back_per_instance_and_is_restored_when_it_wins_again(
        sessionmaker: sessionmaker[Session]) -> None:
    now = [T0]
    # The compiled step takes 0.8x the C step's time on this host: the C step lost.
    prober, engine, writer = _prober(sessionmaker, "i1", 0.8, now)
    policy = load_policy()
    try:
        _cycles(prober, writer, now, range(4))  # 4 pairs a cycle: 16 >= min_pairs 12
        assert {frozenset(p.order) for p in prober.cycle.run("in_domain", ab=True).pairs} \
            == {frozenset({"optimized", "compiled_step"})}
        with sessionmaker.begin() as s:
            actions = [a for a in policy.apply(s, T0 + timedelta(minutes=5)) if a.kind == "set"]
        assert [(a.flag, a.scope, a.value) for a in actions] == [
            ("native_step", "instance:i1", False)]
        assert "0.800x the compiled step over 16 canary pairs" in actions[0].reason
        assert _native(sessionmaker, T0 + timedelta(minutes=5), "i1") is False
        assert _native(sessionmaker, T0 + timedelta(minutes=5), "i2") is True

        # The engine reads it: the compiled step serves, the reverse arm runs the C step.
        r = engine.generate(prompt_of(12, seed=12))
        assert r.path == "compiled" and r.native_step is False
        # The C step wins again (a fixed build): after the hold its reverse arm agrees with
        # the reference and is faster, and the flag is restored.
        engine.timings.compiled_step_factor = 1.5
        _cycles(prober, writer, now, range(6, 40, 3))
        assert {frozenset(p.order) for p in prober.cycle.run("in_domain", ab=True).pairs} \
            == {frozenset({"optimized", "native_step"})}
        with sessionmaker.begin() as s:
            assert "restore" not in [a.kind for a in policy.apply(s, T0 + timedelta(minutes=20))]
            restored = [a for a in policy.apply(s, T0 + timedelta(minutes=40))
                        if a.kind == "restore"]
        assert [(a.flag, a.scope) for a in restored] == [("native_step", "instance:i1")]
        assert "native_step arm agreement 1.0000" in restored[0].reason
        assert "C step 1.500x the compiled step" in restored[0].reason
        assert _native(sessionmaker, T0 + timedelta(minutes=40), "i1") is True
        assert engine.generate(prompt_of(12, seed=12)).native_step is True
    finally:
        writer.close()


def test_a_c_step_that_disagrees_with_the_reference_is_turned_off_on_its_instance(
        sessionmaker: sessionmaker[Session]) -> None:
    now = [T0]
    prober, engine, writer = _prober(sessionmaker, "i2", 1.5, now)  # fast, but wrong
    engine.native_output_shift = 1
    try:
        _cycles(prober, writer, now, range(4))
        with sessionmaker.begin() as s:
            report = evaluate(s, EvaluationOptions(rules=load_rules(), policy=load_policy()),
                              T0 + timedelta(minutes=4))
        assert ("native_step_agreement_drop", {"instance": "i2"}) in [
            (a.rule, dict(a.labels)) for a in report.firing]
        assert [(a.flag, a.scope, a.value) for a in report.actions if a.kind == "set"
                and a.flag == "native_step"] == [("native_step", "instance:i2", False)]
        assert _native(sessionmaker, T0 + timedelta(minutes=5), "i2") is False
        # The compiled step serves that instance and agrees with the reference again.
        now[0] = T0 + timedelta(minutes=5, seconds=5)
        prober.run_cycle(ab=True)
        got = {(g.bucket, g.variant): g for g in prober.agreements}
        assert got["16", "optimized"].exact == got["16", "optimized"].count == 2
        assert got["16", "native_step"].exact == 0  # the C step is still wrong: no restore
    finally:
        writer.close()
