"""GET /v1/deliveries and POST /v1/deliveries/{id}/retry: the webhook outbox, dead letters first.

Nothing is dropped silently: a notification a receiver refused (4xx) or that stayed
undelivered past `alerts.webhook_max_age_s` is a dead letter, listed here and retryable.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from alerts.outbox import retry_dead
from monitor.api.deps import ReaderDep, SessionsDep, WriterDep
from monitor.api.errors import NotFound
from storage.db import reading
from storage.models import WebhookDelivery
from storage.queries.deliveries import list_deliveries, shown_state

log = logging.getLogger(__name__)
router = APIRouter(tags=["alerts"])
_MAX_ID = 2**31 - 1  # the column is a 32-bit integer on PostgreSQL


class DeliveryOut(BaseModel):
    """One outbox row: a notification to one webhook target."""

    id: int
    target: str
    state: Literal["pending", "delivered", "dead", "superseded"]
    attempts: int
    last_status: int | None
    last_error: str | None
    alert_id: int | None
    idempotency_key: str
    created_at: datetime
    next_attempt_at: datetime
    delivered_at: datetime | None
    retried_at: datetime | None

    @classmethod
    def of(cls, row: WebhookDelivery) -> DeliveryOut:
        """Return the API view of `row`."""
        return cls(id=row.id, target=row.target, state=shown_state(row.state),
                   attempts=row.attempts, last_status=row.last_status,
                   last_error=row.last_error, alert_id=row.alert_id,
                   idempotency_key=row.idempotency_key, created_at=row.created_at,
                   next_attempt_at=row.next_attempt_at, delivered_at=row.delivered_at,
                   retried_at=row.retried_at)


@router.get("/v1/deliveries")
def get_deliveries(
    sessions: SessionsDep,
    _actor: ReaderDep,
    state: Annotated[Literal["pending", "delivered", "dead", "superseded", "all"],
                     Query(description="dead = refused (4xx) or given up after the max age")
                     ] = "dead",
    target: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[DeliveryOut]:
    """Return webhook deliveries in `state`, newest first."""
    with reading(sessions) as session:
        return [DeliveryOut.of(r) for r in list_deliveries(session, state=state, target=target,
                                                           limit=limit)]


@router.post("/v1/deliveries/{delivery_id}/retry", responses={
    404: {"description": "No such delivery"},
    409: {"description": "The delivery is pending or delivered"},
})
def retry_delivery(sessions: SessionsDep, actor: WriterDep,
                   delivery_id: Annotated[int, Path(ge=1, le=_MAX_ID)]) -> DeliveryOut:
    """Queue a dead (or superseded) delivery again, due now; its max age restarts."""
    with sessions.begin() as session:
        try:
            row = retry_dead(session, delivery_id, datetime.now(UTC))
        except LookupError as exc:
            raise NotFound("delivery_id", str(exc)) from None
        except ValueError as exc:
            raise HTTPException(409, str(exc).removeprefix("id: ")) from None
        log.info("webhook delivery %d retried by %s", delivery_id, actor)
        return DeliveryOut.of(row)
