"""Webhook target validation and payload formats."""

from __future__ import annotations

import json
import socket
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from alerts.errors import WebhookConfigError
from alerts.webhooks import (
    AlertInfo,
    Notification,
    WebhookTarget,
    body_bytes,
    format_payload,
    parse_targets,
    payload_status,
    signature,
    source_labels,
    verify_signature,
    with_labels,
)

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
T1 = datetime(2026, 11, 30, 12, 7, 30, tzinfo=UTC)


def alert(status: str = "firing") -> Notification:
    info = AlertInfo(
        alert_id=7, rule="p99_latency_regression", fingerprint="0123456789abcdef",
        labels={"bucket": "64"}, annotations={"summary": "p99 +31%", "description": "slow"},
        severity="page", status=status, starts_at=T0,
        ends_at=T1 if status == "resolved" else None, value=0.131, baseline=0.1,
        relative_change=0.31, threshold=0.15)
    return Notification(key="tw-k1", title="p99 (bucket=64) firing", text="slow", at=T1,
                        alert=info)


def target(fmt: str) -> WebhookTarget:
    return WebhookTarget(name="ops", url="http://127.0.0.1:9/hook", format=fmt)


def test_alertmanager_v4_payload_has_exactly_the_documented_fields():
    p = format_payload(target("alertmanager"), alert(), external_url="http://tw:8000")
    assert set(p) == {"version", "groupKey", "truncatedAlerts", "status", "receiver",
                      "groupLabels", "commonLabels", "commonAnnotations", "externalURL",
                      "alerts", "idempotencyKey"}
    assert p["version"] == "4" and p["status"] == "firing" and p["receiver"] == "ops"
    assert p["groupKey"] == '{}:{alertname="p99_latency_regression",bucket="64"}'
    assert p["truncatedAlerts"] == 0 and p["externalURL"] == "http://tw:8000"
    assert p["groupLabels"] == {"alertname": "p99_latency_regression", "bucket": "64"}
    assert p["commonLabels"] == {"alertname": "p99_latency_regression", "severity": "page",
                                 "bucket": "64"}
    (a,) = p["alerts"]
    assert set(a) == {"status", "labels", "annotations", "startsAt", "endsAt",
                      "generatorURL", "fingerprint"}
    assert a["startsAt"] == "2026-11-30T12:00:00Z"
    assert a["endsAt"] == "0001-01-01T00:00:00Z"  # Alertmanager's zero time: still firing
    assert a["generatorURL"] == "http://tw:8000/v1/alerts/7"  # GET /v1/alerts/{id}
    assert a["fingerprint"] == "0123456789abcdef"
    assert a["annotations"]["summary"] == "p99 +31%"
    assert p["idempotencyKey"] == "tw-k1"
    resolved = format_payload(target("alertmanager"), alert("resolved"))
    assert resolved["status"] == "resolved"
    assert resolved["alerts"][0]["status"] == "resolved"
    assert resolved["alerts"][0]["endsAt"] == "2026-11-30T12:07:30Z"


def test_alertmanager_api_is_a_post_array_with_alertname():
    p = format_payload(target("alertmanager_api"), alert())
    assert isinstance(p, list) and len(p) == 1
    item = p[0]
    assert set(item) == {"labels", "annotations", "startsAt", "generatorURL"}  # no endsAt yet
    assert item["labels"]["alertname"] == "p99_latency_regression"
    assert item["annotations"]["idempotency_key"] == "tw-k1"
    done = format_payload(target("alertmanager_api"), alert("resolved"))[0]
    assert done["endsAt"] == "2026-11-30T12:07:30Z"


