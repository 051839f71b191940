"""0008: baselines gain a body (NULL for older rows), dropped on downgrade."""

from __future__ import annotations

from sqlalchemy import inspect, text

from storage import migrate
from storage.db import make_engine


def test_0008_adds_a_null_body_to_old_baselines_and_downgrade_drops_it(db_url: str) -> None:
    migrate.upgrade(db_url, "0007")
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO baselines (id, metric, scope, scope_key, value, samples, kind,"
                " model_version, config_hash, created_at, spread, active) VALUES (1,"
                " 'p99_latency', '{}', 'bucket=64', 0.1, 60, 'rolling', 'm', 'c',"
                " '2026-12-01 00:00:00+00:00', 0.01, true)"))
        migrate.upgrade(db_url, "0008")
        with engine.begin() as conn:
            assert conn.execute(text("SELECT value, body FROM baselines")).one() == (0.1, None)
            conn.execute(text("UPDATE baselines SET body = 0.08"))
        migrate.downgrade(db_url, "0007")
        with engine.connect() as conn:
            cols = {c["name"] for c in inspect(conn).get_columns("baselines")}
            assert conn.execute(text("SELECT value, spread FROM baselines")).one() == (0.1, 0.01)
        assert "body" not in cols
    finally:
        engine.dispose()
        migrate.downgrade(db_url, "base")
