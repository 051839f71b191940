"""Alert rules: the validated `Rule` and the pure per-series check, step by step.

A rule compares the per-cycle series of one metric in one scope with that scope's
baseline and returns a `RuleResult` (`evaluate_rule`). The steps it takes are module-level
and pure: `unjudgeable` (too few samples), `score_cycle` (one cycle's CUSUM increment),
`confirm` (CUSUM and the run's median change), `limit_crossed` (absolute limits),
`recovered` (back: the median of the last cycles inside the hysteresis band, or a pooled
tail quantile's own samples back), `run_over` (a confirmation whose cause
ended: late) and `reason` (the numbers in words). The YAML form and its loader live in
`alerts.rule_file`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

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
from storage.sketches import Sketch, min_samples

PAGE, WARNING = "page", "warning"
# A recovering series' median must sit this many standard errors from the threshold.
RECOVERY_Z = 3.0
# The standard error of the median of n normal values is MEDIAN_SE * sigma / sqrt(n).
MEDIAN_SE = 1.2533
# A pooled tail quantile's own samples tell it back once they are this many times likelier
# without the change than with it (an LLR of -log 20): 32 canaries for a p99 (8 cycles of
# 4), where 20 with none above it read as back on a noise dip of 5 cycles mid-regression.
RECOVERY_LLR = math.log(20.0)
# Quantile metrics: the quantile each reads; a cycle's value must rest on
# storage.sketches.min_samples(q) samples (p99: 100), else the rule says insufficient_samples.
QUANTILE_METRICS: dict[str, float] = {
    "p50_latency": 0.50, "p95_latency": 0.95, "p99_latency": 0.99, "ttft": 0.95,
    "per_token": 0.50, "burst_p99": 0.99,
}


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
    # The least absolute change (in the metric's units) a cycle must also move by to
    # breach: a relative threshold of a baseline near zero is its noise (`with_min_delta`).
    min_delta: float = 0.0
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
    recovered: the last resolve_for cycles say the series is back (`recovered`): their
        median change inside the hysteresis band, or, for a pooled tail quantile whose pool
        still holds an ended regression, their own samples back.
    no_data: the latest cycle is empty or there is no usable baseline; nothing changes.
    over: fired, but the latest `for` cycles no longer breach on their own samples (their
        median change short of the threshold; for a pooled tail quantile, none of their
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


@dataclass(frozen=True)
class Confirmation:
    """The CUSUM's verdict on a scope's relative changes.

    statistic: the CUSUM after the latest cycle.
    run: the relative changes of its current run (the cycles since it last stood at zero).
    change: the run's median change (a pooled tail quantile: its latest), None while the
        run is shorter than `for` cycles.
    fired: the change reaches the threshold and the statistic reaches h.
    """

    statistic: float = 0.0
    run: tuple[float, ...] = ()
    change: float | None = None
    fired: bool = False


@dataclass(frozen=True)
class Checks:
    """What the steps found for one scope, for `reason` to put in words."""

    current: float
    change: float | None
    samples: int
    pooled: bool
    limit_fired: bool
    confirmation: Confirmation
    breaching: bool
    zero_baseline: bool


def evaluate_rule(
    rule: Rule,
    labels: Mapping[str, str],
    baseline: BaselineStats | None,
    points: Sequence[Point],
    *,
    window: int | None = None,
) -> RuleResult:
    """Check one scope's per-cycle series (oldest first) against its baseline.

    window: the judged cycles the detector's whole window holds, where `points` are only
    those since the detector's start (a fired alert's); recovery reads at most that many.
    """
    rule, widened = threshold_in_force(rule, baseline)
    floored = with_min_delta(rule, baseline)
    if floored is not rule:
        widened += (f"; threshold {rule.signed_threshold:+.0%} -> "
                    f"{floored.signed_threshold:+.0%} (min_delta {rule.min_delta:g})")
        rule = floored
    paging, held = rule, pages_held(rule, baseline)
    if held:
        rule = replace(rule, severity=WARNING)
    widened += held
    center = baseline.center if baseline is not None else None
    thin = unjudgeable(rule, points)
    if thin is not None:
        samples, why = thin
        return _result(rule, labels, center, why + widened, current=None,
                       relative_change=None, fired=False, no_data=True, samples=samples)
    judged = judged_points(rule, points)
    values = [float(p.value) for p in judged]  # type: ignore[arg-type]
    current = values[-1]
    samples = judged[-1].samples
    usable = usable_baseline(rule, baseline)
    if usable is None and not has_limit(rule):
        have = baseline.cycles if baseline is not None else 0
        return _result(rule, labels, center,
                       f"baseline warming in: {have} cycles < {rule.min_baseline_cycles}"
                       + widened, current=current, relative_change=None, fired=False,
                       no_data=True, samples=samples)
    changes = relative_changes(values, usable)
    pooled = judged[-1].pooled and is_tail_metric(rule.metric)
    confirmation = confirm(rule, usable, judged, changes, pooled)
    limit_fired = limit_crossed(rule, values)
    recent = rule.for_cycles
    late = confirmation.fired and not limit_fired and baseline is not None and run_over(
        rule, judged[-recent:], changes[-recent:], baseline, pooled)
    checks = Checks(current=current, change=changes[-1], samples=samples, pooled=pooled,
                    limit_fired=limit_fired, confirmation=confirmation,
                    breaching=breaches(rule, changes[-1]) or over_limit(rule, current),
                    zero_baseline=usable is not None and usable.center == 0)
    why = reason(rule, center, checks)
    if late:
        why += "; over: the latest cycles' own samples no longer breach"
    # An absolute limit is the operator's own statement, not a guess about noise: it pages.
    return _result(paging if limit_fired else rule, labels, center, why + widened,
                   current=current,
                   relative_change=changes[-1], fired=limit_fired or confirmation.fired,
                   breaching=checks.breaching,
                   recovered=recovered(rule, baseline, judged, values, changes, window),
                   statistic=confirmation.statistic, samples=samples, over=late)


def _result(rule: Rule, labels: Mapping[str, str], baseline: float | None, reason: str,
            **fields: Any) -> RuleResult:
    """Return a RuleResult of `rule` for one scope."""
    return RuleResult(rule=rule.name, labels=dict(labels), baseline=baseline,
                      threshold=rule.signed_threshold, severity=rule.severity, reason=reason,
                      **fields)


def threshold_in_force(rule: Rule, baseline: BaselineStats | None) -> tuple[Rule, str]:
    """Return the rule with the threshold in force and the suffix every reason gets.

    The false-page budget may have widened the threshold on this series' noise: the
    wider one is in force (`with_threshold`, its band widened alike) and every reason
    says so; never tighter than configured.
    """
    if baseline is None or baseline.threshold is None or baseline.threshold <= rule.threshold:
        return rule, ""
    widened = f"; {baseline.widened}" if baseline.widened else ""
    return with_threshold(rule, baseline.threshold), widened


def with_threshold(rule: Rule, threshold: float) -> Rule:
    """Return the rule at `threshold`, its hysteresis band keeping its share of it.

    A threshold widened on a series' noise says moves up to it are that series' noise:
    with the configured band, a page on that noise whose series settles between the band
    and the widened threshold never resolves. alerts.sensitivity simulates the rule at a
    candidate threshold through this too, so the lifecycle it counts pages on is the one
    the threshold in force runs.
    """
    if threshold == rule.threshold or rule.threshold <= 0:
        return replace(rule, threshold=threshold)
    return replace(rule, threshold=threshold,
                   resolve_threshold=rule.resolve_threshold * threshold / rule.threshold)


def with_min_delta(rule: Rule, baseline: BaselineStats | None) -> Rule:
    """Return the rule at the relative threshold its `min_delta` asks of this baseline,
    where that is wider than its own (`with_threshold`: the band keeps its share).

    Every step then asks the same change: the breach, the run's median, the CUSUM's
    alternative (a change of exactly the threshold) and recovery. Near a zero centre a
    relative threshold is a few units of noise; the absolute floor is what a change must be.
    """
    if rule.min_delta <= 0 or baseline is None or baseline.center == 0:
        return rule
    floor = rule.min_delta / abs(baseline.center)
    return rule if floor <= rule.threshold else with_threshold(rule, floor)


def pages_held(rule: Rule, baseline: BaselineStats | None) -> str:
    """Return the suffix every reason gets where the series' pages are held as warnings.

    A series too young for its false-page estimate (alerts.sensitivity) cannot say how
    often it would page on noise: its confirmed changes are warnings until it can.
    """
    if baseline is None or not baseline.held or rule.severity != PAGE:
        return ""
    return f"; pages held as warnings: {baseline.held}"


def unjudgeable(rule: Rule, points: Sequence[Point]) -> tuple[int, str] | None:
    """Return (samples, reason) when the latest cycle is too thin to judge, else None."""
    if not points or points[-1].value is None or points[-1].samples < rule.min_samples:
        count = points[-1].samples if points else 0
        return count, f"empty window: {count} samples < min_samples {rule.min_samples}"
    need = quantile_samples(rule.metric)
    if points[-1].samples < need:
        count = points[-1].samples
        return count, (f"insufficient_samples: {count} samples cannot support the "
                       f"{rule.metric} quantile (needs {need}; pool more cycles or "
                       "raise probes.canaries_per_bucket)")
    return None


def judged_points(rule: Rule, points: Sequence[Point]) -> list[Point]:
    """Return the cycles with a value resting on enough samples to be judged."""
    need = max(rule.min_samples, quantile_samples(rule.metric))
    return [p for p in points if p.value is not None and p.samples >= need]


def usable_baseline(rule: Rule, baseline: BaselineStats | None) -> BaselineStats | None:
    """Return the baseline when it rests on enough cycles to compare with, else None."""
    if baseline is None or baseline.cycles < rule.min_baseline_cycles:
        return None
    return baseline


def relative_changes(values: Sequence[float], baseline: BaselineStats | None
                     ) -> list[float | None]:
    """Return each value's change relative to the baseline (None: no usable baseline)."""
    if baseline is None:
        return [None for _ in values]
    return [relative_change(value, baseline.center) for value in values]


