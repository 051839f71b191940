"""GET /v1/alerts: alerts and their lifecycle, newest first."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query
from pydantic import BaseModel, ConfigDict

from monitor.api.deps import ReaderDep, SessionsDep
from monitor.api.errors import NotFound
from storage.db import reading
from storage.queries import alerts as queries

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
    updated_at: datetime  # when an evaluation last judged it
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
    with reading(sessions) as session:
        return [AlertOut.model_validate(a)
                for a in queries.list_alerts(session, state, limit=limit)]


@router.get("/v1/alerts/{alert_id}", responses={404: {"description": "No such alert"}})
def get_alert(sessions: SessionsDep, _actor: ReaderDep,
              alert_id: Annotated[int, Path(ge=1, le=2**31 - 1)]) -> AlertOut:
    """Return one alert (the generatorURL of its webhook notifications)."""
    with reading(sessions) as session:
        alert = queries.alert_by_id(session, alert_id)
        if alert is None:
            raise NotFound("alert_id", f"alert {alert_id} does not exist")
        return AlertOut.model_validate(alert)
