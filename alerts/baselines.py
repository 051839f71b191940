"""Baselines: rolling (trailing window, firing periods left out) or pinned by a person.

A rolling baseline is the median and robust spread of a rule's per-cycle values over the
trailing `rule.baseline_window_s` (7 days by default), leaving out cycles when an alert on
the same metric and scope was firing. It is stored as a `Baseline` row (value = median,
samples = cycles, spread = robust sigma) and recomputed when older than
`BaselineConfig.refresh_s`. When the model_version or config_hash of the canary runs
changes, the window restarts at the first run of the new version plus `warm_in_s`, so
rules stay quiet ("baseline warming in") until enough new cycles exist.

A pinned baseline fixes the centre (the spread still comes from the rolling one).
Which stored baseline is in force is decided in one place:
`storage.queries.baselines.decide_in_force`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from alerts.detection import BaselineStats
from alerts.errors import BaselineError
from alerts.rules import METRICS, SCOPE_LABELS, SOURCES, Point, Rule
from alerts.series import Labels, RowCache, series
from storage.models import Baseline, scope_key
from storage.queries import alerts as alert_queries
from storage.queries import baselines as baseline_queries
from storage.queries.baselines import StoredBaseline
from storage.queries.runs import CurrentCohort

_SCOPE_KEYS = (*SCOPE_LABELS, "source", "window")
BaselineView = StoredBaseline  # what the CLI and API show


@dataclass(frozen=True)
class BaselineConfig:
    """How rolling baselines are kept: refresh age and warm-in after a version change."""

    refresh_s: float = 3600.0
    warm_in_s: float = 1800.0


def rule_scope(rule: Rule, labels: Mapping[str, str]) -> dict[str, str]:
    """Return the baseline scope of a rule's series: source, match labels, labels, window."""
    scope = {"source": rule.source, **rule.match, **labels}
    if rule.window_s != 60.0:
        scope["window"] = f"{rule.window_s:g}s"
    return scope


def _firing_periods(session: Session, rule_names: list[str], key: str, now: datetime,
                    start: datetime) -> list[tuple[datetime, datetime]]:
    out = []
    for a in alert_queries.fired_alerts(session, rule_names):
        if scope_key(a.labels) != key or a.fired_at is None:
            continue
        end = a.resolved_at or now
        if end >= start:
            out.append((a.fired_at, end))
    return out


def baselines_for_rule(
    session: Session,
    rule: Rule,
    rules: list[Rule],
    now: datetime,
    cache: RowCache,
    cohort: CurrentCohort,
    config: BaselineConfig,
) -> dict[Labels, BaselineStats]:
    """Return scope labels -> baseline of `rule`, refreshing stale rolling baselines."""
    in_force = baseline_queries.baselines_in_force(session, rule.metric, cohort.key)
    start = now - timedelta(seconds=rule.baseline_window_s)
    if cohort.since is not None:
        start = max(start, cohort.since + timedelta(seconds=config.warm_in_s))
    fresh_after = now - timedelta(seconds=config.refresh_s)
    computed: dict[Labels, list[Point]] | None = None
    same_metric = [r.name for r in rules if r.metric == rule.metric and r.source == rule.source]
    out: dict[Labels, BaselineStats] = {}
    labelsets = set()
    if start < now:
        computed = series(rule, cache, start, now)
        labelsets = set(computed)
    for force in in_force.values():
        b = force.pinned
        if b is not None and _scope_matches(rule, b.scope):
            labelsets.add(tuple((k, b.scope[k]) for k in rule.per))
    for labels in labelsets:
        scope = rule_scope(rule, dict(labels))
        key = scope_key(scope)
        force = in_force.get(key, baseline_queries.InForce())
        rolling = force.rolling
        stale = rolling is None or rolling.created_at < fresh_after or (
            rolling.samples < rule.min_baseline_cycles)  # warming in: refresh every cycle
        if stale and computed is not None:
            rolling = _refresh(session, rule, same_metric, scope, key, computed.get(labels, []),
                               start, now, cohort, rolling) or rolling
        spread = rolling.spread if rolling is not None else None
        pinned = force.pinned
        if pinned is not None:
            out[labels] = BaselineStats(
                center=pinned.value,
                spread=spread if spread is not None else (pinned.spread or 0.0),
                cycles=max(pinned.samples, rule.min_baseline_cycles), pinned=True)
        elif rolling is not None and spread is not None:
            out[labels] = BaselineStats(rolling.value, spread, rolling.samples)
    return out


def _scope_matches(rule: Rule, scope: Mapping[str, str]) -> bool:
    return (scope.get("source", "canary") == rule.source
            and all(scope.get(k) == v for k, v in rule.match.items())
            and all(k in scope for k in rule.per)
            and set(scope) <= {"source", "window", *rule.per, *rule.match})


