"""The weekly report's Alerts section grouped by incident, with the week's late runs."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy.orm import Session, sessionmaker

from alerts.incidents import IncidentConfig, group
from alerts.lifecycle import Lifecycle, fingerprint, open_alerts
from alerts.rule_file import parse_rule
from alerts.rules import Rule, RuleResult
from alerts.webhooks import WebhookTarget
from monitor.report import build_report, load_registry, render_markdown
from monitor.report.html import render_html
from monitor.settings import Settings

NOW = datetime(2026, 11, 30, 6, 0, tzinfo=UTC)  # report of 2026-W48: Nov 23 .. Nov 30
AT = datetime(2026, 11, 25, 3, 0, tzinfo=UTC)
P99 = parse_rule({"name": "p99_latency_regression", "metric": "p99_latency", "change": "+15%",
                  "severity": "page"})
TTFT = parse_rule({"name": "ttft_regression", "metric": "ttft", "change": "+15%"})
TARGET = WebhookTarget(name="pager", url="http://127.0.0.1:9/hook", format="slack")


def move(s: Session, now: datetime, rule: Rule, labels: dict[str, str], *, fired: bool,
         over: bool = False, recovered: bool = False) -> Lifecycle:
    life = Lifecycle(s, now, [TARGET], per_alert=False)
    current = open_alerts(s).get(fingerprint(rule.name, labels))
    if current is None:
        life.apply(rule, RuleResult(rule.name, labels, 1.0, 1.5, 0.5, 0.15, False, "pending",
                                    breaching=True, severity=rule.severity), None)
        current = open_alerts(s)[fingerprint(rule.name, labels)]
    life.apply(rule, RuleResult(rule.name, labels, 1.0, 2.0, 1.0, 0.15, fired, "moved",
                                breaching=fired, over=over, recovered=recovered, severity=rule.severity), current)
    group(s, now, life, IncidentConfig())
    return life


def test_alerts_section_lists_each_incident_once_with_members_cause_and_late_runs(
        sessionmaker: sessionmaker[Session], report_settings: Settings) -> None:
    with sessionmaker.begin() as s:
        move(s, AT, P99, {"bucket": "64"}, fired=True)
        move(s, AT + timedelta(minutes=1), P99, {"bucket": "32"}, fired=True)
        move(s, AT + timedelta(minutes=20), P99, {"bucket": "64"}, fired=False, recovered=True)
        move(s, AT + timedelta(minutes=21), P99, {"bucket": "32"}, fired=False, recovered=True)
        move(s, AT + timedelta(minutes=30), TTFT, {"bucket": "256"}, fired=True, over=True)
    with sessionmaker.begin() as s:
        report = build_report(s, "2026-W48", NOW, load_registry(), report_settings)
    rows = report.data.incidents
    assert [(r.incident is not None, len(r.members), r.notifications) for r in rows] == [
        (True, 2, 2), (False, 1, 0)]
    assert rows[0].members == ("p99_latency_regression [bucket=64] +100%",
                               "p99_latency_regression [bucket=32] +100%")
    section = render_markdown(report).split("## Alerts", 1)[1].split("\n## ", 1)[0]
    assert "| Incident | Started | Resolved | Severity | Probable cause |" in section
    assert "| 2026-11-25 03:00Z | 2026-11-25 03:21Z | page | unknown (no A/B arm rows" \
        in section
    assert "| late | 2026-11-25 03:30Z |" in section and "nobody paged" in section
    assert "<h2>Alerts</h2>" in render_html(report)
