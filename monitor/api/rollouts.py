"""GET /v1/rollouts: the stored verdicts of new cohorts judged against old ones."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import AwareDatetime, BaseModel

from monitor.api.deps import ReaderDep, SessionsDep
from storage.queries import series as queries

router = APIRouter(tags=["rollouts"])


class CohortOut(BaseModel):
    """A cohort: the model version and config hash its canary runs report."""

    model_version: str
    config_hash: str


class RolloutVerdictOut(BaseModel):
    """One comparison's latest verdict (alerts.rollout: pass / marginal / fail)."""

    new: CohortOut
    old: CohortOut
    source: str
    metric: str
    bucket: str
    verdict: str
    p_value: float | None
    relative_change: float | None
    threshold: float
    new_median: float | None
    old_median: float | None
    new_cycles: int
    old_cycles: int
    window_start: datetime
    first_at: datetime
    updated_at: datetime


@router.get("/v1/rollouts")
def list_rollouts(
    sessions: SessionsDep,
    _actor: ReaderDep,
    since: Annotated[AwareDatetime | None, Query(
        description="Only verdicts updated at or after this time (ISO 8601 with offset)")]
    = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> list[RolloutVerdictOut]:
    """Return rollout verdicts, most recently updated first."""
    with sessions() as session:
        rows = queries.list_verdicts(session, since=since, limit=limit)
    return [RolloutVerdictOut(
        new=CohortOut(model_version=v.new[0], config_hash=v.new[1]),
        old=CohortOut(model_version=v.old[0], config_hash=v.old[1]),
        source=v.source, metric=v.metric, bucket=v.bucket, verdict=v.verdict,
        p_value=v.p_value, relative_change=v.relative_change, threshold=v.threshold,
        new_median=v.new_median, old_median=v.old_median, new_cycles=v.new_cycles,
        old_cycles=v.old_cycles, window_start=v.window_start, first_at=v.first_at,
        updated_at=v.updated_at) for v in rows]