def is_tail_metric(metric: str) -> bool:
    """Return whether `metric` is a tail quantile (exceedance scoring applies)."""
    # At the median p1 would equal p0 (no evidence at all), and one slow request barely
    # moves a pooled median anyway.
    quantile = QUANTILE_METRICS.get(metric)
    return quantile is not None and quantile >= TAIL_QUANTILE


def has_limit(rule: Rule) -> bool:
    """Return whether the rule has an absolute ceiling or floor."""
    return rule.ceiling is not None or rule.floor is not None


def over_limit(rule: Rule, value: float) -> bool:
    """Return whether `value` is above the rule's ceiling or below its floor."""
    return (rule.ceiling is not None and value > rule.ceiling) or (
        rule.floor is not None and value < rule.floor)


def breaches(rule: Rule, change: float | None) -> bool:
    """Return whether a relative change reaches the threshold in the rule's direction."""
    return change is not None and rule.direction * change >= rule.threshold


def inside_band(rule: Rule, change: float | None) -> bool:
    """Return whether a relative change is inside the hysteresis band (unknown: inside)."""
    return change is None or rule.direction * change < rule.resolve_threshold


def score_cycle(rule: Rule, baseline: BaselineStats, point: Point, change: float,
                sigma: float) -> float:
    """Return one cycle's CUSUM increment (log-likelihood ratio of a change)."""
    quantile = QUANTILE_METRICS.get(rule.metric)
    # A pooled value repeats earlier cycles' samples: score this cycle's new ones.
    if point.pooled and is_tail_metric(rule.metric) and quantile is not None \
            and rule.direction > 0 and point.fresh is not None:
        above = count_above(point.fresh, baseline.center)
        return exceedance_llr(above, point.fresh.count, quantile)
    return llr(rule.direction * change, rule.threshold, sigma)


