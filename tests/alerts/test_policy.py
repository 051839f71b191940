"""Auto-fallback: acceptance drop -> speculation off for that bucket, probation recovery."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from alerts.baselines import BaselineConfig
from alerts.errors import PolicyError
from alerts.evaluator import EvaluationOptions, evaluate
from alerts.flags import FlagStore, SqlFlagProvider
from alerts.policy import Policy, load_policy, parse_policy
from alerts.rule_file import parse_rule
from probes.canaries import CanarySuite
from probes.prober import Prober
from storage.models import Alert
from storage.writer import Writer
from tests.alerts.builders import add_traffic
from tests.probes.fakes import FakeEngine, FakeTimings, prompt_of

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
ACCEPTANCE = parse_rule({"name": "acceptance_drop", "metric": "acceptance_rate",
                         "source": "traffic", "change": "-20%", "resolve_change": "-7%",
                         "for": 3, "resolve_for": 3, "min_samples": 3, "lookback": 10,
                         "baseline_window": "1h", "min_baseline_cycles": 20})
POLICY_DOC = {
    "policies": [{
        "name": "spec_off", "alerts": ["acceptance_drop"], "flag": "speculative",
        "scope_from": "bucket", "value": False, "probation": 0.1, "expires": "24h",
        "hold": "5m", "cooldown": "30m",
        "recovery": {"measure": "probation_acceptance", "window": "5m", "min_samples": 40,
                     "within": "-7%"}}],
    "revert": {"alerts": ["traffic_p99_regression"], "within": "30m"},
}


def minute(i: int) -> datetime:
    return T0 + timedelta(minutes=i)


def policy() -> Policy:
    items, revert = parse_policy(POLICY_DOC)
    return Policy(items, revert_on=revert["on"], revert_within_s=revert["within_s"])


def tick(sm: sessionmaker[Session], i: int, pol: Policy):
    with sm.begin() as s:
        return evaluate(
            s,
            EvaluationOptions(
                [ACCEPTANCE], policy=pol, baseline_config=BaselineConfig(warm_in_s=0)
            ),
            minute(i) + timedelta(seconds=30),
        )


def flags_at(sm: sessionmaker[Session], i: int):
    with sm() as s:
        return FlagStore(lambda: minute(i)).runtime_flags(s)


def test_acceptance_drop_turns_off_one_bucket_then_probation_restores_it(
        sessionmaker: sessionmaker[Session]):
    pol = policy()
    with sessionmaker.begin() as s:
        for i in range(40):
            add_traffic(s, minute(i), "16")
            add_traffic(s, minute(i), "64")
        for i in range(40, 43):  # shifted-domain traffic reaches bucket 64 only
            add_traffic(s, minute(i), "16")
            add_traffic(s, minute(i), "64", acceptance=0.4)
    tick(sessionmaker, 40, pol)
    assert tick(sessionmaker, 41, pol).actions == ()  # pending: nothing flips yet
    assert tick(sessionmaker, 42, pol).actions == ()
    rep = tick(sessionmaker, 43, pol)
    (firing,) = rep.firing
    assert firing.labels == {"bucket": "64"}
    sets = [a for a in rep.actions if a.kind == "set"]
    assert [(a.flag, a.scope, a.value) for a in sets] == [("speculative", "64", False)]
    with sessionmaker() as s:
        alert = s.scalars(select(Alert).where(Alert.state == "firing")).one()
        eff = FlagStore(lambda: minute(43)).effective(s)
        flag = eff[("speculative", "64")]
        assert flag.source == "auto" and flag.alert_id == alert.id
        assert "acceptance_drop firing" in flag.reason and f"[alert {alert.id}]" in flag.reason
        assert flag.expires_at == minute(43) + timedelta(seconds=30) + timedelta(hours=24)
    f = flags_at(sessionmaker, 43)
    assert f.speculative_for("64") is False and f.speculative_for("16") is True
    assert f.speculative_probation == 0.1
    # Bucket 64 now decodes directly; 10% probation requests still speculate, badly at first.
    restored_at = None
    with sessionmaker.begin() as s:
        for i in range(43, 70):
            add_traffic(s, minute(i), "16")
            add_traffic(s, minute(i), "64", acceptance=None, probation=4,
                        probation_acceptance=0.4 if i < 55 else 0.8)
    for i in range(44, 70):
        rep = tick(sessionmaker, i, pol)
        kinds = [(a.kind, a.flag) for a in rep.actions]
        assert ("set", "speculative") not in kinds, i  # never flipped back off (cooldown)
        if ("restore", "speculative") in kinds:
            restored_at = i
            break
    # Held >= 5 min long ago, but only restored once probation acceptance is back.
    assert restored_at is not None and 58 <= restored_at <= 62
    f = flags_at(sessionmaker, restored_at)
    assert f.speculative_for("64") is True and f.speculative_probation == 0.0
    with sessionmaker() as s:
        audit = FlagStore().audit(s, "speculative", "64")
        assert audit[0].action == "restore" and "probation acceptance" in audit[0].reason
        # The restore and the set it undoes name the same alert in a column, not in text.
        set_row = next(a for a in audit if a.action == "set")
        assert audit[0].alert_id is not None and audit[0].alert_id == set_row.alert_id
    # The acceptance alert may still be firing a few cycles: the policy must not flap.
    for i in range(restored_at + 1, 70):
        rep = tick(sessionmaker, i, pol)
        assert not [a for a in rep.actions if a.kind == "set"]


def _firing(s: Session, rule: str, bucket: str, at: datetime) -> Alert:
    a = Alert(fingerprint=f"{rule}-{bucket}", rule=rule, labels={"bucket": bucket},
              state="firing", started_at=at, fired_at=at, updated_at=at,
              annotations={"summary": "x"})
    s.add(a)
    s.flush()
    return a


def test_manual_flag_wins_and_policy_never_overwrites_it(sessionmaker: sessionmaker[Session]):
    now = minute(0)
    with sessionmaker.begin() as s:
        FlagStore(lambda: now).set(s, "speculative", "64", True, reason="keep it on", actor="ana")
        _firing(s, "acceptance_drop", "64", now)
        actions = policy().apply(s, now)
        assert [(a.kind, a.scope) for a in actions] == [("skip", "64")]
        assert "manual" in actions[0].reason
        rows = FlagStore(lambda: now).list(s)
        assert [(r.name, r.scope, r.source, r.value) for r in rows] == [
            ("speculative", "64", "manual", True)]


def test_p99_regression_after_automatic_change_reverts_it(sessionmaker: sessionmaker[Session]):
    pol = policy()
    with sessionmaker.begin() as s:
        acc = _firing(s, "acceptance_drop", "64", minute(0))
        assert [a.kind for a in pol.apply(s, minute(1))] == ["set", "probation"]
        _firing(s, "traffic_p99_regression", "64", minute(10))
        actions = pol.apply(s, minute(11))
        assert [(a.kind, a.flag, a.scope) for a in actions] == [
            ("revert", "speculative", "64"), ("probation", "speculative_probation", "global")]
        assert "traffic_p99_regression" in actions[0].reason
        assert FlagStore(lambda: minute(11)).runtime_flags(s).speculative_for("64") is True
        # The acceptance alert is still firing, but this change was undone for it.
        again = pol.apply(s, minute(50))
        assert [a.kind for a in again] == ["skip"] and f"alert {acc.id}" in again[0].reason


def test_p99_regression_in_another_bucket_or_too_late_keeps_the_change(
        sessionmaker: sessionmaker[Session]):
    pol = policy()
    with sessionmaker.begin() as s:
        _firing(s, "acceptance_drop", "64", minute(0))
        pol.apply(s, minute(1))
        _firing(s, "traffic_p99_regression", "16", minute(5))
        assert not [a for a in pol.apply(s, minute(6)) if a.kind == "revert"]
        _firing(s, "traffic_p99_regression", "64", minute(45))
        assert not [a for a in pol.apply(s, minute(46)) if a.kind == "revert"]


def test_automatic_flag_expires(sessionmaker: sessionmaker[Session]):
    pol = policy()
    with sessionmaker.begin() as s:
        a = _firing(s, "acceptance_drop", "64", minute(0))
        pol.apply(s, minute(1))
        a.state = "resolved"
        actions = pol.apply(s, minute(1) + timedelta(hours=25))
        assert actions[0].kind == "expire"
        assert FlagStore(lambda: minute(0) + timedelta(hours=25)).list(s) == []


def test_shipped_policy_loads_and_bad_policies_name_the_field(tmp_path: Path):
    pol = load_policy()
    names = {p.name: p for p in pol.policies}
    assert names["speculation_off_on_acceptance_drop"].probation == 0.1
    assert names["eager_on_compile_trouble"].flag == "compiled"
    # Fallbacks slow canaries by design: only real-traffic p99 may revert one.
    assert pol.revert_on == ("traffic_p99_regression",) or set(pol.revert_on) == {
        "traffic_p99_regression"}
    for patch, field in [({"flag": "turbo"}, "flag"), ({"value": "off"}, "value"),
                         ({"alerts": []}, "alerts"), ({"probation": 2}, "probation"),
                         ({"hold": "later"}, "hold"), ({"scope_from": "path"}, "scope_from"),
                         ({"recovery": {"measure": "vibes"}}, "recovery.measure"),
                         # canary_variant pairs the arm that switches this flag back on.
                         ({"recovery": {"measure": "canary_variant", "variant": "compiled"}},
                          "recovery.variant")]:
        doc = {"policies": [{**POLICY_DOC["policies"][0], **patch}]}
        with pytest.raises(PolicyError) as info:
            parse_policy(doc, "user.yaml")
        assert info.value.field == field and "policy 'spec_off'" in str(info.value)
    bad = tmp_path / "p.yaml"
    bad.write_text("policies: {}\n")
    with pytest.raises(PolicyError, match="must be a list"):
        load_policy(str(bad))


def _arm_prober(sessions: sessionmaker[Session], engine: FakeEngine, clock: list[datetime],
                arm: str, buckets: tuple[int, ...] = (40, 45)) -> tuple[Prober, Writer]:
    """The real prober, every cycle A/B with `arm`, two canaries per bucket."""
    writer = Writer(sessions)
    suite = CanarySuite("in_domain", "in_domain",
                        tuple(prompt_of(n, seed=n) for n in buckets), 12, "test")
    return Prober(engine, writer, {"in_domain": suite}, instance_id="i1",
                  canaries_per_bucket=2, ab_share=1.0, ab_arms=(arm,), rng=random.Random(0),
                  clock=lambda: clock[0]), writer


def _run_cycles(prober: Prober, writer: Writer, clock: list[datetime], t0: datetime,
                minutes: range) -> None:
    for i in minutes:
        clock[0] = t0 + timedelta(minutes=i)
        prober.run_cycle()
    assert writer.flush(timeout=30) and writer.stats.failed == 0


def test_eager_fallback_is_restored_when_the_compiled_arm_recovers(
        sessionmaker: sessionmaker[Session]):
    # A fleet-wide eager policy recovered by the canaries' compiled arm (the shipped one reads
    # real traffic's recompiles per instance: tests/alerts/test_fallbacks.py). The arm runs
    # beside the eager fallback prompt by prompt: the paired speedup decides, not p99s.
    items, _ = parse_policy({"policies": [{
        "name": "eager", "alerts": ["recompiles_per_hour"], "flag": "compiled", "value": False,
        "expires": "6h", "hold": "30m", "cooldown": "1h",
        "recovery": {"measure": "canary_variant", "variant": "compiled", "window": "30m",
                     "min_samples": 8, "within": "+0%"}}]})
    pol = Policy(items)
    # Flags expire on the wall clock (the SQL provider reads them now): stay near it.
    t0 = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=2)
    clock = [t0]
    # Compiled is slower than eager on this host at first (the fake's fixed latencies).
    total = {("64", "compiled", "speculative"): 0.30, ("64", "eager", "speculative"): 0.21}
    engine = FakeEngine(flags=SqlFlagProvider(sessionmaker, ttl_s=0.0),
                        timings=FakeTimings(total_s=total))
    engine.warm_up()
    prober, writer = _arm_prober(sessionmaker, engine, clock, "eager")
    try:
        with sessionmaker.begin() as s:
            _firing(s, "recompiles_per_hour", "", t0)
            assert [(a.kind, a.flag) for a in pol.apply(s, t0 + timedelta(minutes=1))] == [
                ("set", "compiled")]
        # While eager is in force the canaries probe the compiled path as a reverse A/B arm.
        _run_cycles(prober, writer, clock, t0, range(5, 35, 5))
        with sessionmaker.begin() as s:
            # Compiled still slower than eager: keep the fallback.
            assert "restore" not in [a.kind for a in pol.apply(s, t0 + timedelta(minutes=34))]
        total[("64", "eager", "speculative")] = 0.45  # compiled recovers: 1.5x faster
        _run_cycles(prober, writer, clock, t0, range(35, 65, 5))
        with sessionmaker.begin() as s:
            actions = pol.apply(s, t0 + timedelta(minutes=66))
            assert [(a.kind, a.flag) for a in actions] == [("restore", "compiled")]
            # Cycles at minutes 40..60, two prompts each: 10 pairs at eager/compiled = 1.5.
            assert ("canary compiled arm 1.500x the fallback path, paired per prompt over 10 "
                    "pairs (95% CI 1.500-1.500x) in every bucket (>= 1.000x, within +0%)"
                    ) in actions[0].reason
            assert FlagStore(lambda: t0 + timedelta(minutes=66)).runtime_flags(s).compiled
    finally:
        writer.close()
        engine.close()


def test_a_bucket_fallback_is_restored_by_its_own_buckets_pairs_only(
        sessionmaker: sessionmaker[Session]):
    items, _ = parse_policy({"policies": [{
        "name": "direct", "alerts": ["p99_latency_regression"], "flag": "speculative",
        "scope_from": "bucket", "value": False, "hold": "10m", "cooldown": "1h",
        "recovery": {"measure": "canary_variant", "variant": "speculative", "window": "10m",
                     "min_samples": 4, "within": "+5%"}}]})
    pol = Policy(items)
    t0 = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=2)
    clock = [t0]
    # Speculation pays in bucket 16 and costs in 64: the fake's fixed latencies per arm.
    total = {("16", "compiled", "speculative"): 0.10, ("16", "compiled", "direct"): 0.14,
             ("64", "compiled", "speculative"): 0.30, ("64", "compiled", "direct"): 0.20}
    engine = FakeEngine(flags=SqlFlagProvider(sessionmaker, ttl_s=0.0),
                        timings=FakeTimings(total_s=total))
    engine.warm_up()
    prober, writer = _arm_prober(sessionmaker, engine, clock, "direct",
                                 buckets=(10, 12, 40, 45))
    try:
        with sessionmaker.begin() as s:
            fired = [_firing(s, "p99_latency_regression", b, t0) for b in ("16", "64")]
            pol.apply(s, t0)
            for alert in fired:
                alert.state = "resolved"
            assert FlagStore(lambda: t0).runtime_flags(s).speculative == {
                "16": False, "64": False}
        _run_cycles(prober, writer, clock, t0, range(1, 12))
        with sessionmaker.begin() as s:
            actions = pol.apply(s, t0 + timedelta(minutes=12))
            assert [(a.kind, a.scope) for a in actions] == [("restore", "16")]
            assert "1.400x the fallback path" in actions[0].reason
            assert "in bucket 16" in actions[0].reason
    finally:
        writer.close()
        engine.close()
