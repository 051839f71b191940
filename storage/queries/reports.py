"""Stored weekly reports and the webhook outbox's state counts."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from storage.models import Report, WebhookDelivery


def report_for_week(session: Session, week: str) -> Report | None:
    """Return the stored report of an ISO week ("2026-W48"), if any."""
    return session.scalars(select(Report).where(Report.week == week)).first()


def list_reports(session: Session, *, limit: int = 52) -> list[Report]:
    """Return stored reports, newest week first."""
    return list(session.scalars(select(Report).order_by(Report.week.desc()).limit(limit)))


def delivery_counts(session: Session) -> dict[str, int]:
    """Return outbox rows counted by state (states without rows left out)."""
    rows = session.execute(select(WebhookDelivery.state, func.count())
                           .group_by(WebhookDelivery.state))
    return {state: int(n) for state, n in rows}


def report_by_id(session: Session, report_id: int) -> Report | None:
    """Return one stored report, if any."""
    return session.get(Report, report_id)
