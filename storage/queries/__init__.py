"""Read-side queries for alerts, the API and the weekly report.

Every function takes a Session, never commits, and returns small frozen
dataclasses. Windows are half-open: start <= at < end, timezone-aware UTC.
Ratios are None where their denominator is zero: "no data" is not "zero".
"""


from __future__ import annotations

from storage.queries.baselines import (
    BaselineValue,
    Change,
    active_baseline,
    change_against_baseline,
    relative_change,
)
from storage.queries.latency import LatencyPercentiles, probe_percentiles, traffic_percentiles
from storage.queries.resources import (
    MEMORY_FIELDS,
    CompileRate,
    MemoryGrowth,
    memory_growth,
    recompiles_per_hour,
)
from storage.queries.series import (
    BURST_METRICS,
    PROBE_METRICS,
    TRAFFIC_METRICS,
    BurstPoint,
    SeriesPoint,
    burst_series,
    metric_series,
    traffic_series,
)
from storage.queries.traffic import (
    ACCEPTANCE_SOURCES,
    Acceptance,
    TrafficShape,
    acceptance,
    traffic_shape,
)

__all__ = [
    "ACCEPTANCE_SOURCES", "BURST_METRICS", "MEMORY_FIELDS", "PROBE_METRICS", "TRAFFIC_METRICS",
    "Acceptance", "BaselineValue", "BurstPoint", "Change", "CompileRate", "LatencyPercentiles",
    "MemoryGrowth", "SeriesPoint", "TrafficShape", "acceptance", "active_baseline",
    "burst_series", "change_against_baseline", "memory_growth", "metric_series",
    "probe_percentiles", "recompiles_per_hour", "relative_change", "traffic_percentiles",
    "traffic_series", "traffic_shape",
]
