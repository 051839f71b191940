"""Incidents remember the cause they are counted under: the counter by cause never falls.

Revision ID: 0014_counted_cause
Revises: 0013_notified_severity
Create Date: 2026-12-06 01:00:00

tailwatch_incidents_total{cause} counted incidents by their current cause, and an unknown
cause is measured again while the incident is open: the count of "unknown" went down when
one was restated. incidents.counted_cause holds the cause an incident is counted under,
set once (its first cause other than unknown, or the one it resolved with). Existing rows
are settled the same way: those with a cause other than unknown, and resolved ones, are
counted under their cause; open unknown ones wait. Downgrade drops the column.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0014_counted_cause'
down_revision: str | Sequence[str] | None = '0013_notified_severity'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add incidents.counted_cause and settle it on the stored incidents."""
    with op.batch_alter_table('incidents') as batch:
        batch.add_column(sa.Column('counted_cause', sa.String(length=32), nullable=True))
    op.execute("UPDATE incidents SET counted_cause = cause "
               "WHERE cause != 'unknown' OR state = 'resolved'")


def downgrade() -> None:
    """Drop incidents.counted_cause."""
    with op.batch_alter_table('incidents') as batch:
        batch.drop_column('counted_cause')
