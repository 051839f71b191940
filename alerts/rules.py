"""Alert rules: YAML definitions, validation, and the pure per-series check.

A rule compares the per-cycle series of one metric in one scope with that scope's
baseline and returns a `RuleResult`. Example (alerts/rules.yaml holds the defaults):

    rules:
      - name: p99_regression
        metric: p99_latency
        source: canary          # canary | traffic
        per: [bucket]           # labels that split the scope: bucket, path, instance
        change: "+15%"          # relative threshold and direction vs the baseline
        resolve_change: "+5%"   # hysteresis: resolve once back under this
        for: 3                  # the change must hold (median) over at least this many cycles
        resolve_for: 5          # cycles back inside the band before resolving
        min_samples: 3          # a cycle with fewer samples counts as empty
        ceiling: 2.0            # optional absolute limit (floor: for downward metrics)
        seasonality: hour_of_week  # optional: baseline from the same hour of the week
        budget: off             # optional: keep the threshold whatever the noise costs
        budget_off_for: [{bucket: "256"}]  # optional: scopes that opt out of the budget
        severity: page
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    StrictFloat,
    StrictInt,
    StringConstraints,
    ValidationInfo,
    field_validator,
)

from alerts.detection import (
    TAIL_QUANTILE,
    BaselineStats,
    Cusum,
    count_above,
    cusum_path,
    exceedance_llr,
    llr,
    relative_change,
)
from alerts.durations import parse_duration
from alerts.errors import RuleError
from alerts.schema import Entry, read_layered, validate
from storage.sketches import Sketch, min_samples
from vocab import Source

DEFAULT_RULES_FILE = Path(__file__).with_name("rules.yaml")

# metric -> (description, sources it can be measured from)
METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "p50_latency": ("p50 of request total_s per cycle (seconds)", ("canary", "traffic")),
    "p95_latency": ("p95 of request total_s per cycle (seconds)", ("canary", "traffic")),
    "p99_latency": ("p99 of request total_s per cycle (seconds)", ("canary", "traffic")),
    "ttft": ("p95 of time to first token per cycle (seconds)", ("canary", "traffic")),
    "per_token": ("p50 of mean time per output token per cycle (seconds)", ("canary", "traffic")),
    "acceptance_rate": ("accepted / draft tokens per cycle", ("canary", "traffic")),
    "memory_growth": ("RSS (or CUDA allocated) growth per hour (bytes)", ("canary",)),
    "recompiles_per_hour": ("torch.compile recompiles per hour", ("canary",)),
    "compile_failures": ("recompile-limit hits + compile failures in the trailing hour",
                         ("canary",)),
    "overflow_share": ("share of requests on the overflow path", ("canary", "traffic")),
    "padding_waste": ("mean share of padded input that is padding", ("canary", "traffic")),
    "probe_failures": ("share of canary probes that failed or timed out", ("canary",)),
    "burst_p99": ("p99 latency of the latest burst probe (seconds)", ("burst",)),
    "rejections": ("share of requests rejected (overloaded or timed out)", ("traffic", "burst")),
    "output_agreement": ("mean token agreement of outputs with the reference path per cycle",
                         ("canary", "traffic")),
}
# variant: the A/B arm (only output_agreement rows carry it).
# Quantile metrics: the quantile each reads; a cycle's value must rest on
# storage.sketches.min_samples(q) samples (p99: 100), else the rule says insufficient_samples.
QUANTILE_METRICS: dict[str, float] = {
    "p50_latency": 0.50, "p95_latency": 0.95, "p99_latency": 0.99, "ttft": 0.95,
    "per_token": 0.50, "burst_p99": 0.99,
}
SCOPE_LABELS = ("bucket", "path", "decoding", "instance", "variant")
SOURCES = tuple(s.value for s in Source)
SEVERITIES = ("page", "warning", "info")
_CHANGE_RE = re.compile(r"^\s*([+-])\s*(\d+(?:\.\d+)?)\s*%\s*$")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Rule:
    """One validated alert rule (see the module docstring for the YAML form)."""

    name: str
    metric: str
    direction: int  # +1: alert when the metric rises, -1: when it falls
    threshold: float  # relative, positive: 0.15 = 15%
    resolve_threshold: float
    source: str = "canary"
    per: tuple[str, ...] = ("bucket",)
    match: Mapping[str, str] = field(default_factory=dict)
    for_cycles: int = 3
    resolve_for: int = 5
    min_samples: int = 1
    ceiling: float | None = None
    floor: float | None = None
    severity: str = "warning"
    window_s: float = 60.0  # length of one cycle of the series
    lookback_cycles: int = 30  # cycles the detector reads on each evaluation
    baseline_window_s: float = 7 * 86400.0
    min_baseline_cycles: int = 30
    description: str = ""
    cusum: Cusum = field(default_factory=Cusum)
    # Quantile metrics pool up to this many latest cycles per scope (alerts.series).
    pool_cycles: int = 30
    seasonality: str = ""  # "hour_of_week": baseline from the same hour of the week only
    # False-page budget (alerts.sensitivity): None takes alerts.false_page_budget_per_30d;
    # budget_off keeps the configured threshold whatever the noise costs; budget_off_for:
    # the scopes (label matches) that opt out.
    budget_per_30d: float | None = None
    budget_off: bool = False
    budget_off_for: tuple[tuple[tuple[str, str], ...], ...] = ()

    def budget_for(self, labels: Mapping[str, str], default: float | None) -> float | None:
        """Return the false-page budget of one scope (None: off, keep the threshold)."""
        if self.budget_off or any(all(labels.get(k) == v for k, v in m)
                                  for m in self.budget_off_for):
            return None
        return default if self.budget_per_30d is None else self.budget_per_30d

    @property
    def signed_threshold(self) -> float:
        """Return the threshold with its direction: +0.15 or -0.20."""
        return self.direction * self.threshold


@dataclass(frozen=True)
class Point:
    """One cycle of a series: its start, its value (None when empty) and sample count.

    fresh: a quantile's own samples of this cycle (alerts.series), when `value` may pool
        earlier cycles; the detector then scores only these (see `pooled`).
    borrowed: of `samples`, those pooled from the scope's other cohorts (a cohort new to
        the scope, alerts.series); such a value stays out of the cohort's own baseline.
    """

    at: datetime
    value: float | None
    samples: int
    fresh: Sketch | None = None
    borrowed: int = 0

    @property
    def pooled(self) -> bool:
        """Return whether `value` rests on earlier cycles' samples too."""
        return self.fresh is not None and 0 < self.fresh.count < self.samples


