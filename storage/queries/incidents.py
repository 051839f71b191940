"""Incidents: open and recent ones, their members, timeline, flag changes, deliveries, arms."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from storage.models import (
    Alert,
    AlertTransition,
    FlagAudit,
    Incident,
    IncidentEvent,
    IncidentMember,
    ProbeResult,
    ProbeRun,
    WebhookDelivery,
)

INCIDENT_FILTERS = ("open", "resolved", "all")


def incident_by_id(session: Session, incident_id: int) -> Incident | None:
    """Return one incident, if it exists."""
    return session.get(Incident, incident_id)


def list_incidents(session: Session, state: str = "all", *, limit: int = 100,
                   since: datetime | None = None, until: datetime | None = None
                   ) -> list[Incident]:
    """Return incidents in `state` (one of INCIDENT_FILTERS), newest first.

    since/until: incidents started in [since, until).
    """
    if state not in INCIDENT_FILTERS:
        raise ValueError(f"state: must be one of {', '.join(INCIDENT_FILTERS)}, got {state!r}")
    q = select(Incident).order_by(Incident.started_at.desc(), Incident.id.desc()).limit(limit)
    if state != "all":
        q = q.where(Incident.state == state)
    if since is not None:
        q = q.where(Incident.started_at >= since)
    if until is not None:
        q = q.where(Incident.started_at < until)
    return list(session.scalars(q))


def open_incidents(session: Session) -> list[Incident]:
    """Return the open incidents, oldest first."""
    return list(session.scalars(select(Incident).where(Incident.state == "open")
                                .order_by(Incident.started_at, Incident.id)))


def recent_incidents(session: Session, since: datetime) -> list[Incident]:
    """Return incidents open, or started or resolved since `since` (grouping candidates)."""
    return list(session.scalars(
        select(Incident).where((Incident.state == "open") | (Incident.started_at >= since)
                               | (Incident.resolved_at >= since))
        .order_by(Incident.started_at, Incident.id)))


def members(session: Session, incident_id: int) -> list[Alert]:
    """Return the incident's member alerts in the order they joined."""
    return list(session.scalars(
        select(Alert).join(IncidentMember, IncidentMember.alert_id == Alert.id)
        .where(IncidentMember.incident_id == incident_id).order_by(IncidentMember.id)))


def members_of(session: Session, incident_ids: Collection[int]) -> dict[int, list[Alert]]:
    """Return incident id -> its member alerts (join order), for many incidents at once."""
    out: dict[int, list[Alert]] = {i: [] for i in incident_ids}
    if not out:
        return out
    rows = session.execute(
        select(IncidentMember.incident_id, Alert)
        .join(Alert, IncidentMember.alert_id == Alert.id)
        .where(IncidentMember.incident_id.in_(tuple(out))).order_by(IncidentMember.id))
    for incident_id, alert in rows:
        out[incident_id].append(alert)
    return out


def open_counts(session: Session) -> int:
    """Return how many incidents are open."""
    return int(session.scalar(select(func.count()).select_from(Incident)
                              .where(Incident.state == "open")) or 0)


def counts_by_cause(session: Session) -> dict[str, int]:
    """Return cause -> how many incidents are counted under it (all time).

    Each incident once, by its `counted_cause` (set once, alerts.incidents): the current
    cause is restated while an incident is open, and a count read from it could fall.
    """
    rows = session.execute(select(Incident.counted_cause, func.count())
                           .where(Incident.counted_cause.is_not(None))
                           .group_by(Incident.counted_cause))
    return {cause: int(n) for cause, n in rows if cause is not None}


def events(session: Session, incident_id: int) -> list[IncidentEvent]:
    """Return the incident's timeline, oldest first."""
    return list(session.scalars(select(IncidentEvent)
                                .where(IncidentEvent.incident_id == incident_id)
                                .order_by(IncidentEvent.at, IncidentEvent.id)))


def event_count(session: Session, incident_id: int, kind: str) -> int:
    """Return how many events of `kind` an incident's timeline holds."""
    return session.scalar(select(func.count()).select_from(IncidentEvent).where(
        IncidentEvent.incident_id == incident_id, IncidentEvent.kind == kind)) or 0


def flag_changes(session: Session, alert_ids: Collection[int]) -> list[FlagAudit]:
    """Return the flag changes made for the alerts `alert_ids`, oldest first."""
    if not alert_ids:
        return []
    return list(session.scalars(select(FlagAudit)
                                .where(FlagAudit.alert_id.in_(tuple(alert_ids)))
                                .order_by(FlagAudit.at, FlagAudit.id)))


def deliveries(session: Session, keys: Collection[str]) -> list[WebhookDelivery]:
    """Return the outbox rows of the notifications with idempotency `keys`, oldest first."""
    if not keys:
        return []
    return list(session.scalars(select(WebhookDelivery)
                                .where(WebhookDelivery.idempotency_key.in_(tuple(keys)))
                                .order_by(WebhookDelivery.created_at, WebhookDelivery.id)))


@dataclass(frozen=True)
class ArmRow:
    """One canary group's median latency: which instance, bucket and A/B arm, and when."""

    at: datetime
    instance: str
    bucket: str
    variant: str
    p50_s: float


def arm_rows(session: Session, start: datetime, end: datetime,
             variants: Sequence[str]) -> list[ArmRow]:
    """Return the canary-cycle groups of `variants` with a p50 in [start, end), oldest first."""
    q = (select(ProbeResult.at, ProbeRun.instance_id, ProbeResult.bucket, ProbeResult.variant,
                ProbeResult.p50_s)
         .join(ProbeRun, ProbeRun.id == ProbeResult.run_id)
         .where(ProbeRun.kind == "cycle", ProbeResult.at >= start, ProbeResult.at < end,
                ProbeResult.variant.in_(tuple(variants)), ProbeResult.p50_s.is_not(None))
         .order_by(ProbeResult.at, ProbeResult.id))
    return [ArmRow(at, inst, b, v, float(p)) for at, inst, b, v, p in session.execute(q)
            if p is not None]


def late_between(session: Session, start: datetime, end: datetime) -> list[tuple[Alert, datetime]]:
    """Return (alert, when) of the runs confirmed late (nobody paged) in [start, end)."""
    rows = session.execute(
        select(Alert, AlertTransition.at)
        .join(AlertTransition, AlertTransition.alert_id == Alert.id)
        .where(AlertTransition.to_state == "late", AlertTransition.at >= start,
               AlertTransition.at < end).order_by(AlertTransition.at, Alert.id))
    return [(a, at) for a, at in rows]


def active_between(session: Session, start: datetime, end: datetime) -> list[Incident]:
    """Return incidents open at some time in [start, end), oldest first."""
    return list(session.scalars(
        select(Incident).where(Incident.started_at < end,
                               (Incident.resolved_at.is_(None)) | (Incident.resolved_at >= start))
        .order_by(Incident.started_at, Incident.id)))
