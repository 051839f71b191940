"""Issue 14: fallbacks that hold while the problem lasts, and manual wins everywhere.

Finding 4: the eager fallback was restored from the canaries' compiled arm (fixed shapes
that never churn) while the storm went on, and never re-engaged. Finding 5: a manual
kill switch leaked through the probation draw while another bucket was automatically off.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from alerts.errors import FlagError, PolicyError
from alerts.flags import FlagStore, SqlFlagProvider
from alerts.policy import Policy, load_policy, parse_policy
from storage.models import Alert, CompileEvent, ProbeRun

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def minute(i: float) -> datetime:
    return T0 + timedelta(minutes=i)


def firing(s: Session, rule: str, labels: dict[str, str], at: datetime,
           breaching: bool = True) -> Alert:
    a = Alert(fingerprint=f"{rule}-{sorted(labels.items())}", rule=rule, labels=labels,
              state="firing", started_at=at, fired_at=at, updated_at=at,
              annotations={"summary": "x"}, consecutive_breaches=3 if breaching else 0)
    s.add(a)
    s.flush()
    return a


def recompiles(s: Session, at: datetime, n: int, instance: str = "i1", *,
               canary: bool = False) -> None:
    run_id = None
    if canary:
        run = ProbeRun(started_at=at, status="ok", instance_id=instance, kind="cycle")
        s.add(run)
        s.flush()
        run_id = run.id
    s.add(CompileEvent(at=at, instance_id=instance, recompiles=n, run_id=run_id))


def compiled(s: Session, at: datetime, instance: str | None) -> bool:
    return FlagStore(lambda: at).runtime_flags(s, instance).compiled


def test_eager_fallback_is_scoped_to_the_storming_instance(sessionmaker: sessionmaker[Session]):
    pol = load_policy()  # shipped: scope_from instance
    with sessionmaker.begin() as s:
        firing(s, "recompiles_per_hour", {"instance": "i1"}, minute(0))
        actions = pol.apply(s, minute(1))
        assert [(a.kind, a.flag, a.scope) for a in actions] == [
            ("set", "compiled", "instance:i1")]
        assert compiled(s, minute(1), "i1") is False
        assert compiled(s, minute(1), "i2") is True
        assert compiled(s, minute(1), None) is True
    # The engine of each instance reads its own scope through the production provider.
    store = FlagStore(lambda: minute(2))  # the fallback expires after 6h
    assert SqlFlagProvider(sessionmaker, store=store, instance_id="i1").flags().compiled is False
    assert SqlFlagProvider(sessionmaker, store=store, instance_id="i2").flags().compiled is True


def test_a_fleet_policy_still_switches_every_instance(sessionmaker: sessionmaker[Session]):
    items, _ = parse_policy({"policies": [{
        "name": "eager", "alerts": ["recompiles_per_hour"], "flag": "compiled", "value": False,
        "recovery": {"measure": "traffic_recompiles", "limit": 4}}]})
    with sessionmaker.begin() as s:
        firing(s, "recompiles_per_hour", {"instance": "i1"}, minute(0))
        assert [a.scope for a in Policy(items).apply(s, minute(1))] == ["global"]
        assert compiled(s, minute(1), "i2") is False


def test_eager_is_restored_only_on_real_traffic_and_re_engages_while_the_alert_fires(
        sessionmaker: sessionmaker[Session]):
    pol = load_policy()  # hold 30m, real-traffic recompiles < 4/h over 30m
    with sessionmaker.begin() as s:
        alert = firing(s, "recompiles_per_hour", {"instance": "i1"}, minute(0))
        pol.apply(s, minute(1))
        # The canaries' fixed shapes churn nothing; one real-traffic event in the hold
        # (eager was off on another path, or the storm hit right before) keeps eager on.
        for i in range(5, 60, 5):
            recompiles(s, minute(i), 0, canary=True)
        recompiles(s, minute(20), 3)
        assert "restore" not in [a.kind for a in pol.apply(s, minute(40))]
        assert compiled(s, minute(40), "i1") is False
        # Another instance's storm does not hold this one's fallback.
        recompiles(s, minute(45), 50, instance="i2")
        actions = pol.apply(s, minute(51))
        assert [(a.kind, a.scope) for a in actions] == [("restore", "instance:i1")]
        assert "real-traffic recompiles" in actions[0].reason
        assert compiled(s, minute(51), "i1") is True
        # The alert that caused it still fires and its latest cycle still breaches:
        # the storm goes on, the fallback comes straight back (no cooldown, no new alert).
        actions = pol.apply(s, minute(52))
        assert [(a.kind, a.scope) for a in actions] == [("set", "instance:i1")]
        assert actions[0].reason.startswith("re-engaged: alert") and actions[0].alert_id == alert.id
        assert compiled(s, minute(52), "i1") is False
        # Next restore: the alert is recovering (no breach): the restore holds.
        alert.consecutive_breaches = 0
        assert [a.kind for a in pol.apply(s, minute(83))] == ["restore"]
        assert "set" not in [a.kind for a in pol.apply(s, minute(84))]
        assert compiled(s, minute(84), "i1") is True


def test_probation_is_not_set_where_speculation_is_manually_off(
        sessionmaker: sessionmaker[Session]):
    pol = load_policy()  # speculation off per bucket with probation 0.1
    with sessionmaker.begin() as s:
        FlagStore(lambda: minute(0)).set(s, "speculative", "global", False,
                                         reason="kill switch", actor="ana")
        firing(s, "acceptance_drop", {"bucket": "64"}, minute(0))
        kinds = [(a.kind, a.flag) for a in pol.apply(s, minute(1))]
        assert ("set", "speculative") in kinds and ("probation", "speculative_probation") \
            not in kinds
        flags = FlagStore(lambda: minute(1)).runtime_flags(s)
        assert flags.speculative_probation == 0.0
        assert flags.manual_off == frozenset({"global"})
        assert flags.probation_for("64") == 0.0 and flags.probation_for("16") == 0.0
        # The kill switch is lifted: the automatically-off bucket gets its probation.
        FlagStore(lambda: minute(2)).clear(s, "speculative", "global", reason="done",
                                           actor="ana")
        assert [a.kind for a in pol.apply(s, minute(2))] == ["probation"]
        flags = FlagStore(lambda: minute(2)).runtime_flags(s)
        assert flags.probation_for("64") == pytest.approx(0.1)


def test_instance_scopes_are_validated(sessionmaker: sessionmaker[Session], tmp_path: Path):
    with sessionmaker.begin() as s, pytest.raises(FlagError) as e:
        FlagStore().set(s, "compiled", "instance:" + "x" * 60, False, reason="r", actor="a")
    assert e.value.field == "scope"
    bad = tmp_path / "policy.yaml"
    bad.write_text("policies:\n  - name: p\n    alerts: [acceptance_drop]\n"
                   "    flag: speculative\n    scope_from: instance\n")
    with pytest.raises(PolicyError) as e2:
        load_policy(str(bad))
    assert "scope_from" in str(e2.value)
