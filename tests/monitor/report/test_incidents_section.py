"""The weekly report's Alerts section grouped by incident, with the week's late runs.

Through the real app: `tailwatch report --week` on the test database, its written files
and the summary it stores.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from alerts.incidents import IncidentConfig, group
from alerts.lifecycle import Lifecycle, fingerprint, open_alerts
from alerts.rule_file import parse_rule
from alerts.rules import Rule, RuleResult
from alerts.webhooks import WebhookTarget
from monitor.cli import main
from storage.models import Report

AT = datetime(2026, 11, 25, 3, 0, tzinfo=UTC)  # in 2026-W48: Nov 23 .. Nov 30
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
                                breaching=fired, over=over, recovered=recovered,
                                severity=rule.severity), current)
    group(s, now, life, IncidentConfig())
    return life


def test_alerts_section_lists_each_incident_once_with_members_cause_and_late_runs(
        sessionmaker: sessionmaker[Session], migrated_url: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two p99 alerts are one incident (one firing, one resolved notification); a TTFT run
    confirmed after its cause ended is late: listed as such, not as a fired alert."""
    with sessionmaker.begin() as s:
        move(s, AT, P99, {"bucket": "64"}, fired=True)
        move(s, AT + timedelta(minutes=1), P99, {"bucket": "32"}, fired=True)
        move(s, AT + timedelta(minutes=20), P99, {"bucket": "64"}, fired=False, recovered=True)
        move(s, AT + timedelta(minutes=21), P99, {"bucket": "32"}, fired=False, recovered=True)
        move(s, AT + timedelta(minutes=30), TTFT, {"bucket": "256"}, fired=True, over=True)
    monkeypatch.setenv("TAILWATCH_DATABASE_URL", migrated_url)
    monkeypatch.delenv("TAILWATCH_CONFIG", raising=False)
    out = tmp_path / "out"
    assert main(["report", "--week", "2026-W48", "--out", str(out), "--no-notify"]) == 0
    md = (out / "report-2026-W48.md").read_text()
    section = md.split("## Alerts", 1)[1].split("\n## ", 1)[0]
    by_incident, by_alert = section.split("| Alert | Bucket | Severity | Fired |", 1)
    rows = [line for line in by_incident.splitlines()
            if line.startswith("| ") and not line.startswith("| Incident |")]
    assert len(rows) == 2
    assert rows[0].endswith(" | 2026-11-25 03:00Z | 2026-11-25 03:21Z | page | unknown (no A/B "
                            "arm rows in the incident's window) | p99_latency_regression "
                            "[bucket=64] +100%; p99_latency_regression [bucket=32] +100% | 2 |")
    assert rows[1].startswith("| late | 2026-11-25 03:30Z | 2026-11-25 03:30Z | warning | late: "
                              "confirmed after its cause ended, nobody paged | ttft_regression "
                              "[bucket=256] +100% | 0 |")
    # The per-alert table lists what fired: the late run never did.
    assert by_alert.count("| p99_latency_regression |") == 2
    assert "ttft_regression" not in by_alert
    assert "<h2>Alerts</h2>" in (out / "report-2026-W48.html").read_text()
    with sessionmaker() as s:
        (stored,) = s.scalars(select(Report)).all()
        assert stored.week == "2026-W48" and stored.summary["alerts"] == 2