def cusum_run(rule: Rule, baseline: BaselineStats | None, points: Sequence[Point],
              changes: Sequence[float | None]) -> tuple[float, list[float]]:
    """Return the CUSUM statistic and the changes of its current run (no baseline: 0, [])."""
    if baseline is None or baseline.center == 0:
        return 0.0, []
    sigma = baseline.relative_noise(rule.cusum)
    known = [(p, c) for p, c in zip(points, changes, strict=True) if c is not None]
    path = cusum_path([score_cycle(rule, baseline, p, c, sigma) for p, c in known], rule.cusum)
    # The current run: cycles since the CUSUM last stood at zero.
    start = max((i + 1 for i, s in enumerate(path) if s == 0.0), default=0)
    return path[-1], [c for _, c in known[start:]]


def run_change(rule: Rule, run: Sequence[float], pooled: bool) -> float | None:
    """Return the change over the current run, None while it is shorter than `for`."""
    if len(run) < rule.for_cycles:
        return None
    # A pooled quantile already aggregates its cycles: the latest one must reach it.
    return run[-1] if pooled else statistics.median(run)


def confirm(rule: Rule, baseline: BaselineStats | None, points: Sequence[Point],
            changes: Sequence[float | None], pooled: bool) -> Confirmation:
    """Return whether the CUSUM and the run's median change confirm a change.

    The median change over the CUSUM's current run (at least `for` cycles) must reach the
    threshold: the CUSUM alone also confirms changes between threshold/2 and threshold,
    which the rule does not ask for, and a median cannot be carried over it by one spike.
    baseline: the usable one (None: nothing is confirmed).
    """
    statistic, run = cusum_run(rule, baseline, points, changes)
    change = run_change(rule, run, pooled)
    return Confirmation(statistic=statistic, run=tuple(run), change=change,
                        fired=breaches(rule, change) and statistic >= rule.cusum.h)


