"""Memory growth and compile activity over a window."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.errors import InvalidQuery
from storage.models import (
    CompileEvent,
    MemorySample,
)
from storage.queries._common import _check_window

MEMORY_FIELDS = ("rss_bytes", "kv_cache_bytes", "cuda_allocated_bytes", "cuda_reserved_bytes",
                 "cuda_peak_bytes")


@dataclass(frozen=True)
class MemoryGrowth:
    """Least-squares growth of one memory field of one instance over a window."""

    instance_id: str
    field: str
    samples: int
    first_at: datetime
    last_at: datetime
    first_bytes: int
    last_bytes: int
    slope_bytes_per_hour: float | None
    growth_pct_per_day: float | None  # slope x 24 h over the fitted value at first_at


def memory_growth(
    session: Session, start: datetime, end: datetime, *,
    instance_id: str | None = None, field: str = "rss_bytes",
) -> list[MemoryGrowth]:
    """Return the memory growth slope of each instance (or one) in the window."""
    _check_window(start, end)
    if field not in MEMORY_FIELDS:
        raise InvalidQuery("field", f"must be one of {', '.join(MEMORY_FIELDS)}", value=field)
    m = MemorySample
    col = getattr(m, field)
    stmt = (select(m.instance_id, m.at, col)
            .where(m.at >= start, m.at < end, col.is_not(None)).order_by(m.instance_id, m.at))
    if instance_id is not None:
        stmt = stmt.where(m.instance_id == instance_id)
    series: dict[str, list[tuple[datetime, int]]] = defaultdict(list)
    for inst, at, value in session.execute(stmt):
        series[inst].append((at, value))
    return [_growth(inst, field, pts) for inst, pts in sorted(series.items())]


def _growth(instance_id: str, field: str, pts: list[tuple[datetime, int]]) -> MemoryGrowth:
    t0 = pts[0][0]
    xs = [(at - t0).total_seconds() / 3600.0 for at, _ in pts]
    ys = [float(v) for _, v in pts]
    slope = pct = None
    if len(pts) >= 2 and xs[-1] > 0:
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
        fitted0 = my - slope * mx
        pct = slope * 24.0 / fitted0 * 100.0 if fitted0 > 0 else None
    return MemoryGrowth(instance_id, field, len(pts), t0, pts[-1][0], pts[0][1], pts[-1][1],
                        slope, pct)


@dataclass(frozen=True)
class CompileRate:
    """Compile activity summed over a window (all instances unless one is given)."""

    hours: float
    events: int
    graphs: int
    recompiles: int
    recompiles_per_hour: float
    graph_breaks: int
    limit_hits: int
    failures: int
    compile_seconds: float
    top_recompile_reasons: tuple[tuple[str, int], ...]
    top_graph_break_reasons: tuple[tuple[str, int], ...]


def recompiles_per_hour(
    session: Session, start: datetime, end: datetime, *,
    instance_id: str | None = None, top: int = 5,
) -> CompileRate:
    """Return recompiles per hour and the compile counters summed over the window."""
    _check_window(start, end)
    c = CompileEvent
    stmt = select(c.graphs, c.recompiles, c.recompile_reasons, c.graph_breaks,
                  c.graph_break_reasons, c.compile_seconds, c.limit_hits, c.failures
                  ).where(c.at >= start, c.at < end)
    if instance_id is not None:
        stmt = stmt.where(c.instance_id == instance_id)
    totals = [0, 0, 0, 0.0, 0, 0]
    recompile_reasons: Counter[str] = Counter()
    break_reasons: Counter[str] = Counter()
    events = 0
    for graphs, recompiles, rr, breaks, br, seconds, hits, failures in session.execute(stmt):
        events += 1
        for i, v in enumerate((graphs, recompiles, breaks, seconds, hits, failures)):
            totals[i] += v or 0
        recompile_reasons.update(rr or {})
        break_reasons.update(br or {})
    hours = (end - start).total_seconds() / 3600.0
    return CompileRate(
        hours=hours, events=events, graphs=int(totals[0]), recompiles=int(totals[1]),
        recompiles_per_hour=totals[1] / hours, graph_breaks=int(totals[2]),
        compile_seconds=float(totals[3]), limit_hits=int(totals[4]), failures=int(totals[5]),
        top_recompile_reasons=tuple(recompile_reasons.most_common(top)),
        top_graph_break_reasons=tuple(break_reasons.most_common(top)),
    )
