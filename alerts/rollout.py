"""Rollout analysis: while two cohorts serve, judge the new one against the old one.

Kayenta's judgement, small: over the same trailing window, the per-cycle values of the
new cohort (the one that started probing last) and of the old one (the other cohort
with the most cycles) per source x metric x bucket are compared with a one-sided
Mann-Whitney U rank test (normal approximation, tie-corrected) and the relative change
of their medians against the shipped rule's threshold for that metric:

    fail      significant (p < alpha) and the median moved by at least the threshold
    marginal  significant but under the threshold, or over it but not significant
    pass      neither

Each comparison's verdict is stored (`rollout_verdicts`, one row updated while both
serve) and a fail raises a `rollout_regression` alert naming the cohorts and the metric
through the normal lifecycle (so it notifies); a pass, or the rollout ending, resolves it.
A cohort serves while the latest cycle of some instance ran it: one every instance has
left is not judged, though its cycles are still in the window. Its severity is `warning`: the page for the same regression comes from the metric's own
rule, which judges the new cohort against the inherited baseline in the same cycles as
any other regression (`alerts.cohorts`, with the new cohort's short pools topped up from
the old one's samples, `alerts.series.pooled_quantile`); two pages for one incident help
nobody.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np
from sqlalchemy.orm import Session

from alerts.baselines import cohort_label
from alerts.cohorts import ServingCohorts
from alerts.detection import relative_change
from alerts.lifecycle import Lifecycle, Transition, fingerprint
from alerts.rules import Rule, RuleResult
from alerts.series import RowCache, cohort_series
from storage.models import Alert
from storage.queries import series as series_queries
from storage.queries.series import Cohort, Verdict

ROLLOUT_RULE = "rollout_regression"
ROLLOUT_SEVERITY = "warning"
# (source, metric) pairs compared; each uses the threshold of the first rule measuring it.
COMPARED = (("canary", "p99_latency"), ("canary", "ttft"), ("canary", "acceptance_rate"),
            ("canary", "output_agreement"), ("traffic", "p99_latency"),
            ("traffic", "acceptance_rate"))
VERDICTS = ("pass", "marginal", "fail")


@dataclass(frozen=True)
class RolloutConfig:
    """Window, minimum cycles per cohort and significance level of the rollout check."""

    window_s: float = 1800.0
    min_cycles: int = 10
    alpha: float = 0.01


def mann_whitney_p(new: Sequence[float], old: Sequence[float], direction: int) -> float:
    """Return the one-sided p-value of `new` being larger (direction +1) or smaller (-1).

    U of `new` from the ranks of the pooled sample (ties get their average rank), its
    variance with the tie correction, a continuity correction of 1/2.
    """
    x, y = np.asarray(new, dtype=float), np.asarray(old, dtype=float)
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        return 1.0
    pooled = np.concatenate([x, y])
    order = pooled.argsort(kind="mergesort")
    ranks = np.empty(len(pooled))
    ranks[order] = np.arange(1, len(pooled) + 1)
    _, inverse, counts = np.unique(pooled, return_inverse=True, return_counts=True)
    sums = np.zeros(len(counts))
    np.add.at(sums, inverse, ranks)
    ranks = (sums / counts)[inverse]
    u = float(ranks[:n1].sum()) - n1 * (n1 + 1) / 2.0
    n = n1 + n2
    ties = float((counts ** 3 - counts).sum())
    var = n1 * n2 / 12.0 * ((n + 1) - ties / (n * (n - 1)))
    if var <= 0:
        return 1.0
    mean = n1 * n2 / 2.0
    diff = (u - mean) if direction > 0 else (mean - u)
    z = (diff - 0.5) / math.sqrt(var)
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def verdict_of(p: float, rel: float | None, direction: int, threshold: float,
               alpha: float) -> str:
    """Return pass / marginal / fail from the p-value and the relative median change."""
    significant = p < alpha
    big = rel is not None and direction * rel >= threshold
    if significant and big:
        return "fail"
    if significant or big:
        return "marginal"
    return "pass"


def _rule_for(rules: Sequence[Rule], source: str, metric: str) -> Rule | None:
    for r in rules:
        if r.source == source and r.metric == metric and not r.match:
            return r
    return None


def check(session: Session, rules: Sequence[Rule], now: datetime, cache: RowCache,
          life: Lifecycle, alerts: Mapping[str, Alert],
          config: RolloutConfig | None = None,
          serving: ServingCohorts | None = None) -> tuple[list[Verdict], list[Transition]]:
    """Compare the serving cohorts, store verdicts, move `rollout_regression` alerts.

    serving: the evaluation's read of the cohorts the instances serve (the incidents
    read it too); None: read here.
    """
    cfg = config or RolloutConfig()
    start = now - timedelta(seconds=cfg.window_s)
    verdicts: list[Verdict] = []
    transitions: list[Transition] = []
    live: set[str] = set()
    # A cohort serves while some instance's latest cycle ran it: one every instance left
    # (rolled back) keeps its cycles in the window for a while, and judged against the
    # old cohort's moving window it would fail again after the rollout is over.
    served = set((serving or ServingCohorts(session, now)).within(cfg.window_s).values())
    for source, metric in COMPARED:
        base_rule = _rule_for(rules, source, metric)
        if base_rule is None:
            continue
        # Per bucket, all paths together: what a user of that bucket meets.
        rule = Rule(name=ROLLOUT_RULE, metric=metric, direction=base_rule.direction,
                    threshold=base_rule.threshold, resolve_threshold=base_rule.resolve_threshold,
                    source=source, per=("bucket",), min_samples=base_rule.min_samples,
                    window_s=base_rule.window_s, severity=ROLLOUT_SEVERITY,
                    # Each cycle on its own samples: pooled quantiles of neighbouring
                    # cycles are correlated, and a rank test needs independent values.
                    pool_cycles=1,
                    description="A new cohort is worse than the old one over the same window.")
        for labels, per_cohort in sorted(cohort_series(rule, cache, start, now).items()):
            vals = {c: [p.value for p in pts if p.value is not None
                        and p.samples >= rule.min_samples] for c, pts in per_cohort.items()}
            judged = [c for c, v in vals.items() if len(v) >= cfg.min_cycles and c in served]
            if len(judged) < 2:
                continue
            new = max(judged, key=lambda c: (cache.since(c, now) or start, c))
            old = max((c for c in judged if c != new), key=lambda c: (len(vals[c]), c))
            v = _judge(rule, dict(labels), new, old, vals[new], vals[old], now, start, cfg)
            series_queries.save_verdict(session, v)
            verdicts.append(v)
            result = _result(rule, v)
            fp = fingerprint(ROLLOUT_RULE, result.labels)
            live.add(fp)
            transitions += life.apply(rule, result, alerts.get(fp))
    for fp, a in alerts.items():
        if a.rule == ROLLOUT_RULE and a.state != "resolved" and fp not in live:
            transitions.append(life.retire(a, "rollout over: the cohorts no longer both serve"))
    return verdicts, transitions


def _judge(rule: Rule, labels: dict[str, str], new: Cohort, old: Cohort, xs: list[float],
           ys: list[float], now: datetime, start: datetime, cfg: RolloutConfig) -> Verdict:
    med_new, med_old = float(np.median(xs)), float(np.median(ys))
    rel = relative_change(med_new, med_old)
    p = mann_whitney_p(xs, ys, rule.direction)
    return Verdict(new=new, old=old, source=rule.source, metric=rule.metric,
                   bucket=labels.get("bucket", ""),
                   verdict=verdict_of(p, rel, rule.direction, rule.threshold, cfg.alpha),
                   p_value=p, relative_change=rel, threshold=rule.signed_threshold,
                   new_median=med_new, old_median=med_old, new_cycles=len(xs),
                   old_cycles=len(ys), window_start=start, first_at=now, updated_at=now)


def _result(rule: Rule, v: Verdict) -> RuleResult:
    labels = {"bucket": v.bucket, "metric": v.metric, "source": v.source,
              "new": cohort_label(v.new), "old": cohort_label(v.old)}
    rel = f"{v.relative_change:+.1%}" if v.relative_change is not None else "n/a"
    reason = (f"rollout {cohort_label(v.new)} vs {cohort_label(v.old)}: {v.metric} ({v.source}) "
              f"bucket {v.bucket} median {v.new_median:.4g} vs {v.old_median:.4g} ({rel}, "
              f"threshold {v.threshold:+.0%}), Mann-Whitney p={v.p_value:.2g} over "
              f"{v.new_cycles}/{v.old_cycles} cycles: {v.verdict}")
    fail = v.verdict == "fail"
    return RuleResult(rule=ROLLOUT_RULE, labels=labels, baseline=v.old_median,
                      current=v.new_median, relative_change=v.relative_change,
                      threshold=v.threshold, fired=fail, reason=reason, breaching=fail,
                      recovered=v.verdict == "pass", samples=v.new_cycles,
                      severity=ROLLOUT_SEVERITY)
