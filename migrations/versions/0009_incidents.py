"""Incidents: alerts that fired together in a shared scope, with their timeline.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03 10:30:00

Creates incidents, incident_members (alert -> incident, one each) and incident_events
(the timeline; a notification's idempotency key links its outbox rows). No existing table
changes: on SQLite a batch alter of `alerts` recreates the table, and with foreign keys on
that would cascade into alert_transitions. Alerts stored before belong to no incident.
Downgrade drops the three tables.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0009'
down_revision: str | Sequence[str] | None = '0008'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create incidents, incident_events and incident_members."""
    op.create_table(
        'incidents',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('state', sa.String(length=16), nullable=False),
        sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('resolved_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('severity', sa.String(length=16), nullable=False),
        sa.Column('families', sa.JSON(none_as_null=True), nullable=False),
        sa.Column('buckets', sa.JSON(none_as_null=True), nullable=False),
        sa.Column('instances', sa.JSON(none_as_null=True), nullable=False),
        sa.Column('cohorts', sa.JSON(none_as_null=True), nullable=False),
        sa.Column('summary', sa.Text(), nullable=False),
        sa.Column('cause', sa.String(length=32), nullable=False),
        sa.Column('cause_text', sa.Text(), nullable=False),
        sa.Column('evidence', sa.JSON(none_as_null=True), nullable=False),
        sa.Column('reopened', sa.Integer(), nullable=False),
        sa.Column('last_notified_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('last_resent_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('notified_members', sa.JSON(none_as_null=True), nullable=False),
        sa.CheckConstraint("state IN ('open', 'resolved')", name=op.f('ck_incidents_state')),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_incidents')),
    )
    op.create_index('ix_incidents_state_started_at', 'incidents', ['state', 'started_at'],
                    unique=False)
    op.create_table(
        'incident_events',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('incident_id', sa.Integer(), nullable=False),
        sa.Column('at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('kind', sa.String(length=16), nullable=False),
        sa.Column('alert_id', sa.Integer(), nullable=True),
        sa.Column('detail', sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(['alert_id'], ['alerts.id'], ondelete='SET NULL',
                                name=op.f('fk_incident_events_alert_id_alerts')),
        sa.ForeignKeyConstraint(['incident_id'], ['incidents.id'], ondelete='CASCADE',
                                name=op.f('fk_incident_events_incident_id_incidents')),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_incident_events')),
    )
    op.create_index(op.f('ix_incident_events_incident_id'), 'incident_events',
                    ['incident_id'], unique=False)
    op.create_table(
        'incident_members',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('incident_id', sa.Integer(), nullable=False),
        sa.Column('alert_id', sa.Integer(), nullable=False),
        sa.Column('joined_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['alert_id'], ['alerts.id'], ondelete='CASCADE',
                                name=op.f('fk_incident_members_alert_id_alerts')),
        sa.ForeignKeyConstraint(['incident_id'], ['incidents.id'], ondelete='CASCADE',
                                name=op.f('fk_incident_members_incident_id_incidents')),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_incident_members')),
        sa.UniqueConstraint('alert_id', name=op.f('uq_incident_members_alert_id')),
    )
    op.create_index(op.f('ix_incident_members_incident_id'), 'incident_members',
                    ['incident_id'], unique=False)


def downgrade() -> None:
    """Drop incident_members, incident_events and incidents."""
    op.drop_index(op.f('ix_incident_members_incident_id'), table_name='incident_members')
    op.drop_table('incident_members')
    op.drop_index(op.f('ix_incident_events_incident_id'), table_name='incident_events')
    op.drop_table('incident_events')
    op.drop_index('ix_incidents_state_started_at', table_name='incidents')
    op.drop_table('incidents')
