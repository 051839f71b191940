"""Webhook targets and the payload formats they receive.

Formats (an incident's notification, `alerts.incidents`, in brackets):
    generic           {"idempotency_key", "kind", "status", "title", "text", "alert"}
                      [kind "incident"; "incident": id, summary, probable_cause,
                      evidence, members]
    alertmanager      Alertmanager's webhook payload, version "4" (what a receiver of
                      Alertmanager expects: version, groupKey, truncatedAlerts, status,
                      receiver, groupLabels, commonLabels, commonAnnotations, externalURL,
                      alerts[{status, labels, annotations, startsAt, endsAt, generatorURL,
                      fingerprint}]) plus "idempotencyKey" (receivers ignore unknown fields)
                      [one group per incident: groupLabels {"incident": id}, every
                      member in alerts[] with the label incident=<id>]
    slack             an incoming-webhook message {"text", "blocks"}
    alertmanager_api  the JSON array Alertmanager's POST /api/v2/alerts takes; a firing
                      alert is re-sent periodically, or Alertmanager resolves it itself

Payloads are built once, when the notification enters the outbox, so every retry sends
the same bytes under the same idempotency key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import Field, StrictBool, StrictStr, StringConstraints, field_validator

from alerts.durations import parse_duration
from alerts.errors import WebhookConfigError
from alerts.schema import Entry, validate

FORMATS = ("generic", "alertmanager", "slack", "alertmanager_api")
SIGNATURE_HEADER = "X-Tailwatch-Signature"
IDEMPOTENCY_HEADER = "Idempotency-Key"
# Alertmanager's zero time: an alert with no known end.
ZERO_TIME = "0001-01-01T00:00:00Z"


@dataclass(frozen=True)
class WebhookTarget:
    """One configured receiver; `messages` says whether it gets non-alert messages."""

    name: str
    url: str
    format: str = "generic"
    secret: str | None = field(default=None, repr=False)
    timeout_s: float = 5.0
    messages: bool = True
    headers: Mapping[str, str] = field(default_factory=dict)
    # Added to every notification's labels (service, job, instance: see source_labels).
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class AlertInfo:
    """The alert a notification is about (what formatters read)."""

    alert_id: int
    rule: str
    fingerprint: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    severity: str
    status: str  # firing | resolved
    starts_at: datetime
    ends_at: datetime | None
    value: float | None = None
    baseline: float | None = None
    relative_change: float | None = None
    threshold: float | None = None


@dataclass(frozen=True)
class IncidentInfo:
    """The incident a notification is about (alerts.incidents): its members and cause.

    kind: firing (opened or reopened), update (members joined or left), escalated (a
    more severe member joined: sent to every target), deescalated (no page member fires
    any more, warnings do: sent to every target), resend (for alertmanager_api) or
    resolved. severity: the incident's highest; for escalated and deescalated the one
    now in force.
    """

    incident_id: int
    status: str  # firing | resolved
    kind: str
    summary: str
    cause: str
    cause_text: str
    evidence: Mapping[str, Any]
    severity: str
    families: tuple[str, ...]
    started_at: datetime
    ends_at: datetime | None
    members: tuple[AlertInfo, ...]


@dataclass(frozen=True)
class Notification:
    """One thing to tell receivers: an alert transition, an incident or a plain message.

    An incident's notification carries its first member as `alert` (status: the
    incident's) and every member in `incident`.
    """

    key: str
    title: str
    text: str
    at: datetime
    alert: AlertInfo | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    incident: IncidentInfo | None = None

    @property
    def status(self) -> str:
        """Return "firing", "resolved" or "message"."""
        return self.alert.status if self.alert is not None else "message"


class TargetEntry(Entry):
    """One `alerts.webhooks` entry as written in settings; `parse_targets` validates it."""

    name: Annotated[str, StringConstraints(strip_whitespace=False, min_length=1, max_length=64)]
    url: str
    format: str = "generic"
    secret: Annotated[str, StringConstraints(min_length=1)] | None = None
    timeout: float = 5.0
    messages: StrictBool | None = None  # default: every format but alertmanager_api
    headers: dict[str, StrictStr] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v.strip():
            raise ValueError(f"must be 1-64 characters, got {v!r}")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"must be an http(s) URL, got {v!r}")
        return v

    @field_validator("format")
    @classmethod
    def _format(cls, v: str) -> str:
        if v not in FORMATS:
            raise ValueError(f"must be one of {', '.join(FORMATS)}, got {v!r}")
        return v

    @field_validator("timeout", mode="before")
    @classmethod
    def _timeout(cls, v: object) -> float:
        timeout = parse_duration(v)
        if not 0 < timeout <= 120:
            raise ValueError(f"must be within (0, 120] seconds, got {timeout}")
        return timeout

    @field_validator("headers", mode="before")
    @classmethod
    def _headers(cls, v: object) -> object:
        return v or {}

    def to_target(self) -> WebhookTarget:
        """Return the WebhookTarget this entry describes."""
        messages = self.format != "alertmanager_api" if self.messages is None else self.messages
        return WebhookTarget(name=self.name, url=self.url, format=self.format,
                             secret=self.secret, timeout_s=self.timeout, messages=messages,
                             headers=dict(self.headers))


def parse_targets(raw: Sequence[Mapping[str, Any]] | None, source: str = "alerts.webhooks"
                  ) -> list[WebhookTarget]:
    """Validate `alerts.webhooks` entries; raise WebhookConfigError naming target and field."""
    out: list[WebhookTarget] = []
    seen: set[str] = set()
    for i, item in enumerate(raw or []):
        entry = f"webhook #{i + 1}"
        if not isinstance(item, Mapping):
            raise WebhookConfigError(source, entry, "webhook", "must be a mapping")
        name = item.get("name")
        if not isinstance(name, str) or not name.strip() or len(name) > 64:
            raise WebhookConfigError(source, entry, "name", f"must be 1-64 characters, got {name!r}")
        entry = f"webhook {name!r}"
        if name in seen:
            raise WebhookConfigError(source, entry, "name", "is used twice")
        seen.add(name)
        target = validate(TargetEntry, dict(item), WebhookConfigError, source, entry,
                          nested=False)
        out.append(target.to_target())
    return out


def source_labels(host: str, port: int, *, job: str = "tailwatch",
                  service: str = "tailwatch") -> dict[str, str]:
    """Return the labels naming this process as Prometheus does: service, job, instance.

    Prometheus' `instance` is the scrape target "host:port"; a wildcard bind address
    is scraped under the machine's name, so that stands in for it.
    """
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostname()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6, as Prometheus writes it
    return {"service": service, "job": job, "instance": f"{host}:{port}"}


def with_labels(targets: Sequence[WebhookTarget], labels: Mapping[str, str]
                ) -> list[WebhookTarget]:
    """Return `targets` whose notifications carry `labels` too."""
    return [replace(t, labels={**labels, **t.labels}) for t in targets]


def generator_url(external_url: str, alert_id: int | None) -> str:
    """Return the link to an alert (GET /v1/alerts/{id}), or the service URL for messages."""
    if alert_id is None or not external_url:
        return external_url
    return f"{external_url.rstrip('/')}/v1/alerts/{alert_id}"


def group_key(labels: Mapping[str, str]) -> str:
    """Return Alertmanager's groupKey for one alert scope: `{}:{k="v",...}` sorted."""
    inner = ",".join(f"{k}={json.dumps(labels[k])}" for k in sorted(labels))
    return "{}:{" + inner + "}"


