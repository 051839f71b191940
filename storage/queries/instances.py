"""Instances: when each one last reported (probe runs, traffic, memory, compile events)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from storage.models import CompileEvent, MemorySample, ProbeRun, TrafficRollup


@dataclass(frozen=True)
class InstanceSeen:
    """One instance and the newest row it wrote; stale when that is older than the limit."""

    instance_id: str
    last_seen: datetime
    stale: bool


def last_seen(session: Session, since: datetime) -> dict[str, datetime]:
    """Return instance_id -> its newest row at or after `since` (any table it writes)."""
    out: dict[str, datetime] = {}
    for column, instance in ((ProbeRun.started_at, ProbeRun.instance_id),
                             (TrafficRollup.minute, TrafficRollup.instance_id),
                             (MemorySample.at, MemorySample.instance_id),
                             (CompileEvent.at, CompileEvent.instance_id)):
        rows = session.execute(select(instance, func.max(column)).where(column >= since)
                               .group_by(instance))
        for inst, at in rows:
            if at is not None and (inst not in out or at > out[inst]):
                out[inst] = at
    return out


def instances(session: Session, now: datetime, stale_after_s: float, *,
              lookback_s: float = 7 * 86400.0) -> list[InstanceSeen]:
    """Return the instances seen within `lookback_s` of `now`, live ones first, by id."""
    limit = now - timedelta(seconds=stale_after_s)
    seen = last_seen(session, now - timedelta(seconds=lookback_s))
    out = [InstanceSeen(i, at, at < limit) for i, at in seen.items()]
    return sorted(out, key=lambda x: (x.stale, x.instance_id))
