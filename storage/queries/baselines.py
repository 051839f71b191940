"""Relative change of a value against the baseline in force."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.models import (
    Baseline,
    scope_key,
)


@dataclass(frozen=True)
class Change:
    """A current value against a baseline; relative_change None when undefined (reason says why)."""

    current: float | None
    baseline: float | None
    relative_change: float | None
    reason: str | None = None
    baseline_id: int | None = None


def relative_change(current: float | None, baseline: float | None) -> Change:
    """Return (current - baseline) / |baseline|, guarding empty and zero baselines."""
    if current is None or (isinstance(current, float) and math.isnan(current)):
        return Change(current, baseline, None, "no current value")
    if baseline is None or (isinstance(baseline, float) and math.isnan(baseline)):
        return Change(current, baseline, None, "no baseline")
    if baseline == 0:
        if current == 0:
            return Change(current, baseline, 0.0)
        return Change(current, baseline, None, "zero baseline")
    return Change(current, baseline, (current - baseline) / abs(baseline))


@dataclass(frozen=True)
class BaselineValue:
    """The baseline in force for one metric and scope."""

    id: int
    metric: str
    scope_key: str
    value: float
    samples: int
    kind: str
    window_start: datetime | None
    window_end: datetime | None
    model_version: str
    config_hash: str


def active_baseline(
    session: Session, metric: str, scope: Mapping[str, object] | str,
) -> BaselineValue | None:
    """Return the active baseline of `metric` in `scope`: pinned beats rolling, newest wins."""
    key = scope if isinstance(scope, str) else scope_key(scope)
    b = Baseline
    row = session.scalars(
        select(b).where(b.metric == metric, b.scope_key == key, b.active.is_(True))
        .order_by((b.kind == "pinned").desc(), b.created_at.desc(), b.id.desc()).limit(1)
    ).first()
    if row is None:
        return None
    return BaselineValue(row.id, row.metric, row.scope_key, row.value, row.samples, row.kind,
                         row.window_start, row.window_end, row.model_version, row.config_hash)


def change_against_baseline(
    session: Session, metric: str, scope: Mapping[str, object] | str, current: float | None,
) -> Change:
    """Return the relative change of `current` against the active baseline."""
    base = active_baseline(session, metric, scope)
    change = relative_change(current, base.value if base else None)
    if base is None:
        return change
    return Change(change.current, change.baseline, change.relative_change, change.reason, base.id)
