"""Metrics the assumption checks may name, computed from a WeekData.

Each metric returns a MetricReading: the week's value, a value per day (for trends)
and, for per-bucket metrics, the same per bucket. `None` means no data.
Adding a metric: write a function below and list it in METRICS.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from statistics import median
from typing import TYPE_CHECKING

import pandas as pd

from monitor.report.data import BurstPair, WeekData
from storage.queries.batching import BatchUsage
from storage.queries.speedups import ALL_BUCKETS, OPTIMIZATION_OF_ARM, ArmSpeedup
from vocab import BUCKET_OVERFLOW, Variant

if TYPE_CHECKING:
    from monitor.report.optimizations import Optimization

ARM_OPTIMIZED = Variant.OPTIMIZED.value


@dataclass(frozen=True)
class Reading:
    """One value with its evidence; daily holds the seven per-day values (None = no data)."""

    value: float | None
    detail: str
    n: int = 0
    daily: tuple[float | None, ...] = ()


@dataclass(frozen=True)
class MetricReading:
    """A metric over the whole week and, where it applies, per bucket."""

    overall: Reading
    per_bucket: Mapping[str, Reading] = field(default_factory=dict)


@dataclass(frozen=True)
class MetricSpec:
    """A metric the registry may name."""

    name: str
    description: str
    unit: str  # "share", "ratio", "count", "seconds"
    per_bucket: bool
    compute: Callable[[WeekData, Optimization], MetricReading]
    needs_ab: bool = False
    needs_expected: bool = False


NO_DATA = Reading(None, "no data", 0, (None,) * 7)


def _ratio_reading(num: float, den: float, detail: str, n: int,
                   daily: tuple[float | None, ...]) -> Reading:
    return Reading(num / den if den else None, detail, n, daily)


def _frame(rows: Iterable[object], columns: tuple[str, ...]) -> pd.DataFrame:
    """Return the named attributes of `rows` as a DataFrame (the columns exist when empty)."""
    return pd.DataFrame([[getattr(r, c) for c in columns] for r in rows], columns=list(columns))


def _daily(df: pd.DataFrame, num: str, den: str) -> tuple[float | None, ...]:
    """Return sum(num) / sum(den) for each day 0..6 (None where den sums to 0)."""
    per_day = df.groupby("day")[[num, den]].sum().reindex(range(7), fill_value=0)
    return tuple(float(n / d) if d else None for n, d in zip(per_day[num], per_day[den],
                                                              strict=True))


def _by_bucket(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """Return (bucket, rows) groups in bucket order (numeric edges, then named buckets)."""
    return sorted(((str(b), g) for b, g in df.groupby("bucket")), key=lambda kv: _bucket_key(kv[0]))


def recompiles_after_warmup(data: WeekData, opt: Optimization) -> MetricReading:
    """Count recompiles recorded after warm-up finished."""
    if not data.has_data:
        return MetricReading(NO_DATA)
    df = _frame(data.recompiles, ("hour", "after_warmup", "limit_hits"))
    df["day"] = [(h - data.week.start).days for h in df["hour"]]
    per_day = df.groupby("day")["after_warmup"].sum().reindex(range(7), fill_value=0)
    total, limit_hits = int(df["after_warmup"].sum()), int(df["limit_hits"].sum())
    detail = f"{total} recompiles after warm-up, {limit_hits} recompile-limit hits"
    return MetricReading(Reading(float(total), detail, len(data.recompiles),
                                 tuple(float(v) for v in per_day)))


def acceptance_rate(data: WeekData, opt: Optimization) -> MetricReading:
    """Accepted / proposed draft tokens, per bucket and overall."""
    df = _frame(data.acceptance, ("bucket", "day", "accepted", "proposed"))

    def reading(rows: pd.DataFrame) -> Reading:
        a, p = int(rows["accepted"].sum()), int(rows["proposed"].sum())
        return _ratio_reading(a, p, f"{a} accepted / {p} proposed", p,
                              _daily(rows, "accepted", "proposed"))

    return MetricReading(reading(df), {b: reading(g) for b, g in _by_bucket(df)})


def largest_bucket_fit(data: WeekData, opt: Optimization) -> MetricReading:
    """Share of real requests that fit the largest bucket (not overflow)."""
    df = _frame(data.traffic, ("day", "requests", "overflowed"))
    total, over = int(df["requests"].sum()), int(df["overflowed"].sum())
    if not total:
        return MetricReading(NO_DATA)
    df["fits"] = df["requests"] - df["overflowed"]
    largest = max(data.buckets) if data.buckets else 0
    detail = f"{total - over} of {total} real requests <= {largest} tokens ({over} overflow)"
    return MetricReading(Reading((total - over) / total, detail, total,
                                 _daily(df, "fits", "requests")))


def padding_waste(data: WeekData, opt: Optimization) -> MetricReading:
    """Share of padded input tokens that are padding (real traffic, overflow excluded)."""
    df = _frame(data.traffic, ("bucket", "day", "requests", "input_tokens", "padded_tokens"))
    df = df[df["bucket"] != BUCKET_OVERFLOW]
    df = df.assign(padding=df["padded_tokens"] - df["input_tokens"])

    def reading(rows: pd.DataFrame) -> Reading:
        pad, padded = int(rows["padding"].sum()), int(rows["padded_tokens"].sum())
        return _ratio_reading(pad, padded, f"{pad} padding of {padded} padded tokens",
                              int(rows["requests"].sum()), _daily(rows, "padding", "padded_tokens"))

    per_bucket = {b: reading(g) for b, g in _by_bucket(df)}
    return MetricReading(reading(df) if len(df) else NO_DATA, per_bucket)


def kv_cache_budget_share(data: WeekData, opt: Optimization) -> MetricReading:
    """Peak KV-cache bytes over its memory budget."""
    if not data.memory:
        return MetricReading(NO_DATA)
    daily: list[float | None] = [None] * 7
    peak_share: float | None = None
    peak = None
    for m in data.memory:
        budget = m.kv_budget_bytes or data.kv_budget_bytes
        if not budget:
            continue
        share = m.kv_cache_bytes / budget
        day = (m.at - data.week.start).days
        daily[day] = share if daily[day] is None else max(daily[day], share)  # type: ignore[type-var]
        if peak_share is None or share > peak_share:
            peak_share, peak = share, (m.kv_cache_bytes, budget)
    if peak is None:
        return MetricReading(Reading(None, "no KV-cache budget recorded or configured"))
    detail = f"peak {_mib(peak[0])} of a {_mib(peak[1])} budget over {len(data.memory)} samples"
    return MetricReading(Reading(peak_share, detail, len(data.memory), tuple(daily)))


def memory_growth_per_day(data: WeekData, opt: Optimization) -> MetricReading:
    """RSS growth per day relative to the fitted start, worst instance (least squares)."""
    by_instance: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for m in data.memory:
        by_instance[m.instance].append(
            ((m.at - data.week.start).total_seconds() / 86400.0, float(m.rss_bytes)))
    best: Reading | None = None
    for instance, pts in sorted(by_instance.items()):
        if len(pts) < 2 or pts[-1][0] - pts[0][0] < 1 / 24:
            continue  # under an hour of samples says nothing about a daily trend
        slope, intercept = linear_fit(pts)
        start_value = intercept + slope * pts[0][0]
        if start_value <= 0:
            continue
        growth = slope / start_value
        who = f"instance {instance}: " if instance else ""
        detail = (f"{who}RSS slope {_mib(slope)}/day from {_mib(start_value)} "
                  f"({len(pts)} samples)")
        if best is None or growth > (best.value or 0.0):
            best = Reading(growth, detail, len(pts))
    if best is None:
        return MetricReading(Reading(None, f"{len(data.memory)} memory samples: "
                                           "under an hour per instance, no trend"))
    return MetricReading(best)


def speedup(data: WeekData, opt: Optimization) -> MetricReading:
    """Measured speedup per bucket and over all buckets (storage.queries.speedups)."""
    name = OPTIMIZATION_OF_ARM.get(opt.ab_arm or "")
    rows = [s for s in data.ab if s.optimization == name]
    if not rows:
        left = data.ab_on_demand.pairs(name or "", ALL_BUCKETS)
        return MetricReading(Reading(None, f"nothing measured: no A/B pairs for arm "
                                           f"{opt.ab_arm!r} this week" + (
            f" (only {left} pairs of cycles run on demand after a slow one, left out)"
            if left else "")))
    daily: dict[tuple[str, int], float] = {
        (d.speedup.bucket, d.day): d.speedup.speedup for d in data.ab_daily
        if d.speedup.optimization == name}

    def reading(s: ArmSpeedup) -> Reading:
        days = tuple(daily.get((s.bucket, i)) for i in range(7))
        return Reading(s.speedup, speedup_evidence(s, data), s.pairs, days)

    overall = next((reading(s) for s in rows if s.bucket == ALL_BUCKETS), NO_DATA)
    per_bucket = {s.bucket: reading(s) for s in rows if s.bucket != ALL_BUCKETS}
    return MetricReading(overall, per_bucket)


def speedup_evidence(s: ArmSpeedup, data: WeekData | None = None) -> str:
    """Return how a measured speedup was measured, e.g. for a report cell; with the
    week's `data`, also the pairs of its bucket that on-demand cycles would have added."""
    ci = ("" if s.ci_low is None or s.ci_high is None
          else f", 95% CI {s.ci_low:.2f}-{s.ci_high:.2f}x")
    arms = "/".join(s.arms)
    # The week's speedups leave out the cycles that ran the arms after a slow one.
    left = 0 if data is None else data.ab_on_demand.pairs(s.optimization, s.bucket)
    # Without vs with the optimization, not arm vs optimized request: where a reverse arm
    # is pooled in, the optimized request ran without the optimization in its pairs.
    return (f"median of {s.pairs} per-prompt pairs in {s.runs} A/B cycles{ci}; without it "
            f"{s.off_p50_s * 1000:.1f} ms vs with it {s.on_p50_s * 1000:.1f} ms (medians; "
            f"arms {arms})"
            + (f"; {left} pairs of cycles run on demand after a slow one left out"
               if left else ""))


