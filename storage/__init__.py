"""Persistence: SQLAlchemy models, engine/session factories, migrations, queries.

Modules: models (tables), db (make_engine, make_sessionmaker), migrate (Alembic
from code), queries (read side), rollups (per-minute traffic upserts), histograms
(fixed-edge count lists), retention (prune), writer (background writes that
survive a down database), synthetic (bulk history for benchmarks and demos),
errors (the exception tree).

Never imports torch, engine, probes, alerts or monitor. Queries take a session and
never commit; the caller owns the transaction (`with sessionmaker.begin() as s:`).
"""

from __future__ import annotations

from storage.db import make_engine, make_sessionmaker, normalize_url
from storage.errors import (
    DatabaseUnavailable,
    InvalidQuery,
    SchemaBehind,
    StorageError,
    UnknownMetric,
)
from storage.models import Base

__all__ = [
    "Base",
    "DatabaseUnavailable",
    "InvalidQuery",
    "SchemaBehind",
    "StorageError",
    "UnknownMetric",
    "make_engine",
    "make_sessionmaker",
    "normalize_url",
]
