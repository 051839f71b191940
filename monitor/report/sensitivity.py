"""The report's "What this monitor can see" section: each rule's sensitivity per series.

One row per rule and scope (cohort) from the stored estimates (alerts.sensitivity): the
shift the rule confirms within N cycles at p95 on that series' own noise, the expected
false pages per 30 days at the threshold in force, and whether the false-page budget
widened the threshold, and why.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from monitor.report.data import SensitivityRow
from monitor.report.tables import Table
from storage.queries import sensitivity as queries


def collect_sensitivity(session: Session) -> tuple[SensitivityRow, ...]:
    """Return the stored estimates, widened ones first, then by rule and scope."""
    out = []
    for s in queries.listing(session):
        sign = "+" if s.direction > 0 else "-"
        widened = s.threshold > s.configured_threshold
        out.append((not widened, SensitivityRow(
            s.rule, s.scope_key, f"{s.model_version or '?'}/{s.config_hash or '?'}",
            f"{sign}{s.detectable_change:.0%} within {s.within_cycles} cycles"
            if s.detectable_change is not None else s.status,
            f"{s.false_pages_30d:.3g}" if s.false_pages_30d is not None else "-",
            f"{sign}{s.threshold:.0%}",
            s.reason if widened or s.false_pages_30d is None else
            ("budget off" if s.budget_per_30d is None else "as configured"))))
    return tuple(r for _, r in sorted(out, key=lambda x: (x[0], x[1].rule, x[1].scope)))


def sensitivity_table(rows: tuple[SensitivityRow, ...]) -> Table:
    """Return the "What this monitor can see" table."""
    return Table(("Rule", "Scope", "Cohort", "Detectable shift (p95)", "False pages / 30 days",
                  "Threshold in force", "Why"),
                 tuple((r.rule, r.scope, r.cohort, r.detectable, r.false_pages, r.threshold,
                        r.why) for r in rows),
                 "No estimate yet: the sensitivity job has not run on a warm baseline.")
