"""One notification per incident in every format, delivered through the real outbox.

Alerts move through the production Lifecycle, `alerts.incidents.group` queues the
incident's notifications, and the Deliverer sends them to a loopback receiver.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from alerts.incidents import IncidentConfig, IncidentReport, group
from alerts.lifecycle import Lifecycle, fingerprint, open_alerts
from alerts.outbox import Deliverer
from alerts.rule_file import parse_rule
from alerts.rules import Rule, RuleResult
from alerts.webhooks import WebhookTarget
from monitor.loopback import WebhookReceiver
from storage.models import Incident, WebhookDelivery

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
P99 = parse_rule({"name": "p99_latency_regression", "metric": "p99_latency", "change": "+15%",
                  "severity": "page"})
P50 = parse_rule({"name": "p50_latency_regression", "metric": "p50_latency", "change": "+15%"})
FORMATS = ("generic", "slack", "alertmanager", "alertmanager_api")
# Alertmanager's webhook payload, version 4 (prometheus/alertmanager notify/webhook).
AM_V4 = {"version", "groupKey", "truncatedAlerts", "status", "receiver", "groupLabels",
         "commonLabels", "commonAnnotations", "externalURL", "alerts"}
AM_ALERT = {"status", "labels", "annotations", "startsAt", "endsAt", "generatorURL",
            "fingerprint"}
AM_API_ALERT = {"labels", "annotations", "startsAt", "endsAt", "generatorURL"}
CONFIG = IncidentConfig(window_s=150.0, hold_s=600.0, group_interval_s=300.0)


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


def targets(url: str = "http://127.0.0.1:9/hook") -> list[WebhookTarget]:
    return [WebhookTarget(name=f, url=url, format=f) for f in FORMATS]


def step(s: Session, now: datetime, tg: list[WebhookTarget], *,
         fire: tuple[tuple[Rule, dict[str, str]], ...] = (),
         recover: tuple[tuple[Rule, dict[str, str]], ...] = ()) -> IncidentReport:
    """Fire and recover scopes in one evaluation (as the evaluator does), then group."""
    life = Lifecycle(s, now, tg, external_url="http://tw.example", per_alert=False)
    for rule, labels in fire:
        # The severity as evaluate_rule gives it: the rule's.
        life.apply(rule, RuleResult(rule.name, labels, 1.0, 1.5, 0.5, 0.15, False, "pending",
                                    breaching=True, severity=rule.severity), None)
        life.apply(rule, RuleResult(rule.name, labels, 1.0, 2.1, 1.1, 0.15, True,
                                    "fired", breaching=True, severity=rule.severity),
                   open_alerts(s)[fingerprint(rule.name, labels)])
    for rule, labels in recover:
        life.apply(rule, RuleResult(rule.name, labels, 1.0, 1.0, 0.0, 0.15, False,
                                    "recovered", recovered=True),
                   open_alerts(s)[fingerprint(rule.name, labels)])
    return group(s, now, life, CONFIG)


def rows(s: Session, fmt: str) -> list[WebhookDelivery]:
    return list(s.scalars(select(WebhookDelivery).where(WebhookDelivery.format == fmt)
                          .order_by(WebhookDelivery.id)))


def hog(s: Session, tg: list[WebhookTarget]) -> None:
    """One host-wide slowdown: 3 alerts at once, a 4th later, all resolve, one early."""
    step(s, at(0), tg, fire=((P99, {"bucket": "64"}), (P99, {"bucket": "32"}),
                             (P50, {"bucket": "64"})))
    step(s, at(2), tg, fire=((P50, {"bucket": "128"}),))  # joins: within group_interval
    step(s, at(3), tg, recover=((P99, {"bucket": "32"}),))  # leaves: within it too
    step(s, at(9), tg)  # group_interval over: one update with both changes
    step(s, at(12), tg, recover=((P99, {"bucket": "64"}), (P50, {"bucket": "64"}),
                                 (P50, {"bucket": "128"})))


def test_one_firing_and_one_resolved_per_incident_for_generic_and_slack(
        sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        hog(s, targets())
    with sessionmaker() as s:
        generic = [r.payload for r in rows(s, "generic")]
        assert [p["status"] for p in generic] == ["firing", "resolved"]
        first = generic[0]
        assert first["kind"] == "incident"
        inc = first["incident"]
        assert inc["id"] == s.scalars(select(Incident.id)).one()
        assert len(inc["members"]) == 3 and inc["summary"].startswith("3 alerts (3 firing)")
        assert inc["probable_cause"] and "probable cause:" in inc["summary"]
        assert inc["url"] == f"http://tw.example/v1/incidents/{inc['id']}"
        assert len(generic[1]["incident"]["members"]) == 4
        assert all(m["status"] == "resolved" for m in generic[1]["incident"]["members"])
        slack = [r.payload for r in rows(s, "slack")]
        assert ["[FIRING]" in p["text"] for p in slack] == [True, False]
        assert "[RESOLVED]" in slack[1]["text"]
        listed = slack[0]["blocks"][2]["text"]["text"]
        assert listed.count("\n• ") == 3 and "p99_latency_regression" in listed
        # Order per incident: every row is keyed on the incident's first member.
        assert len({r.alert_id for r in rows(s, "generic") + rows(s, "slack")}) == 1


def test_alertmanager_gets_one_group_per_incident_and_one_update_per_group_interval(
        sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        hog(s, targets())
    with sessionmaker() as s:
        am = [r.payload for r in rows(s, "alertmanager")]
        # firing (3 members); nothing within the group_interval after it; one update at
        # +9 min (a member joined, one resolved); resolved.
        assert [(p["status"], len(p["alerts"])) for p in am] == [
            ("firing", 3), ("firing", 4), ("resolved", 4)]
        iid = str(s.scalars(select(Incident.id)).one())
        for p in am:
            assert set(p) == AM_V4 | {"idempotencyKey"} and p["version"] == "4"
            assert p["groupLabels"] == {"incident": iid}
            assert p["groupKey"] == '{}:{incident="' + iid + '"}'
            assert p["truncatedAlerts"] == 0
            for a in p["alerts"]:
                assert set(a) == AM_ALERT and a["labels"]["incident"] == iid
                assert a["labels"]["alertname"] in (P99.name, P50.name)
                assert a["startsAt"].endswith("Z") and a["endsAt"].endswith("Z")
        assert p["commonLabels"]["incident"] == iid and "bucket" not in p["commonLabels"]
        assert "probable_cause" in am[0]["commonAnnotations"]
        mid = am[1]
        statuses = sorted(a["status"] for a in mid["alerts"])
        assert statuses == ["firing", "firing", "firing", "resolved"]
        assert {a["endsAt"] for a in mid["alerts"] if a["status"] == "firing"} == {
            "0001-01-01T00:00:00Z"}
        api = [r.payload for r in rows(s, "alertmanager_api")]
        for p in api:
            assert all(set(a) <= AM_API_ALERT and "alertname" in a["labels"] for a in p)
        assert all("endsAt" not in a for a in api[0])
        assert all("endsAt" in a for a in api[-1])


def test_alertmanager_api_members_are_re_sent_while_the_incident_is_open(
        sessionmaker: sessionmaker[Session]) -> None:
    tg = targets()
    with sessionmaker.begin() as s:
        step(s, at(0), tg, fire=((P99, {"bucket": "64"}),))
        for minute in (1, 2, 3, 4):
            step(s, at(minute), tg)
        api = rows(s, "alertmanager_api")
        generic = rows(s, "generic")
    # resend_s 120: the firing at 0, re-sent at +2 and +4 minutes; the others only once.
    assert len(api) == 3 and len(generic) == 1


def test_the_deliverer_sends_each_incident_notification_once_with_its_key(
        sessionmaker: sessionmaker[Session]) -> None:
    with WebhookReceiver() as rx:
        tg = targets(rx.url)
        with sessionmaker.begin() as s:
            step(s, at(0), tg, fire=((P99, {"bucket": "64"}), (P50, {"bucket": "32"})))
        with Deliverer(sessionmaker, tg, clock=lambda: at(0.5)) as d:
            report = d.run_once()
        with sessionmaker.begin() as s:
            step(s, at(5), tg, recover=((P99, {"bucket": "64"}), (P50, {"bucket": "32"})))
        with Deliverer(sessionmaker, tg, clock=lambda: at(5.5)) as d:
            d.run_once()
    assert report.delivered == 4
    bodies: list[dict[str, Any]] = [d.body for d in rx.deliveries() if d.ok]
    # Two keys (firing, resolved), each delivered once to each of the 4 targets.
    assert len(bodies) == 8 and sorted(rx.accepted.values()) == [4, 4]
    generic = [b for b in bodies if isinstance(b, dict) and b.get("kind") == "incident"]
    assert [b["status"] for b in generic] == ["firing", "resolved"]


def test_a_member_resolving_alone_is_an_update_for_alertmanager_only(
        sessionmaker: sessionmaker[Session]) -> None:
    tg = targets()
    with sessionmaker.begin() as s:
        step(s, at(0), tg, fire=((P99, {"bucket": "64"}), (P99, {"bucket": "32"})))
        step(s, at(6), tg, recover=((P99, {"bucket": "32"}),))  # group_interval passed
        step(s, at(7), tg)  # nothing changed since: no update
        step(s, at(8), tg, recover=((P99, {"bucket": "64"}),))
        am = [r.payload for r in rows(s, "alertmanager")]
        generic = [r.payload for r in rows(s, "generic")]
    assert [(p["status"], sorted(a["status"] for a in p["alerts"])) for p in am] == [
        ("firing", ["firing", "firing"]), ("firing", ["firing", "resolved"]),
        ("resolved", ["resolved", "resolved"])]
    assert [p["incident"]["notification"] for p in generic] == ["firing", "resolved"]


def test_a_page_joining_a_warning_incident_is_sent_to_every_target_once(
        sessionmaker: sessionmaker[Session]) -> None:
    """Receivers first heard a warning; the page that joins is not left to the updates
    (which generic and slack do not get): every target hears the escalation, once."""
    tg = targets()
    with sessionmaker.begin() as s:
        step(s, at(0), tg, fire=((P50, {"bucket": "64"}),))  # a warning opens it
        step(s, at(1), tg, fire=((P99, {"bucket": "64"}),))  # a page joins
        step(s, at(2), tg, fire=((P99, {"bucket": "32"}),))  # another page: no second one
        step(s, at(20), tg, recover=((P50, {"bucket": "64"}), (P99, {"bucket": "64"}),
                                     (P99, {"bucket": "32"})))
        inc = s.scalars(select(Incident)).one()
        assert inc.severity == "page" and inc.notified_severity == "page"
        for fmt in ("generic", "slack"):
            sent = [r.payload for r in rows(s, fmt)]
            assert len(sent) == 3, (fmt, sent)
        generic = [r.payload for r in rows(s, "generic")]
        assert [p["incident"]["notification"] for p in generic] == [
            "firing", "escalated", "resolved"]
        assert [p["incident"]["severity"] for p in generic[:2]] == ["warning", "page"]
        assert "escalated to page" in generic[1]["title"]
        slack = [r.payload for r in rows(s, "slack")]
        assert "escalated to page" in slack[1]["text"]
        # Slack readers are told whether it pages, not left to infer it from rule names.
        assert [[f["text"] for b in p["blocks"] for f in b.get("fields", [])]
                for p in slack[:2]] == [["*Severity:* warning"], ["*Severity:* page"]]
        am = [r.payload for r in rows(s, "alertmanager")]
        assert [p["status"] for p in am] == ["firing", "firing", "resolved"]
        assert {a["labels"]["severity"] for a in am[1]["alerts"]} == {"warning", "page"}


def test_a_page_that_ends_while_warnings_go_on_is_deescalated_to_every_target_once(
        sessionmaker: sessionmaker[Session]) -> None:
    """A page joined a warning's incident and resolved; the warning goes on (a drift can
    hold it for days). Every target hears the page is over, once; a page coming back
    escalates again under a new key; the incident's end is its one resolved."""
    tg = targets()
    with sessionmaker.begin() as s:
        step(s, at(0), tg, fire=((P50, {"bucket": "64"}),))  # a warning opens it
        step(s, at(1), tg, fire=((P99, {"bucket": "64"}),))  # a page joins: escalated
        step(s, at(8), tg, recover=((P99, {"bucket": "64"}),))  # the page ends: deescalated
        step(s, at(9), tg)  # nothing changed: nothing sent
        step(s, at(30), tg, fire=((P99, {"bucket": "32"}),))  # a page again: escalated
        step(s, at(40), tg, recover=((P50, {"bucket": "64"}), (P99, {"bucket": "32"})))
        inc = s.scalars(select(Incident)).one()
        assert inc.state == "resolved" and inc.severity == "page"
        generic = [r.payload for r in rows(s, "generic")]
        assert [(p["incident"]["notification"], p["incident"]["severity"]) for p in generic] == [
            ("firing", "warning"), ("escalated", "page"), ("deescalated", "warning"),
            ("escalated", "page"), ("resolved", "page")]
        assert generic[2]["status"] == "firing"
        assert "de-escalated to warning: no page firing" in generic[2]["title"]
        assert len({p["idempotency_key"] for p in generic}) == 5
        slack = [r.payload for r in rows(s, "slack")]
        assert len(slack) == 5 and "de-escalated to warning" in slack[2]["text"]
        am = [r.payload for r in rows(s, "alertmanager")]
        down = am[[p["idempotencyKey"] for p in am].index(generic[2]["idempotency_key"])]
        assert down["status"] == "firing" and sorted(
            (a["labels"]["severity"], a["status"]) for a in down["alerts"]) == [
            ("page", "resolved"), ("warning", "firing")]
        api = [r.payload for r in rows(s, "alertmanager_api")]
        assert generic[2]["idempotency_key"] in {
            p[0]["annotations"]["idempotency_key"] for p in api}
        kinds = [e.kind for e in inc.events]
        assert kinds.count("deescalated") == 1


def test_a_flapping_page_changes_the_severity_at_most_once_per_group_interval(
        sessionmaker: sessionmaker[Session]) -> None:
    """A warning goes on while a page member fires and resolves every other minute. The
    first escalation goes out at once; after it, one severity change per group_interval
    (5 minutes), stating the severity in force then: not one per flap."""
    tg = targets()
    with sessionmaker.begin() as s:
        step(s, at(0), tg, fire=((P50, {"bucket": "64"}),))  # a warning opens it
        for minute in range(1, 13):
            flap = ((P99, {"bucket": "64"}),)
            if minute % 2:
                step(s, at(minute), tg, fire=flap)
            else:
                step(s, at(minute), tg, recover=flap)
        sent = {fmt: [(r.created_at, r.payload) for r in rows(s, fmt)] for fmt in FORMATS}
    generic = [(when, p["incident"]["notification"], p["incident"]["severity"])
               for when, p in sent["generic"]]
    assert generic == [(at(0), "firing", "warning"), (at(1), "escalated", "page"),
                       (at(6), "deescalated", "warning"), (at(11), "escalated", "page")]
    for fmt in ("slack", "alertmanager"):
        assert [when for when, _ in sent[fmt]] == [at(0), at(1), at(6), at(11)], fmt
