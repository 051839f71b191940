"""Output quality: reference outputs per canary and cohort, agreements per run and arm.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 19:00:00

Adds `canary_references` (the reference path's output of each canary in each cohort)
and `output_agreements` (each arm's outputs compared with their references, per run x
bucket x path x decoding x variant; real-traffic samples with no run). Downgrade drops both.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | Sequence[str] | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create canary_references and output_agreements."""
    op.create_table(
        'canary_references',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('model_version', sa.String(length=128), nullable=False),
        sa.Column('config_hash', sa.String(length=64), nullable=False),
        sa.Column('prompt_key', sa.String(length=64), nullable=False),
        sa.Column('suite', sa.String(length=64), nullable=False),
        sa.Column('bucket', sa.String(length=16), nullable=False),
        sa.Column('output_ids', sa.JSON(none_as_null=True), nullable=False),
        sa.Column('text', sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_canary_references')),
        sa.UniqueConstraint('model_version', 'config_hash', 'prompt_key',
                            name=op.f('uq_canary_references_model_version_config_hash_prompt_key')),
    )
    op.create_table(
        'output_agreements',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('run_id', sa.Integer(), nullable=True),
        sa.Column('at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('source', sa.String(length=16), nullable=False),
        sa.Column('instance_id', sa.String(length=128), nullable=False),
        sa.Column('model_version', sa.String(length=128), nullable=False),
        sa.Column('config_hash', sa.String(length=64), nullable=False),
        sa.Column('bucket', sa.String(length=16), nullable=False),
        sa.Column('path', sa.String(length=16), nullable=False),
        sa.Column('decoding', sa.String(length=16), nullable=False),
        sa.Column('variant', sa.String(length=16), nullable=False),
        sa.Column('count', sa.Integer(), nullable=False),
        sa.Column('exact', sa.Integer(), nullable=False),
        sa.Column('agreement_sum', sa.Float(), nullable=False),
        sa.Column('length_diff_sum', sa.Integer(), nullable=False),
        sa.Column('first_divergence_min', sa.Integer(), nullable=True),
        sa.Column('worst', sa.JSON(none_as_null=True), nullable=False),
        sa.Column('text', sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(['run_id'], ['probe_runs.id'],
                                name=op.f('fk_output_agreements_run_id_probe_runs'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_output_agreements')),
        sa.UniqueConstraint('run_id', 'bucket', 'path', 'decoding', 'variant',
                            name=op.f('uq_output_agreements_run_id_bucket_path_decoding_variant')),
    )
    op.create_index('ix_output_agreements_at_bucket', 'output_agreements', ['at', 'bucket'],
                    unique=False)


def downgrade() -> None:
    """Drop output_agreements and canary_references."""
    op.drop_index('ix_output_agreements_at_bucket', table_name='output_agreements')
    op.drop_table('output_agreements')
    op.drop_table('canary_references')
