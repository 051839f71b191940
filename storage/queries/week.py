"""Rows of a window as pandas DataFrames, for readers that analyse windows (the weekly report).

Each function reads with `pandas.read_sql` on the session's connection (inside the
caller's transaction) and returns a frame with the columns its docstring names;
timestamps come back timezone-aware UTC on SQLite and PostgreSQL alike.
"""

from __future__ import annotations

from datetime import datetime

import pandas as pd
from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from storage.models import (
    CompileEvent,
    MemorySample,
    ProbeResult,
    ProbeRun,
    TrafficRollup,
)
from storage.queries._common import _day
from storage.sketches import lengths_add, lengths_items


def frame(session: Session, stmt: Select, time_columns: tuple[str, ...] = ()) -> pd.DataFrame:
    """Return the rows of `stmt` as a DataFrame; `time_columns` become UTC datetimes."""
    if session.autoflush:
        # read_sql runs on the connection, past the ORM: flush as session.execute would.
        session.flush()
    df = pd.read_sql(stmt, session.connection())
    for col in time_columns:
        # SQLite returns naive UTC text; PostgreSQL aware timestamps: one dtype for both.
        df[col] = pd.to_datetime(df[col], utc=True, format="ISO8601")
    return df


def canary_results_frame(session: Session, start: datetime, end: datetime, *, kind: str,
                         variant: str | None = None) -> pd.DataFrame:
    """Return variant, bucket, at, p50_s, p99_s, count of `kind` runs' results in [start, end)."""
    r = ProbeResult
    stmt = (select(r.variant, r.bucket, r.at, r.p50_s, r.p99_s, r.count)
            .join(ProbeRun, ProbeRun.id == r.run_id)
            .where(r.at >= start, r.at < end, ProbeRun.kind == kind))
    if variant is not None:
        stmt = stmt.where(r.variant == variant)
    return frame(session, stmt, ("at",))


def traffic_sums_frame(session: Session, start: datetime, end: datetime) -> pd.DataFrame:
    """Return per UTC day x bucket x path: requests, input/padded tokens, overflow, accepted,
    drafted (`day` a 'YYYY-MM-DD' string; summed in SQL: a week is ~10^5 rollup rows)."""
    t = TrafficRollup
    day = _day(session, t.minute).label("day")
    stmt = (select(day, t.bucket, t.path, func.sum(t.requests).label("requests"),
                   func.sum(t.input_tokens_sum).label("input_tokens"),
                   func.sum(t.padded_tokens_sum).label("padded_tokens"),
                   func.sum(t.overflow).label("overflow"),
                   func.sum(t.accepted_tokens).label("accepted"),
                   func.sum(t.draft_tokens).label("drafted"))
            .where(t.minute >= start, t.minute < end).group_by(day, t.bucket, t.path))
    return frame(session, stmt)


def input_lengths(session: Session, start: datetime, end: datetime) -> list[tuple[int, int]]:
    """Return (input tokens, requests) of the rollup minutes in [start, end), exact, by length."""
    t = TrafficRollup
    counts: dict[str, int] = {}
    for (lens,) in session.execute(select(t.input_lens).where(t.minute >= start, t.minute < end)):
        counts = lengths_add(counts, lens)
    return lengths_items(counts)


def canary_acceptance_frame(session: Session, start: datetime, end: datetime, *,
                            variant: str) -> pd.DataFrame:
    """Return per UTC day ('YYYY-MM-DD') x bucket: accepted and drafted tokens of the canary
    results that drafted, in [start, end)."""
    r = ProbeResult
    day = _day(session, r.at).label("day")
    stmt = (select(day, r.bucket, func.sum(r.accepted_tokens).label("accepted"),
                   func.sum(r.draft_tokens).label("drafted"))
            .where(r.at >= start, r.at < end, r.variant == variant, r.draft_tokens > 0,
                   # canary cycles only: burst rows are load, not canaries
                   r.run_id.in_(select(ProbeRun.id).where(ProbeRun.kind == "cycle")))
            .group_by(day, r.bucket))
    return frame(session, stmt)


def memory_frame(session: Session, start: datetime, end: datetime) -> pd.DataFrame:
    """Return at, rss_bytes, kv_cache_bytes, instance_id of memory samples, oldest first."""
    m = MemorySample
    stmt = (select(m.at, m.rss_bytes, m.kv_cache_bytes, m.instance_id)
            .where(m.at >= start, m.at < end).order_by(m.at))
    return frame(session, stmt, ("at",))


def compile_frame(session: Session, start: datetime, end: datetime) -> pd.DataFrame:
    """Return at, instance_id, recompiles, limit_hits and first_at (the instance's first
    compile event before `end`) of the compile events in [start, end)."""
    c = CompileEvent
    first = (select(c.instance_id, func.min(c.at).label("first_at"))
             .where(c.at < end).group_by(c.instance_id).subquery())
    stmt = (select(c.at, c.instance_id, c.recompiles, c.limit_hits, first.c.first_at)
            .join(first, first.c.instance_id == c.instance_id)
            .where(c.at >= start, c.at < end))
    return frame(session, stmt, ("at", "first_at"))
