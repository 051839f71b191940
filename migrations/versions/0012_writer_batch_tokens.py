"""Writer batch tokens: a retry after an ambiguous commit is not written twice.

Revision ID: 0012_batch_tokens
Revises: 0011_batchmon
Create Date: 2026-12-03 16:30:00

applied_batches holds the token of each storage Writer batch, inserted in the batch's own
transaction; a retry whose token is already there was committed by the attempt that lost
its connection, and is skipped. Each writer deletes its committed tokens in bulk with a
later batch and retention prunes what stopped writers left, so the table stays small (at
most 64 rows per writer). No existing table changes. Downgrade drops it (writers of an older release
do not use it).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0012_batch_tokens'
down_revision: str | Sequence[str] | None = '0011_batchmon'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create applied_batches."""
    op.create_table(
        'applied_batches',
        sa.Column('token', sa.String(length=32), nullable=False),
        sa.Column('applied_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('token', name=op.f('pk_applied_batches')),
    )


def downgrade() -> None:
    """Drop applied_batches."""
    op.drop_table('applied_batches')