def limit_crossed(rule: Rule, values: Sequence[float]) -> bool:
    """Return whether each of the last `for` cycles is beyond an absolute limit."""
    last = values[-rule.for_cycles:]
    return has_limit(rule) and len(last) >= rule.for_cycles \
        and all(over_limit(rule, value) for value in last)


def recovery_cycles(rule: Rule, baseline: BaselineStats | None) -> int:
    """Return how many latest cycles a plain series' recovery reads: resolve_for, or more.

    Their median must tell a series back inside the band from one still at the threshold
    (RECOVERY_Z standard errors of a median apart) on this series' noise; fewer cycles
    resolve a noisy series still at the threshold, and it fires again (a second page).
    At most the lookback: a series too noisy for it waits that long.

    The noise is the baseline's measured spread, not the detector's floored one: the
    floor keeps a flat baseline from turning tiny moves into infinite evidence, but read
    here it would make a quiet series (a deterministic agreement, a band a fraction of a
    percent wide) wait the whole lookback to resolve after its cause ended.
    """
    gap = rule.threshold - rule.resolve_threshold
    if baseline is None or baseline.center == 0 or gap <= 0:
        return rule.resolve_for
    sigma = baseline.measured_noise()
    need = math.ceil((RECOVERY_Z * MEDIAN_SE * sigma / gap) ** 2)
    return max(rule.resolve_for, min(need, rule.lookback_cycles))


def median_inside_band(rule: Rule, changes: Sequence[float | None]) -> bool:
    """Return whether the median of the known changes is inside the band (none known: inside).

    A noisy series strays out of a band narrower than its noise in most runs of cycles
    however healthy it is; the median of the run is where the series sits.
    """
    known = [c for c in changes if c is not None]
    return not known or inside_band(rule, statistics.median(known))


def median_back(rule: Rule, baseline: BaselineStats | None,
                changes: Sequence[float | None], need: int) -> bool:
    """Return whether the median change of the latest k cycles tells the series back, for
    some k from resolve_for to `need`.

    `need` cycles (`recovery_cycles`) put a median inside the band RECOVERY_Z standard
    errors from the threshold; fewer tell it as surely when their median lies further
    from the threshold: RECOVERY_Z standard errors of a median of that many. So a series
    clearly back resolves in a few cycles and one just inside the band reads them all.
    At `need` itself the band alone decides (a series too noisy for its window resolves
    once the window reads inside the band, as before).
    """
    sigma = baseline.measured_noise() if baseline is not None and baseline.center else None
    for k in range(rule.resolve_for, need + 1):
        if len(changes) < k:
            return False
        if k == need:
            return median_inside_band(rule, changes[-k:])
        known = [c for c in changes[-k:] if c is not None]
        if sigma is None or not known:
            continue
        median = rule.direction * statistics.median(known)
        margin = RECOVERY_Z * MEDIAN_SE * sigma / math.sqrt(len(known))
        if median < rule.resolve_threshold and rule.threshold - median >= margin:
            return True
    return False


