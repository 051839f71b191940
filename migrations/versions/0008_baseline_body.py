"""Baselines keep the series' body: the median of its cycles' own sample medians.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 15:00:00

baselines gains `body` (nullable float): for a quantile rule, the median over the
baseline's cycles of each cycle's own median sample (where the canaries' body normally
sits, beside the centre of a tail quantile). Rows stored before have NULL: their recovery
reads only the canaries' own fall since the alert fired, until the next refresh writes a
row with a body (each refresh reads the stored hourly chunks, and chunks written before
this revision carry no per-cycle median, so a body appears once hours with one are
stored). Downgrade drops the column.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0008'
down_revision: str | Sequence[str] | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add body to baselines."""
    with op.batch_alter_table('baselines') as batch:
        batch.add_column(sa.Column('body', sa.Float(), nullable=True))


def downgrade() -> None:
    """Drop body from baselines."""
    with op.batch_alter_table('baselines') as batch:
        batch.drop_column('body')
