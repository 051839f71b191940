"""Create the initial tailwatch schema.

Revision ID: 0001
Revises:
Create Date: 2026-11-30 09:56:19.594129
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0001'
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade the schema."""
    op.create_table('alerts',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('fingerprint', sa.String(length=64), nullable=False),
    sa.Column('rule', sa.String(length=128), nullable=False),
    sa.Column('labels', sa.JSON(none_as_null=True), nullable=False),
    sa.Column('annotations', sa.JSON(none_as_null=True), nullable=False),
    sa.Column('severity', sa.String(length=16), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('fired_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('resolved_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_notified_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('value', sa.Float(), nullable=True),
    sa.Column('baseline', sa.Float(), nullable=True),
    sa.Column('relative_change', sa.Float(), nullable=True),
    sa.Column('threshold', sa.Float(), nullable=True),
    sa.Column('consecutive_breaches', sa.Integer(), nullable=False),
    sa.Column('consecutive_ok', sa.Integer(), nullable=False),
    sa.CheckConstraint("state IN ('pending', 'firing', 'resolved')", name=op.f('ck_alerts_state')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_alerts'))
    )
    op.create_index('ix_alerts_state_started_at', 'alerts', ['state', 'started_at'], unique=False)
    op.create_index('uq_alerts_fingerprint_open', 'alerts', ['fingerprint'], unique=True, sqlite_where=sa.text("state != 'resolved'"), postgresql_where=sa.text("state != 'resolved'"))

    op.create_table('baselines',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('metric', sa.String(length=64), nullable=False),
    sa.Column('scope', sa.JSON(none_as_null=True), nullable=False),
    sa.Column('scope_key', sa.String(length=255), nullable=False),
    sa.Column('value', sa.Float(), nullable=False),
    sa.Column('samples', sa.Integer(), nullable=False),
    sa.Column('window_start', sa.DateTime(timezone=True), nullable=True),
    sa.Column('window_end', sa.DateTime(timezone=True), nullable=True),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('model_version', sa.String(length=128), nullable=False),
    sa.Column('config_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('pinned_by', sa.String(length=128), nullable=True),
    sa.Column('note', sa.Text(), nullable=True),
    sa.Column('active', sa.Boolean(), nullable=False),
    sa.CheckConstraint("kind IN ('rolling', 'pinned')", name=op.f('ck_baselines_kind')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_baselines'))
    )
    op.create_index('ix_baselines_metric_scope_key_active', 'baselines', ['metric', 'scope_key', 'active'], unique=False)

    op.create_table('flag_audits',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('scope', sa.String(length=64), nullable=False),
    sa.Column('actor', sa.String(length=128), nullable=False),
    sa.Column('source', sa.String(length=16), nullable=False),
    sa.Column('action', sa.String(length=16), nullable=False),
    sa.Column('old_value', sa.JSON(none_as_null=True), nullable=True),
    sa.Column('new_value', sa.JSON(none_as_null=True), nullable=True),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_flag_audits'))
    )
    op.create_index(op.f('ix_flag_audits_at'), 'flag_audits', ['at'], unique=False)
    op.create_index('ix_flag_audits_name_scope_at', 'flag_audits', ['name', 'scope', 'at'], unique=False)

    op.create_table('memory_samples',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('instance_id', sa.String(length=128), nullable=False),
    sa.Column('device', sa.String(length=32), nullable=False),
    sa.Column('rss_bytes', sa.BigInteger(), nullable=False),
    sa.Column('kv_cache_bytes', sa.BigInteger(), nullable=False),
    sa.Column('cuda_allocated_bytes', sa.BigInteger(), nullable=True),
    sa.Column('cuda_reserved_bytes', sa.BigInteger(), nullable=True),
    sa.Column('cuda_peak_bytes', sa.BigInteger(), nullable=True),
    sa.Column('cuda_alloc_retries', sa.Integer(), nullable=True),
    sa.Column('cuda_ooms', sa.Integer(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_memory_samples'))
    )
    op.create_index(op.f('ix_memory_samples_at'), 'memory_samples', ['at'], unique=False)
    op.create_index('ix_memory_samples_instance_id_at', 'memory_samples', ['instance_id', 'at'], unique=False)

    op.create_table('probe_runs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('instance_id', sa.String(length=128), nullable=False),
    sa.Column('model_version', sa.String(length=128), nullable=False),
    sa.Column('config_hash', sa.String(length=64), nullable=False),
    sa.Column('device', sa.String(length=32), nullable=False),
    sa.Column('suite', sa.String(length=64), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('rate_per_s', sa.Float(), nullable=True),
    sa.Column('requests', sa.Integer(), nullable=True),
    sa.Column('rejections', sa.Integer(), nullable=True),
    sa.Column('queue_wait_p95_s', sa.Float(), nullable=True),
    sa.Column('details', sa.JSON(none_as_null=True), nullable=True),
    sa.CheckConstraint("kind IN ('cycle', 'burst', 'ab')", name=op.f('ck_probe_runs_kind')),
    sa.CheckConstraint("status IN ('ok', 'error', 'timeout')", name=op.f('ck_probe_runs_status')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_probe_runs'))
    )
    op.create_index('ix_probe_runs_kind_started_at', 'probe_runs', ['kind', 'started_at'], unique=False)

    op.create_table('reports',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('week', sa.String(length=10), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('markdown', sa.Text(), nullable=False),
    sa.Column('html', sa.Text(), nullable=False),
    sa.Column('summary', sa.JSON(none_as_null=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_reports')),
    sa.UniqueConstraint('week', name=op.f('uq_reports_week'))
    )
    op.create_table('traffic_rollups',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('minute', sa.DateTime(timezone=True), nullable=False),
    sa.Column('instance_id', sa.String(length=128), nullable=False),
    sa.Column('bucket', sa.String(length=16), nullable=False),
    sa.Column('path', sa.String(length=16), nullable=False),
    sa.Column('decoding', sa.String(length=16), nullable=False),
    sa.Column('requests', sa.Integer(), nullable=False),
    sa.Column('errors', sa.Integer(), nullable=False),
    sa.Column('rejections', sa.Integer(), nullable=False),
    sa.Column('overflow', sa.Integer(), nullable=False),
    sa.Column('latency_sum_s', sa.Float(), nullable=False),
    sa.Column('latency_hist', sa.JSON(none_as_null=True), nullable=False),
    sa.Column('ttft_sum_s', sa.Float(), nullable=False),
    sa.Column('input_tokens_sum', sa.BigInteger(), nullable=False),
    sa.Column('padded_tokens_sum', sa.BigInteger(), nullable=False),
    sa.Column('output_tokens_sum', sa.BigInteger(), nullable=False),
    sa.Column('input_len_hist', sa.JSON(none_as_null=True), nullable=False),
    sa.Column('output_len_hist', sa.JSON(none_as_null=True), nullable=False),
    sa.Column('drafts', sa.Integer(), nullable=False),
    sa.Column('draft_tokens', sa.Integer(), nullable=False),
    sa.Column('accepted_tokens', sa.Integer(), nullable=False),
    sa.Column('accepted_per_position', sa.JSON(none_as_null=True), nullable=False),
    sa.Column('probation_requests', sa.Integer(), nullable=False),
    sa.Column('probation_draft_tokens', sa.Integer(), nullable=False),
    sa.Column('probation_accepted', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_traffic_rollups')),
    sa.UniqueConstraint('minute', 'instance_id', 'bucket', 'path', 'decoding', name=op.f('uq_traffic_rollups_minute_instance_id_bucket_path_decoding'))
    )
    op.create_table('alert_transitions',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('alert_id', sa.Integer(), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('from_state', sa.String(length=16), nullable=True),
    sa.Column('to_state', sa.String(length=16), nullable=False),
    sa.Column('value', sa.Float(), nullable=True),
    sa.Column('baseline', sa.Float(), nullable=True),
    sa.Column('relative_change', sa.Float(), nullable=True),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['alert_id'], ['alerts.id'], name=op.f('fk_alert_transitions_alert_id_alerts'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_alert_transitions'))
    )
    op.create_index(op.f('ix_alert_transitions_alert_id'), 'alert_transitions', ['alert_id'], unique=False)

    op.create_table('compile_events',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('instance_id', sa.String(length=128), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=True),
    sa.Column('graphs', sa.Integer(), nullable=False),
    sa.Column('recompiles', sa.Integer(), nullable=False),
    sa.Column('recompile_reasons', sa.JSON(none_as_null=True), nullable=False),
    sa.Column('graph_breaks', sa.Integer(), nullable=False),
    sa.Column('graph_break_reasons', sa.JSON(none_as_null=True), nullable=False),
    sa.Column('compile_seconds', sa.Float(), nullable=False),
    sa.Column('limit_hits', sa.Integer(), nullable=False),
    sa.Column('failures', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['probe_runs.id'], name=op.f('fk_compile_events_run_id_probe_runs'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_compile_events'))
    )
    op.create_index(op.f('ix_compile_events_at'), 'compile_events', ['at'], unique=False)
    op.create_index('ix_compile_events_instance_id_at', 'compile_events', ['instance_id', 'at'], unique=False)

    op.create_table('flags',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('scope', sa.String(length=64), nullable=False),
    sa.Column('value', sa.JSON(none_as_null=True), nullable=False),
    sa.Column('source', sa.String(length=16), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('actor', sa.String(length=128), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('alert_id', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.CheckConstraint("source IN ('manual', 'auto')", name=op.f('ck_flags_source')),
    sa.ForeignKeyConstraint(['alert_id'], ['alerts.id'], name=op.f('fk_flags_alert_id_alerts'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_flags')),
    sa.UniqueConstraint('name', 'scope', 'source', name=op.f('uq_flags_name_scope_source'))
    )
    op.create_table('probe_results',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('bucket', sa.String(length=16), nullable=False),
    sa.Column('path', sa.String(length=16), nullable=False),
    sa.Column('decoding', sa.String(length=16), nullable=False),
    sa.Column('variant', sa.String(length=16), nullable=False),
    sa.Column('count', sa.Integer(), nullable=False),
    sa.Column('errors', sa.Integer(), nullable=False),
    sa.Column('p50_s', sa.Float(), nullable=True),
    sa.Column('p95_s', sa.Float(), nullable=True),
    sa.Column('p99_s', sa.Float(), nullable=True),
    sa.Column('max_s', sa.Float(), nullable=True),
    sa.Column('ttft_p50_s', sa.Float(), nullable=True),
    sa.Column('ttft_p95_s', sa.Float(), nullable=True),
    sa.Column('per_token_p50_s', sa.Float(), nullable=True),
    sa.Column('input_tokens_min', sa.Integer(), nullable=True),
    sa.Column('input_tokens_mean', sa.Float(), nullable=True),
    sa.Column('input_tokens_max', sa.Integer(), nullable=True),
    sa.Column('padded_length', sa.Integer(), nullable=True),
    sa.Column('padding_waste', sa.Float(), nullable=True),
    sa.Column('output_tokens', sa.Integer(), nullable=False),
    sa.Column('drafts', sa.Integer(), nullable=False),
    sa.Column('draft_tokens', sa.Integer(), nullable=False),
    sa.Column('accepted_tokens', sa.Integer(), nullable=False),
    sa.Column('accepted_per_position', sa.JSON(none_as_null=True), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['probe_runs.id'], name=op.f('fk_probe_results_run_id_probe_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_probe_results')),
    sa.UniqueConstraint('run_id', 'bucket', 'path', 'decoding', 'variant', name=op.f('uq_probe_results_run_id_bucket_path_decoding_variant'))
    )
    op.create_index('ix_probe_results_at_bucket', 'probe_results', ['at', 'bucket'], unique=False)

    op.create_table('webhook_deliveries',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('target', sa.String(length=64), nullable=False),
    sa.Column('url', sa.Text(), nullable=False),
    sa.Column('format', sa.String(length=32), nullable=False),
    sa.Column('payload', sa.JSON(none_as_null=True), nullable=False),
    sa.Column('idempotency_key', sa.String(length=128), nullable=False),
    sa.Column('alert_id', sa.Integer(), nullable=True),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('next_attempt_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_status', sa.Integer(), nullable=True),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('delivered_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("state IN ('pending', 'delivered', 'failed')", name=op.f('ck_webhook_deliveries_state')),
    sa.ForeignKeyConstraint(['alert_id'], ['alerts.id'], name=op.f('fk_webhook_deliveries_alert_id_alerts'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_webhook_deliveries')),
    sa.UniqueConstraint('target', 'idempotency_key', name=op.f('uq_webhook_deliveries_target_idempotency_key'))
    )
    op.create_index('ix_webhook_deliveries_state_next_attempt_at', 'webhook_deliveries', ['state', 'next_attempt_at'], unique=False)



def downgrade() -> None:
    """Downgrade the schema."""
    op.drop_index('ix_webhook_deliveries_state_next_attempt_at', table_name='webhook_deliveries')

    op.drop_table('webhook_deliveries')
    op.drop_index('ix_probe_results_at_bucket', table_name='probe_results')

    op.drop_table('probe_results')
    op.drop_table('flags')
    op.drop_index('ix_compile_events_instance_id_at', table_name='compile_events')
    op.drop_index(op.f('ix_compile_events_at'), table_name='compile_events')

    op.drop_table('compile_events')
    op.drop_index(op.f('ix_alert_transitions_alert_id'), table_name='alert_transitions')

    op.drop_table('alert_transitions')
    op.drop_table('traffic_rollups')
    op.drop_table('reports')
    op.drop_index('ix_probe_runs_kind_started_at', table_name='probe_runs')

    op.drop_table('probe_runs')
    op.drop_index('ix_memory_samples_instance_id_at', table_name='memory_samples')
    op.drop_index(op.f('ix_memory_samples_at'), table_name='memory_samples')

    op.drop_table('memory_samples')
    op.drop_index('ix_flag_audits_name_scope_at', table_name='flag_audits')
    op.drop_index(op.f('ix_flag_audits_at'), table_name='flag_audits')

    op.drop_table('flag_audits')
    op.drop_index('ix_baselines_metric_scope_key_active', table_name='baselines')

    op.drop_table('baselines')
    op.drop_index('uq_alerts_fingerprint_open', table_name='alerts')
    op.drop_index('ix_alerts_state_started_at', table_name='alerts')

    op.drop_table('alerts')
