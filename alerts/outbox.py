"""The webhook outbox: notifications written with the transition, delivered later.

`enqueue_alert` / `enqueue_message` add `WebhookDelivery` rows (one per target) in the
caller's transaction, so a notification exists exactly when its cause was committed.
`Deliverer.run_once()` delivers the due rows:

1. claim: in a short transaction, select due rows (FOR UPDATE SKIP LOCKED on PostgreSQL,
   so two replicas never claim the same row; SQLite has one writer) and push their
   next_attempt_at forward by a lease;
2. send each outside any transaction (a slow receiver never holds a DB lock);
3. record: delivered, failed (4xx other than 408/429: retrying cannot help) or retry
   with exponential backoff and jitter (timeouts, connection errors, 5xx, 408, 429).

State lives in SQL, so a restarted Deliverer resumes where the last one stopped. A crash
between sending and recording re-sends after the lease: delivery is at-least-once (as
Alertmanager's), and the Idempotency-Key header lets receivers drop the duplicate.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from alerts.webhooks import (
    IDEMPOTENCY_HEADER,
    SIGNATURE_HEADER,
    Notification,
    WebhookTarget,
    body_bytes,
    format_payload,
    signature,
)
from storage.models import WebhookDelivery

log = logging.getLogger(__name__)
Clock = Callable[[], datetime]
_RETRY_4XX = (408, 429)


def utcnow() -> datetime:
    """Return the current time, timezone-aware UTC."""
    return datetime.now(UTC)


def notification_key(*parts: object) -> str:
    """Return a stable idempotency key for a notification identified by `parts`."""
    return "tw-" + hashlib.sha256("\x1f".join(map(str, parts)).encode()).hexdigest()[:32]


def enqueue(session: Session, notification: Notification, targets: Iterable[WebhookTarget], *,
            external_url: str = "", alert_id: int | None = None) -> list[WebhookDelivery]:
    """Add one outbox row per target for `notification` (skips rows that already exist)."""
    rows = []
    for t in targets:
        if notification.alert is None and not t.messages:
            continue
        exists = session.scalar(select(WebhookDelivery.id).where(
            WebhookDelivery.target == t.name,
            WebhookDelivery.idempotency_key == notification.key))
        if exists is not None:
            continue
        row = WebhookDelivery(
            target=t.name, url=t.url, format=t.format,
            payload=format_payload(t, notification, external_url=external_url),
            idempotency_key=notification.key, alert_id=alert_id, attempts=0,
            next_attempt_at=notification.at, state="pending", created_at=notification.at)
        session.add(row)
        rows.append(row)
    session.flush()
    return rows


def enqueue_message(session: Session, title: str, text: str,
                    targets: Iterable[WebhookTarget], *, now: datetime | None = None,
                    key: str | None = None, labels: Mapping[str, str] | None = None,
                    external_url: str = "") -> list[WebhookDelivery]:
    """Queue a plain message (e.g. the weekly report summary) to every target that takes them.

    `key` makes repeated calls idempotent (e.g. "report-2026-W48"); by default the key
    derives from the title, text and time.
    """
    if not title or not title.strip():
        raise ValueError("title: must not be empty")
    now = now or utcnow()
    n = Notification(key=key or notification_key("message", title, text, now.isoformat()),
                     title=title, text=text, at=now, labels=dict(labels or {}))
    return enqueue(session, n, targets, external_url=external_url)


@dataclass(frozen=True)
class DeliveryReport:
    """What one run_once did."""

    claimed: int = 0
    delivered: int = 0
    retried: int = 0
    failed: int = 0


@dataclass(frozen=True)
class _Claim:
    id: int
    target: str
    url: str
    payload: Any
    key: str
    attempts: int


class Deliverer:
    """Deliver due outbox rows; safe to run in several replicas at once.

    Example:
        deliverer = Deliverer(sessions, parse_targets(settings.alerts.webhooks))
        deliverer.run_once()   # the scheduler calls this every few seconds
    """

    def __init__(
        self,
        sessions: sessionmaker[Session],
        targets: Sequence[WebhookTarget],
        *,
        transport: httpx.BaseTransport | None = None,
        clock: Clock = utcnow,
        rng: random.Random | None = None,
        batch: int = 50,
        lease_s: float = 120.0,
        backoff_base_s: float = 2.0,
        backoff_max_s: float = 900.0,
    ) -> None:
        self.sessions = sessions
        self.targets = {t.name: t for t in targets}
        self.clock = clock
        self.rng = rng or random.Random()
        self.batch = batch
        self.lease_s = lease_s
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self._client = httpx.Client(transport=transport, follow_redirects=False,
                                    headers={"User-Agent": "tailwatch-webhooks"})

    def close(self) -> None:
        """Close the HTTP client."""
        self._client.close()

    def __enter__(self) -> Deliverer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def backoff_s(self, attempts: int) -> float:
        """Return the wait before attempt `attempts + 1`: capped doubling, jittered 50-100%."""
        delay = min(self.backoff_max_s, self.backoff_base_s * 2 ** max(0, attempts - 1))
        return delay * (0.5 + 0.5 * self.rng.random())

    def claim(self) -> list[_Claim]:
        """Lease the due rows to this deliverer and return them."""
        now = self.clock()
        with self.sessions.begin() as session:
            q = (select(WebhookDelivery)
                 .where(WebhookDelivery.state == "pending", WebhookDelivery.next_attempt_at <= now)
                 .order_by(WebhookDelivery.next_attempt_at, WebhookDelivery.id)
                 .limit(self.batch))
            if session.get_bind().dialect.name == "postgresql":
                q = q.with_for_update(skip_locked=True)
            rows = list(session.scalars(q))
            lease = now + timedelta(seconds=self.lease_s)
            for r in rows:
                r.next_attempt_at = lease
            return [_Claim(r.id, r.target, r.url, r.payload, r.idempotency_key, r.attempts)
                    for r in rows]

    def run_once(self) -> DeliveryReport:
        """Deliver every due row once; return counts."""
        claims = self.claim()
        delivered = retried = failed = 0
        for c in claims:
            outcome = self._deliver(c)
            delivered += outcome == "delivered"
            retried += outcome == "retry"
            failed += outcome == "failed"
        return DeliveryReport(len(claims), delivered, retried, failed)

    def _deliver(self, c: _Claim) -> str:
        target = self.targets.get(c.target)
        status: int | None = None
        if target is None:
            outcome, error = "retry", f"target {c.target!r} is not configured (kept for later)"
        else:
            body = body_bytes(c.payload)
            headers = {"Content-Type": "application/json", IDEMPOTENCY_HEADER: c.key,
                       **target.headers}
            if target.secret:
                headers[SIGNATURE_HEADER] = signature(target.secret, body)
            try:
                resp = self._client.post(target.url, content=body, headers=headers,
                                         timeout=target.timeout_s)
                status = resp.status_code
                if 200 <= status < 300:
                    outcome, error = "delivered", None
                elif 400 <= status < 500 and status not in _RETRY_4XX:
                    outcome, error = "failed", f"HTTP {status}: {resp.text[:200]}"
                else:
                    outcome, error = "retry", f"HTTP {status}: {resp.text[:200]}"
            except httpx.TimeoutException as e:
                outcome, error = "retry", f"timeout after {target.timeout_s:g}s: {type(e).__name__}"
            except httpx.TransportError as e:
                outcome, error = "retry", f"{type(e).__name__}: {e}"
        self._record(c, outcome, status, error)
        if outcome != "delivered":
            log.warning("webhook %s row %d: %s", c.target, c.id, error)
        return outcome

    def _record(self, c: _Claim, outcome: str, status: int | None, error: str | None) -> None:
        now = self.clock()
        with self.sessions.begin() as session:
            row = session.get(WebhookDelivery, c.id)
            if row is None or row.state != "pending":
                return
            row.attempts = c.attempts + 1
            row.last_status = status
            row.last_error = error
            if outcome == "delivered":
                row.state = "delivered"
                row.delivered_at = now
            elif outcome == "failed":
                row.state = "failed"
            else:
                row.next_attempt_at = now + timedelta(seconds=self.backoff_s(row.attempts))


def pending_count(session: Session) -> int:
    """Return how many outbox rows wait for delivery."""
    from sqlalchemy import func

    return int(session.scalar(select(func.count()).select_from(WebhookDelivery)
                              .where(WebhookDelivery.state == "pending")) or 0)
