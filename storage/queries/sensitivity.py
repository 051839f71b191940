"""Rule sensitivities: the latest estimate per rule, scope and cohort (alerts.sensitivity)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.models import RuleSensitivity

SensitivityKey = tuple[str, str, str, str]  # rule, scope_key, model_version, config_hash


@dataclass(frozen=True)
class StoredSensitivity:
    """One stored estimate (see storage.models.RuleSensitivity for the fields)."""

    rule: str
    metric: str
    scope: Mapping[str, str]
    scope_key: str
    model_version: str
    config_hash: str
    baseline_id: int | None
    computed_at: datetime
    status: str
    direction: int
    cycles: int
    within_cycles: int
    configured_threshold: float
    threshold: float
    detectable_change: float | None
    false_pages_30d: float | None
    false_pages_configured: float | None
    budget_per_30d: float | None
    reason: str
    cpu_s: float

    @property
    def key(self) -> SensitivityKey:
        """Return (rule, scope_key, model_version, config_hash)."""
        return self.rule, self.scope_key, self.model_version, self.config_hash


_FIELDS = tuple(f.name for f in fields(StoredSensitivity))


def _stored(row: RuleSensitivity) -> StoredSensitivity:
    return StoredSensitivity(**{f: getattr(row, f) for f in _FIELDS})


def save(session: Session, s: StoredSensitivity) -> None:
    """Write `s` over the stored estimate of its rule, scope and cohort."""
    rs = RuleSensitivity
    row = session.scalars(select(rs).where(
        rs.rule == s.rule, rs.scope_key == s.scope_key, rs.model_version == s.model_version,
        rs.config_hash == s.config_hash)).first()
    if row is None:
        row = RuleSensitivity()
        session.add(row)
    for f in _FIELDS:
        setattr(row, f, getattr(s, f))
    session.flush()


def by_key(session: Session, rules: Iterable[str] | None = None
           ) -> dict[SensitivityKey, StoredSensitivity]:
    """Return (rule, scope_key, model_version, config_hash) -> its stored estimate."""
    q = select(RuleSensitivity)
    if rules is not None:
        q = q.where(RuleSensitivity.rule.in_(tuple(rules)))
    return {s.key: s for s in map(_stored, session.scalars(q))}


def listing(session: Session, rule: str | None = None) -> list[StoredSensitivity]:
    """Return stored estimates ordered by rule, scope and cohort."""
    rs = RuleSensitivity
    q = select(rs).order_by(rs.rule, rs.scope_key, rs.model_version, rs.config_hash)
    if rule is not None:
        q = q.where(rs.rule == rule)
    return [_stored(r) for r in session.scalars(q)]


def describe(s: StoredSensitivity) -> str:
    """Return one line: what the rule confirms, how often it pages, and its threshold."""
    sign = "+" if s.direction > 0 else "-"
    thr = f"{sign}{s.threshold:.0%}"
    if s.detectable_change is not None:
        seen = f"confirms {sign}{s.detectable_change:.0%} within {s.within_cycles} cycles (p95)"
    elif s.false_pages_30d is None:  # insufficient history, or past its CPU budget
        return f"{s.reason}; threshold {thr} kept"
    else:
        seen = f"{s.status}: no shift confirmed within {s.within_cycles} cycles"
    widened = f"; {s.reason}" if s.threshold > s.configured_threshold else ""
    return f"{seen}; {s.false_pages_30d:.3g} false pages per 30 days at {thr}{widened}"
