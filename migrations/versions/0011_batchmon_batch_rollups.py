"""Batch rollups: what continuous batching did per minute, per bucket and batch size.

Revision ID: 0011_batchmon
Revises: 0010
Create Date: 2026-12-03 13:30:00

batch_rollups holds one row per minute x instance x bucket x batch-size class x decoding
of real traffic (queue wait, batch size, step throughput, latency sketch), and one row
per minute x instance with bucket, batch and decoding "all" for the batching loop
sampled at each traffic flush (rows waiting, step seconds by phase). Downgrade drops it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0011_batchmon'
down_revision: str | Sequence[str] | None = '0010'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_INTS = ('requests', 'batched_requests', 'batch_size_max', 'samples', 'rows_waiting_sum',
         'rows_waiting_max', 'batch_now_sum', 'steps', 'encode_steps', 'decode_steps',
         'verify_steps')
_BIG = ('output_tokens_sum', 'decode_tokens_sum')
_FLOATS = ('batch_size_sum', 'queue_wait_sum_s', 'batch_wait_sum_s', 'latency_sum_s',
           'decode_sum_s', 'row_tokens_sum', 'window_sum_s', 'encode_s', 'decode_s',
           'verify_s')


def upgrade() -> None:
    """Create batch_rollups."""
    op.create_table(
        'batch_rollups',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('minute', sa.DateTime(timezone=True), nullable=False),
        sa.Column('instance_id', sa.String(length=128), nullable=False),
        sa.Column('bucket', sa.String(length=16), nullable=False),
        sa.Column('batch', sa.String(length=16), nullable=False),
        sa.Column('decoding', sa.String(length=16), nullable=False),
        *(sa.Column(name, sa.Integer(), nullable=False) for name in _INTS),
        *(sa.Column(name, sa.BigInteger(), nullable=False) for name in _BIG),
        *(sa.Column(name, sa.Float(), nullable=False) for name in _FLOATS),
        sa.Column('latency_sketch', sa.JSON(none_as_null=True), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_batch_rollups')),
        sa.UniqueConstraint('minute', 'instance_id', 'bucket', 'batch', 'decoding',
                            name=op.f('uq_batch_rollups_minute_instance_id_bucket_batch_decoding')),
    )


def downgrade() -> None:
    """Drop batch_rollups."""
    op.drop_table('batch_rollups')
