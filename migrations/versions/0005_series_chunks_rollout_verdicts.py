"""Incremental baselines and rollout verdicts.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 19:00:00

Adds `series_chunks` (an hour of a rule's per-cycle values per scope and cohort: rolling
baselines are refreshed from these, not from raw history) and `rollout_verdicts` (a new
cohort judged against the old one per source x metric x bucket). Downgrade drops both.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005'
down_revision: str | Sequence[str] | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create series_chunks and rollout_verdicts."""
    op.create_table(
        'series_chunks',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('rule', sa.String(length=128), nullable=False),
        sa.Column('scope_key', sa.String(length=255), nullable=False),
        sa.Column('model_version', sa.String(length=128), nullable=False),
        sa.Column('config_hash', sa.String(length=64), nullable=False),
        sa.Column('start', sa.DateTime(timezone=True), nullable=False),
        sa.Column('values', sa.JSON(none_as_null=True), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_series_chunks')),
        sa.UniqueConstraint('rule', 'scope_key', 'model_version', 'config_hash', 'start',
                            name='uq_series_chunks_key'),
    )
    op.create_index('ix_series_chunks_rule_start', 'series_chunks', ['rule', 'start'],
                    unique=False)
    op.create_table(
        'rollout_verdicts',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('new_model_version', sa.String(length=128), nullable=False),
        sa.Column('new_config_hash', sa.String(length=64), nullable=False),
        sa.Column('old_model_version', sa.String(length=128), nullable=False),
        sa.Column('old_config_hash', sa.String(length=64), nullable=False),
        sa.Column('source', sa.String(length=16), nullable=False),
        sa.Column('metric', sa.String(length=64), nullable=False),
        sa.Column('bucket', sa.String(length=16), nullable=False),
        sa.Column('verdict', sa.String(length=16), nullable=False),
        sa.Column('p_value', sa.Float(), nullable=True),
        sa.Column('relative_change', sa.Float(), nullable=True),
        sa.Column('threshold', sa.Float(), nullable=False),
        sa.Column('new_median', sa.Float(), nullable=True),
        sa.Column('old_median', sa.Float(), nullable=True),
        sa.Column('new_cycles', sa.Integer(), nullable=False),
        sa.Column('old_cycles', sa.Integer(), nullable=False),
        sa.Column('window_start', sa.DateTime(timezone=True), nullable=False),
        sa.Column('first_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("verdict IN ('pass', 'marginal', 'fail')",
                           name=op.f('ck_rollout_verdicts_verdict')),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_rollout_verdicts')),
        sa.UniqueConstraint('new_model_version', 'new_config_hash', 'old_model_version',
                            'old_config_hash', 'source', 'metric', 'bucket',
                            name='uq_rollout_verdicts_key'),
    )


def downgrade() -> None:
    """Drop rollout_verdicts and series_chunks."""
    op.drop_table('rollout_verdicts')
    op.drop_index('ix_series_chunks_rule_start', table_name='series_chunks')
    op.drop_table('series_chunks')