@dataclass(frozen=True)
class RuleResult:
    """What a rule decided for one scope, with the numbers it used.

    fired: a change is confirmed (the CUSUM reaches h and the median change over its
        current run of at least for_cycles cycles reaches the threshold), or an absolute
        limit is crossed on each of the last for_cycles cycles.
    breaching: the latest cycle breaches (an alert is pending until fired).
    recovered: the last resolve_for cycles sit inside the hysteresis band.
    no_data: the latest cycle is empty or there is no usable baseline; nothing changes.
    over: fired, but the latest `for` cycles no longer breach on their own samples (their
        median change inside the hysteresis band; for a pooled tail quantile, none of their
        own samples above the baseline and their median back at the baseline's body): a
        run that confirms only after its cause ended (the lifecycle records it as late).
    """

    rule: str
    labels: Mapping[str, str]
    baseline: float | None
    current: float | None
    relative_change: float | None
    threshold: float
    fired: bool
    reason: str
    breaching: bool = False
    recovered: bool = False
    no_data: bool = False
    statistic: float = 0.0
    samples: int = 0
    severity: str = "warning"
    over: bool = False


def evaluate_rule(
    rule: Rule,
    labels: Mapping[str, str],
    baseline: BaselineStats | None,
    points: Sequence[Point],
) -> RuleResult:
    """Check one scope's per-cycle series (oldest first) against its baseline."""
    labels = dict(labels)
    base = baseline.center if baseline is not None else None
    # The false-page budget may have widened the threshold on this series' noise: the
    # wider one is in force and every reason says so; never tighter than configured.
    widened = ""
    if baseline is not None and baseline.threshold is not None \
            and baseline.threshold > rule.threshold:
        rule = replace(rule, threshold=baseline.threshold)
        widened = f"; {baseline.widened}" if baseline.widened else ""

    def result(**kw: Any) -> RuleResult:
        kw.setdefault("baseline", base)
        kw["reason"] += widened
        return RuleResult(rule=rule.name, labels=labels, threshold=rule.signed_threshold,
                          severity=rule.severity, **kw)

    need = quantile_samples(rule.metric)
    valid = [p for p in points if p.value is not None and p.samples >= max(rule.min_samples, need)]
    if not points or points[-1].value is None or points[-1].samples < rule.min_samples:
        n = points[-1].samples if points else 0
        return result(current=None, relative_change=None, fired=False, no_data=True,
                      samples=n, reason=f"empty window: {n} samples < min_samples {rule.min_samples}")
    if points[-1].samples < need:
        n = points[-1].samples
        return result(current=None, relative_change=None, fired=False, no_data=True, samples=n,
                      reason=f"insufficient_samples: {n} samples cannot support the "
                             f"{rule.metric} quantile (needs {need}; pool more cycles or "
                             "raise probes.canaries_per_bucket)")
    values = [float(p.value) for p in valid]  # type: ignore[arg-type]
    current = values[-1]
    samples = valid[-1].samples
    has_limit = rule.ceiling is not None or rule.floor is not None

    def over_limit(v: float) -> bool:
        return (rule.ceiling is not None and v > rule.ceiling) or (
            rule.floor is not None and v < rule.floor)

    usable = baseline is not None and baseline.cycles >= rule.min_baseline_cycles
    if not usable and not has_limit:
        have = baseline.cycles if baseline is not None else 0
        return result(current=current, relative_change=None, fired=False, no_data=True,
                      samples=samples,
                      reason=f"baseline warming in: {have} cycles < {rule.min_baseline_cycles}")
    rels: list[float | None] = [
        relative_change(v, baseline.center) if usable else None  # type: ignore[union-attr]
        for v in values
    ]
    rel = rels[-1]

    def rel_breach(r: float | None) -> bool:
        return r is not None and rule.direction * r >= rule.threshold

    def rel_inside(r: float | None) -> bool:
        return r is None or rule.direction * r < rule.resolve_threshold

    n = rule.for_cycles
    stat = 0.0
    run_rels: list[float] = []
    q = QUANTILE_METRICS.get(rule.metric)
    # Exceedance scoring is for tail quantiles only: at the median p1 would equal p0 (no
    # evidence at all), and one slow request barely moves a pooled median anyway.
    tail_q = q is not None and q >= TAIL_QUANTILE
    pooled = valid[-1].pooled and tail_q
    if usable and baseline is not None and baseline.center != 0:
        sigma = baseline.relative_noise(rule.cusum)

        def score(p: Point, r: float) -> float:
            # A pooled value repeats earlier cycles' samples: score this cycle's new ones.
            if p.pooled and tail_q and q is not None and rule.direction > 0 \
                    and p.fresh is not None:
                above = count_above(p.fresh, baseline.center)
                return exceedance_llr(above, p.fresh.count, q)
            return llr(rule.direction * r, rule.threshold, sigma)

        known = [(p, r) for p, r in zip(valid, rels, strict=True) if r is not None]
        path = cusum_path([score(p, r) for p, r in known], rule.cusum)
        stat = path[-1]
        # The current run: cycles since the CUSUM last stood at zero.
        start = max((i + 1 for i, s in enumerate(path) if s == 0.0), default=0)
        run_rels = [r for _, r in known[start:]]
    last_n = list(zip(values[-n:], rels[-n:], strict=True))
    enough = len(last_n) >= n
    limit_fire = has_limit and enough and all(over_limit(v) for v, _ in last_n)
    # The median change over the CUSUM's current run (at least `for` cycles) must reach the
    # threshold: the CUSUM alone also confirms changes between threshold/2 and threshold,
    # which the rule does not ask for, and a median cannot be carried over it by one spike.
    # A pooled quantile already aggregates its cycles: the latest one must reach it.
    window_rel = (run_rels[-1] if pooled else statistics.median(run_rels)) \
        if len(run_rels) >= n else None
    rel_fire = rel_breach(window_rel) and stat >= rule.cusum.h
    breaching = rel_breach(rel) or over_limit(current)
    m = rule.resolve_for
    tail = list(zip(valid[-m:], values[-m:], rels[-m:], strict=True))
    came_down: bool | None = None  # computed once, when the lenient path below needs it

    def back(p: Point, r: float | None) -> bool:
        nonlocal came_down
        # A pooled value keeps a regression's samples for up to `pool` cycles after it
        # ended: back under the threshold with none of the cycle's own samples above the
        # baseline quantile counts as inside the band too, once the canaries themselves
        # came down (canaries_came_down) where the series breached.
        if rel_inside(r) or not (tail_q and p.pooled and p.fresh is not None
                                 and r is not None):
            return rel_inside(r)
        if not (not rel_breach(r) and rule.direction > 0 and baseline is not None
                and count_above(p.fresh, baseline.center) == 0):
            return False
        if came_down is None:
            # Only a series that breached since the detector's start (for a firing alert:
            # since it fired) must show its canaries coming down; one that never did (a
            # scope's other cohort, say) was not the regression.
            came_down = (not any(rel_breach(x) for x in rels)
                         or canaries_came_down(valid, m, rule.threshold, baseline.body))
        return came_down

    recovered = len(tail) >= m and all(back(p, r) and not over_limit(v) for p, v, r in tail)
    fired = limit_fire or rel_fire
    ended = rel_fire and not limit_fire and baseline is not None and run_over(
        rule, valid[-n:], rels[-n:], baseline, pooled)
    pct = f"{rel:+.1%}" if rel is not None else "n/a"
    if limit_fire:
        lim = f"ceiling {rule.ceiling:g}" if rule.ceiling is not None and current > rule.ceiling \
            else f"floor {rule.floor:g}"
        reason = f"{rule.metric} {current:.4g} beyond absolute {lim} for {n} cycles"
    elif rel_fire:
        wpct = f"{window_rel:+.1%}" if window_rel is not None else "n/a"
        over = (f"pooled over {samples} samples, new samples' exceedances" if pooled
                else f"median {wpct} over {len(run_rels)} cycles")
        reason = (f"{rule.metric} {current:.4g} vs baseline {base:.4g} ({pct}; {over}, "
                  f"threshold {rule.signed_threshold:+.0%}), "
                  f"CUSUM {stat:.1f} >= {rule.cusum.h:g} over {len(run_rels)} cycles")
    elif breaching:
        reason = (f"{rule.metric} {current:.4g} breaches ({pct}) but is not confirmed yet "
                  f"(CUSUM {stat:.1f} of {rule.cusum.h:g}, {n} cycles needed)")
    elif usable and baseline is not None and baseline.center == 0:
        reason = f"{rule.metric} {current:.4g}: zero baseline, only absolute limits apply"
    else:
        reason = f"{rule.metric} {current:.4g} within threshold ({pct})"
    if ended:
        reason += "; over: the latest cycles' own samples no longer breach"
    return result(current=current, relative_change=rel, fired=fired, reason=reason,
                  breaching=breaching, recovered=recovered, statistic=stat, samples=samples,
                  over=ended)


