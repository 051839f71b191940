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
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from alerts.baselines import HOUR_OF_DAY, HOUR_OF_WEEK, CohortBaseline, cohort_label, hour_start
from alerts.rules import Point, Rule, RuleResult, evaluate_rule, judged_points
from storage.queries.runs import LatestCycle, latest_cycles, serving_since
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


class ServingCohorts:
    """The cohort each instance serves at `until` (its latest canary cycle's), over any
    lookback, from one read of the longest asked.

    One evaluation asks twice: the rollout check over its window, the incidents over an
    hour. A shorter lookback's latest cycles are the longer one's that started in it
    (`storage.queries.runs.serving_since`), so the second answer costs no query.
    lookback_s: the least lookback the first read covers (the longest the caller knows of).
    """

    def __init__(self, session: Session, until: datetime, lookback_s: float = 0.0) -> None:
        self.session, self.until, self.lookback_s = session, until, lookback_s
        self._latest: dict[str, LatestCycle] | None = None
        self._read_s = 0.0

    def within(self, lookback_s: float) -> dict[str, Cohort]:
        """Return instance -> the cohort of its latest cycle started in the last `lookback_s`."""
        if self._latest is None or lookback_s > self._read_s:
            self._read_s = max(lookback_s, self.lookback_s)
            self._latest = latest_cycles(self.session, self._since(self._read_s), self.until)
        return serving_since(self._latest, self._since(lookback_s))

    def _since(self, lookback_s: float) -> datetime:
        return self.until - timedelta(seconds=lookback_s)
