"""GET /v1/baselines and POST /v1/baselines (pin or unpin a metric's baseline)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field, field_validator

from alerts import baselines
from monitor.api.deps import ReaderDep, SessionsDep, WriterDep
from monitor.api.fields import SCOPE_KEY_MAX_CHARS, Name64, Note, check_label_value
from monitor.api.sensitivity import SensitivityOut
from storage.db import reading
from storage.models import scope_key
from storage.queries import sensitivity as sensitivity_queries
from storage.queries.baselines import StoredBaseline

router = APIRouter(tags=["baselines"])
Metric = Name64  # baselines.metric


@dataclass(frozen=True)
class BaselineOut(StoredBaseline):
    """A stored baseline."""

    scope_key: Annotated[str, Field(exclude=True)]  # `scope` as stored; `scope` says it
    body: Annotated[float | None, Field(description=(
        "quantile rules: the median of the cycles' own median samples (where the canaries' "
        "body sits)"))] = None
    sensitivity: Annotated[list[SensitivityOut], Field(description=(
        "what each rule of this metric can see on this series, and its threshold in force "
        "(GET /v1/rules/sensitivity)"))] = field(default_factory=list)


class BaselineChange(BaseModel):
    """Pin a baseline (to the current rolling value unless `value` is given) or unpin it."""

    model_config = ConfigDict(extra="forbid")

    action: Literal["pin", "unpin"]
    metric: Metric
    scope: dict[str, Any] | str = Field(
        default_factory=dict, description='labels, as a mapping or "bucket=64,source=canary"')
    value: float | None = Field(None, allow_inf_nan=False, strict=True)
    note: Note | None = None

    @field_validator("scope")
    @classmethod
    def _scope(cls, v: dict[str, Any] | str) -> dict[str, Any] | str:
        # Label names are checked by alerts.baselines; values and length are checked here.
        labels = baselines.parse_scope(v)
        for key, value in labels.items():
            check_label_value(key, value)
        if len(scope_key(labels)) > SCOPE_KEY_MAX_CHARS:
            raise ValueError(f"scope: longer than {SCOPE_KEY_MAX_CHARS} characters")
        return v


class BaselineChangeOut(BaseModel):
    """What a pin or unpin did."""

    action: str
    actor: str
    baseline: BaselineOut | None = None
    unpinned: int = 0


@router.get("/v1/baselines")
def list_baselines(
    sessions: SessionsDep,
    _actor: ReaderDep,
    metric: Annotated[Metric | None, Query()] = None,
    include_inactive: Annotated[bool, Query()] = False,
) -> list[BaselineOut]:
    """Return baselines (active ones unless include_inactive)."""
    with reading(sessions) as session:
        views = baselines.list_baselines(session, metric, active_only=not include_inactive)
        by_series: dict[tuple[str, str, str, str], list[SensitivityOut]] = {}
        for s in sensitivity_queries.listing(session):
            key = (s.metric, s.scope_key, s.model_version, s.config_hash)
            by_series.setdefault(key, []).append(SensitivityOut.of(s))
    return [BaselineOut(**asdict(v), sensitivity=by_series.get(
        (v.metric, v.scope_key, v.model_version, v.config_hash), [])) for v in views]


@router.post("/v1/baselines")
def change_baseline(body: BaselineChange, sessions: SessionsDep,
                    actor: WriterDep) -> BaselineChangeOut:
    """Pin or unpin a baseline; the token's name is recorded as pinned_by."""
    with sessions.begin() as session:
        if body.action == "pin":
            view = baselines.pin(session, body.metric, body.scope, actor, value=body.value,
                                 note=body.note)
            return BaselineChangeOut(action="pin", actor=actor,
                                     baseline=BaselineOut(**asdict(view)))
        n = baselines.unpin(session, body.metric, body.scope, actor)
    return BaselineChangeOut(action="unpin", actor=actor, unpinned=n)
