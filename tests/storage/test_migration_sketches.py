"""0006: fixed bins become sketches and exact lengths, and come back on downgrade."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import inspect, text

from storage import migrate
from storage.db import make_engine
from storage.sketches import Sketch

LAT_HIST = [0] * 21
LAT_HIST[4] = 3  # (0.05, 0.075] s
LAT_HIST[20] = 1  # > 60 s: the overflow bin
TOK_HIST = [0] * 17
TOK_HIST[6] = 5  # (32, 48] tokens


def test_0006_backfills_sketches_and_lengths_and_downgrade_rebuilds_bins(db_url: str) -> None:
    migrate.upgrade(db_url, "0005")
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO traffic_rollups (id, minute, instance_id, bucket, path, decoding,"
                " requests, errors, rejections, overflow, latency_sum_s, latency_hist,"
                " ttft_sum_s, input_tokens_sum, padded_tokens_sum, output_tokens_sum,"
                " input_len_hist, output_len_hist, drafts, draft_tokens, accepted_tokens,"
                " accepted_per_position, probation_requests, probation_draft_tokens,"
                " probation_accepted) VALUES (1, '2026-11-02 00:00:00+00:00', 'i', '64',"
                " 'compiled', 'direct', 4, 0, 0, 0, 60.2, :lat, 0.1, 200, 256, 40, :tok, :tok,"
                " 0, 0, 0, '[]', 0, 0, 0)"),
                {"lat": json.dumps(LAT_HIST), "tok": json.dumps(TOK_HIST)})
            conn.execute(text(
                "INSERT INTO probe_runs (id, started_at, status, instance_id, model_version,"
                " config_hash, device, suite, kind) VALUES (1, '2026-11-02 00:00:00+00:00',"
                " 'ok', 'i', 'm', 'c', 'cpu', 's', 'cycle')"))
            conn.execute(text(
                "INSERT INTO probe_results (id, run_id, at, bucket, path, decoding, variant,"
                " count, errors, output_tokens, drafts, draft_tokens, accepted_tokens,"
                " accepted_per_position) VALUES (1, 1, '2026-11-02 00:00:00+00:00', '64',"
                " 'compiled', 'direct', 'optimized', 4, 1, 0, 0, 0, 0, '[]')"))
        migrate.upgrade(db_url, "0006")
        with engine.connect() as conn:
            lat, lens = conn.execute(text(
                "SELECT latency_sketch, input_lens FROM traffic_rollups")).one()
            samples = conn.execute(text("SELECT samples FROM probe_results")).scalar_one()
            cols = {c["name"] for c in inspect(conn).get_columns("traffic_rollups")}
        lat = json.loads(lat) if isinstance(lat, str) else lat
        lens = json.loads(lens) if isinstance(lens, str) else lens
        s = Sketch.from_json(lat)
        # Each bin's count sits at its upper edge: 3 at 0.075 s, the overflow just above 60 s.
        assert s.count == 4 and s.quantile(0.5) == pytest.approx(0.075, rel=0.01)
        assert s.quantile(1.0) == pytest.approx(63.0, rel=0.01)
        assert lens == {"48": 5} and samples == 3
        assert "latency_hist" not in cols and "input_len_hist" not in cols
        migrate.downgrade(db_url, "0005")
        with engine.connect() as conn:
            lat_hist, tok_hist = conn.execute(text(
                "SELECT latency_hist, input_len_hist FROM traffic_rollups")).one()
        lat_hist = json.loads(lat_hist) if isinstance(lat_hist, str) else lat_hist
        tok_hist = json.loads(tok_hist) if isinstance(tok_hist, str) else tok_hist
        assert lat_hist == LAT_HIST and tok_hist == TOK_HIST
    finally:
        engine.dispose()
        migrate.downgrade(db_url, "base")
