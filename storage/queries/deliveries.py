"""Delivery-listing reads: the webhook outbox rows an operator inspects.

States as operators name them: "dead" is the stored "failed" (a 4xx answer, or given up
after the max age), "all" is every state.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.models import WebhookDelivery

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
