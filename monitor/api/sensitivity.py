"""GET /v1/rules/sensitivity: what each rule can see on each series, and its threshold."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import Field

from alerts.detection import INSUFFICIENT_HISTORY
from monitor.api.deps import ReaderDep, SessionsDep
from monitor.api.fields import Name64
from storage.db import reading
from storage.queries import sensitivity as queries
from storage.queries.sensitivity import StoredSensitivity

router = APIRouter(tags=["rules"])


@dataclass(frozen=True)
class SensitivityOut(StoredSensitivity):
    """One rule on one series (scope x cohort): relative values, positive in `direction`."""

    scope_key: Annotated[str, Field(exclude=True)]  # `scope` as stored; `scope` says it
    status: Annotated[str, Field(
        description="ok, insufficient history, not detectable or timed out")]
    cycles: Annotated[int, Field(description="history cycles the estimate resampled")]
    detectable_change: Annotated[float | None, Field(
        description="smallest shift confirmed within within_cycles cycles at p95")]
    false_pages_30d: Annotated[float | None, Field(
        description="expected at the threshold in force")]
    budget_per_30d: Annotated[float | None, Field(description="null: the budget is off")]
    threshold: Annotated[float, Field(description="the threshold in force")]
    cpu_s: Annotated[float, Field(exclude=True)]  # the estimator's own budget accounting
    widened: bool = False
    pages_held: Annotated[bool, Field(description=(
        "the series is too young to state its false pages: its confirmed changes fire as "
        "warnings, not pages, until it can (status insufficient history, budget on)"))] = False
    summary: str = ""

    @classmethod
    def of(cls, s: StoredSensitivity) -> SensitivityOut:
        """Return the API form of a stored estimate, with what it implies spelled out."""
        return cls(**asdict(s), widened=s.threshold > s.configured_threshold,
                   pages_held=s.status == INSUFFICIENT_HISTORY and s.budget_per_30d is not None,
                   summary=queries.describe(s))


@router.get("/v1/rules/sensitivity")
def list_sensitivity(
    sessions: SessionsDep,
    _actor: ReaderDep,
    rule: Annotated[Name64 | None, Query(description="Only this rule")] = None,
) -> list[SensitivityOut]:
    """Return every rule's sensitivity per series, by rule and scope."""
    with reading(sessions) as session:
        rows = queries.listing(session, rule)
    return [SensitivityOut.of(s) for s in rows]
