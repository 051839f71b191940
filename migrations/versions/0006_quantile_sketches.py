"""Quantile sketches and exact length counts replace fixed-bin histograms.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30 19:30:00

traffic_rollups gains latency_sketch, ttft_sketch, per_token_sketch (storage.sketches,
0.35% relative accuracy) and input_lens / output_lens (exact sparse counts) and loses
latency_hist, input_len_hist and output_len_hist (21 / 17 fixed bins). probe_results
gains the same three sketches and `samples` (the successful requests its quantiles rest on).
memory_samples gains kv_static_bytes and kv_request_peak_bytes (0 for older samples).

Backfill (the cut-over, documented in docs/operations.md#upgrades): a minute stored before this revision
has only its fixed bins, so each bin's count is put at the bin's upper edge (the overflow
bin just above the last edge, a lower bound): those minutes keep bin resolution, minutes written
after it have 0.35%. TTFT and per-token sketches cannot be rebuilt (only sums were kept) and
start empty; canary rows get samples = count - errors and empty sketches (their pooled
quantiles start at the upgrade). Downgrade rebuilds the fixed bins from the sketches and
counts (each value into the bin it falls in) and drops the new columns.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = '0006'
down_revision: str | Sequence[str] | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies (a migration must not follow later code): storage.histograms' edges
# as of 0005 and storage.sketches' mapping.
_LATENCY_EDGES_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 60.0)
_TOKEN_EDGES = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
_GAMMA = 1.0035 / 0.9965  # storage.sketches.RELATIVE_ACCURACY 0.0035
_SKETCHES = ('latency_sketch', 'ttft_sketch', 'per_token_sketch')
_EMPTY = sa.text("'{}'")
_EMPTY_LIST = sa.text("'[]'")


def _json_col(name: str, default: Any) -> sa.Column:
    return sa.Column(name, sa.JSON(none_as_null=True), nullable=False, server_default=default)


def _sketch_of_bins(hist: Sequence[int]) -> dict[str, Any]:
    bins: dict[str, int] = {}
    for i, c in enumerate(hist or ()):
        if c:
            # The overflow bin (> 60 s) goes just above the last edge: a lower bound.
            edge = _LATENCY_EDGES_S[i] if i < len(_LATENCY_EDGES_S) else 1.05 * 60.0
            k = str(math.ceil(math.log(edge) / math.log(_GAMMA)))
            bins[k] = bins.get(k, 0) + int(c)
    return {"b": bins} if bins else {}


def _lens_of_bins(hist: Sequence[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for i, c in enumerate(hist or ()):
        if c:
            k = str(_TOKEN_EDGES[i] if i < len(_TOKEN_EDGES) else _TOKEN_EDGES[-1] + 1)
            out[k] = out.get(k, 0) + int(c)
    return out


def _bins_of_sketch(sketch: dict[str, Any] | None) -> list[int]:
    hist = [0] * (len(_LATENCY_EDGES_S) + 1)
    hist[0] += int((sketch or {}).get("z") or 0)
    for k, c in ((sketch or {}).get("b") or {}).items():
        # Bin k holds (gamma^(k-1), gamma^k]: an edge inside it takes its counts (values
        # backfilled at that edge round-trip; others move by at most one bin width).
        hist[bisect_right(_LATENCY_EDGES_S, _GAMMA ** (int(k) - 1))] += int(c)
    return hist


def _bins_of_lens(lens: dict[str, int] | None) -> list[int]:
    hist = [0] * (len(_TOKEN_EDGES) + 1)
    for k, c in (lens or {}).items():
        hist[bisect_left(_TOKEN_EDGES, int(k))] += int(c)
    return hist


def _rows(table: sa.TableClause, *cols: str) -> list[Any]:
    conn = op.get_bind()
    return list(conn.execute(sa.select(table.c.id, *(table.c[c] for c in cols))))


def upgrade() -> None:
    """Add the sketch and length columns, backfill them from the bins, drop the bins."""
    with op.batch_alter_table('traffic_rollups') as batch:
        for name in _SKETCHES + ('input_lens', 'output_lens'):
            batch.add_column(_json_col(name, _EMPTY))
    with op.batch_alter_table('memory_samples') as batch:
        for name in ('kv_static_bytes', 'kv_request_peak_bytes'):
            batch.add_column(sa.Column(name, sa.BigInteger(), nullable=False,
                                       server_default=sa.text('0')))
    with op.batch_alter_table('probe_results') as batch:
        for name in _SKETCHES:
            batch.add_column(_json_col(name, _EMPTY))
        batch.add_column(sa.Column('samples', sa.Integer(), nullable=False,
                                   server_default=sa.text('0')))
    t = sa.table('traffic_rollups', sa.column('id', sa.Integer),
                 sa.column('latency_hist', sa.JSON), sa.column('input_len_hist', sa.JSON),
                 sa.column('output_len_hist', sa.JSON), sa.column('latency_sketch', sa.JSON),
                 sa.column('input_lens', sa.JSON), sa.column('output_lens', sa.JSON))
    conn = op.get_bind()
    for rid, lat, inp, out in _rows(t, 'latency_hist', 'input_len_hist', 'output_len_hist'):
        conn.execute(t.update().where(t.c.id == rid).values(
            latency_sketch=_sketch_of_bins(lat), input_lens=_lens_of_bins(inp),
            output_lens=_lens_of_bins(out)))
    p = sa.table('probe_results', sa.column('count', sa.Integer),
                 sa.column('errors', sa.Integer), sa.column('samples', sa.Integer))
    conn.execute(p.update().values(samples=p.c.count - p.c.errors))
    with op.batch_alter_table('traffic_rollups') as batch:
        for name in ('latency_hist', 'input_len_hist', 'output_len_hist'):
            batch.drop_column(name)


def downgrade() -> None:
    """Rebuild the fixed bins from the sketches and counts, then drop the new columns."""
    with op.batch_alter_table('traffic_rollups') as batch:
        for name in ('latency_hist', 'input_len_hist', 'output_len_hist'):
            batch.add_column(_json_col(name, _EMPTY_LIST))
    t = sa.table('traffic_rollups', sa.column('id', sa.Integer),
                 sa.column('latency_hist', sa.JSON), sa.column('input_len_hist', sa.JSON),
                 sa.column('output_len_hist', sa.JSON), sa.column('latency_sketch', sa.JSON),
                 sa.column('input_lens', sa.JSON), sa.column('output_lens', sa.JSON))
    conn = op.get_bind()
    for rid, lat, inp, out in _rows(t, 'latency_sketch', 'input_lens', 'output_lens'):
        conn.execute(t.update().where(t.c.id == rid).values(
            latency_hist=_bins_of_sketch(lat), input_len_hist=_bins_of_lens(inp),
            output_len_hist=_bins_of_lens(out)))
    with op.batch_alter_table('probe_results') as batch:
        batch.drop_column('samples')
        for name in _SKETCHES:
            batch.drop_column(name)
    with op.batch_alter_table('traffic_rollups') as batch:
        for name in _SKETCHES + ('input_lens', 'output_lens'):
            batch.drop_column(name)
    with op.batch_alter_table('memory_samples') as batch:
        batch.drop_column('kv_request_peak_bytes')
        batch.drop_column('kv_static_bytes')
