"""0007: output_agreements gains golden-answer counts (0 for older rows), dropped on downgrade."""

from __future__ import annotations

from sqlalchemy import inspect, text

from storage import migrate
from storage.db import make_engine


def test_0007_adds_golden_counts_zero_for_old_rows_and_downgrade_drops_them(
        db_url: str) -> None:
    migrate.upgrade(db_url, "0006")
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO output_agreements (id, at, source, instance_id, model_version,"
                " config_hash, bucket, path, decoding, variant, count, exact, agreement_sum,"
                " length_diff_sum, worst) VALUES (1, '2026-11-02 00:00:00+00:00', 'canary',"
                " 'i', 'm', 'c', '16', 'compiled', 'direct', 'optimized', 4, 3, 3.5, 0, '[]')"))
        migrate.upgrade(db_url, "0007")
        with engine.begin() as conn:
            assert conn.execute(text(
                "SELECT count, golden_count, golden_exact FROM output_agreements")).one() == (
                4, 0, 0)
            conn.execute(text("UPDATE output_agreements SET golden_count = 2, golden_exact = 1"))
        migrate.downgrade(db_url, "0006")
        with engine.connect() as conn:
            cols = {c["name"] for c in inspect(conn).get_columns("output_agreements")}
            assert conn.execute(text("SELECT count, exact FROM output_agreements")).one() == (
                4, 3)
        assert "golden_count" not in cols and "golden_exact" not in cols
    finally:
        engine.dispose()
        migrate.downgrade(db_url, "base")