def test_slack_and_generic_formats():
    s = format_payload(target("slack"), alert())
    assert s["text"].startswith(":rotating_light: [FIRING]")
    assert [b["type"] for b in s["blocks"]] == ["header", "section", "section", "context"]
    assert "*bucket:* 64" in json.dumps(s["blocks"])
    g = format_payload(target("generic"), alert())
    assert g["idempotency_key"] == "tw-k1" and g["kind"] == "alert"
    assert g["alert"]["relative_change"] == 0.31 and g["alert"]["labels"] == {"bucket": "64"}
    msg = Notification(key="tw-m", title="Weekly report", text="all good", at=T1)
    g = format_payload(target("generic"), msg)
    assert g["kind"] == "message" and g["alert"] is None and g["status"] == "message"
    am = format_payload(target("alertmanager"), msg)
    assert am["commonLabels"]["alertname"] == "TailwatchMessage"


def test_signature_is_hmac_sha256_of_the_exact_body():
    body = body_bytes({"b": 1, "a": [1, 2]})
    assert body == b'{"a":[1,2],"b":1}'
    sig = signature("s3cret", body)
    assert sig.startswith("sha256=") and len(sig) == 7 + 64
    assert verify_signature("s3cret", body, sig)
    assert not verify_signature("other", body, sig)
    assert not verify_signature("s3cret", body + b" ", sig)
    assert not verify_signature("s3cret", body, None)


def test_parse_targets_defaults_and_errors():
    (t,) = parse_targets([{"name": "am", "url": "https://am:9093/api/v2/alerts",
                           "format": "alertmanager_api", "timeout": "2s", "secret": "x"}])
    assert t.timeout_s == 2.0 and t.messages is False and t.secret == "x"
    assert "x" not in repr(t)
    bad = [
        ({"name": "a", "url": "ftp://x"}, "url"),
        ({"name": "a", "url": "http://x", "format": "teams"}, "format"),
        ({"name": "a", "url": "http://x", "timeout": 0}, "timeout"),
        ({"name": "a", "url": "http://x", "secret": ""}, "secret"),
        ({"name": "", "url": "http://x"}, "name"),
        ({"name": "a", "url": "http://x", "retries": 3}, "retries"),
    ]
    for raw, field in bad:
        with pytest.raises(WebhookConfigError) as info:
            parse_targets([raw])
        assert info.value.field == field
    with pytest.raises(WebhookConfigError, match="used twice"):
        parse_targets([{"name": "a", "url": "http://x"}, {"name": "a", "url": "http://y"}])


def test_group_key_is_per_alert_scope():
    def resolved(bucket: str) -> Notification:
        n = alert("resolved")
        info = replace(n.alert, labels={"bucket": bucket})
        return replace(n, alert=info)

    keys = {format_payload(target("alertmanager"), resolved(b))["groupKey"] for b in ("32", "64")}
    assert keys == {'{}:{alertname="p99_latency_regression",bucket="32"}',
                    '{}:{alertname="p99_latency_regression",bucket="64"}'}


def test_alerts_carry_service_job_and_the_prometheus_instance():
    labels = source_labels("127.0.0.1", 8000)
    assert labels == {"service": "tailwatch", "job": "tailwatch", "instance": "127.0.0.1:8000"}
    assert source_labels("0.0.0.0", 9000)["instance"] == f"{socket.gethostname()}:9000"
    assert source_labels("::1", 8000)["instance"] == "[::1]:8000"
    (t,) = with_labels([target("alertmanager")], labels)
    am = format_payload(t, alert())
    assert am["commonLabels"] == {"alertname": "p99_latency_regression", "severity": "page",
                                  **labels, "bucket": "64"}
    assert am["alerts"][0]["labels"]["instance"] == "127.0.0.1:8000"
    (api,) = with_labels([target("alertmanager_api")], labels)
    assert format_payload(api, alert())[0]["labels"]["job"] == "tailwatch"
    (gen,) = with_labels([target("generic")], labels)
    g = format_payload(gen, alert())
    assert g["labels"] == labels and g["alert"]["labels"] == {"bucket": "64"}


def test_payload_status_reads_every_format():
    for fmt in ("generic", "alertmanager", "slack", "alertmanager_api"):
        for status in ("firing", "resolved"):
            assert payload_status(fmt, format_payload(target(fmt), alert(status))) == status
