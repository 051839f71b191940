"""GET /v1/alerts: alerts and their lifecycle, newest first."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict
from sqlalchemy import select

from monitor.api.deps import ReaderDep, SessionsDep
from storage.models import Alert

router = APIRouter(tags=["alerts"])


class AlertOut(BaseModel):
    """One alert as the API shows it."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    rule: str
    state: str
    severity: str
    labels: dict[str, str]
    annotations: dict[str, str]
    started_at: datetime
    fired_at: datetime | None
    resolved_at: datetime | None
    value: float | None
    baseline: float | None
    relative_change: float | None
    threshold: float | None


@router.get("/v1/alerts")
def list_alerts(
    sessions: SessionsDep,
    _actor: ReaderDep,
    state: Annotated[Literal["pending", "firing", "resolved", "open", "all"],
                     Query(description="open = pending or firing")] = "open",
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[AlertOut]:
    """Return alerts in `state`, newest first."""
    q = select(Alert).order_by(Alert.started_at.desc(), Alert.id.desc()).limit(limit)
    if state == "open":
        q = q.where(Alert.state != "resolved")
    elif state != "all":
        q = q.where(Alert.state == state)
    with sessions() as session:
        return [AlertOut.model_validate(a) for a in session.scalars(q)]
