"""Stored baselines and the one rule deciding which of them is in force."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.models import Alert, Baseline, scope_key
from storage.queries.alerts import confirmed_run


@dataclass(frozen=True)
class StoredBaseline:
    """One stored baseline row (value = centre, spread = robust sigma, body = the cycles'
    median sample for a quantile; None when unknown)."""

    id: int | None  # None: computed by the evaluation under way, stored when it records
    metric: str
    scope: Mapping[str, str]
    scope_key: str
    kind: str
    value: float
    spread: float | None
    samples: int
    window_start: datetime | None
    window_end: datetime | None
    model_version: str
    config_hash: str
    created_at: datetime
    pinned_by: str | None
    note: str | None
    active: bool
    body: float | None = None


@dataclass(frozen=True)
class InForce:
    """The baselines that count for one metric and scope.

    pinned: the newest active pinned row (any cohort); rolling: the newest active rolling
    row of the current cohort; inherited: while that one warms in, the newest warmed-in
    rolling row of another cohort. `baseline` is the one in force (see decide_in_force).
    """

    pinned: StoredBaseline | None = None
    rolling: StoredBaseline | None = None
    inherited: StoredBaseline | None = None

    @property
    def baseline(self) -> StoredBaseline | None:
        """Return the baseline in force: pinned, else inherited while warming in, else rolling."""
        return self.pinned or self.inherited or self.rolling


Cohort = tuple[str, str]  # (model_version, config_hash) of the canary runs


def decide_in_force(rows: Iterable[StoredBaseline], cohort: Cohort | None, *,
                    min_cycles: int = 1) -> InForce:
    """Decide which of one scope's active baselines is in force for one cohort.

    The rule: a pinned baseline wins (the newest active one, whatever cohort it came
    from: a person fixed it). Otherwise the newest active rolling baseline of the cohort
    (model_version, config_hash) once it has `min_cycles` cycles. While it warms in, the
    newest rolling baseline of another cohort that has them is inherited: a new model
    version is judged against the old one's baseline until its own is ready, so a
    regression on it is caught as fast as any other. With `cohort` None every rolling
    row counts as the cohort's (nothing has been probed yet).
    """
    pinned: StoredBaseline | None = None
    rolling: StoredBaseline | None = None
    other: StoredBaseline | None = None
    for b in rows:
        if not b.active:
            continue
        if b.kind == "pinned":
            pinned = _newer(pinned, b)
        elif cohort is None or (b.model_version, b.config_hash) == cohort:
            rolling = _newer(rolling, b)
        elif b.samples >= min_cycles:
            other = _newer(other, b)
    warm = rolling is not None and rolling.samples >= min_cycles
    return InForce(pinned, rolling, None if warm else other)


def _newer(old: StoredBaseline | None, new: StoredBaseline) -> StoredBaseline:
    if old is None or _order(new) > _order(old):
        return new
    return old


def _order(b: StoredBaseline) -> tuple[datetime, bool, int]:
    """Return the sort key of `b` by age (a row not stored yet is the newest of its time)."""
    return b.created_at, b.id is None, b.id or 0


def baselines_in_force(session: Session, metric: str,
                       cohort: Cohort | None) -> dict[str, InForce]:
    """Return scope_key -> the baselines in force for every scope of `metric`."""
    return {key: decide_in_force(rows, cohort) for key, rows in active_by_scope(session, metric).items()}


def active_by_scope(session: Session, metric: str) -> dict[str, list[StoredBaseline]]:
    """Return scope_key -> the active baselines of `metric` (decide_in_force picks per cohort)."""
    by_key: dict[str, list[StoredBaseline]] = {}
    for b in active_baselines(session, metric):
        by_key.setdefault(b.scope_key, []).append(b)
    return by_key


def active_by_metric(session: Session,
                     metrics: Iterable[str]) -> dict[str, dict[str, list[StoredBaseline]]]:
    """Return metric -> scope_key -> its active baselines, for many metrics in one query."""
    out: dict[str, dict[str, list[StoredBaseline]]] = {m: {} for m in metrics}
    if not out:
        return out
    rows = session.scalars(select(Baseline).where(Baseline.metric.in_(tuple(out)),
                                                  Baseline.active.is_(True)))
    for r in rows:
        b = stored(r)
        out[b.metric].setdefault(b.scope_key, []).append(b)
    return out


@dataclass(frozen=True)
class AlertPeriod:
    """When an alert of a scope was open: from pending (started_at) to resolved (or now)."""

    labels: Mapping[str, str]
    start: datetime
    end: datetime | None


def alert_periods(session: Session, rules: Iterable[str], since: datetime) -> list[AlertPeriod]:
    """Return the periods of `rules`' alerts that fired or are still open, overlapping `since`.

    Rolling baselines leave these cycles out: the firing ones and the pending run that led
    to a firing or a late run (a regression is not the normal level). Pending alerts that
    resolved unconfirmed stay in: leaving out every noisy cycle would shrink the spread.
    """
    a = Alert
    q = select(a.labels, a.started_at, a.resolved_at).where(
        a.rule.in_(tuple(rules)), confirmed_run() | (a.state != "resolved"),
        (a.resolved_at.is_(None)) | (a.resolved_at >= since))
    return [AlertPeriod(dict(labels or {}), start, end) for labels, start, end in session.execute(q)]


def baseline_in_force(session: Session, metric: str, scope: Mapping[str, object] | str,
                      cohort: Cohort | None) -> InForce:
    """Return the baselines in force for `metric` in one scope (see decide_in_force)."""
    key = scope if isinstance(scope, str) else scope_key(scope)
    b = Baseline
    rows = session.scalars(select(b).where(b.metric == metric, b.scope_key == key,
                                           b.active.is_(True)))
    return decide_in_force((stored(r) for r in rows), cohort)


def active_baselines(session: Session, metric: str) -> list[StoredBaseline]:
    """Return every active baseline of `metric`."""
    rows = session.scalars(select(Baseline).where(Baseline.metric == metric,
                                                  Baseline.active.is_(True)))
    return [stored(r) for r in rows]


def list_baselines(session: Session, metric: str | None = None, *,
                   active_only: bool = True) -> list[StoredBaseline]:
    """Return stored baselines by metric and scope, newest first within a scope."""
    q = select(Baseline).order_by(Baseline.metric, Baseline.scope_key, Baseline.created_at.desc())
    if metric is not None:
        q = q.where(Baseline.metric == metric)
    if active_only:
        q = q.where(Baseline.active.is_(True))
    return [stored(b) for b in session.scalars(q)]


def stored(b: Baseline) -> StoredBaseline:
    """Return the frozen view of a Baseline row."""
    return StoredBaseline(
        id=b.id, metric=b.metric, scope=dict(b.scope or {}), scope_key=b.scope_key, kind=b.kind,
        value=b.value, spread=b.spread, samples=b.samples, window_start=b.window_start,
        window_end=b.window_end, model_version=b.model_version, config_hash=b.config_hash,
        created_at=b.created_at, pinned_by=b.pinned_by, note=b.note, active=b.active,
        body=b.body)