def run_over(rule: Rule, points: Sequence[Point], rels: Sequence[float | None],
             baseline: BaselineStats, pooled: bool) -> bool:
    """Return whether the latest cycles' own samples say a confirmed run has ended.

    A run median or a pooled quantile still holds an ended regression's cycles for a
    while; these cycles alone must still breach for the confirmation to page. Plain
    series: the median change of the cycles is inside the hysteresis band. Pooled
    quantiles: the quantile of the cycles' own samples, merged, is inside the band; for
    a tail quantile (a few samples say little about it) none of their own samples is above
    the baseline quantile and their median is back within threshold / 2 of the
    baseline's body (unknown body: not over).
    """
    q = QUANTILE_METRICS.get(rule.metric)
    if q is None or not any(p.pooled for p in points):
        known = [r for r in rels if r is not None]
        return bool(known) and rule.direction * statistics.median(known) < rule.resolve_threshold
    fresh = [p.fresh for p in points if p.fresh is not None and p.fresh.count]
    if len(fresh) < len(points) or not fresh or baseline.center <= 0:
        return False
    merged = Sketch()
    for f in fresh:
        merged.merge(f)
    if not pooled:
        own = merged.quantile(q)
        rel = relative_change(own, baseline.center) if own is not None else None
        return rel is not None and rule.direction * rel < rule.resolve_threshold
    if baseline.body is None or any(count_above(f, baseline.center) for f in fresh):
        return False
    mid = merged.quantile(0.5)
    return mid is not None and mid <= baseline.body * (1.0 + rule.threshold / 2.0)


