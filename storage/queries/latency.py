"""Latency quantiles of any window and scope, merged from the stored sketches.

Traffic minutes (`traffic_rollups`) and canary groups (`probe_results` of cycle runs, the
optimized arm) carry storage.sketches sketches; a window's quantile is the quantile of
their merge, so a 7-day p99 over several buckets and replicas is exact up to the sketch's
relative accuracy, never an average of per-minute percentiles. Every result carries the
samples it rests on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.errors import InvalidQuery
from storage.models import VARIANT_OPTIMIZED, ProbeResult, ProbeRun, TrafficRollup
from storage.queries._common import _check_window
from storage.sketches import Sketch
from vocab import RunKind

SOURCES = ("traffic", "canary")
FIELDS = ("latency", "ttft", "per_token")


@dataclass(frozen=True)
class Quantiles:
    """Quantiles of one window and scope: q -> value (None when empty) and the samples."""

    values: dict[float, float | None]
    samples: int


def sketch(session: Session, start: datetime, end: datetime, *, source: str = "traffic",
           field: str = "latency", buckets: Sequence[str] | None = None,
           instances: Sequence[str] | None = None) -> Sketch:
    """Return the merged sketch of `field` over [start, end) (of some buckets / instances)."""
    _check_window(start, end)
    if source not in SOURCES:
        raise InvalidQuery("source", f"must be one of {', '.join(SOURCES)}", value=source)
    if field not in FIELDS:
        raise InvalidQuery("field", f"must be one of {', '.join(FIELDS)}", value=field)
    if source == "traffic":
        t = TrafficRollup
        stmt = select(getattr(t, f"{field}_sketch")).where(t.minute >= start, t.minute < end)
        if buckets is not None:
            stmt = stmt.where(t.bucket.in_(list(buckets)))
        if instances is not None:
            stmt = stmt.where(t.instance_id.in_(list(instances)))
    else:
        r = ProbeResult
        stmt = (select(getattr(r, f"{field}_sketch"))
                .join(ProbeRun, ProbeRun.id == r.run_id)
                .where(r.at >= start, r.at < end, r.variant == VARIANT_OPTIMIZED,
                       ProbeRun.kind == RunKind.CYCLE.value))
        if buckets is not None:
            stmt = stmt.where(r.bucket.in_(list(buckets)))
        if instances is not None:
            stmt = stmt.where(ProbeRun.instance_id.in_(list(instances)))
    out = Sketch()
    for (data,) in session.execute(stmt):
        out.merge_json(data)
    return out


def quantiles(session: Session, start: datetime, end: datetime,
              qs: Sequence[float] = (0.5, 0.95, 0.99), **scope: object) -> Quantiles:
    """Return the quantiles `qs` over [start, end) with their sample count (see `sketch`)."""
    s = sketch(session, start, end, **scope)  # type: ignore[arg-type]
    return Quantiles({q: s.quantile(q) for q in qs}, s.count)
