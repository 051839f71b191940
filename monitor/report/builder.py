"""Turn a week of measurements and the assumption registry into a WeeklyReport."""

from __future__ import annotations

import math
from datetime import datetime

from monitor.report.data import WeekData
from monitor.report.metrics import METRICS, speedup_evidence
from monitor.report.model import (
    CheckResult,
    CostlyOptimization,
    CostlyRow,
    OptimizationReview,
    Recommendation,
    SpeedupRow,
    WeeklyReport,
)
from monitor.report.optimizations import Optimization, Registry
from monitor.report.shapes import MIN_GAIN, ShapeSummary, summarize
from monitor.report.verdict import judge_metric, overall
from storage.queries.speedups import ALL_BUCKETS, OPTIMIZATION_OF_ARM, REVERSE_ARMS

ACCEPTANCE_METRIC = "acceptance_rate"


def build_from_data(data: WeekData, registry: Registry, now: datetime) -> WeeklyReport:
    """Judge every assumption of `registry` on `data` and return the report."""
    window = f"{_iso(data.week.start)} .. {_iso(data.week.end)}"
    reviews = tuple(_review(opt, data, window) for opt in registry.optimizations)
    shapes = summarize(data.lengths, data.buckets)
    return WeeklyReport(
        week=data.week.label,
        start=data.week.start,
        end=data.week.end,
        generated_at=now,
        has_data=data.has_data,
        optimizations=reviews,
        alerts=data.alerts,
        flag_changes=data.flag_changes,
        shapes=shapes,
        recommendations=_recommendations(data, registry, shapes),
        costly=_costly(reviews),
        data=data,
    )


def _review(opt: Optimization, data: WeekData, window: str) -> OptimizationReview:
    checks = []
    for a in opt.assumptions:
        spec = METRICS[a.metric]
        verdict, buckets = judge_metric(a, spec.compute(data, opt), spec.unit)
        checks.append(CheckResult(a, verdict, buckets, window))
    name = OPTIMIZATION_OF_ARM.get(opt.ab_arm or "")
    rows = [SpeedupRow(opt.name, "/".join(s.arms), s.bucket, opt.expected_speedup, s.speedup,
                       speedup_evidence(s, data), s.ci_low, s.ci_high, s.pairs)
            for s in data.ab if name is not None and s.optimization == name]
    whole = next((r for r in rows if r.bucket == ALL_BUCKETS), None)
    status = overall([c.status for c in checks])
    return OptimizationReview(opt.name, opt.owner, opt.description, status,
                              opt.expected_speedup, whole.measured if whole else None,
                              tuple(checks), tuple(r for r in rows if r is not whole),
                              opt.disable_when, whole)


def _costly(reviews: tuple[OptimizationReview, ...]) -> tuple[CostlyOptimization, ...]:
    out = []
    for r in reviews:
        rows = tuple(CostlyRow(s.bucket, s.measured, s.evidence, turn_off(s))
                     for s in (*r.speedups, *([r.overall] if r.overall else ()))
                     if s.measured is not None and s.measured < 1.0)
        if rows:
            slower = tuple((c.bucket, c.measured) for c in rows if c.bucket != ALL_BUCKETS)
            out.append(CostlyOptimization(r.name, r.measured_speedup, slower, rows))
    return tuple(out)


# optimization (storage.queries.speedups) -> the flag that turns it off, and whether it
# takes a bucket scope.
_FLAG_OF = {"compile": ("compiled", False), "speculative": ("speculative", True),
            "bucketing": ("bucketing", False), "int8": ("quantized", True),
            "native_step": ("native_step", False)}


def turn_off(row: SpeedupRow) -> str:
    """Return the flag change that would turn `row`'s optimization off in its bucket."""
    name = OPTIMIZATION_OF_ARM.get(row.arm.split("/")[0], "")
    flag, per_bucket = _FLAG_OF.get(name, ("", False))
    if not flag:
        return "-"
    if all(a in REVERSE_ARMS for a in row.arm.split("/")):
        return f"already off ({flag}=false; measured switched back on): keep it off"
    scope = row.bucket if per_bucket and row.bucket != ALL_BUCKETS else "global"
    body = f'{{"scope": "{scope}", "value": false}}'
    return f"{flag}=false in scope {scope}: PUT /v1/flags/{flag} {body}"


def _recommendations(data: WeekData, registry: Registry,
                     shapes: ShapeSummary | None) -> tuple[Recommendation, ...]:
    out: list[Recommendation] = []
    if shapes is not None:
        if (shapes.padding_waste is not None and shapes.proposed_waste is not None
                and shapes.proposed_edges != shapes.buckets
                and shapes.padding_waste - shapes.proposed_waste >= MIN_GAIN):
            out.append(Recommendation(
                "bucket_edges",
                f"Move bucket edges from {list(shapes.buckets)} to {list(shapes.proposed_edges)}",
                f"padding waste {shapes.padding_waste:.1%} -> "
                f"{shapes.proposed_waste:.1%} over {shapes.requests} real requests "
                f"(exact input lengths; edges chosen to pad the fewest tokens, top edge at "
                f"p99)"))
        cap = _round8(shapes.p99)
        out.append(Recommendation(
            "context_cap",
            f"Cap the context at {cap} tokens (observed p99 input length {shapes.p99})",
            f"p50 {shapes.p50}, p90 {shapes.p90}, p99 {shapes.p99}, max {shapes.max_length} "
            f"tokens; {shapes.fit_largest:.2%} of inputs fit the largest bucket "
            f"({max(shapes.buckets)})"))
    threshold = _acceptance_threshold(registry)
    if threshold is not None:
        reading = METRICS[ACCEPTANCE_METRIC].compute(data, registry.optimizations[0])
        for bucket, r in reading.per_bucket.items():
            if r.value is not None and r.value < threshold:
                out.append(Recommendation(
                    "speculation_off",
                    f"Keep speculation off in bucket {bucket}",
                    f"acceptance {r.value:.3f} < {threshold:g} ({r.detail})"))
    return tuple(out)


def _acceptance_threshold(registry: Registry) -> float | None:
    for opt in registry.optimizations:
        for a in opt.assumptions:
            if a.metric == ACCEPTANCE_METRIC and a.op in (">=", ">"):
                return a.threshold
    return None


def _round8(n: int) -> int:
    return int(math.ceil(n / 8) * 8)


def _iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%MZ")