def canaries_came_down(points: Sequence[Point], recent: int, threshold: float,
                       body: float | None = None) -> bool:
    """Return whether the last `recent` cycles' own samples came down.

    Down: their median within threshold / 2 of the baseline's `body` (the median of its
    cycles' medians), or at least threshold / 2 under that of the earlier cycles' samples
    (at least 2 such cycles). The points are the detector's: for a firing alert, the
    cycles since it fired. Where a few slow cycles set the baseline p99, a regression of
    the other canaries can go on below it, with no new sample above it and a pool without
    a slow cycle reading under the threshold (bench.incidents on the 2026-12-02 recording:
    a +30% ramp read +13% and resolved mid-incident). Without this check the lenient
    recovery resolved such an alert and it fired again; an ended regression shows as its
    canaries coming down. The body answers where the earlier cycles cannot: an alert that
    fired near an incident's end has mostly normal cycles since, which the canaries never
    come down from.
    """
    last = [p.fresh for p in points[-recent:] if p.fresh is not None and p.fresh.count]
    if len(last) < recent:
        return False
    now = Sketch()
    for f in last:
        now.merge(f)
    a = now.quantile(0.5)
    if a is None:
        return False
    if body is not None and a <= body * (1.0 + threshold / 2.0):
        return True
    before = [p.fresh for p in points[:-recent] if p.fresh is not None and p.fresh.count]
    if len(before) < 2:
        return False
    then = Sketch()
    for f in before:
        then.merge(f)
    b = then.quantile(0.5)
    return b is not None and a * (1.0 + threshold / 2.0) <= b