def speedup_vs_expected(data: WeekData, opt: Optimization) -> MetricReading:
    """Measured speedup / expected speedup, per bucket and overall."""
    raw = speedup(data, opt)
    expected = opt.expected_speedup or 1.0

    def scale(r: Reading) -> Reading:
        if r.value is None:
            return r
        return Reading(r.value / expected,
                       f"measured {r.value:.2f}x / expected {expected:g}x; {r.detail}", r.n,
                       tuple(None if d is None else d / expected for d in r.daily))

    return MetricReading(scale(raw.overall), {b: scale(r) for b, r in raw.per_bucket.items()})


def p99_vs_baseline(data: WeekData, opt: Optimization) -> MetricReading:
    """Week p99 latency / baseline p99, per bucket (optimized canaries)."""
    daily: dict[str, list[float | None]] = defaultdict(lambda: [None] * 7)
    counts: dict[str, int] = defaultdict(int)
    for row in data.p99:
        base = data.baseline_p99.get(row.bucket)
        if base:
            daily[row.bucket][row.day] = row.p99_s / base
        counts[row.bucket] += row.n
    per_bucket = {}
    for bucket, p99 in sorted(data.p99_week.items(), key=lambda kv: _bucket_key(kv[0])):
        base = data.baseline_p99.get(bucket)
        if not base:
            continue
        per_bucket[bucket] = Reading(p99 / base, f"p99 {p99 * 1000:.1f} ms vs baseline "
                                     f"{base * 1000:.1f} ms", counts[bucket],
                                     tuple(daily[bucket]))
    if not per_bucket:
        return MetricReading(Reading(None, "no p99 with a baseline"))
    worst = max(per_bucket.items(), key=lambda kv: kv[1].value or 0.0)
    return MetricReading(Reading(worst[1].value, f"worst bucket {worst[0]}: {worst[1].detail}",
                                 worst[1].n), per_bucket)


