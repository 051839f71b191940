"""Webhook outbox: superseded firings and manual retries of dead letters.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 18:10:00

Adds the delivery state "superseded" (a firing never delivered whose resolved went in
its place) and `webhook_deliveries.retried_at` (a dead letter retried by hand: its max
age counts from then). Downgrade turns superseded rows back into failed ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0003'
down_revision: str | Sequence[str] | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OLD = "state IN ('pending', 'delivered', 'failed')"
_NEW = "state IN ('pending', 'delivered', 'failed', 'superseded')"
_deliveries = sa.table("webhook_deliveries", sa.column("state", sa.String))


def upgrade() -> None:
    """Widen the state check and add retried_at."""
    with op.batch_alter_table('webhook_deliveries') as batch:
        batch.drop_constraint(op.f('ck_webhook_deliveries_state'), type_='check')
        batch.create_check_constraint(op.f('ck_webhook_deliveries_state'), _NEW)
        batch.add_column(sa.Column('retried_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    """Fold superseded rows into failed, narrow the check, drop retried_at."""
    op.execute(sa.update(_deliveries).where(_deliveries.c.state == 'superseded')
               .values(state='failed'))
    with op.batch_alter_table('webhook_deliveries') as batch:
        batch.drop_column('retried_at')
        batch.drop_constraint(op.f('ck_webhook_deliveries_state'), type_='check')
        batch.create_check_constraint(op.f('ck_webhook_deliveries_state'), _OLD)
