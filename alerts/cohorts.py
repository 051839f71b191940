"""Judge one scope cohort by cohort: each (model_version, config_hash) against its baseline.

During a rollout two cohorts serve the same scope. Each one's series is checked against
its own baseline (or the inherited one while it warms in, `alerts.baselines`), and the
scope gets one result, so a rollout raises one alert per scope, not one per cohort:

    fired       if any cohort fired (the worst one speaks, its cohort named in the reason)
    breaching   if any cohort breaches
    recovered   only when every cohort with data has recovered
    no_data     only when no cohort has data

A seasonal baseline (hour_of_week, or its fallback hour_of_day) is the baseline of the current hour only: cycles of
the previous hour were judged against their own hour's baseline, so the detector reads
only this hour's cycles (a regular peak ending at the hour would otherwise be re-scored,
29 cycles at once, against the quieter next hour and page).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from datetime import datetime

from alerts.baselines import HOUR_OF_DAY, HOUR_OF_WEEK, CohortBaseline, cohort_label, hour_start
from alerts.rules import Point, Rule, RuleResult, evaluate_rule, judged_points
from storage.queries.series import Cohort


def judge(rule: Rule, labels: Mapping[str, str], points: Mapping[Cohort, Sequence[Point]],
          baselines: Mapping[Cohort, CohortBaseline], since: datetime | None) -> RuleResult:
    """Return the scope's result from each cohort's points (cycles before `since` left out)."""
    results: list[tuple[Cohort, CohortBaseline, RuleResult]] = []
    for cohort, pts in sorted(points.items()):
        base = baselines.get(cohort, CohortBaseline(None))
        if base.origin in (HOUR_OF_WEEK, HOUR_OF_DAY) and pts:
            hour = hour_start(pts[-1].at)
            pts = [p for p in pts if p.at >= hour]
        # What recovery may ask for at most: the judged cycles of the whole window.
        window = len(judged_points(rule, pts))
        if since is not None:
            pts = [p for p in pts if p.at >= since]
        results.append((cohort, base, evaluate_rule(rule, labels, base.stats, pts,
                                                     window=window)))
    if not results:
        return evaluate_rule(rule, labels, None, [])
    if len(results) == 1 and not results[0][1].origin:
        return results[0][2]

    def rank(item: tuple[Cohort, CohortBaseline, RuleResult]) -> tuple[bool, bool, bool, float]:
        r = item[2]
        rel = rule.direction * r.relative_change if r.relative_change is not None else -math.inf
        return r.fired, r.breaching, not r.no_data, rel

    cohort, base, worst = max(results, key=rank)
    with_data = [r for _, _, r in results if not r.no_data]
    note = f"cohort {cohort_label(cohort)}" + (f", baseline {base.origin}" if base.origin else "")
    return dataclasses.replace(
        worst, reason=f"{worst.reason} [{note}]",
        recovered=bool(with_data) and all(r.recovered for r in with_data))
