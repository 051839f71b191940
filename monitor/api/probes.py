"""GET /v1/probes/runs, GET /v1/probes/speedups and POST /v1/probes/run (run one now)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, StrictBool

from monitor.api.deps import ProbeRunnerDep, ReaderDep, ServicesDep, SessionsDep, WriterDep
from monitor.api.fields import Name64, UtcTime
from storage.db import reading
from storage.queries import runs as queries
from storage.queries.speedups import ArmSpeedup, ab_speedups
from vocab import utcnow

router = APIRouter(tags=["probes"])

# How long a requested run waits for its rows to be committed before answering anyway.
STORE_WAIT_S = 10.0
# The default window of GET /v1/probes/speedups: reading pairs takes time in proportion
# to the window (every A/B cycle's JSON), and an API read should stay quick.
SPEEDUP_WINDOW = timedelta(days=1)


class ProbeRunOut(BaseModel):
    """One stored probe run."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    kind: str
    suite: str
    status: str
    error: str | None
    instance_id: str
    model_version: str
    config_hash: str
    started_at: datetime
    finished_at: datetime | None
    requests: int | None
    rejections: int | None
    result_rows: int = 0  # probe_results rows (bucket x path x decoding x variant)


class ProbeRunRequest(BaseModel):
    """Run a probe now."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["cycle", "burst"] = "cycle"
    suite: Name64 | None = None  # probe_runs.suite
    ab: StrictBool | None = None


class ProbeRunDone(BaseModel):
    """What a requested probe run did."""

    kind: str
    suite: str
    status: str
    error: str | None
    duration_s: float
    actor: str
    # True when the run's rows were committed before this response (GET /v1/probes/runs
    # lists it); False while the database is slow or down: the rows stay queued, not lost.
    stored: bool


@router.get("/v1/probes/runs")
def list_runs(
    sessions: SessionsDep,
    _actor: ReaderDep,
    kind: Annotated[Literal["cycle", "burst"] | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
) -> list[ProbeRunOut]:
    """Return probe runs, newest first, with their result-row counts."""
    with reading(sessions) as session:
        return [ProbeRunOut.model_validate(r.columns | {"result_rows": r.result_rows})
                for r in queries.list_runs(session, kind=kind, limit=limit)]


@dataclass(frozen=True)
class SpeedupOut(ArmSpeedup):
    """Measured speedup of one optimization in one bucket ("all": every bucket's pairs).

    The median over A/B prompt pairs of the fallback / optimized latency ratio (reverse
    arms inverted), with its 95% confidence interval (null under 6 pairs); see
    docs/speedups.md (storage.queries.speedups).
    """


@router.get("/v1/probes/speedups")
def list_speedups(
    sessions: SessionsDep,
    _actor: ReaderDep,
    since: Annotated[UtcTime | None, Query(description="RFC 3339; default: a day ago")] = None,
    until: Annotated[UtcTime | None, Query(description="RFC 3339; default: now")] = None,
    instance_id: Annotated[Name64 | None, Query()] = None,
    on_demand: Annotated[bool, Query(
        description="also read the cycles that ran the arms on demand after a slow one "
                    "(they crowd into slow periods; the weekly report leaves them out)")] = False,
) -> list[SpeedupOut]:
    """Return each optimization's measured speedup per bucket from A/B cycles in the window."""
    end = until or utcnow()
    start = since or end - SPEEDUP_WINDOW
    if end <= start:
        raise ValueError(f"until: must be after since ({start.isoformat()})")
    with reading(sessions) as session:
        rows = ab_speedups(session, start, end, instance_id=instance_id, on_demand=on_demand)
    return [SpeedupOut(**asdict(s)) for s in rows]


@router.post("/v1/probes/run")
def run_probe(body: ProbeRunRequest, probes: ProbeRunnerDep, services: ServicesDep,
              actor: WriterDep) -> ProbeRunDone:
    """Run one canary cycle or burst now and store it (blocks until it finishes)."""
    result = probes.run(body.kind, suite=body.suite, ab=body.ab)
    # The prober hands its rows to the background writer: wait for them so that a
    # caller who lists runs next sees this one.
    stored = services.writer.flush(timeout=STORE_WAIT_S)
    return ProbeRunDone(kind=body.kind, suite=result.suite, status=result.status,
                        error=result.error, duration_s=_duration(result), actor=actor,
                        stored=stored)


def _duration(result: object) -> float:
    started = getattr(result, "started_at", None)
    finished = getattr(result, "finished_at", None)
    if started is None or finished is None:
        return 0.0
    return (finished - started).total_seconds()
