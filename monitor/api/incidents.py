"""GET /v1/incidents: alerts grouped into incidents, with members, timeline and cause."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query
from pydantic import BaseModel, ConfigDict
from sqlalchemy.orm import Session

from alerts.webhooks import payload_status
from monitor.api.alerts import AlertOut
from monitor.api.deps import ReaderDep, SessionsDep
from monitor.api.errors import NotFound
from storage.db import reading
from storage.models import Incident
from storage.queries import deliveries as delivery_queries
from storage.queries import incidents as queries

router = APIRouter(tags=["incidents"])


class IncidentOut(BaseModel):
    """One incident as listed: its scope, summary and probable cause."""

    id: int
    state: str
    severity: str
    started_at: datetime
    resolved_at: datetime | None
    families: list[str]
    buckets: list[str]
    instances: list[str]
    cohorts: list[str]
    summary: str
    cause: str
    cause_text: str
    reopened: int
    members: int = 0


class EventOut(BaseModel):
    """One step of an incident's timeline."""

    model_config = ConfigDict(from_attributes=True)

    at: datetime
    kind: str
    alert_id: int | None
    detail: str


class FlagChangeOut(BaseModel):
    """A flag change one of the incident's members caused (the policy acts per alert)."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    at: datetime
    name: str
    scope: str
    action: str
    old_value: Any
    new_value: Any
    reason: str | None
    alert_id: int | None


class NotificationOut(BaseModel):
    """One outbox row of the incident's notifications."""

    id: int
    target: str
    format: str
    status: str
    state: str
    idempotency_key: str
    created_at: datetime
    delivered_at: datetime | None


class IncidentDetail(IncidentOut):
    """One incident with its members, timeline, evidence, flag changes and notifications."""

    evidence: dict[str, Any]
    member_alerts: list[AlertOut]
    timeline: list[EventOut]
    flag_changes: list[FlagChangeOut]
    notifications: list[NotificationOut]


def _out(inc: Incident, members: int) -> IncidentOut:
    fields = {k: getattr(inc, k) for k in IncidentOut.model_fields if k != "members"}
    return IncidentOut(**fields, members=members)


@router.get("/v1/incidents")
def list_incidents(
    sessions: SessionsDep,
    _actor: ReaderDep,
    state: Annotated[Literal["open", "resolved", "all"], Query()] = "all",
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[IncidentOut]:
    """Return incidents in `state`, newest first."""
    with reading(sessions) as session:
        rows = queries.list_incidents(session, state, limit=limit)
        members = queries.members_of(session, [i.id for i in rows])
        return [_out(i, len(members[i.id])) for i in rows]


def detail(session: Session, inc: Incident) -> IncidentDetail:
    """Return the full view of `inc` (the API's and the CLI's)."""
    alerts = queries.members(session, inc.id)
    events = queries.events(session, inc.id)
    keys = [e.detail for e in events if e.kind == "notified"]
    sent = [NotificationOut(id=d.id, target=d.target, format=d.format,
                            status=payload_status(d.format, d.payload),
                            state=delivery_queries.shown_state(d.state),
                            idempotency_key=d.idempotency_key, created_at=d.created_at,
                            delivered_at=d.delivered_at)
            for d in queries.deliveries(session, keys)]
    flags = queries.flag_changes(session, [a.id for a in alerts])
    return IncidentDetail(
        **_out(inc, len(alerts)).model_dump(), evidence=dict(inc.evidence or {}),
        member_alerts=[AlertOut.model_validate(a) for a in alerts],
        timeline=[EventOut.model_validate(e) for e in events],
        flag_changes=[FlagChangeOut.model_validate(f) for f in flags], notifications=sent)


@router.get("/v1/incidents/{incident_id}", responses={404: {"description": "No such incident"}})
def get_incident(sessions: SessionsDep, _actor: ReaderDep,
                 incident_id: Annotated[int, Path(ge=1, le=2**31 - 1)]) -> IncidentDetail:
    """Return one incident: members, timeline, cause and evidence, flag changes, notifications."""
    with reading(sessions) as session:
        inc = queries.incident_by_id(session, incident_id)
        if inc is None:
            raise NotFound("incident_id", f"incident {incident_id} does not exist")
        return detail(session, inc)
