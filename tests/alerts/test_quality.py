"""Output agreement end to end: a perturbed int8 arm fires in one bucket and is turned off.

The real runtime with `engine.quantization: int8` and the `quantizer` test seam (float
weights with noise instead of int8), rolled out to bucket 32 only; the production Prober
with its OutputChecker stores agreements; the shipped rules and policy evaluate them.
"""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from alerts.evaluator import EvaluationOptions, evaluate
from alerts.flags import FlagStore, SqlFlagProvider
from alerts.policy import load_policy
from alerts.quality import canary_recovery
from alerts.rule_file import load_rules
from engine.protocol import RuntimeFlags
from monitor.report.job import build_report
from monitor.report.markdown import render_markdown
from monitor.report.week import week_of
from probes.canaries import CanarySuite
from probes.prober import Prober
from probes.reference import OutputChecker
from storage import make_engine, make_sessionmaker
from storage.migrate import upgrade
from storage.writer import Writer

# The policy's flag expires 24 h after it is set and the engine reads flags on the wall
# clock: a fixed date would let the flag expire a day after this was written.
T0 = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(minutes=10)


class RolloutFlags:
    """The SQL flags over a rollout that serves int8 in bucket 32 only (SQL flags win)."""

    def __init__(self, sql: SqlFlagProvider) -> None:
        self.sql = sql

    def flags(self) -> RuntimeFlags:
        f = self.sql.flags()
        return replace(f, quantized_default=False, quantized={"32": True, **f.quantized})

    def invalidate(self) -> None:
        self.sql.invalidate()


def _prompts(engine, bucket: str, words: tuple[str, ...], n: int) -> list[str]:
    rng = random.Random(7)
    out: list[str] = []
    while len(out) < n:
        text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 8)))
        if engine.bucket_for(engine.count_tokens(text)) == bucket and text not in out:
            out.append(text)
    return out


@pytest.mark.slow
def test_noisy_int8_arm_fires_in_its_bucket_only_and_is_turned_off(tmp_path: Path) -> None:
    from engine.config import EngineConfig
    from engine.quantize import noisy
    from engine.runtime import Runtime

    url = f"sqlite:///{tmp_path / 'q.db'}"
    upgrade(url)
    db = make_engine(url)
    sessions: sessionmaker[Session] = make_sessionmaker(db)
    flags = RolloutFlags(SqlFlagProvider(sessions, ttl_s=0.0))
    config = EngineConfig(device="cpu", compile_mode="off", quantization="int8",
                          flags_file="", flag_timeout_s=5.0, use_draft=False)
    engine = Runtime(config, flags, quantizer=noisy(1.0))
    writer = Writer(sessions)
    words = ("the", "small", "river", "green", "field", "stone", "house", "light")
    suite = CanarySuite("in_domain", "in_domain",
                        tuple(_prompts(engine, "16", words, 2) + _prompts(engine, "32", words, 2)),
                        max_new_tokens=12)
    now = [T0]
    prober = Prober(engine, writer, {"in_domain": suite}, instance_id="a",
                    canaries_per_bucket=2, ab_share=0.0, rng=random.Random(0),
                    clock=lambda: now[0], checker=OutputChecker(engine, sessions=sessions,
                                                                writer=writer))
    rules = load_rules()
    policy = load_policy()
    try:
        for minute in range(4):
            now[0] = T0 + timedelta(minutes=minute, seconds=5)
            prober.run_cycle()
            got = {g.bucket: g for g in prober.agreements}
            assert got["16"].exact == 2 and got["32"].exact == 0, got
        assert writer.flush(timeout=30) and writer.stats.failed == 0
        with sessions.begin() as s:
            report = evaluate(s, EvaluationOptions(rules, policy=policy), T0 + timedelta(minutes=4))
        firing = [(r.rule, dict(r.labels)) for r in report.firing]
        assert firing == [("output_agreement_drop", {"bucket": "32", "variant": "optimized"})]
        assert [(a.kind, a.flag, a.scope, a.value) for a in report.actions
                if a.kind == "set"] == [("set", "quantized", "32", False)]

        # The flag reaches the engine: bucket 32 serves float32 again and agrees.
        flags.invalidate()
        now[0] = T0 + timedelta(minutes=4, seconds=5)
        prober.run_cycle(ab=True)
        got = {(g.bucket, g.variant): g for g in prober.agreements}
        assert got["32", "optimized"].exact == 2
        # The quantized arm still runs int8 there, and it still disagrees: no recovery.
        assert got["32", "quantized"].exact == 0
        assert writer.flush(timeout=30)
        with sessions() as s:
            assert canary_recovery(s, "32", T0, T0 + timedelta(minutes=6), variant="quantized",
                                   floor=0.99, min_samples=2) is None
            stored = FlagStore().runtime_flags(s)
            report = build_report(s, week_of(T0), T0 + timedelta(minutes=6))
        assert stored.quantized == {"32": False}
        # The weekly report lists the bucket, its agreement and where outputs diverged.
        rows = {(r.bucket, r.arm): r for r in report.data.quality}
        assert rows["32", "quantized"].agreement < 0.5 and rows["16", "optimized"].exact == 10
        text = render_markdown(report)
        section = text.split("## Quality", 1)[1].split("\n## ", 1)[0]
        line = next(ln for ln in section.splitlines()
                    if "| quantized | canary | 32 |" in ln)
        assert "int8 weights" in line and rows["32", "quantized"].worst
        check = next(c for o in report.optimizations if o.name == "int8 weights"
                     for c in o.checks if c.assumption.id == "int8-agreement")
        assert check.status == "violated"
    finally:
        writer.close()
        engine.close()
        db.dispose()