# The A/B arm that switches an optimization back on while its fallback flag is off.
_REVERSE_ARM = {"float32": "quantized", "eager": "compiled", "direct": "speculative",
                "compiled_step": "native_step"}


def output_agreement(data: WeekData, opt: Optimization) -> MetricReading:
    """Mean token agreement with the reference path per bucket (canaries), worst bucket first.

    Reads the optimized arm and, when the optimization's fallback was on, the arm that
    switched it back on (int8: `quantized`), so a bucket turned off still gets judged.
    """
    arms = {ARM_OPTIMIZED, _REVERSE_ARM.get(opt.ab_arm or "", ARM_OPTIMIZED)}
    sums: dict[str, tuple[float, int]] = {}
    for row in data.quality:
        if row.source == "canary" and row.arm in arms and row.agreement is not None:
            total, n = sums.get(row.bucket, (0.0, 0))
            sums[row.bucket] = (total + row.agreement * row.compared, n + row.compared)
    per_bucket = {b: Reading(t / n, f"{t / n:.4f} over {n} outputs", n)
                  for b, (t, n) in sorted(sums.items(), key=lambda kv: _bucket_key(kv[0])) if n}
    if not per_bucket:
        return MetricReading(Reading(None, "no outputs compared with reference outputs"))
    worst = min(per_bucket.items(), key=lambda kv: kv[1].value or 0.0)
    return MetricReading(Reading(worst[1].value, f"worst bucket {worst[0]}: {worst[1].detail}",
                                 worst[1].n), per_bucket)