def quantile_samples(metric: str) -> int:
    """Return the samples a cycle of `metric` needs (1 for metrics that are no quantile)."""
    q = QUANTILE_METRICS.get(metric)
    return 1 if q is None else min_samples(q)


def parse_change(value: object) -> tuple[int, float]:
    """Return (direction, relative threshold) for "+15%" / "-20%"; raise ValueError."""
    if isinstance(value, str):
        m = _CHANGE_RE.match(value)
        if m:
            pct = float(m.group(2)) / 100.0
            if pct <= 0:
                raise ValueError(f"must be non-zero, got {value!r}")
            return (1 if m.group(1) == "+" else -1), pct
    raise ValueError(f'expected a signed percentage such as "+15%" or "-20%", got {value!r}')


class RuleEntry(Entry):
    """One rule as written in YAML (see the module docstring); `parse_rule` validates it."""

    name: Annotated[str, StringConstraints(pattern=_NAME_RE.pattern)]
    metric: str
    source: str = "canary"
    per: tuple[str, ...] = ("bucket",)
    match: dict[str, str] = Field(default_factory=dict)
    change: tuple[int, float] = Field(None, validate_default=True)
    resolve_change: tuple[int, float] | None = None
    for_: StrictInt = Field(3, alias="for", ge=2)
    resolve_for: StrictInt = Field(5, ge=1)
    min_samples: StrictInt = Field(1, ge=1)
    lookback: StrictInt = Field(30, ge=2)
    min_baseline_cycles: StrictInt = Field(30, ge=1)
    ceiling: StrictFloat | None = None
    floor: StrictFloat | None = None
    severity: str = "warning"
    window: float = 60.0
    baseline_window: float = 7 * 86400.0
    description: str = ""
    cusum: Cusum = Field(default_factory=Cusum)
    pool: StrictInt = Field(30, ge=1)
    seasonality: Literal["", "hour_of_week"] = ""
    # `off` (YAML reads it as false), `on` / true, or this rule's false pages per 30 days.
    budget: bool | float | None = None
    budget_off_for: tuple[dict[str, str], ...] = ()

    @field_validator("budget", mode="before")
    @classmethod
    def _budget(cls, v: object) -> bool | float | None:
        if v is None or isinstance(v, bool):
            return v
        if v in ("off", "on"):
            return v == "on"
        if isinstance(v, int | float) and v >= 0:
            return float(v)
        raise ValueError(f"must be off, on or false pages per 30 days (>= 0), got {v!r}")

    @field_validator("budget_off_for", mode="before")
    @classmethod
    def _budget_off_for(cls, v: object) -> object:
        items = v or []
        if not isinstance(items, list) or not all(
                isinstance(m, dict) and m and all(k in SCOPE_LABELS for k in m) for m in items):
            raise ValueError(f"must be a list of label matches ({', '.join(SCOPE_LABELS)}), "
                             f"got {v!r}")
        return tuple({str(k): str(x) for k, x in m.items()} for m in items)

    @field_validator("metric")
    @classmethod
    def _metric(cls, v: str) -> str:
        if v not in METRICS:
            raise ValueError(f"must be one of {', '.join(METRICS)}, got {v!r}")
        return v

    @field_validator("source")
    @classmethod
    def _source(cls, v: str, info: ValidationInfo) -> str:
        metric = info.data.get("metric")
        if metric is not None and v not in METRICS[metric][1]:
            raise ValueError(f"{metric} is measured from {'/'.join(METRICS[metric][1])}, "
                             f"got {v!r}")
        return v

    @field_validator("per", mode="before")
    @classmethod
    def _per(cls, v: object) -> object:
        per = [] if v in ("all", None) else [v] if isinstance(v, str) else v
        if not isinstance(per, list | tuple) or any(p not in SCOPE_LABELS for p in per):
            raise ValueError(f"must be 'all' or a list of {', '.join(SCOPE_LABELS)}, got {v!r}")
        return tuple(per)

    @field_validator("match", mode="before")
    @classmethod
    def _match(cls, v: object) -> object:
        match = v or {}
        if not isinstance(match, dict) or any(k not in SCOPE_LABELS for k in match):
            raise ValueError(f"must map {', '.join(SCOPE_LABELS)} to values, got {v!r}")
        return {str(k): str(x) for k, x in match.items()}

    @field_validator("change", mode="before")
    @classmethod
    def _change(cls, v: object) -> tuple[int, float]:
        if v is None:
            raise ValueError('is required (a signed percentage such as "+15%")')
        return parse_change(v)

    @field_validator("resolve_change", mode="before")
    @classmethod
    def _resolve_change(cls, v: object, info: ValidationInfo) -> tuple[int, float] | None:
        if v is None:
            return None
        rdir, rthr = parse_change(v)
        change = info.data.get("change")
        if change is not None and (rdir != change[0] or rthr >= change[1]):
            raise ValueError("must point the same way as change and be smaller")
        return rdir, rthr

    @field_validator("lookback")
    @classmethod
    def _lookback(cls, v: int, info: ValidationInfo) -> int:
        if v < max(info.data.get("for_", 0), info.data.get("resolve_for", 0)):
            raise ValueError("must be >= for and resolve_for")
        return v

    @field_validator("severity")
    @classmethod
    def _severity(cls, v: str) -> str:
        if v not in SEVERITIES:
            raise ValueError(f"must be one of {', '.join(SEVERITIES)}, got {v!r}")
        return v

    @field_validator("window", "baseline_window", mode="before")
    @classmethod
    def _duration(cls, v: object) -> float:
        seconds = parse_duration(v)
        if seconds <= 0:
            raise ValueError("must be positive")
        return seconds

    @field_validator("cusum", mode="before")
    @classmethod
    def _cusum(cls, v: object) -> Cusum:
        raw = v or {}
        if not isinstance(raw, dict) or set(raw) - {"h", "min_cycles", "min_spread_rel"}:
            raise ValueError(f"must map h, min_cycles, min_spread_rel to numbers, got {v!r}")
        try:
            fields: dict[str, Any] = {k: (int(x) if k == "min_cycles" else float(x))
                                      for k, x in raw.items()}
            return Cusum(**fields)
        except TypeError as e:
            raise ValueError(str(e)) from None

    def to_rule(self) -> Rule:
        """Return the Rule this entry describes."""
        direction, threshold = self.change
        resolve = self.resolve_change
        return Rule(
            name=self.name, metric=self.metric, direction=direction, threshold=threshold,
            resolve_threshold=threshold / 3.0 if resolve is None else resolve[1],
            source=self.source, per=self.per, match=dict(self.match),
            for_cycles=self.for_, resolve_for=self.resolve_for, min_samples=self.min_samples,
            ceiling=self.ceiling, floor=self.floor, severity=self.severity,
            window_s=self.window, lookback_cycles=self.lookback,
            baseline_window_s=self.baseline_window,
            min_baseline_cycles=self.min_baseline_cycles, description=self.description,
            cusum=self.cusum, seasonality=self.seasonality, pool_cycles=self.pool,
            budget_off=self.budget is False,
            budget_per_30d=None if isinstance(self.budget, bool) else self.budget,
            budget_off_for=tuple(tuple(sorted(m.items())) for m in self.budget_off_for),
        )


