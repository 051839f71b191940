"""Whole tables of a window as DataFrames, for `tailwatch export` and notebooks."""

from __future__ import annotations

import json
from datetime import datetime

import pandas as pd
from sqlalchemy import JSON, select
from sqlalchemy.orm import Session

from storage.errors import InvalidQuery
from storage.models import (
    Alert,
    Base,
    BatchRollup,
    FlagAudit,
    ProbeResult,
    TrafficRollup,
    UTCDateTime,
)
from storage.queries.week import frame

# table name -> (model, the time column a window filters on)
EXPORT_TABLES: dict[str, tuple[type[Base], str]] = {
    "probe_results": (ProbeResult, "at"),
    "traffic_rollups": (TrafficRollup, "minute"),
    "batch_rollups": (BatchRollup, "minute"),
    "alerts": (Alert, "started_at"),
    "flag_audits": (FlagAudit, "at"),
}


def table_frame(session: Session, table: str, since: datetime) -> pd.DataFrame:
    """Return every column of `table`'s rows at or after `since`, oldest first.

    Timestamps are UTC datetimes; JSON columns (histograms, labels) are JSON text, so
    CSV and Parquet hold the same values and a reader parses them with json.loads.
    """
    if table not in EXPORT_TABLES:
        raise InvalidQuery("table", f"must be one of {', '.join(EXPORT_TABLES)}", value=table)
    model, time_column = EXPORT_TABLES[table]
    columns = model.__table__.columns
    when = getattr(model, time_column)
    stmt = select(*columns).where(when >= since).order_by(when, model.id)  # type: ignore[attr-defined]
    times = tuple(c.key for c in columns if isinstance(c.type, UTCDateTime))
    df = frame(session, stmt, times)
    for c in columns:
        if isinstance(c.type, JSON):
            df[c.key] = df[c.key].map(lambda v: None if v is None else json.dumps(v))
    return df
