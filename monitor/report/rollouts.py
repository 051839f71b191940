"""The report's "Rollouts" section: new cohorts judged against old ones (alerts.rollout).

One row per comparison judged during the week (storage.queries.series.list_verdicts):
the latest verdict, the median change and the Mann-Whitney p-value behind it.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from monitor.report.data import RolloutRow
from monitor.report.tables import Table
from storage.queries import series as queries


def collect_rollouts(session: Session, start: datetime, end: datetime) -> tuple[RolloutRow, ...]:
    """Return the comparisons judged within [start, end), fails first."""
    order = {"fail": 0, "marginal": 1, "pass": 2}
    rows = [RolloutRow(f"{v.new[0]}/{v.new[1]}", f"{v.old[0]}/{v.old[1]}", v.source, v.metric,
                       v.bucket, v.verdict, v.relative_change, v.p_value,
                       min(v.new_cycles, v.old_cycles), v.updated_at)
            for v in queries.list_verdicts(session, since=start, until=end, limit=1000)]
    return tuple(sorted(rows, key=lambda r: (order.get(r.verdict, 3), r.new, r.metric,
                                             r.source, r.bucket)))


def rollout_table(rows: tuple[RolloutRow, ...]) -> Table:
    """Return the Rollouts table."""
    out = [(r.new, r.old, r.source, r.metric, r.bucket, r.verdict.upper(),
            f"{r.relative_change:+.1%}" if r.relative_change is not None else "-",
            f"{r.p_value:.2g}" if r.p_value is not None else "-", str(r.cycles),
            r.last_at.strftime("%Y-%m-%d %H:%M")) for r in rows]
    return Table(("New cohort", "Old cohort", "Source", "Metric", "Bucket", "Verdict",
                  "Median change", "Mann-Whitney p", "Cycles each", "Last judged (UTC)"),
                 tuple(out), "No rollout this week: one cohort served at a time.")
