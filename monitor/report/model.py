"""The weekly report as frozen dataclasses; renderers and the summary read only these."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from monitor.report.data import AlertEntry, FlagChange, WeekData
from monitor.report.optimizations import Assumption, DisableCondition
from monitor.report.shapes import ShapeSummary
from monitor.report.verdict import BucketVerdict, Verdict


@dataclass(frozen=True)
class CheckResult:
    """One assumption judged over the week's window."""

    assumption: Assumption
    verdict: Verdict
    buckets: tuple[BucketVerdict, ...]
    window: str  # the query window, e.g. "2026-11-23T00:00Z .. 2026-11-30T00:00Z"

    @property
    def status(self) -> str:
        """Return holds / at risk / violated / no data."""
        return self.verdict.status


@dataclass(frozen=True)
class SpeedupRow:
    """Expected vs measured speedup of one optimization in one bucket (A/B canaries)."""

    optimization: str
    arm: str
    bucket: str
    expected: float | None
    measured: float | None
    evidence: str
    ci_low: float | None = None  # 95% CI of the measured median (storage.queries.speedups)
    ci_high: float | None = None
    pairs: int = 0


@dataclass(frozen=True)
class OptimizationReview:
    """One optimization: its checks, measured speedup and kill conditions."""

    name: str
    owner: str
    description: str
    status: str
    expected_speedup: float | None
    measured_speedup: float | None  # median over every bucket's pairs; None: not measured
    checks: tuple[CheckResult, ...]
    speedups: tuple[SpeedupRow, ...]
    disable_when: tuple[DisableCondition, ...]
    overall: SpeedupRow | None = None  # bucket "all": the pairs of every bucket together


@dataclass(frozen=True)
class Recommendation:
    """One suggested change; kind is bucket_edges, context_cap or speculation_off."""

    kind: str
    text: str
    evidence: str


@dataclass(frozen=True)
class CostlyRow:
    """One bucket (or "all") where an optimization measured slower than its fallback.

    turn_off: the flag change that would turn it off there (or that it is off already).
    """

    bucket: str
    measured: float
    evidence: str
    turn_off: str


@dataclass(frozen=True)
class CostlyOptimization:
    """An optimization whose measured speedup is under 1 overall or in some buckets."""

    name: str
    measured_speedup: float | None
    slower_buckets: tuple[tuple[str, float], ...]
    rows: tuple[CostlyRow, ...] = ()


@dataclass(frozen=True)
class WeeklyReport:
    """Everything the weekly assumption review says about one ISO week."""

    week: str
    start: datetime
    end: datetime
    generated_at: datetime
    has_data: bool
    optimizations: tuple[OptimizationReview, ...]
    alerts: tuple[AlertEntry, ...]
    flag_changes: tuple[FlagChange, ...]
    shapes: ShapeSummary | None
    recommendations: tuple[Recommendation, ...]
    costly: tuple[CostlyOptimization, ...]
    data: WeekData  # what the plots draw

    @property
    def window(self) -> str:
        """Return the week's query window as text."""
        return f"{_iso(self.start)} .. {_iso(self.end)} (UTC, end exclusive)"

    @property
    def measured(self) -> bool:
        """Return whether any optimization's speedup was measured this week."""
        return any(o.speedups for o in self.optimizations)

    def counts(self) -> dict[str, int]:
        """Return how many checks hold, are at risk, are violated or lack data."""
        out = {"holds": 0, "at risk": 0, "violated": 0, "no data": 0}
        for opt in self.optimizations:
            for c in opt.checks:
                out[c.status] += 1
        return out

    def summary(self) -> dict[str, Any]:
        """Return the JSON summary stored with the report and sent to webhooks."""
        return {
            "week": self.week,
            "start": _iso(self.start),
            "end": _iso(self.end),
            "generated_at": _iso(self.generated_at),
            "has_data": self.has_data,
            "counts": self.counts(),
            "optimizations": [
                {
                    "name": o.name,
                    "owner": o.owner,
                    "status": o.status,
                    "expected_speedup": o.expected_speedup,
                    "measured_speedup": o.measured_speedup,
                    "checks": [
                        {"id": c.assumption.id, "metric": c.assumption.metric,
                         "condition": c.assumption.condition, "status": c.status,
                         "value": c.verdict.value, "reason": c.verdict.reason,
                         "buckets": {b.bucket: {"status": b.verdict.status,
                                                "value": b.verdict.value}
                                     for b in c.buckets}}
                        for c in o.checks
                    ],
                }
                for o in self.optimizations
            ],
            "alerts": len(self.alerts),
            "flag_changes": len(self.flag_changes),
            "dead_letters": {r.target: r.count for r in self.data.dead_letters},
            "costly": [c.name for c in self.costly],
            "measured": self.measured,
            # A/B cycles run on demand after a slow one: not in the speedups above.
            "ab_on_demand_left_out": {"cycles": self.data.ab_on_demand.cycles,
                                      "prompt_pairs": self.data.ab_on_demand.prompts},
            "recommendations": [{"kind": r.kind, "text": r.text} for r in self.recommendations],
        }


def _iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%MZ")