def test_quantized_flag_is_per_bucket_and_survives_the_flags_file(
        sessionmaker: sessionmaker[Session], tmp_path: Path) -> None:
    from alerts.errors import FlagError
    from alerts.flags import validate
    from engine.flags import load_flags, save_flags

    store = FlagStore()
    with sessionmaker.begin() as s:
        store.set(s, "quantized", "32", False, reason="int8 drifts on logs", actor="ana")
    with sessionmaker() as s:
        flags = store.runtime_flags(s)
    assert flags.quantized == {"32": False}
    assert flags.quantized_for("16") and not flags.quantized_for("32")
    with pytest.raises(FlagError):
        validate("quantized", "instance:a", True)
    save_flags(tmp_path / "flags.json", flags)
    assert load_flags(tmp_path / "flags.json").quantized == {"32": False}


def test_canary_recovery_needs_the_quantized_arm_at_the_floor(
        sessionmaker: sessionmaker[Session]) -> None:
    from storage.models import OutputAgreement

    def row(minute: int, agreement: float, variant: str = "quantized") -> OutputAgreement:
        return OutputAgreement(at=T0 + timedelta(minutes=minute), source="canary",
                               bucket="32", path="compiled", decoding="direct",
                               variant=variant, count=4, exact=4 if agreement == 1 else 0,
                               agreement_sum=4 * agreement, length_diff_sum=0)

    with sessionmaker.begin() as s:
        s.add_all([row(1, 0.9), row(2, 1.0), row(3, 1.0), row(4, 0.2, "optimized")])
    end = T0 + timedelta(minutes=5)
    with sessionmaker() as s:
        assert canary_recovery(s, "32", T0, end, variant="quantized", floor=0.99,
                               min_samples=8) is None  # 0.9667 over 12 outputs
        why = canary_recovery(s, "32", T0 + timedelta(minutes=2), end, variant="quantized",
                              floor=0.99, min_samples=8)
        assert why is not None and "agreement 1.0000 >= floor 0.99 over 8 outputs" in why
        assert canary_recovery(s, "32", T0 + timedelta(minutes=2), end, variant="quantized",
                               floor=0.99, min_samples=9) is None
