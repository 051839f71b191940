"""Flag rows and their audit trail."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.models import Flag, FlagAudit


def flag_row(session: Session, name: str, scope: str, source: str) -> Flag | None:
    """Return the flag row of one name, scope and source, if any."""
    return session.scalars(select(Flag).where(Flag.name == name, Flag.scope == scope,
                                              Flag.source == source)).first()


def flag_rows(session: Session) -> list[Flag]:
    """Return every flag row, by name, scope and source."""
    return list(session.scalars(select(Flag).order_by(Flag.name, Flag.scope, Flag.source)))


def expired_flags(session: Session, now: datetime) -> list[Flag]:
    """Return the flag rows whose expires_at has passed at `now`."""
    return list(session.scalars(select(Flag).where(Flag.expires_at.is_not(None),
                                                   Flag.expires_at <= now)))


def flag_audits(session: Session, name: str | None = None, scope: str | None = None, *,
                since: datetime | None = None, until: datetime | None = None,
                limit: int | None = 100, oldest_first: bool = False) -> list[FlagAudit]:
    """Return audit rows (newest first unless oldest_first), filtered as given."""
    a = FlagAudit
    order = (a.at, a.id) if oldest_first else (a.at.desc(), a.id.desc())
    q = select(a).order_by(*order)
    if limit is not None:
        q = q.limit(limit)
    if name is not None:
        q = q.where(a.name == name)
    if scope is not None:
        q = q.where(a.scope == scope)
    if since is not None:
        q = q.where(a.at >= since)
    if until is not None:
        q = q.where(a.at < until)
    return list(session.scalars(q))