def own_samples_back(rule: Rule, baseline: BaselineStats | None,
                     points: Sequence[Point]) -> bool:
    """Return whether the cycles' own samples, merged, read as no change of a tail quantile.

    Scored as the detector scores them (alerts.detection.exceedance_llr): how many lie
    above the baseline quantile is likelier without a change than with the one the rule
    confirms. A pooled value ignores this for up to `pool` cycles: it still holds the
    samples of a regression that ended.
    """
    q = QUANTILE_METRICS.get(rule.metric)
    fresh = [p.fresh for p in points if p.fresh is not None and p.fresh.count]
    if q is None or not is_tail_metric(rule.metric) or rule.direction <= 0 or baseline is None or baseline.center <= 0 \
            or not fresh or len(fresh) < len(points):
        return False
    merged = Sketch()
    for f in fresh:
        merged.merge(f)
    return exceedance_llr(count_above(merged, baseline.center), merged.count, q) \
        <= -RECOVERY_LLR


def own_samples_cycles(rule: Rule, points: Sequence[Point]) -> int | None:
    """Return how many of the latest cycles a tail quantile's recovery reads its own
    samples over: at least resolve_for, and enough samples to reach RECOVERY_LLR were
    none above the baseline quantile (None: the points do not hold that many, or a cycle
    has no samples of its own)."""
    q = QUANTILE_METRICS.get(rule.metric)
    if q is None:
        return None
    n = 0
    for k, p in enumerate(reversed(points), start=1):
        if p.fresh is None or not p.fresh.count:
            return None
        n += p.fresh.count
        if k >= rule.resolve_for and exceedance_llr(0, n, q) <= -RECOVERY_LLR:
            return k
    return None


def series_came_down(rule: Rule, baseline: BaselineStats | None, points: Sequence[Point],
                     changes: Sequence[float | None], recent: int | None = None) -> bool:
    """Return whether a series that breached shows its canaries coming down.

    Only a series that breached since the detector's start (for a firing alert: since it
    fired) must show its canaries coming down; one that never did (a scope's other
    cohort, say) was not the regression. recent: the latest cycles read (resolve_for).
    """
    body = baseline.body if baseline is not None else None
    return not any(breaches(rule, change) for change in changes) or canaries_came_down(
        points, recent or rule.resolve_for, rule.threshold, body)


def recovered(rule: Rule, baseline: BaselineStats | None, points: Sequence[Point],
              values: Sequence[float], changes: Sequence[float | None],
              window: int | None = None) -> bool:
    """Return whether the last resolve_for cycles say the series is back (and inside limits).

    Plain series: the median change of those cycles (more on a noisy series:
    `recovery_cycles`, at most the `window`'s) is inside the hysteresis band.
    Pooled tail quantiles: every pooled value inside the band, or, while the pool still
    holds an ended regression's samples, the own samples of the latest cycles
    (`own_samples_cycles`: enough of them to tell) read as no change (`own_samples_back`)
    and, where the series breached, those cycles' canaries came down.
    """
    recent = rule.resolve_for
    tail = list(zip(points[-recent:], values[-recent:], changes[-recent:], strict=True))
    if len(tail) < recent or any(over_limit(rule, value) for _, value, _ in tail):
        return False
    last = [change for _, _, change in tail]
    if not (is_tail_metric(rule.metric) and any(p.pooled for p, _, _ in tail)):
        need = recovery_cycles(rule, baseline)
        if window is not None:
            # A lookback window read between cycle boundaries holds one cycle fewer than
            # the lookback (its oldest is unfinished at its start), fewer still where rows
            # settle or cycles are empty: asking for more than it holds never resolves.
            need = max(rule.resolve_for, min(need, window))
        return median_back(rule, baseline, changes, need)
    if all(inside_band(rule, change) for change in last):
        return True
    k = own_samples_cycles(rule, points)
    return k is not None and own_samples_back(rule, baseline, points[-k:]) \
        and series_came_down(rule, baseline, points, changes, k)


