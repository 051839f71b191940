"""The report's tables as plain rows, shared by the Markdown and HTML renderers."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from monitor.report.metrics import METRICS
from monitor.report.model import CheckResult, OptimizationReview, WeeklyReport


@dataclass(frozen=True)
class Table:
    """A titled table of text cells."""

    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    empty: str = "none"
    status_col: int | None = None  # a column of check statuses, which HTML colours


def fmt(value: float | None, unit: str = "") -> str:
    """Format a metric value for a table cell."""
    if value is None:
        return "-"
    if unit == "share":
        return f"{value:.1%}"
    return f"{value:.3g}"


def speed(value: float | None) -> str:
    """Format a speedup, e.g. 1.30x, or n/a."""
    return "n/a" if value is None else f"{value:.2f}x"


def when(t: datetime | None) -> str:
    """Format a timestamp as UTC minutes."""
    return "-" if t is None else t.strftime("%Y-%m-%d %H:%MZ")


def check_rows(opt: OptimizationReview) -> Table:
    """Return one row per assumption, plus one per judged bucket."""
    rows = []
    for c in opt.checks:
        unit = METRICS[c.assumption.metric].unit
        rows.append((c.assumption.text, c.assumption.condition, c.status.upper(),
                     fmt(c.verdict.value, unit), _evidence(c)))
        for b in c.buckets:
            rows.append((f"  bucket {b.bucket}", "", b.verdict.status,
                         fmt(b.verdict.value, unit), b.verdict.detail))
    return Table(("Assumption", "Check", "Status", "Value", "Evidence"), tuple(rows),
                 status_col=2)


def _evidence(c: CheckResult) -> str:
    v = c.verdict
    parts = [v.reason]
    if v.detail and v.detail != v.reason:
        parts.append(v.detail)
    if v.projected is not None:
        parts.append(f"trend in 7 days: {v.projected:.3g}")
    parts.append(f"window {c.window}")
    return "; ".join(parts)


def speedup_table(report: WeeklyReport) -> Table:
    """Return expected vs measured speedup per optimization and bucket."""
    rows = []
    for o in report.optimizations:
        for s in (*o.speedups, *([o.overall] if o.overall else ())):
            bucket = "all (every bucket's pairs)" if s is o.overall else s.bucket
            rows.append((o.name, bucket, s.arm, fmt(s.expected), fmt(s.measured),
                         ci(s.ci_low, s.ci_high), str(s.pairs), s.evidence))
    return Table(("Optimization", "Bucket", "Fallback arm", "Expected", "Measured", "95% CI",
                  "Pairs", "Evidence"), tuple(rows),
                 "nothing measured: no A/B prompt pairs this week")


def ci(low: float | None, high: float | None) -> str:
    """Format a confidence interval, or '-' when there are too few pairs for one."""
    return "-" if low is None or high is None else f"{low:.3g}-{high:.3g}"


def alert_table(report: WeeklyReport) -> Table:
    """Return the week's alerts with their transitions."""
    rows = tuple((a.name, a.bucket or "-", a.severity, when(a.fired_at), when(a.resolved_at),
                  a.summary + ("; " + "; ".join(a.transitions) if a.transitions else ""))
                 for a in report.alerts)
    return Table(("Alert", "Bucket", "Severity", "Fired", "Resolved", "What happened"), rows,
                 "no alerts this week")


def flag_table(report: WeeklyReport) -> Table:
    """Return the week's flag changes: who or what, and why."""
    rows = tuple((when(f.at), f.flag, f.old if f.old is not None else "-", f.new, f.actor,
                  f.reason) for f in report.flag_changes)
    return Table(("When", "Flag", "Old", "New", "Who/what", "Why"), rows,
                 "no flag changes this week")


def shape_table(report: WeeklyReport) -> Table:
    """Return the real-traffic input length summary."""
    s = report.shapes
    if s is None:
        return Table(("Measure", "Value"), (), "no real traffic this week")
    rows = (
        ("real requests", str(s.requests)),
        ("input length p50 / p90 / p99 / max", f"{s.p50} / {s.p90} / {s.p99} / {s.max_length}"),
        ("bucket edges", ", ".join(str(b) for b in s.buckets)),
        ("fit the largest bucket", f"{s.fit_largest:.2%}"),
        ("padding waste (estimated from histogram)", fmt(s.padding_waste, "share")),
        ("quantile edges", ", ".join(str(b) for b in s.proposed_edges)),
        ("padding waste with quantile edges", fmt(s.proposed_waste, "share")),
    )
    return Table(("Measure", "Value"), rows)


def costly_table(report: WeeklyReport) -> Table:
    """Return each bucket where an optimization measured slower than going without it."""
    rows = tuple((c.name, r.bucket, speed(r.measured), r.evidence, r.turn_off)
                 for c in report.costly for r in c.rows)
    empty = ("every measured optimization earns its cost" if report.measured
             else "nothing measured: no A/B prompt pairs this week")
    return Table(("Optimization", "Bucket", "Measured speedup", "Evidence", "Turn off with"),
                 rows, empty)
