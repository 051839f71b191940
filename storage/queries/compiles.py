"""Compile events of real traffic: what the eager fallback's recovery reads."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from storage.models import CompileEvent


@dataclass(frozen=True)
class TrafficCompiles:
    """Recompiles (and recompile-limit hits or failures) outside probe runs in a window."""

    recompiles: int
    failures: int
    events: int


def traffic_compiles(session: Session, start: datetime, end: datetime, *,
                     instance_id: str | None = None) -> TrafficCompiles:
    """Sum the compile events in [start, end) that no probe run stored (real traffic's).

    Canary cycles store their own deltas with a run id; the fixed canary shapes never
    churn, so only the rows without one say whether users' shapes still recompile.
    """
    q = select(func.coalesce(func.sum(CompileEvent.recompiles), 0),
               func.coalesce(func.sum(CompileEvent.limit_hits + CompileEvent.failures), 0),
               func.count()).where(CompileEvent.at >= start, CompileEvent.at < end,
                                   CompileEvent.run_id.is_(None))
    if instance_id is not None:
        q = q.where(CompileEvent.instance_id == instance_id)
    recompiles, failures, events = session.execute(q).one()
    return TrafficCompiles(int(recompiles), int(failures), int(events))