def batching_gain(data: WeekData, opt: Optimization) -> MetricReading:
    """Return batching's throughput gain over its p99 cost, from the burst's arm pairs.

    Per burst: the batched arm's completed requests per second over the unbatched arm's
    (same arrivals), and its p99 over theirs; the value is the week's median gain divided
    by the median p99 cost (>= 1: batching buys more throughput than it costs the tail).
    """
    pairs = [p for p in data.batching.bursts if p.unbatched_per_s > 0 and p.unbatched_p99_s > 0]

    def reading(ps: list[BurstPair]) -> Reading:
        if not ps:
            return NO_DATA
        gain = median(p.batched_per_s / p.unbatched_per_s for p in ps)
        cost = median(p.batched_p99_s / p.unbatched_p99_s for p in ps)
        if not cost:
            return NO_DATA
        return Reading(gain / cost, f"throughput {gain:.2f}x unbatched at p99 {cost:.2f}x "
                       f"(median over {len(ps)} bursts' arm pairs)", len(ps))

    week = reading(pairs)
    daily = tuple(reading([p for p in pairs if p.day == d]).value for d in range(7))
    return MetricReading(Reading(week.value, week.detail, week.n, daily))


def window_vs_token_time(data: WeekData, opt: Optimization) -> MetricReading:
    """Return the batching window's mean over real traffic's p50 time per output token."""
    b = data.batching
    samples = sum(x.samples for x in b.loop if x.window_mean_s is not None)
    if not samples or not b.token_p50_s:
        return MetricReading(NO_DATA)
    window = sum((x.window_mean_s or 0.0) * x.samples for x in b.loop) / samples
    return MetricReading(Reading(window / b.token_p50_s,
                                 f"window {window * 1e3:.2f} ms (mean of {samples} samples) / "
                                 f"p50 token time {b.token_p50_s * 1e3:.2f} ms", samples,
                                 (None,) * 7))