def reason(rule: Rule, center: float | None, checks: Checks) -> str:
    """Return the one-line reason of a scope's result, naming the numbers used."""
    metric, current = rule.metric, checks.current
    pct = f"{checks.change:+.1%}" if checks.change is not None else "n/a"
    confirmation = checks.confirmation
    if checks.limit_fired:
        limit = f"ceiling {rule.ceiling:g}" if rule.ceiling is not None \
            and current > rule.ceiling else f"floor {rule.floor:g}"
        return (f"{metric} {current:.4g} beyond absolute {limit} "
                f"for {rule.for_cycles} cycles")
    if confirmation.fired:
        cycles = len(confirmation.run)
        run_pct = f"{confirmation.change:+.1%}" if confirmation.change is not None else "n/a"
        how = (f"pooled over {checks.samples} samples, new samples' exceedances"
               if checks.pooled else f"median {run_pct} over {cycles} cycles")
        return (f"{metric} {current:.4g} vs baseline {center:.4g} ({pct}; {how}, "
                f"threshold {rule.signed_threshold:+.0%}), "
                f"CUSUM {confirmation.statistic:.1f} >= {rule.cusum.h:g} over {cycles} cycles")
    if checks.breaching:
        return (f"{metric} {current:.4g} breaches ({pct}) but is not confirmed yet "
                f"(CUSUM {confirmation.statistic:.1f} of {rule.cusum.h:g}, "
                f"{rule.for_cycles} cycles needed)")
    if checks.zero_baseline:
        return f"{metric} {current:.4g}: zero baseline, only absolute limits apply"
    return f"{metric} {current:.4g} within threshold ({pct})"


def run_over(rule: Rule, points: Sequence[Point], rels: Sequence[float | None],
             baseline: BaselineStats, pooled: bool) -> bool:
    """Return whether the latest cycles' own samples say a confirmed run has ended.

    A run median or a pooled quantile still holds an ended regression's cycles for a
    while; these cycles alone must still breach (reach the threshold, not merely stay
    outside the hysteresis band) for the confirmation to page: cycles settled between the
    band and the threshold are what an ended cause leaves, and the rule would not confirm
    them on their own. Plain series: the median change of the cycles does not reach the
    threshold. Pooled quantiles: the quantile of the cycles' own samples, merged, does
    not reach it; for a tail quantile (a few samples say little about it) none of their
    own samples is above the baseline quantile and their median is back within
    threshold / 2 of the baseline's body (unknown body: not over).
    """
    q = QUANTILE_METRICS.get(rule.metric)
    if q is None or not any(p.pooled for p in points):
        known = [r for r in rels if r is not None]
        return bool(known) and not breaches(rule, statistics.median(known))
    fresh = [p.fresh for p in points if p.fresh is not None and p.fresh.count]
    if len(fresh) < len(points) or not fresh or baseline.center <= 0:
        return False
    merged = Sketch()
    for f in fresh:
        merged.merge(f)
    if not pooled:
        own = merged.quantile(q)
        rel = relative_change(own, baseline.center) if own is not None else None
        return rel is not None and not breaches(rule, rel)
    if baseline.body is None or any(count_above(f, baseline.center) for f in fresh):
        return False
    mid = merged.quantile(0.5)
    return mid is not None and mid <= baseline.body * (1.0 + rule.threshold / 2.0)


def canaries_came_down(points: Sequence[Point], recent: int, threshold: float,
                       body: float | None = None) -> bool:
    """Return whether the last `recent` cycles' own samples came down.

    Down: their median within threshold / 2 of the baseline's `body` (the median of its
    cycles' medians); with no body known, at least threshold / 2 under that of the earlier
    cycles' samples (at least 2 such cycles). The points are the detector's: for a firing
    alert, the cycles since it fired. Where a few slow cycles set the baseline p99, a regression of
    the other canaries can go on below it, with no new sample above it and a pool without
    a slow cycle reading under the threshold (bench.incidents shows a ramp read well under
    its size and resolved mid-incident). Without this check the lenient
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
    if body is not None:
        # The body decides where there is one: the earlier cycles' samples move with the
        # noise too, and a dip of a few cycles in a regression that goes on read as
        # coming down from them (a ramp resolved mid-incident and paged again).
        return a <= body * (1.0 + threshold / 2.0)
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
