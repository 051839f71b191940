"""Rule sensitivities: what each rule can see on each series, and its threshold in force.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03 10:30:00

rule_sensitivities holds one row per rule, scope and cohort, written by the scheduled
sensitivity estimate (alerts.sensitivity): the smallest shift the rule confirms within N
cycles at p95, the expected false pages per 30 days, and the threshold in force under
the false-page budget with the reason it was widened. baseline_id points at the baseline
it was measured against (SET NULL when retention deletes that row). Downgrade drops it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0010'
down_revision: str | Sequence[str] | None = '0009'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create rule_sensitivities."""
    op.create_table(
        'rule_sensitivities',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('rule', sa.String(length=128), nullable=False),
        sa.Column('metric', sa.String(length=64), nullable=False),
        sa.Column('scope', sa.JSON(none_as_null=True), nullable=False),
        sa.Column('scope_key', sa.String(length=255), nullable=False),
        sa.Column('model_version', sa.String(length=128), nullable=False),
        sa.Column('config_hash', sa.String(length=64), nullable=False),
        sa.Column('baseline_id', sa.Integer(), nullable=True),
        sa.Column('computed_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('status', sa.String(length=32), nullable=False),
        sa.Column('direction', sa.Integer(), nullable=False),
        sa.Column('cycles', sa.Integer(), nullable=False),
        sa.Column('within_cycles', sa.Integer(), nullable=False),
        sa.Column('configured_threshold', sa.Float(), nullable=False),
        sa.Column('threshold', sa.Float(), nullable=False),
        sa.Column('detectable_change', sa.Float(), nullable=True),
        sa.Column('false_pages_30d', sa.Float(), nullable=True),
        sa.Column('false_pages_configured', sa.Float(), nullable=True),
        sa.Column('budget_per_30d', sa.Float(), nullable=True),
        sa.Column('reason', sa.Text(), nullable=False),
        sa.Column('cpu_s', sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(['baseline_id'], ['baselines.id'],
                                name=op.f('fk_rule_sensitivities_baseline_id_baselines'),
                                ondelete='SET NULL'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_rule_sensitivities')),
        sa.UniqueConstraint('rule', 'scope_key', 'model_version', 'config_hash',
                            name='uq_rule_sensitivities_key'),
    )


def downgrade() -> None:
    """Drop rule_sensitivities."""
    op.drop_table('rule_sensitivities')