def payload_status(fmt: str, payload: Any) -> str:
    """Return "firing", "resolved" or "message" for a stored payload of format `fmt`."""
    if fmt == "alertmanager_api":
        item = payload[0] if isinstance(payload, list) and payload else {}
        return "resolved" if "endsAt" in item else "firing"
    if fmt == "slack":
        return "resolved" if "[RESOLVED]" in str(payload.get("text", "")) else "firing"
    return str(payload.get("status", "firing"))


def rfc3339(t: datetime | None) -> str:
    """Return `t` as RFC 3339 UTC with a Z, or Alertmanager's zero time for None."""
    if t is None:
        return ZERO_TIME
    return t.astimezone(UTC).isoformat().replace("+00:00", "Z")


def body_bytes(payload: Any) -> bytes:
    """Return the exact bytes sent for a payload (stable across retries)."""
    return json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()


def signature(secret: str, body: bytes) -> str:
    """Return the X-Tailwatch-Signature value: sha256=<hex HMAC-SHA256 of the body>."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify_signature(secret: str, body: bytes, header: str | None) -> bool:
    """Return whether `header` is the signature of `body` (constant-time compare)."""
    return header is not None and hmac.compare_digest(signature(secret, body), header)


def _am_labels(n: Notification, static: Mapping[str, str]) -> dict[str, str]:
    if n.alert is None:
        return {"alertname": "TailwatchMessage", "severity": "info", **static, **n.labels}
    return {"alertname": n.alert.rule, "severity": n.alert.severity, **static,
            **n.alert.labels}


def _am_annotations(n: Notification) -> dict[str, str]:
    base = {"summary": n.title, "description": n.text}
    if n.alert is not None:
        base = {**base, **n.alert.annotations}
    return base


def _am_alert(n: Notification, generator_url: str, static: Mapping[str, str]
              ) -> dict[str, Any]:
    a = n.alert
    return {
        "status": "resolved" if a is not None and a.status == "resolved" else "firing",
        "labels": _am_labels(n, static),
        "annotations": _am_annotations(n),
        "startsAt": rfc3339(a.starts_at if a is not None else n.at),
        "endsAt": rfc3339(a.ends_at if a is not None else n.at),
        "generatorURL": generator_url,
        "fingerprint": a.fingerprint if a is not None else n.key[:16],
    }


def incident_url(external_url: str, incident_id: int) -> str:
    """Return the link to an incident (GET /v1/incidents/{id})."""
    return f"{external_url.rstrip('/')}/v1/incidents/{incident_id}" if external_url else ""


def _member_labels(inc: IncidentInfo, a: AlertInfo, static: Mapping[str, str]
                   ) -> dict[str, str]:
    return {"alertname": a.rule, "severity": a.severity, **static, **a.labels,
            "incident": str(inc.incident_id)}


def _incident_annotations(inc: IncidentInfo) -> dict[str, str]:
    return {"summary": inc.summary, "description": inc.summary,
            "probable_cause": inc.cause_text, "cause": inc.cause}


def _member_alert(inc: IncidentInfo, a: AlertInfo, external_url: str,
                  static: Mapping[str, str]) -> dict[str, Any]:
    # A member resolved while the incident goes on is resolved; all are, once it is.
    resolved = inc.status == "resolved" or a.status == "resolved"
    ends = a.ends_at or inc.ends_at
    return {
        "status": "resolved" if resolved else "firing",
        "labels": _member_labels(inc, a, static),
        "annotations": {**a.annotations, **_incident_annotations(inc)},
        "startsAt": rfc3339(a.starts_at),
        "endsAt": rfc3339(ends if resolved else None),
        "generatorURL": generator_url(external_url, a.alert_id),
        "fingerprint": a.fingerprint,
    }


def _incident_payload(target: WebhookTarget, n: Notification, inc: IncidentInfo,
                      external_url: str) -> Any:
    static = target.labels
    # Firing members first: payload_status reads an alertmanager_api payload's first item.
    members = sorted(inc.members, key=lambda a: (a.status == "resolved", a.alert_id))
    alerts = [_member_alert(inc, a, external_url, static) for a in members]
    if target.format == "alertmanager":
        group = {"incident": str(inc.incident_id)}
        common = dict(alerts[0]["labels"])
        for a in alerts[1:]:
            common = {k: v for k, v in common.items() if a["labels"].get(k) == v}
        return {
            "version": "4", "groupKey": group_key(group), "truncatedAlerts": 0,
            "status": inc.status, "receiver": target.name, "groupLabels": group,
            "commonLabels": common, "commonAnnotations": _incident_annotations(inc),
            "externalURL": external_url, "alerts": alerts, "idempotencyKey": n.key,
        }
    if target.format == "alertmanager_api":
        for a in alerts:
            a.pop("status")
            a.pop("fingerprint")
            a["annotations"]["idempotency_key"] = n.key
            if a["endsAt"] == ZERO_TIME:
                a.pop("endsAt")  # Alertmanager applies resolve_timeout until re-sent
        return alerts
    if target.format == "slack":
        return _slack_incident(n, inc, incident_url(external_url, inc.incident_id))
    return {
        "idempotency_key": n.key, "kind": "incident", "status": inc.status, "title": n.title,
        "text": n.text, "at": rfc3339(n.at), "labels": {**static, **n.labels},
        "alert": _generic_alert(n.alert, external_url),
        "incident": {
            "id": inc.incident_id, "status": inc.status, "notification": inc.kind,
            "summary": inc.summary, "cause": inc.cause, "probable_cause": inc.cause_text,
            "evidence": dict(inc.evidence), "severity": inc.severity,
            "families": list(inc.families), "startsAt": rfc3339(inc.started_at),
            "endsAt": rfc3339(inc.ends_at) if inc.ends_at else None,
            "members": [_generic_alert(a, external_url) for a in inc.members],
            "url": incident_url(external_url, inc.incident_id) or None,
        },
    }


def _generic_alert(a: AlertInfo | None, external_url: str) -> dict[str, Any] | None:
    if a is None:
        return None
    gen = generator_url(external_url, a.alert_id)
    return {
        "id": a.alert_id, "rule": a.rule, "fingerprint": a.fingerprint,
        "labels": dict(a.labels), "annotations": dict(a.annotations),
        "severity": a.severity, "status": a.status, "startsAt": rfc3339(a.starts_at),
        "endsAt": rfc3339(a.ends_at) if a.ends_at else None, "value": a.value,
        "baseline": a.baseline, "relative_change": a.relative_change,
        "threshold": a.threshold, "url": gen or None,
    }


def _slack_incident(n: Notification, inc: IncidentInfo, url: str) -> dict[str, Any]:
    icon = (":white_check_mark:" if inc.status == "resolved" else
            ":arrow_down:" if inc.kind == "deescalated" else ":rotating_light:")
    head = f"{icon} [{inc.status.upper()}] {n.title}"
    lines = []
    for a in inc.members:
        where = ", ".join(f"{k}={v}" for k, v in sorted(a.labels.items())) or "all"
        change = f" {a.relative_change:+.1%}" if a.relative_change is not None else ""
        lines.append(f"• `{a.rule}` ({where}){change} {a.status}")
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": head[:150], "emoji": True}},
        {"type": "section", "text": {"type": "mrkdwn", "text": n.text[:2900] or " "}},
        {"type": "section", "text": {"type": "mrkdwn",
                                     "text": ("*Members:*\n" + "\n".join(lines))[:2900]}},
        # Whether it pages: a member held as a warning (a young series) is not its rule's
        # severity, so the reader is told, not left to infer it from the rule names.
        {"type": "section", "fields": [{"type": "mrkdwn", "text": f"*Severity:* {inc.severity}"}]},
    ]
    ctx = f"tailwatch · key {n.key}" + (f" · <{url}|details>" if url else "")
    blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": ctx}]})
    return {"text": head, "blocks": blocks, "idempotency_key": n.key}


def format_payload(target: WebhookTarget, n: Notification, *, external_url: str = "") -> Any:
    """Return the JSON payload `target` receives for notification `n`."""
    if n.incident is not None and n.incident.members:
        return _incident_payload(target, n, n.incident, external_url)
    gen = generator_url(external_url, n.alert.alert_id if n.alert is not None else None)
    static = target.labels
    if target.format == "alertmanager":
        labels = _am_labels(n, static)
        # One group per alert scope (rule + scope labels): resolving bucket 64 can never
        # close bucket 32's incident at a receiver keyed on groupKey.
        scope = n.alert.labels if n.alert is not None else n.labels
        group = {"alertname": labels["alertname"], **scope}
        return {
            "version": "4",
            "groupKey": group_key(group),
            "truncatedAlerts": 0,
            "status": "resolved" if n.status == "resolved" else "firing",
            "receiver": target.name,
            "groupLabels": group,
            "commonLabels": labels,
            "commonAnnotations": _am_annotations(n),
            "externalURL": external_url,
            "alerts": [_am_alert(n, gen, static)],
            "idempotencyKey": n.key,
        }
    if target.format == "alertmanager_api":
        item = _am_alert(n, gen, static)
        item.pop("status")
        item.pop("fingerprint")
        item["annotations"] = {**item["annotations"], "idempotency_key": n.key}
        if n.alert is not None and n.alert.status == "firing":
            item.pop("endsAt")  # Alertmanager applies resolve_timeout until re-sent
        return [item]
    if target.format == "slack":
        return _slack(n, gen)
    a = n.alert
    return {
        "idempotency_key": n.key,
        "kind": "alert" if a is not None else "message",
        "status": n.status,
        "title": n.title,
        "text": n.text,
        "at": rfc3339(n.at),
        "labels": {**static, **n.labels},
        "alert": _generic_alert(a, external_url),
    }


def _slack(n: Notification, url: str) -> dict[str, Any]:
    a = n.alert
    icon = {"firing": ":rotating_light:", "resolved": ":white_check_mark:"}.get(n.status, ":memo:")
    head = f"{icon} [{n.status.upper()}] {n.title}" if a is not None else f"{icon} {n.title}"
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": head[:150], "emoji": True}},
        {"type": "section", "text": {"type": "mrkdwn", "text": n.text[:2900] or " "}},
    ]
    if a is not None:
        facts = [f"*Rule:* `{a.rule}`", f"*Severity:* {a.severity}"]
        facts += [f"*{k}:* {v}" for k, v in sorted(a.labels.items())]
        if a.relative_change is not None:
            facts.append(f"*Change:* {a.relative_change:+.1%}")
        blocks.append({"type": "section",
                       "fields": [{"type": "mrkdwn", "text": f} for f in facts[:10]]})
    ctx = f"tailwatch · key {n.key}" + (f" · <{url}|details>" if url else "")
    blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": ctx}]})
    return {"text": head, "blocks": blocks, "idempotency_key": n.key}
