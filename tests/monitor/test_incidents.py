"""Incidents through the real app: GET /v1/incidents, the metrics, and `tailwatch incidents`."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from alerts.cause import CAUSES
from alerts.flags import FlagStore
from alerts.incidents import IncidentConfig, group
from alerts.lifecycle import Lifecycle, fingerprint, open_alerts
from alerts.rule_file import parse_rule
from alerts.rules import RuleResult
from alerts.webhooks import WebhookTarget
from monitor.app import create_app
from monitor.cli import main
from monitor.hub import services_of
from monitor.settings import Settings
from storage.models import Alert, Incident
from tests.alerts.test_incident_cause import BUCKETS, cycles, incident_after
from tests.alerts.test_incident_cause import P99 as CAUSE_P99
from tests.alerts.test_incident_cause import T0 as CAUSE_T0
from tests.monitor.conftest import TOKEN, wait_for
from tests.monitor.fakes import FakeFactory
from tests.monitor.live import LiveServer

T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=30)
P99 = parse_rule({"name": "p99_latency_regression", "metric": "p99_latency", "change": "+15%",
                  "severity": "page"})
TARGET = WebhookTarget(name="pager", url="http://127.0.0.1:9/hook", format="generic")


def make_incident(sessions: sessionmaker[Session]) -> tuple[int, list[int]]:
    """Two alerts fire together (one incident); the policy flips a flag for one of them."""
    buckets = ("32", "64")
    with sessions.begin() as s:
        life = Lifecycle(s, T0, [TARGET], per_alert=False)
        for b in buckets:
            labels = {"bucket": b}
            life.apply(P99, RuleResult(P99.name, labels, 1.0, 1.5, 0.5, 0.15, False, "pending",
                                       breaching=True, severity=P99.severity), None)
            life.apply(P99, RuleResult(P99.name, labels, 1.0, 2.0, 1.0, 0.15, True, "fired",
                                       breaching=True, severity=P99.severity),
                       open_alerts(s)[fingerprint(P99.name, labels)])
        report = group(s, T0, life, IncidentConfig())
        ids = sorted(a.id for a in life.fired)
        FlagStore(lambda: T0).set(s, "speculative", "64", False, reason="policy: p99 firing",
                                  actor="policy", source="auto", alert_id=ids[1])
    return report.opened[0], ids


def test_incidents_are_listed_and_shown_with_members_flags_and_notifications(
        client: TestClient) -> None:
    sessions = services_of(client.app).sessions  # type: ignore[arg-type]
    iid, members = make_incident(sessions)
    listed = client.get("/v1/incidents", params={"state": "open"}).json()
    assert [(i["id"], i["members"], i["families"], i["buckets"]) for i in listed] == [
        (iid, 2, ["latency"], ["32", "64"])]
    assert listed[0]["cause"] == "unknown"  # no A/B rows: said, not guessed
    shown = client.get(f"/v1/incidents/{iid}").json()
    assert [a["id"] for a in shown["member_alerts"]] == members
    assert [e["kind"] for e in shown["timeline"]] == ["opened", "joined", "notified"]
    assert [(f["name"], f["scope"], f["alert_id"]) for f in shown["flag_changes"]] == [
        ("speculative", "64", members[1])]
    assert [(n["target"], n["status"]) for n in shown["notifications"]] == [("pager", "firing")]
    assert shown["summary"].startswith("2 alerts (2 firing) in 2 buckets (32, 64)")
    assert "arms" in shown["evidence"]
    assert client.get("/v1/incidents", params={"state": "resolved"}).json() == []
    missing = client.get("/v1/incidents/999999")
    assert missing.status_code == 404 and missing.json()["error"]["field"] == "incident_id"
    bad = client.get("/v1/incidents", params={"state": "burning"})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "state"


def by_cause(client: TestClient) -> dict[str, float]:
    """Return tailwatch_incidents_total per cause, as scraped from /metrics."""
    text = client.get("/metrics").text
    return {cause: float(n) for cause, n in re.findall(
        r'^tailwatch_incidents_total\{cause="(\w+)"\} (\S+)$', text, re.M)}


def test_metrics_count_open_incidents_and_incidents_by_cause(client: TestClient) -> None:
    sessions = services_of(client.app).sessions  # type: ignore[arg-type]
    text = client.get("/metrics").text
    assert "tailwatch_incidents_open 0.0" in text
    _, ids = make_incident(sessions)
    text = client.get("/metrics").text
    assert "tailwatch_incidents_open 1.0" in text
    # Its cause is unknown (no A/B rows) and measured again while it is open: not counted
    # under any cause yet.
    assert set(by_cause(client).values()) == {0.0}
    with sessions.begin() as s:
        life = Lifecycle(s, T0 + timedelta(minutes=10), [TARGET], per_alert=False)
        for alert in s.scalars(select(Alert).where(Alert.id.in_(ids))):
            life.apply(P99, RuleResult(P99.name, alert.labels, 1.0, 1.0, 0.0, 0.15, False,
                                       "recovered", recovered=True), alert)
        group(s, T0 + timedelta(minutes=10), life, IncidentConfig())
    assert "tailwatch_incidents_open 0.0" in client.get("/metrics").text
    # Resolved without a cause: counted once, as unknown.
    counts = by_cause(client)
    assert counts["unknown"] == 1.0 and sum(counts.values()) == 1.0


def test_the_counter_by_cause_never_goes_down_when_a_cause_is_measured_later(
        client: TestClient) -> None:
    """An incident opens before any A/B cycle shows its cause (unknown); the next cycles'
    arms slow alike and the next evaluation restates it host_or_load. Scraped through the
    app before and after: no cause's count fell, and the incident counts once."""
    sessions = services_of(client.app).sessions  # type: ignore[arg-type]
    with sessions.begin() as s:
        cycles(s, 0, 64, {})  # the hour before: nothing slowed
        incident = incident_after(s, [(CAUSE_P99, {"bucket": b}) for b in BUCKETS])
        iid, first = incident.id, incident.cause
    before = by_cause(client)
    with sessions.begin() as s:
        cycles(s, 64, 73, {"optimized": 2.12, "eager": 2.08, "direct": 2.08})
        now = CAUSE_T0 + timedelta(minutes=73)
        group(s, now, Lifecycle(s, now, per_alert=False), IncidentConfig())
        restated = s.get(Incident, iid)
        assert restated is not None and restated.cause == "host_or_load"
    after = by_cause(client)
    assert first == "unknown" and set(before) == set(after) == set(CAUSES)
    assert [c for c in CAUSES if after[c] < before[c]] == []
    assert after["host_or_load"] == 1.0 and sum(after.values()) == 1.0


