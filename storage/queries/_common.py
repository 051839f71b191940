"""Helpers shared by the query modules (windows, ratios, dialect expressions)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ColumnElement, Select, SQLColumnExpression, func
from sqlalchemy.orm import Session

from storage.db import dialect_name
from storage.errors import InvalidQuery
from storage.models import (
    ProbeResult,
    ProbeRun,
)


def _check_window(start: datetime, end: datetime) -> None:
    if end <= start:
        raise InvalidQuery("end", f"must be after start ({start.isoformat()})", value=end)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _day(session: Session, column: SQLColumnExpression[datetime]) -> ColumnElement[str]:
    """Return an expression giving the UTC day of `column` as 'YYYY-MM-DD'."""
    if dialect_name(session) == "sqlite":
        return func.substr(column, 1, 10)  # stored as naive UTC text
    return func.to_char(func.timezone("UTC", column), "YYYY-MM-DD")


def _json_sums(column: SQLColumnExpression[list[int]], n: int) -> list[ColumnElement[int]]:
    """Return per-index sums of a JSON count-list column (missing entries count 0)."""
    return [func.coalesce(func.sum(column[i].as_integer()), 0) for i in range(n)]


def _bucket_order(bucket: str) -> tuple[int, str]:
    return (int(bucket), "") if bucket.isdigit() else (1 << 30, bucket)


def _by_instance(stmt: Select, instance_id: str | None) -> Select:
    if instance_id is None:
        return stmt
    return stmt.join(ProbeRun, ProbeRun.id == ProbeResult.run_id).where(
        ProbeRun.instance_id == instance_id
    )
