"""GET /v1/instances: every instance seen in the last week, live or stale."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel

from monitor.api.deps import ReaderDep, ServicesDep, SessionsDep
from storage.db import reading
from storage.queries import alerts as alert_queries
from storage.queries import instances as queries

router = APIRouter(tags=["instances"])


class InstanceOut(BaseModel):
    """One instance: when it last wrote a row, whether that is too long ago, its open alerts."""

    instance_id: str
    last_seen: datetime
    state: str  # live | stale
    open_alerts: int


class InstancesOut(BaseModel):
    """Instances seen within the lookback, live ones first, and the staleness limit used."""

    stale_after_s: float
    instances: list[InstanceOut]


@router.get("/v1/instances")
def list_instances(
    sessions: SessionsDep,
    services: ServicesDep,
    _actor: ReaderDep,
    lookback_s: Annotated[float, Query(gt=0, le=90 * 86400.0,
                                       description="How far back to look for instances")]
    = 7 * 86400.0,
) -> InstancesOut:
    """Return live and stale instances (stale: silent for alerts.stale_after_s)."""
    stale_after_s = services.alerts.stale_after_s
    now = services.seams.clock()
    with reading(sessions) as session:
        seen = queries.instances(session, now, stale_after_s, lookback_s=lookback_s)
        open_by: dict[str, int] = {}
        for a in alert_queries.open_alerts(session):
            inst = (a.labels or {}).get("instance")
            if inst:
                open_by[inst] = open_by.get(inst, 0) + 1
    return InstancesOut(stale_after_s=stale_after_s, instances=[
        InstanceOut(instance_id=i.instance_id, last_seen=i.last_seen,
                    state="stale" if i.stale else "live", open_alerts=open_by.get(i.instance_id, 0))
        for i in seen])
