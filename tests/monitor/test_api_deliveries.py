"""Dead letters over HTTP: listed, retried with auth, counted; alert links that resolve."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit

from fastapi.testclient import TestClient

from alerts.outbox import Deliverer, enqueue
from alerts.webhooks import AlertInfo, Notification, WebhookTarget, format_payload
from monitor.hub import services_of
from monitor.loopback import WebhookReceiver
from storage.models import Alert

# Notifications go through the service's real deliverer, whose clock is the wall clock:
# a fixed date would turn into a dead letter (max age 24 h) a day after it was written.
T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=5)


def note(i: int) -> Notification:
    return Notification(key=f"k{i}", title=f"message {i}", text="t", at=T0)


def test_dead_letters_are_listed_counted_and_retried(client: TestClient, auth: dict[str, str]):
    app = client.app
    sessions = services_of(app).sessions
    rx = WebhookReceiver(script=[422])
    with rx:
        url = rx.url
        tgt = WebhookTarget(name="strict", url=url)
        with sessions.begin() as s:
            (row,) = enqueue(s, note(1), [tgt])
            row_id = row.id
        with Deliverer(sessions, [tgt]) as d:
            services_of(app).sink.deliveries(d.run_once())  # as the job does
        registry = services_of(app).metrics.registry
        assert registry.get_sample_value("tailwatch_webhook_dead_letters_total",
                                         {"target": "strict"}) == 1
        dead = client.get("/v1/deliveries", params={"state": "dead"}).json()
        assert [(d["id"], d["target"], d["state"], d["last_status"]) for d in dead] == [
            (row_id, "strict", "dead", 422)]
        assert client.get("/v1/deliveries", params={"state": "pending"}).json() == []
        assert client.post(f"/v1/deliveries/{row_id}/retry").status_code == 401
        retried = client.post(f"/v1/deliveries/{row_id}/retry", headers=auth)
        assert retried.status_code == 200, retried.text
        assert retried.json()["state"] == "pending" and retried.json()["retried_at"]
        with Deliverer(sessions, [tgt]) as d:
            assert d.run_once().delivered == 1
    assert rx.accepted == {"k1": 1}
    again = client.post(f"/v1/deliveries/{row_id}/retry", headers=auth)
    assert again.status_code == 409 and again.json()["error"]["code"] == "conflict"
    missing = client.post("/v1/deliveries/999999/retry", headers=auth)
    assert missing.status_code == 404 and missing.json()["error"]["field"] == "delivery_id"
    huge = client.post("/v1/deliveries/99999999999999999999/retry", headers=auth)
    assert huge.status_code == 422
    bad = client.get("/v1/deliveries", params={"state": "lost"})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "state"


def test_generator_url_points_to_an_existing_alert_route(client: TestClient):
    sessions = services_of(client.app).sessions
    with sessions.begin() as s:
        a = Alert(fingerprint="fp", rule="p99", labels={"bucket": "64"}, severity="page",
                  state="firing", started_at=T0, fired_at=T0, updated_at=T0)
        s.add(a)
        s.flush()
        alert_id = a.id
    info = AlertInfo(alert_id=alert_id, rule="p99", fingerprint="fp", labels={"bucket": "64"},
                     annotations={}, severity="page", status="firing", starts_at=T0, ends_at=None)
    payload = format_payload(WebhookTarget(name="am", url="http://x/y", format="alertmanager"),
                             Notification(key="k", title="t", text="t", at=T0, alert=info),
                             external_url="http://testserver")
    link = urlsplit(payload["alerts"][0]["generatorURL"])
    got = client.get(link.path)
    assert got.status_code == 200 and got.json()["id"] == alert_id
    assert got.json()["labels"] == {"bucket": "64"}
    missing = client.get("/v1/alerts/999999")
    assert missing.status_code == 404 and missing.json()["error"]["field"] == "alert_id"
