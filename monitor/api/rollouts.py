"""GET /v1/rollouts: the stored verdicts of new cohorts judged against old ones."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import AwareDatetime, BaseModel, ConfigDict, PlainSerializer

from monitor.api.deps import ReaderDep, SessionsDep
from storage.db import reading
from storage.queries import series as queries
from storage.queries.series import Cohort, Verdict

router = APIRouter(tags=["rollouts"])


class CohortOut(BaseModel):
    """A cohort: the model version and config hash its canary runs report."""

    model_version: str
    config_hash: str


def _cohort_out(cohort: Cohort) -> CohortOut:
    return CohortOut(model_version=cohort[0], config_hash=cohort[1])


def _untitled(schema: dict[str, Any]) -> None:
    # A serialized field gets a title a model field would not: keep the published schema.
    for name in ("new", "old"):
        schema["properties"][name].pop("title", None)


CohortJson = Annotated[Cohort, PlainSerializer(_cohort_out, return_type=CohortOut)]


@dataclass(frozen=True)
class RolloutVerdictOut(Verdict):
    """One comparison's latest verdict (alerts.rollout: pass / marginal / fail)."""

    __pydantic_config__ = ConfigDict(json_schema_extra=_untitled)

    new: CohortJson
    old: CohortJson


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
    with reading(sessions) as session:
        rows = queries.list_verdicts(session, since=since, limit=limit)
    return [RolloutVerdictOut(**asdict(v)) for v in rows]
