"""The durable flag store and the engine's SQL flag provider."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from alerts.errors import FlagError
from alerts.flags import FlagStore, SqlFlagProvider
from engine.protocol import FlagProvider, RuntimeFlags
from storage.db import make_engine, make_sessionmaker

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


def test_manual_wins_over_auto_and_both_are_audited(sessionmaker: sessionmaker[Session]):
    clock = Clock()
    store = FlagStore(clock)
    with sessionmaker.begin() as s:
        store.set(s, "speculative", "64", False, source="auto", reason="acceptance fell",
                  actor="policy", alert_id=None)
        assert store.runtime_flags(s).speculative == {"64": False}
        store.set(s, "speculative", "64", True, reason="draft retrained", actor="ana")
        flags = store.runtime_flags(s)
        assert flags.speculative_for("64") is True and flags.speculative_for("16") is True
        assert store.effective(s)[("speculative", "64")].source == "manual"
        assert len(store.list(s)) == 2  # the automatic row stays, shadowed
        store.clear(s, "speculative", "64", reason="let the policy decide", actor="ana")
        assert store.runtime_flags(s).speculative_for("64") is False
        audit = store.audit(s, "speculative", "64")
        assert [(a.action, a.source, a.old_value, a.new_value) for a in audit] == [
            ("clear", "manual", True, None), ("set", "manual", None, True),
            ("set", "auto", None, False)]
        assert audit[0].actor == "ana" and audit[0].reason == "let the policy decide"


def test_global_flags_build_runtime_flags(sessionmaker: sessionmaker[Session]):
    store = FlagStore(Clock())
    with sessionmaker.begin() as s:
        assert store.runtime_flags(s) == RuntimeFlags()
        store.set(s, "compiled", "global", False, reason="recompile storm", actor="bob")
        store.set(s, "bucketing", "global", False, reason="experiment", actor="bob")
        store.set(s, "speculative", "global", False, reason="draft broken", actor="bob")
        store.set(s, "speculative_probation", "global", 0.1, reason="measure", actor="bob")
        f = store.runtime_flags(s)
    assert (f.compiled, f.bucketing, f.speculative_default, f.speculative_probation) == (
        False, False, False, 0.1)


def test_expired_flags_are_ignored_then_cleaned_with_audit(sessionmaker: sessionmaker[Session]):
    clock = Clock()
    store = FlagStore(clock)
    with sessionmaker.begin() as s:
        store.set(s, "compiled", "global", False, source="auto", reason="storm", actor="policy",
                  expires_at=T0 + timedelta(hours=1))
        assert store.runtime_flags(s).compiled is False
    clock.now = T0 + timedelta(hours=2)
    with sessionmaker.begin() as s:
        assert store.runtime_flags(s).compiled is True
        assert store.list(s) == [] and len(store.list(s, include_expired=True)) == 1
        assert store.expire(s) == 1
        assert store.list(s, include_expired=True) == []
        last = store.audit(s, "compiled")[0]
        assert last.action == "expire" and last.old_value is False


@pytest.mark.parametrize(("args", "field"), [
    (("turbo", "global", True), "name"),
    (("speculative", "sixty-four", False), "scope"),
    (("compiled", "64", False), "scope"),
    (("compiled", "global", "off"), "value"),
    (("speculative_probation", "global", 1.5), "value"),
    (("speculative_probation", "global", True), "value"),
])
def test_validation_errors_name_the_field(sessionmaker: sessionmaker[Session], args, field):
    store = FlagStore(Clock())
    with sessionmaker.begin() as s, pytest.raises(FlagError) as info:
        store.set(s, *args, reason="r", actor="a")
    assert info.value.field == field and isinstance(info.value, ValueError)


def test_reason_actor_source_and_expiry_are_required_sane(sessionmaker: sessionmaker[Session]):
    store = FlagStore(Clock())
    with sessionmaker.begin() as s:
        for kw, field in [({"reason": " "}, "reason"), ({"actor": ""}, "actor"),
                          ({"source": "robot"}, "source"),
                          ({"expires_at": T0 - timedelta(seconds=1)}, "expires_at")]:
            args = {"reason": "r", "actor": "a", **kw}
            with pytest.raises(FlagError) as info:
                store.set(s, "compiled", "global", False, **args)
            assert info.value.field == field
        assert store.list(s) == []


def test_sql_provider_caches_for_ttl_and_raises_on_db_errors(
        sessionmaker: sessionmaker[Session], tmp_path: Path):
    ticks = [0.0]
    provider = SqlFlagProvider(sessionmaker, ttl_s=1.0, monotonic=lambda: ticks[0])
    assert isinstance(provider, FlagProvider)
    assert provider.flags().compiled is True
    with sessionmaker.begin() as s:
        FlagStore().set(s, "compiled", "global", False, reason="storm", actor="a")
    assert provider.flags().compiled is True  # cached
    ticks[0] = 1.5
    assert provider.flags().compiled is False
    # A database without the tables (or down) raises: the engine keeps its last flags.
    broken = make_sessionmaker(make_engine(f"sqlite:///{tmp_path / 'empty.db'}"))
    with pytest.raises(OperationalError):
        SqlFlagProvider(broken).flags()