def parse_rule(raw: object, source: str = "<rules>", index: int = 0) -> Rule:
    """Validate one YAML rule mapping; raise RuleError naming the rule and field."""
    entry = f"rule #{index + 1}"
    if not isinstance(raw, dict):
        raise RuleError(source, entry, "rule", "must be a mapping")
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise RuleError(source, entry, "name", f"must be an identifier, got {name!r}")
    return validate(RuleEntry, raw, RuleError, source, f"rule {name!r}", nested=False).to_rule()


def parse_rules(data: object, source: str = "<rules>") -> list[Rule]:
    """Validate a `{rules: [...]}` document; raise RuleError on the first bad rule."""
    if data is None:
        return []
    if not isinstance(data, dict) or set(data) - {"rules"}:
        raise RuleError(source, "", "rules", "the document must be a mapping with one key 'rules'")
    items = data.get("rules")
    items = [] if items is None else items
    if not isinstance(items, list):
        raise RuleError(source, "", "rules", "must be a list")
    rules = [parse_rule(r, source, i) for i, r in enumerate(items)]
    seen: set[str] = set()
    for r in rules:
        if r.name in seen:
            raise RuleError(source, f"rule {r.name!r}", "name", "is defined twice")
        seen.add(r.name)
    return rules


def load_rules(rules_file: str | None = None, *, defaults: bool = True) -> list[Rule]:
    """Return the shipped rules plus the user's; a user rule replaces a shipped one by name."""
    rules: dict[str, Rule] = {}
    for source, data in read_layered(DEFAULT_RULES_FILE, rules_file, defaults=defaults,
                                     error=RuleError, file_field="rules_file",
                                     doc_field="rules"):
        for r in parse_rules(data, source):
            rules[r.name] = r
    return list(rules.values())
