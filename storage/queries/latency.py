"""Latency percentiles per bucket from canaries and from real-traffic histograms."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from storage import histograms
from storage.models import (
    VARIANT_OPTIMIZED,
    ProbeResult,
    TrafficRollup,
)
from storage.queries._common import (
    _bucket_order,
    _bucket_sort,
    _by_instance,
    _check_window,
    _json_sums,
    _pct,
    _ratio,
    _rollups,
)


@dataclass(frozen=True)
class LatencyPercentiles:
    """Latency of one bucket x path x decoding over a window (seconds).

    From probes (variant set): samples = probe cycles, and each pXX is the median
    over cycles of that cycle's pXX (robust to one bad cycle); max_s is the worst.
    From traffic (variant None): samples = requests, pXX interpolated from the
    summed latency histograms, max_s None.
    """

    bucket: str
    path: str
    decoding: str
    variant: str | None
    samples: int
    requests: int
    p50_s: float | None
    p95_s: float | None
    p99_s: float | None
    max_s: float | None
    mean_s: float | None


def probe_percentiles(
    session: Session, start: datetime, end: datetime, *,
    variant: str | None = VARIANT_OPTIMIZED, instance_id: str | None = None,
) -> list[LatencyPercentiles]:
    """Return canary latency per bucket x path x decoding (x variant) in the window."""
    _check_window(start, end)
    r = ProbeResult
    stmt = select(r.bucket, r.path, r.decoding, r.variant, r.count, r.errors,
                  r.p50_s, r.p95_s, r.p99_s, r.max_s).where(r.at >= start, r.at < end)
    if variant is not None:
        stmt = stmt.where(r.variant == variant)
    stmt = _by_instance(stmt, instance_id)
    groups: dict[tuple[str, str, str, str], list[tuple]] = defaultdict(list)
    for bucket, path, decoding, var, count, errors, p50, p95, p99, mx in session.execute(stmt):
        groups[(bucket, path, decoding, var)].append((count - errors, p50, p95, p99, mx))
    out = []
    for (bucket, path, decoding, var), rows in sorted(groups.items(), key=_bucket_sort):
        def col(i: int, rows: list[tuple] = rows) -> list[float]:
            return [row[i] for row in rows if row[i] is not None]
        p50s = col(1)
        out.append(LatencyPercentiles(
            bucket=bucket, path=path, decoding=decoding, variant=var, samples=len(rows),
            requests=sum(row[0] for row in rows), p50_s=_pct(p50s, 0.5),
            p95_s=_pct(col(2), 0.5), p99_s=_pct(col(3), 0.5),
            max_s=max(col(4), default=None), mean_s=statistics.fmean(p50s) if p50s else None,
        ))
    return out


def traffic_percentiles(
    session: Session, start: datetime, end: datetime, *, instance_id: str | None = None,
) -> list[LatencyPercentiles]:
    """Return real-traffic latency per bucket x path x decoding from rollup histograms."""
    _check_window(start, end)
    t = TrafficRollup
    n = len(histograms.LATENCY_EDGES_S) + 1
    where = [t.minute >= start, t.minute < end]
    if instance_id is not None:
        where.append(t.instance_id == instance_id)
    r = _rollups(session, where, ("bucket", "path", "decoding", "requests", "latency_sum_s"),
                 ("latency_hist",)).c
    stmt = (
        select(r.bucket, r.path, r.decoding, func.sum(r.requests), func.sum(r.latency_sum_s),
               *_json_sums(r.latency_hist, n))
        .group_by(r.bucket, r.path, r.decoding)
    )
    out = []
    for bucket, path, decoding, requests, lat_sum, *hist in session.execute(stmt):
        edges = histograms.LATENCY_EDGES_S
        out.append(LatencyPercentiles(
            bucket=bucket, path=path, decoding=decoding, variant=None, samples=int(requests or 0),
            requests=int(requests or 0), p50_s=histograms.quantile(hist, edges, 0.5),
            p95_s=histograms.quantile(hist, edges, 0.95),
            p99_s=histograms.quantile(hist, edges, 0.99), max_s=None,
            mean_s=_ratio(lat_sum or 0.0, requests or 0),
        ))
    return sorted(out, key=lambda p: (_bucket_order(p.bucket), p.path, p.decoding))
