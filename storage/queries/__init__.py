"""The read path: every query of alerts, probes, the API, the CLI and the weekly report.

Every function takes a Session, never commits, and returns ORM rows, small frozen
dataclasses, or a pandas DataFrame (read with pandas.read_sql on the session's
connection) where the caller analyses a window. Windows are half-open:
start <= at < end, timezone-aware UTC. Ratios are None where their denominator is
zero: "no data" is not "zero". Modules by subject: alerts, baselines (and which one
is in force), deliveries, export, flags, latency (window quantiles merged from
sketches), measurements, reports, runs, speedups (the measured speedup of each
optimization, paired per prompt: the one definition), traffic (acceptance), week
(DataFrames for the weekly report).
"""


from __future__ import annotations

from storage.queries.baselines import (
    InForce,
    StoredBaseline,
    baseline_in_force,
    baselines_in_force,
    decide_in_force,
)
from storage.queries.traffic import ACCEPTANCE_SOURCES, Acceptance, acceptance

__all__ = [
    "ACCEPTANCE_SOURCES", "Acceptance", "InForce", "StoredBaseline", "acceptance",
    "baseline_in_force", "baselines_in_force", "decide_in_force",
]
