"""Judge one assumption against a metric reading: holds, violated, at risk or no data.

At risk: the check holds this week but either the value lies within 10% of the threshold,
or the least-squares line through the daily values crosses the threshold within
7 days after the week ends. For a share that must stay high (">= 0.99 of inputs fit")
closeness is measured on the complement: 0.995 uses 50% of the 0.01 allowed to miss,
so it holds, where a plain 10% band would keep every such check at risk forever.
"""

from __future__ import annotations

from dataclasses import dataclass

from monitor.report.metrics import MetricReading, Reading, linear_fit
from monitor.report.optimizations import Assumption

HOLDS = "holds"
AT_RISK = "at risk"
VIOLATED = "violated"
NO_DATA = "no data"
PARTIALLY_CHECKED = "partially checked"  # an optimization's status only, never a check's
SEVERITY = {NO_DATA: 0, HOLDS: 1, AT_RISK: 2, VIOLATED: 3}

NEAR_SHARE = 0.10  # "within 10% of the threshold"
HORIZON_DAYS = 7.0  # project the trend this far past the end of the week
MIN_TREND_DAYS = 3


@dataclass(frozen=True)
class Verdict:
    """One judged value; projected is the trend's value HORIZON_DAYS after the week."""

    status: str
    value: float | None
    reason: str
    detail: str
    n: int
    projected: float | None = None


@dataclass(frozen=True)
class BucketVerdict:
    """A per-bucket judgement."""

    bucket: str
    verdict: Verdict


def judge(check: Assumption, reading: Reading, unit: str = "") -> Verdict:
    """Judge `reading` against `check` (unit "share" judges closeness on the complement)."""
    if reading.value is None:
        return Verdict(NO_DATA, None, reading.detail, reading.detail, reading.n)
    value = reading.value
    projected = project(reading.daily)
    if not check.passes(value):
        return Verdict(VIOLATED, value, f"{value:.4g} fails {check.op} {check.threshold:g}",
                       reading.detail, reading.n, projected)
    margin = abs(value - check.threshold)
    scale = abs(check.threshold)
    if unit == "share" and check.op in (">=", ">"):
        scale = 1.0 - check.threshold  # the share allowed to miss
    if scale > 0 and margin <= NEAR_SHARE * scale:
        return Verdict(AT_RISK, value, f"{value:.4g} is within 10% of its limit "
                       f"{check.op} {check.threshold:g}",
                       reading.detail, reading.n, projected)
    if projected is not None and not check.passes(projected):
        return Verdict(AT_RISK, value,
                       f"daily trend projects {projected:.4g} within {HORIZON_DAYS:g} days "
                       f"(threshold {check.op} {check.threshold:g})",
                       reading.detail, reading.n, projected)
    return Verdict(HOLDS, value, f"{value:.4g} {check.op} {check.threshold:g}", reading.detail,
                   reading.n, projected)


def judge_metric(check: Assumption, reading: MetricReading,
                 unit: str = "") -> tuple[Verdict, tuple[BucketVerdict, ...]]:
    """Judge a check overall or, when per_bucket, each bucket (the worst bucket decides)."""
    if not check.per_bucket:
        return judge(check, reading.overall, unit), ()
    buckets = tuple(BucketVerdict(b, judge(check, r, unit))
                    for b, r in reading.per_bucket.items())
    if not buckets:
        return judge(check, reading.overall, unit), ()
    worst = max(buckets, key=lambda bv: SEVERITY[bv.verdict.status])
    v = worst.verdict
    bad = [bv.bucket for bv in buckets if bv.verdict.status == v.status]
    reason = f"bucket {', '.join(bad)}: {v.reason}" if v.status in (VIOLATED, AT_RISK) else (
        f"all {len(buckets)} buckets: {check.op} {check.threshold:g}")
    return Verdict(v.status, v.value, reason, v.detail, sum(b.verdict.n for b in buckets),
                   v.projected), buckets


def project(daily: tuple[float | None, ...]) -> float | None:
    """Return the daily values' linear trend HORIZON_DAYS after the week, or None."""
    pts = [(i + 0.5, v) for i, v in enumerate(daily) if v is not None]
    if len(pts) < MIN_TREND_DAYS:
        return None
    slope, intercept = linear_fit(pts)
    return intercept + slope * (len(daily) + HORIZON_DAYS)


def worst(statuses: list[str]) -> str:
    """Return the most severe of `statuses` (no data when empty)."""
    return max(statuses, key=SEVERITY.__getitem__, default=NO_DATA)


def overall(statuses: list[str]) -> str:
    """Return an optimization's status from its checks' statuses.

    A violated or at-risk check decides. Otherwise every check must have data for the
    optimization to hold: with some checks lacking data it is "partially checked" (what
    was measured holds, the rest is unknown), and with none measured it has no data.
    """
    measured = [s for s in statuses if s != NO_DATA]
    if not measured:
        return NO_DATA
    status = worst(measured)
    if status == HOLDS and len(measured) < len(statuses):
        return PARTIALLY_CHECKED
    return status