def speculation_speedup_at_load(data: WeekData, opt: Optimization) -> MetricReading:
    """Return speculation's measured speedup at the batch sizes real traffic ran at.

    Per batch-size class holding both speculative and direct requests: speculative step
    tokens per second over direct's; the value weighs the classes by their speculative
    requests. The detail gives the speculative share and the speedup per class.
    """

    def reading(usage: tuple[BatchUsage, ...]) -> Reading:
        by_class: dict[str, dict[str, tuple[int, float | None]]] = defaultdict(dict)
        for u in usage:
            n, rate = by_class[u.batch].get(u.decoding, (0, None))
            by_class[u.batch][u.decoding] = (n + u.requests, _mean_rate(rate, n, u))
        total = sum(u.requests for u in usage)
        spec = sum(u.requests for u in usage if u.decoding == "speculative")
        speedups: list[tuple[str, float, int]] = []
        for cls, d in sorted(by_class.items(), key=lambda kv: int(kv[0])):
            s, direct = d.get("speculative"), d.get("direct")
            if s and direct and s[1] and direct[1]:
                speedups.append((cls, s[1] / direct[1], s[0]))
        if not speedups:
            return Reading(None, f"speculative share {spec / total:.0%}; no batch size ran "
                           "both ways" if total else "no data", total, ())
        weight = sum(n for _, _, n in speedups)
        value = sum(x * n for _, x, n in speedups) / weight
        per = ", ".join(f"{c} rows: {x:.2f}x" for c, x, _ in speedups)
        return Reading(value, f"speculative share {spec / total:.0%}; speedup by batch size: "
                       f"{per}", weight, ())

    week = reading(data.batching.usage)
    daily = tuple(reading(u).value for u in data.batching.usage_daily) or (None,) * 7
    return MetricReading(Reading(week.value, week.detail, week.n, daily))


def _mean_rate(rate: float | None, n: int, u: BatchUsage) -> float | None:
    """Return the request-weighted mean step rate of a class so far with `u` added."""
    if u.step_tokens_per_s is None:
        return rate
    if rate is None:
        return u.step_tokens_per_s
    return (rate * n + u.step_tokens_per_s * u.requests) / (n + u.requests)


def linear_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Return (slope, intercept) of the least-squares line through `points`."""
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    if sxx == 0:
        return 0.0, my
    slope = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx
    return slope, my - slope * mx


def _bucket_key(label: str) -> tuple[int, int]:
    return (1, 0) if not label.isdigit() else (0, int(label))


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


METRICS: dict[str, MetricSpec] = {
    s.name: s
    for s in (
        MetricSpec("recompiles_after_warmup", "recompiles once warm-up finished", "count",
                   False, recompiles_after_warmup),
        MetricSpec("acceptance_rate", "accepted / proposed draft tokens", "share", True,
                   acceptance_rate),
        MetricSpec("largest_bucket_fit", "share of real inputs that fit the largest bucket",
                   "share", False, largest_bucket_fit),
        MetricSpec("padding_waste", "padding share of padded input tokens", "share", True,
                   padding_waste),
        MetricSpec("kv_cache_budget_share", "peak KV cache / its memory budget", "share",
                   False, kv_cache_budget_share),
        MetricSpec("memory_growth_per_day", "RSS growth per day, relative", "share", False,
                   memory_growth_per_day),
        MetricSpec("speedup", "median over A/B prompt pairs of fallback / optimized latency",
                   "ratio",
                   True, speedup, needs_ab=True),
        MetricSpec("speedup_vs_expected", "measured speedup / expected speedup", "ratio",
                   True, speedup_vs_expected, needs_ab=True, needs_expected=True),
        MetricSpec("p99_vs_baseline", "week p99 / baseline p99", "ratio", True,
                   p99_vs_baseline),
        MetricSpec("output_agreement", "mean token agreement with the reference path",
                   "share", True, output_agreement),
        MetricSpec("batching_gain", "burst throughput gain over p99 cost, batched vs the "
                   "unbatched arm", "ratio", False, batching_gain),
        MetricSpec("window_vs_token_time", "mean batching window / p50 time per output token",
                   "ratio", False, window_vs_token_time),
        MetricSpec("speculation_speedup_at_load", "speculative / direct step tokens per "
                   "second at the batch sizes traffic ran at", "ratio", False,
                   speculation_speedup_at_load),
    )
}
