"""Move baseline spread and a flag change's alert id out of free text into columns.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 18:00:00

Upgrade adds `baselines.spread` and `flag_audits.alert_id` and backfills them from
the text they used to live in: "spread=<x>" in a baseline's note (the note keeps
only what a person wrote) and "[alert N]" in a flag audit's reason (the reason stays
as written: it is what people read). Downgrade writes the spread back into the note.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | Sequence[str] | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SPREAD = re.compile(r"\s*spread=([0-9.eE+-]+|nan|inf)")
_ALERT = re.compile(r"\[alert (\d+)\]")

_baselines = sa.table("baselines", sa.column("id", sa.Integer), sa.column("note", sa.Text),
                      sa.column("spread", sa.Float))
_audits = sa.table("flag_audits", sa.column("id", sa.Integer), sa.column("reason", sa.Text),
                   sa.column("alert_id", sa.Integer))
_alerts = sa.table("alerts", sa.column("id", sa.Integer))


def upgrade() -> None:
    """Add the columns, then backfill them from the text."""
    with op.batch_alter_table('baselines') as batch:
        batch.add_column(sa.Column('spread', sa.Float(), nullable=True))
    with op.batch_alter_table('flag_audits') as batch:
        batch.add_column(sa.Column('alert_id', sa.Integer(), nullable=True))
        batch.create_foreign_key(op.f('fk_flag_audits_alert_id_alerts'), 'alerts',
                                 ['alert_id'], ['id'], ondelete='SET NULL')
    conn = op.get_bind()
    for row_id, note in conn.execute(sa.select(_baselines.c.id, _baselines.c.note)
                                     .where(_baselines.c.note.like('%spread=%'))).all():
        m = _SPREAD.search(note)
        if m is None:
            continue
        try:
            spread = float(m.group(1))
        except ValueError:
            continue
        rest = (note[:m.start()] + note[m.end():]).strip() or None
        conn.execute(sa.update(_baselines).where(_baselines.c.id == row_id)
                     .values(spread=spread, note=rest))
    known = {i for (i,) in conn.execute(sa.select(_alerts.c.id))}
    for row_id, reason in conn.execute(sa.select(_audits.c.id, _audits.c.reason)
                                       .where(_audits.c.reason.like('%[alert %'))).all():
        m = _ALERT.search(reason)
        # An alert deleted since would violate the key: SET NULL is what deletion does too.
        if m is not None and int(m.group(1)) in known:
            conn.execute(sa.update(_audits).where(_audits.c.id == row_id)
                         .values(alert_id=int(m.group(1))))


def downgrade() -> None:
    """Write the spread back into the note, then drop both columns."""
    conn = op.get_bind()
    for row_id, note, spread in conn.execute(
            sa.select(_baselines.c.id, _baselines.c.note, _baselines.c.spread)
            .where(_baselines.c.spread.is_not(None))).all():
        text = " ".join(filter(None, [note, f"spread={spread!r}"]))
        conn.execute(sa.update(_baselines).where(_baselines.c.id == row_id).values(note=text))
    with op.batch_alter_table('flag_audits') as batch:
        batch.drop_constraint(op.f('fk_flag_audits_alert_id_alerts'), type_='foreignkey')
        batch.drop_column('alert_id')
    with op.batch_alter_table('baselines') as batch:
        batch.drop_column('spread')
