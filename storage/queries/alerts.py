"""Alerts: open and firing ones, counts by state, listings and a week's history."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ColumnElement, exists, func, or_, select
from sqlalchemy.orm import Session

from storage.models import Alert, AlertTransition

ALERT_FILTERS = ("pending", "firing", "resolved", "open", "all")  # open = pending or firing


def alert_by_id(session: Session, alert_id: int) -> Alert | None:
    """Return one alert, if it exists."""
    return session.get(Alert, alert_id)


def open_alerts(session: Session) -> list[Alert]:
    """Return the alerts that are pending or firing."""
    return list(session.scalars(select(Alert).where(Alert.state != "resolved")))


def firing_alerts(session: Session, rules: Collection[str] | None = None) -> list[Alert]:
    """Return firing alerts (of `rules` when given), oldest first."""
    q = select(Alert).where(Alert.state == "firing").order_by(Alert.fired_at, Alert.id)
    if rules is not None:
        q = q.where(Alert.rule.in_(tuple(rules)))
    return list(session.scalars(q))


def confirmed_run() -> ColumnElement[bool]:
    """Return a condition on Alert: its run was confirmed (it fired, or it was late).

    A late run (confirmed only after its cause ended) never fired and has no fired_at,
    but its cycles were a regression all the same: the detector restarts after it and
    the baselines leave it out, as after an alert that fired.
    """
    late = exists().where(AlertTransition.alert_id == Alert.id,
                          AlertTransition.to_state == "late")
    return or_(Alert.fired_at.is_not(None), late)


def fired_alerts(session: Session, rules: Collection[str]) -> list[Alert]:
    """Return every alert of `rules` that ever fired (resolved ones included)."""
    return list(session.scalars(select(Alert).where(Alert.rule.in_(tuple(rules)),
                                                    Alert.fired_at.is_not(None))))


def last_resolved_fired(session: Session, rule: str) -> dict[str, datetime]:
    """Return fingerprint -> when its latest alert whose run was confirmed (fired or late)
    was resolved (rule `rule`)."""
    rows = session.execute(
        select(Alert.fingerprint, func.max(Alert.resolved_at))
        .where(Alert.rule == rule, Alert.state == "resolved", confirmed_run())
        .group_by(Alert.fingerprint))
    return {fp: at for fp, at in rows if at is not None}


def last_resolved_fired_by_rule(session: Session,
                                rules: Collection[str]) -> dict[str, dict[str, datetime]]:
    """Return rule -> last_resolved_fired of that rule, for many rules in one query."""
    out: dict[str, dict[str, datetime]] = {name: {} for name in rules}
    if not out:
        return out
    rows = session.execute(
        select(Alert.rule, Alert.fingerprint, func.max(Alert.resolved_at))
        .where(Alert.rule.in_(tuple(out)), Alert.state == "resolved", confirmed_run())
        .group_by(Alert.rule, Alert.fingerprint))
    for rule, fp, at in rows:
        if at is not None:
            out[rule][fp] = at
    return out


def list_alerts(session: Session, state: str = "open", *, limit: int = 100) -> list[Alert]:
    """Return alerts in `state` (one of ALERT_FILTERS), newest first."""
    q = select(Alert).order_by(Alert.started_at.desc(), Alert.id.desc()).limit(limit)
    if state == "open":
        q = q.where(Alert.state != "resolved")
    elif state != "all":
        q = q.where(Alert.state == state)
    return list(session.scalars(q))


@dataclass(frozen=True)
class AlertCount:
    """How many open alerts one rule has in one severity and state."""

    rule: str
    severity: str
    state: str
    count: int


def open_alert_counts(session: Session) -> list[AlertCount]:
    """Return open alerts counted by rule, severity and state."""
    rows = session.execute(
        select(Alert.rule, Alert.severity, Alert.state, func.count())
        .where(Alert.state != "resolved")
        .group_by(Alert.rule, Alert.severity, Alert.state))
    return [AlertCount(rule, severity, state, int(n)) for rule, severity, state, n in rows]


def alerts_active_between(session: Session, start: datetime, end: datetime) -> list[Alert]:
    """Return alerts that fired before `end` and were firing or moved within [start, end).

    Late runs are not among them: they never fired (the incidents section lists them).
    """
    moved = select(AlertTransition.alert_id).where(AlertTransition.at >= start,
                                                   AlertTransition.at < end)
    return list(session.scalars(
        select(Alert).where(
            Alert.fired_at.is_not(None), Alert.fired_at < end,
            or_(Alert.resolved_at.is_(None), Alert.resolved_at >= start, Alert.id.in_(moved)))
        .order_by(Alert.fired_at, Alert.id)))
