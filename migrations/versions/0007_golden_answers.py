"""Golden answers: exact-match counts against user-supplied expected outputs.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 00:30:00

output_agreements gains golden_count (outputs whose canary carries an `expected` answer
in its suites file) and golden_exact (those equal to it), 0 for rows stored before: no
golden answer was checked then. Downgrade drops both columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0007'
down_revision: str | Sequence[str] | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = ('golden_count', 'golden_exact')


def upgrade() -> None:
    """Add golden_count and golden_exact to output_agreements."""
    with op.batch_alter_table('output_agreements') as batch:
        for name in _COLUMNS:
            batch.add_column(sa.Column(name, sa.Integer(), nullable=False,
                                       server_default=sa.text('0')))


def downgrade() -> None:
    """Drop golden_count and golden_exact from output_agreements."""
    with op.batch_alter_table('output_agreements') as batch:
        for name in reversed(_COLUMNS):
            batch.drop_column(name)
