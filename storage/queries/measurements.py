"""Raw measurement rows of a window, as the alert series aggregate them per cycle."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.models import (
    VARIANT_OPTIMIZED,
    CompileEvent,
    MemorySample,
    ProbeResult,
    ProbeRun,
    TrafficRollup,
)


@dataclass(frozen=True)
class CanaryResult:
    """One canary cycle's result row and the instance that ran it."""

    result: ProbeResult
    instance_id: str


def canary_cycle_results(session: Session, start: datetime, end: datetime) -> list[CanaryResult]:
    """Return the optimized-variant results of "cycle" runs in [start, end) (A/B arms left out)."""
    q = (select(ProbeResult, ProbeRun.instance_id)
         .join(ProbeRun, ProbeResult.run_id == ProbeRun.id)
         .where(ProbeResult.at >= start, ProbeResult.at < end, ProbeRun.kind == "cycle",
                ProbeResult.variant == VARIANT_OPTIMIZED))
    return [CanaryResult(r, inst) for r, inst in session.execute(q)]


def failed_cycle_runs(session: Session, start: datetime,
                      end: datetime) -> list[tuple[datetime, str]]:
    """Return (started_at, instance_id) of "cycle" runs in [start, end) that failed as a whole."""
    q = select(ProbeRun.started_at, ProbeRun.instance_id).where(
        ProbeRun.started_at >= start, ProbeRun.started_at < end, ProbeRun.kind == "cycle",
        ProbeRun.status != "ok")
    return [(at, inst) for at, inst in session.execute(q)]


def traffic_rollups(session: Session, start: datetime, end: datetime) -> list[TrafficRollup]:
    """Return the traffic rollup rows of minutes in [start, end)."""
    q = select(TrafficRollup).where(TrafficRollup.minute >= start, TrafficRollup.minute < end)
    return list(session.scalars(q))


def burst_runs(session: Session, start: datetime, end: datetime) -> list[ProbeRun]:
    """Return the burst runs started in [start, end)."""
    q = select(ProbeRun).where(ProbeRun.started_at >= start, ProbeRun.started_at < end,
                               ProbeRun.kind == "burst")
    return list(session.scalars(q))


def compile_events(session: Session, start: datetime, end: datetime) -> list[CompileEvent]:
    """Return the compile events in [start, end)."""
    q = select(CompileEvent).where(CompileEvent.at >= start, CompileEvent.at < end)
    return list(session.scalars(q))


def memory_samples(session: Session, start: datetime, end: datetime) -> list[MemorySample]:
    """Return the memory samples in [start, end)."""
    q = select(MemorySample).where(MemorySample.at >= start, MemorySample.at < end)
    return list(session.scalars(q))


@dataclass(frozen=True)
class VariantP99:
    """The p99 of one canary result row in one variant (arm)."""

    variant: str
    p99_s: float
    count: int


def variant_p99s(session: Session, start: datetime, end: datetime, *,
                 bucket: str | None = None) -> list[VariantP99]:
    """Return the p99 of every canary result row in [start, end) (of one bucket when given)."""
    q = select(ProbeResult.variant, ProbeResult.p99_s, ProbeResult.count).where(
        ProbeResult.at >= start, ProbeResult.at < end, ProbeResult.p99_s.is_not(None))
    if bucket is not None:
        q = q.where(ProbeResult.bucket == bucket)
    return [VariantP99(var, p99, count) for var, p99, count in session.execute(q)
            if p99 is not None]  # the WHERE clause already says so; this tells the type
