"""The report's alerts grouped by incident: one row per incident, its members and cause.

An incident is the alerts that fired together in a shared scope (alerts.incidents): one
page. Rows: when it started and ended, its probable cause (measured from the A/B arms),
its members (rule and scope, with each one's change), and how many notifications it
sent. Runs confirmed only after their cause ended are listed too: late, nobody paged.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from monitor.report.data import IncidentRow
from monitor.report.tables import Table, when
from storage.queries import incidents as queries


def _member(rule: str, labels: dict[str, str], change: float | None) -> str:
    where = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return f"{rule}" + (f" [{where}]" if where else "") + (
        f" {change:+.0%}" if change is not None else "")


def collect_incidents(session: Session, start: datetime,
                      end: datetime) -> tuple[IncidentRow, ...]:
    """Return the incidents open during [start, end) and the week's late runs, oldest first."""
    incidents = queries.active_between(session, start, end)
    members = queries.members_of(session, [i.id for i in incidents])
    rows = []
    for inc in incidents:
        sent = {e.detail for e in queries.events(session, inc.id) if e.kind == "notified"}
        rows.append(IncidentRow(
            inc.id, inc.started_at, inc.resolved_at, inc.severity, inc.cause_text or inc.cause,
            tuple(_member(a.rule, dict(a.labels or {}), a.relative_change)
                  for a in members[inc.id]), len(sent)))
    for alert, at in queries.late_between(session, start, end):
        rows.append(IncidentRow(None, at, at, alert.severity,
                                "late: confirmed after its cause ended, nobody paged",
                                (_member(alert.rule, dict(alert.labels or {}),
                                         alert.relative_change),), 0))
    return tuple(sorted(rows, key=lambda r: (r.started_at, r.incident or 0)))


def incident_table(rows: tuple[IncidentRow, ...]) -> Table:
    """Return the alerts-by-incident table."""
    out = tuple((str(r.incident) if r.incident is not None else "late", when(r.started_at),
                 when(r.resolved_at), r.severity, r.cause, "; ".join(r.members),
                 str(r.notifications)) for r in rows)
    return Table(("Incident", "Started", "Resolved", "Severity", "Probable cause", "Alerts",
                  "Notifications"), out, "no incidents this week")