@pytest.fixture
def server(settings: Settings) -> Iterator[LiveServer]:
    app = create_app(settings, engine_factory=FakeFactory(), registry=CollectorRegistry())
    with LiveServer(app) as live:
        wait_for(lambda: httpx.get(live.url + "/readyz").status_code == 200)
        yield live


@pytest.mark.parametrize("db_kind", ["sqlite"])
def test_cli_lists_and_shows_incidents_and_fails_in_one_line(
        server: LiveServer, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TAILWATCH_URL", server.url)
    monkeypatch.setenv("TAILWATCH_API_TOKEN", TOKEN)
    assert main(["incidents", "list"]) == 0
    assert capsys.readouterr().out.strip() == "(none)"
    iid, _ = make_incident(services_of(server.app).sessions)
    assert main(["incidents", "list", "--state", "open"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:4] == ["ID", "STATE", "SEVERITY", "MEMBERS"]
    assert out.splitlines()[1].split()[:4] == [str(iid), "open", "page", "2"]
    assert main(["incidents", "show", str(iid)]) == 0
    out = capsys.readouterr().out
    assert "probable cause: unknown" in out and "speculative" in out and "pager" in out
    assert main(["incidents", "show", "999999"]) == 1
    err = capsys.readouterr().err
    assert "incident 999999 does not exist" in err and err.strip().count("\n") == 0
