"""GET /v1/rules/sensitivity: what each rule can see on each series, and its threshold."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from alerts.detection import INSUFFICIENT_HISTORY
from monitor.api.deps import ReaderDep, SessionsDep
from monitor.api.fields import Name64
from storage.queries import sensitivity as queries
from storage.queries.sensitivity import StoredSensitivity

router = APIRouter(tags=["rules"])


class SensitivityOut(BaseModel):
    """One rule on one series (scope x cohort): relative values, positive in `direction`."""

    rule: str
    metric: str
    scope: dict[str, str]
    model_version: str
    config_hash: str
    baseline_id: int | None
    computed_at: datetime
    status: str = Field(description="ok, insufficient history, not detectable or timed out")
    direction: int
    cycles: int = Field(description="history cycles the estimate resampled")
    within_cycles: int
    detectable_change: float | None = Field(
        description="smallest shift confirmed within within_cycles cycles at p95")
    false_pages_30d: float | None = Field(description="expected at the threshold in force")
    false_pages_configured: float | None
    budget_per_30d: float | None = Field(description="null: the budget is off")
    configured_threshold: float
    threshold: float = Field(description="the threshold in force")
    widened: bool
    pages_held: bool = Field(description=(
        "the series is too young to state its false pages: its confirmed changes fire as "
        "warnings, not pages, until it can (status insufficient history, budget on)"))
    reason: str
    summary: str


def sensitivity_out(s: StoredSensitivity) -> SensitivityOut:
    """Return the API form of a stored estimate."""
    return SensitivityOut(
        rule=s.rule, metric=s.metric, scope=dict(s.scope), model_version=s.model_version,
        config_hash=s.config_hash, baseline_id=s.baseline_id, computed_at=s.computed_at,
        status=s.status, direction=s.direction, cycles=s.cycles,
        within_cycles=s.within_cycles, detectable_change=s.detectable_change,
        false_pages_30d=s.false_pages_30d, false_pages_configured=s.false_pages_configured,
        budget_per_30d=s.budget_per_30d, configured_threshold=s.configured_threshold,
        threshold=s.threshold, widened=s.threshold > s.configured_threshold,
        pages_held=s.status == INSUFFICIENT_HISTORY and s.budget_per_30d is not None,
        reason=s.reason,
        summary=queries.describe(s))


@router.get("/v1/rules/sensitivity")
def list_sensitivity(
    sessions: SessionsDep,
    _actor: ReaderDep,
    rule: Annotated[Name64 | None, Query(description="Only this rule")] = None,
) -> list[SensitivityOut]:
    """Return every rule's sensitivity per series, by rule and scope."""
    with sessions() as session:
        rows = queries.listing(session, rule)
    return [sensitivity_out(s) for s in rows]
