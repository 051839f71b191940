"""Incidents remember the severity their receivers were told: an escalation is sent.

Revision ID: 0013_notified_severity
Revises: 0012_batch_tokens
Create Date: 2026-12-03 18:15:00

An incident that opened as a warning and then gained a page member changed severity while
generic and slack targets (no updates by default) heard only the warning: nobody was paged.
incidents.notified_severity holds the severity of the last firing notification; a higher
one is sent to every target at once. Null on existing rows (read as what they last sent:
nothing to escalate from). Downgrade drops the column.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0013_notified_severity'
down_revision: str | Sequence[str] | None = '0012_batch_tokens'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add incidents.notified_severity."""
    with op.batch_alter_table('incidents') as batch:
        batch.add_column(sa.Column('notified_severity', sa.String(length=16), nullable=True))


def downgrade() -> None:
    """Drop incidents.notified_severity."""
    with op.batch_alter_table('incidents') as batch:
        batch.drop_column('notified_severity')