def _refresh(session: Session, rule: Rule, rule_names: list[str], scope: dict[str, str],
             key: str, points: list[Point], start: datetime, now: datetime,
             cohort: CurrentCohort, old: StoredBaseline | None) -> StoredBaseline | None:
    excluded = _firing_periods(session, rule_names, scope_key(
        {k: v for k, v in scope.items() if k in rule.per}), now, start)
    values = [p.value for p in points
              if p.value is not None and p.samples >= rule.min_samples
              and not any(a <= p.at < b for a, b in excluded)]
    stats = BaselineStats.of(v for v in values if v is not None)
    if stats is None:
        return None
    if old is not None:
        session.execute(update(Baseline).where(Baseline.id == old.id).values(active=False)
                        .execution_options(synchronize_session="fetch"))
    row = Baseline(metric=rule.metric, scope=scope, scope_key=key, value=stats.center,
                   samples=stats.cycles, window_start=start, window_end=now, kind="rolling",
                   model_version=cohort.model_version, config_hash=cohort.config_hash,
                   created_at=now, spread=stats.spread, active=True)
    session.add(row)
    session.flush()
    return baseline_queries.stored(row)


def parse_scope(scope: Mapping[str, Any] | str) -> dict[str, str]:
    """Return a validated scope from a mapping or "k=v,k=v"; source defaults to canary."""
    if isinstance(scope, str):
        items: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in scope.split(","))):
            k, sep, v = part.partition("=")
            if not sep or not k.strip() or not v.strip():
                raise BaselineError("scope", f"expected k=v pairs, got {part!r}", value=scope)
            items[k.strip()] = v.strip()
        scope = items
    if not isinstance(scope, Mapping):
        raise BaselineError("scope", "must be a mapping or k=v pairs", value=scope)
    out = {str(k): str(v) for k, v in scope.items()}
    bad = set(out) - set(_SCOPE_KEYS)
    if bad:
        raise BaselineError("scope", f"unknown label {sorted(bad)[0]!r} (allowed: "
                                     f"{', '.join(_SCOPE_KEYS)})", value=scope)
    out.setdefault("source", "canary")
    if out["source"] not in SOURCES:
        raise BaselineError("scope", f"source must be one of {', '.join(SOURCES)}", value=scope)
    return out


def _check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise BaselineError("metric", f"must be one of {', '.join(METRICS)}", value=metric)


def pin(session: Session, metric: str, scope: Mapping[str, Any] | str, actor: str, *,
        value: float | None = None, note: str | None = None,
        now: datetime | None = None) -> BaselineView:
    """Pin a baseline (the current rolling value unless `value` is given)."""
    _check_metric(metric)
    if not actor or not actor.strip():
        raise BaselineError("actor", "must not be empty", value=actor)
    sc = parse_scope(scope)
    key = scope_key(sc)
    # Any cohort: a person pins what the newest rolling baseline shows.
    rolling = baseline_queries.baseline_in_force(session, metric, key, None).rolling
    if value is None:
        if rolling is None:
            raise BaselineError("value", f"no rolling baseline for {metric} {key} yet: pass a value")
        value = rolling.value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BaselineError("value", "must be a number", value=value)
    spread = rolling.spread if rolling is not None else None
    _deactivate(session, metric, key, "pinned")
    kw = {"created_at": now} if now is not None else {}
    row = Baseline(metric=metric, scope=sc, scope_key=key, value=float(value),
                   samples=rolling.samples if rolling is not None else 0, kind="pinned",
                   model_version=rolling.model_version if rolling is not None else "",
                   config_hash=rolling.config_hash if rolling is not None else "",
                   pinned_by=actor, note=note or None, spread=spread, active=True, **kw)
    session.add(row)
    session.flush()
    return baseline_queries.stored(row)


def unpin(session: Session, metric: str, scope: Mapping[str, Any] | str, actor: str) -> int:
    """Deactivate the pinned baseline of a metric and scope; return how many were active."""
    _check_metric(metric)
    if not actor or not actor.strip():
        raise BaselineError("actor", "must not be empty", value=actor)
    return _deactivate(session, metric, scope_key(parse_scope(scope)), "pinned")


def _deactivate(session: Session, metric: str, key: str, kind: str) -> int:
    result = session.execute(
        update(Baseline).where(Baseline.metric == metric, Baseline.scope_key == key,
                               Baseline.kind == kind, Baseline.active.is_(True))
        .values(active=False).execution_options(synchronize_session="fetch"))
    return int(result.rowcount or 0)  # type: ignore[attr-defined]


def list_baselines(session: Session, metric: str | None = None, *,
                   active_only: bool = True) -> list[BaselineView]:
    """Return stored baselines, newest first."""
    if metric is not None:
        _check_metric(metric)
    return baseline_queries.list_baselines(session, metric, active_only=active_only)
