"""Delivery-listing reads: the webhook outbox rows an operator inspects.

States as operators name them: "dead" is the stored "failed" (a 4xx answer, or given up
after the max age), "all" is every state.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import Select, and_, func, or_, select
from sqlalchemy.orm import Session

from storage.models import Alert, WebhookDelivery

STATES = ("pending", "delivered", "dead", "superseded", "all")
_STORED = {"pending": "pending", "delivered": "delivered", "dead": "failed",
           "superseded": "superseded"}
_SHOWN = {v: k for k, v in _STORED.items()}


def shown_state(stored: str) -> str:
    """Return the operator's name of a stored delivery state ("failed" -> "dead")."""
    return _SHOWN.get(stored, stored)


def list_deliveries(session: Session, *, state: str = "dead", target: str | None = None,
                    since: datetime | None = None, limit: int = 100) -> list[WebhookDelivery]:
    """Return outbox rows in `state` (one of STATES), newest first."""
    if state not in STATES:
        raise ValueError(f"state: must be one of {', '.join(STATES)}, got {state!r}")
    q = (select(WebhookDelivery)
         .order_by(WebhookDelivery.created_at.desc(), WebhookDelivery.id.desc()).limit(limit))
    if state != "all":
        q = q.where(WebhookDelivery.state == _STORED[state])
    if target is not None:
        q = q.where(WebhookDelivery.target == target)
    if since is not None:
        q = q.where(WebhookDelivery.created_at >= since)
    return list(session.scalars(q))


def dead_letter_reasons(session: Session, since: datetime,
                        until: datetime) -> list[tuple[str, str | None, int, datetime]]:
    """Return (target, reason, count, oldest) of dead letters created in [since, until)."""
    q = (select(WebhookDelivery.target, WebhookDelivery.last_error, func.count(),
                func.min(WebhookDelivery.created_at))
         .where(WebhookDelivery.state == _STORED["dead"], WebhookDelivery.created_at >= since,
                WebhookDelivery.created_at < until)
         .group_by(WebhookDelivery.target, WebhookDelivery.last_error)
         .order_by(WebhookDelivery.target))
    return [(t, e, int(n), oldest) for t, e, n, oldest in session.execute(q)]


_S = TypeVar("_S", bound=Select)


# The outbox's own reads: what the deliverer claims, expires, orders and counts.

def _locked(session: Session, q: _S) -> _S:
    """Lock the selected rows on PostgreSQL, skipping rows another replica holds."""
    if session.get_bind().dialect.name == "postgresql":
        return q.with_for_update(skip_locked=True, of=WebhookDelivery)
    return q


def delivery_exists(session: Session, target: str, key: str) -> bool:
    """Return whether `target` already has a row with idempotency `key`."""
    return session.scalar(select(WebhookDelivery.id).where(
        WebhookDelivery.target == target, WebhookDelivery.idempotency_key == key)) is not None


def due_rows(session: Session, now: datetime, limit: int,
             target: str | None = None) -> list[tuple[WebhookDelivery, str | None]]:
    """Return (row, alert fingerprint) of pending rows due at `now`, oldest first, locked."""
    q = (select(WebhookDelivery, Alert.fingerprint)
         .outerjoin(Alert, Alert.id == WebhookDelivery.alert_id)
         .where(WebhookDelivery.state == "pending", WebhookDelivery.next_attempt_at <= now)
         .order_by(WebhookDelivery.created_at, WebhookDelivery.id)
         .limit(limit))
    if target is not None:
        q = q.where(WebhookDelivery.target == target)
    return [(r, fp) for r, fp in session.execute(_locked(session, q)).all()]


def due_targets(session: Session, now: datetime) -> list[str]:
    """Return the targets that have pending rows due at `now`."""
    return list(session.scalars(
        select(WebhookDelivery.target).distinct()
        .where(WebhookDelivery.state == "pending", WebhookDelivery.next_attempt_at <= now)
        .order_by(WebhookDelivery.target)))


def expired_rows(session: Session, now: datetime, cutoff: datetime) -> list[WebhookDelivery]:
    """Return due pending rows created (or last retried) before `cutoff`, locked."""
    q = select(WebhookDelivery).where(
        WebhookDelivery.state == "pending", WebhookDelivery.next_attempt_at <= now,
        func.coalesce(WebhookDelivery.retried_at, WebhookDelivery.created_at) < cutoff)
    return list(session.scalars(_locked(session, q)))


def older_pending(session: Session, target: str, fingerprint: str, created_at: datetime,
                  row_id: int) -> list[tuple[int, str, Any, datetime]]:
    """Return (id, format, payload, next attempt) of the alert's earlier pending rows."""
    q = (select(WebhookDelivery.id, WebhookDelivery.format, WebhookDelivery.payload,
                WebhookDelivery.next_attempt_at)
         .join(Alert, Alert.id == WebhookDelivery.alert_id)
         .where(WebhookDelivery.target == target, WebhookDelivery.state == "pending",
                Alert.fingerprint == fingerprint,
                or_(WebhookDelivery.created_at < created_at,
                    and_(WebhookDelivery.created_at == created_at,
                         WebhookDelivery.id < row_id)))
         .order_by(WebhookDelivery.created_at, WebhookDelivery.id))
    return [(r.id, r.format, r.payload, r.next_attempt_at) for r in session.execute(q)]


def pending_rows(session: Session, ids: list[int]) -> list[WebhookDelivery]:
    """Return the rows among `ids` that are still pending."""
    return list(session.scalars(select(WebhookDelivery).where(
        WebhookDelivery.id.in_(ids), WebhookDelivery.state == "pending")))


def next_attempt_at(session: Session, row_id: int) -> datetime | None:
    """Return when row `row_id` is next due (None: no such row)."""
    return session.scalar(select(WebhookDelivery.next_attempt_at)
                          .where(WebhookDelivery.id == row_id))


def pending_count(session: Session) -> int:
    """Return how many outbox rows wait for delivery."""
    return int(session.scalar(select(func.count()).select_from(WebhookDelivery)
                              .where(WebhookDelivery.state == "pending")) or 0)
