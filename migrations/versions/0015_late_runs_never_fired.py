"""A late run never fired: alerts.fired_at is cleared on runs confirmed after their cause.

Revision ID: 0015_late_not_fired
Revises: 0014_counted_cause
Create Date: 2026-12-06 01:00:00

A run confirmed only after its cause ended records a `late` transition and pages nobody,
but the lifecycle set its fired_at (to restart the detector after it), so the weekly
report listed it among the fired alerts and counted it. fired_at now means the alert
fired (paged); the detector and the baselines read the late transition instead
(storage.queries.alerts.confirmed_run). Upgrade clears fired_at on alerts with a late
transition (such an alert never fired: a late run moves pending -> resolved). Downgrade
sets it back to their resolved_at (a late run set both to the same moment).
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = '0015_late_not_fired'
down_revision: str | Sequence[str] | None = '0014_counted_cause'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LATE = "SELECT alert_id FROM alert_transitions WHERE to_state = 'late'"


def upgrade() -> None:
    """Clear fired_at on the alerts of late runs."""
    op.execute(f"UPDATE alerts SET fired_at = NULL WHERE id IN ({LATE})")


def downgrade() -> None:
    """Set fired_at of the alerts of late runs back to when they resolved."""
    op.execute(f"UPDATE alerts SET fired_at = resolved_at WHERE id IN ({LATE})")
