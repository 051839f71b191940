"""SQLAlchemy 2.0 tables: what tailwatch records and what it decides.

Every timestamp column is a `UTCDateTime`: timezone-aware UTC in Python on SQLite
and PostgreSQL alike. Counters default to 0 so writers may leave them out.
Histogram columns hold JSON lists of counts over the fixed edges of
`storage.histograms` (len(edges) + 1 entries, the last one counting values above
the last edge). Label and reason maps are JSON objects.

Tables and their classes:
    probe_runs          ProbeRun        one canary cycle, burst or A/B probe
    probe_results       ProbeResult     per run x bucket x path x decoding x variant
    traffic_rollups     TrafficRollup   real traffic per minute x instance x bucket x path x decoding
    batch_rollups       BatchRollup     batching per minute x instance x bucket x batch size x decoding
    memory_samples      MemorySample
    compile_events      CompileEvent    compile counter deltas (CompileDelta)
    baselines           Baseline
    alerts              Alert           + alert_transitions AlertTransition
    incidents           Incident        alerts grouped by time and scope
                                        + incident_members IncidentMember, incident_events
    webhook_deliveries  WebhookDelivery the outbox
    flags               Flag            + flag_audits FlagAudit
    reports             Report
    canary_references   CanaryReference the reference path's output per canary and cohort
    output_agreements   OutputAgreement outputs vs references per run x bucket x path x ... x variant
    series_chunks       SeriesChunk     an hour of a baseline series' per-cycle values per cohort
    rollout_verdicts    RolloutVerdict  a new cohort judged against the old one per metric x bucket
    rule_sensitivities  RuleSensitivity what a rule can see on one series, and its threshold in force
    applied_batches     AppliedBatch    the storage Writer's batch tokens (exactly-once retries)
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

from vocab import SCOPE_GLOBAL, RunKind, RunStatus, Variant, utcnow

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# Allowed values of the enumerated string columns (checked by the database too).
RUN_STATUSES = tuple(s.value for s in RunStatus)
RUN_KINDS = tuple(k.value for k in RunKind)
VARIANT_OPTIMIZED = Variant.OPTIMIZED.value
VARIANTS = tuple(v.value for v in Variant)
BASELINE_KINDS = ("rolling", "pinned")
ALERT_STATES = ("pending", "firing", "resolved")
INCIDENT_STATES = ("open", "resolved")
# failed: a dead letter (4xx or past the max age; listed, retryable); superseded: a firing
# never delivered whose resolved went instead.
DELIVERY_STATES = ("pending", "delivered", "failed", "superseded")
FLAG_SOURCES = ("manual", "auto")
FLAG_SCOPE_GLOBAL = SCOPE_GLOBAL


def scope_key(labels: Mapping[str, object]) -> str:
    """Return the canonical string of a label map: sorted `k=v` joined by commas."""
    return ",".join(f"{k}={labels[k]}" for k in sorted(labels))


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class NaiveDatetimeError(ValueError):
    """A naive datetime was bound to a UTC column."""


class UTCDateTime(TypeDecorator[datetime]):
    """Store aware datetimes as UTC; return them aware UTC (SQLite keeps naive UTC text)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if not isinstance(value, datetime):
            raise TypeError(f"expected a datetime, got {type(value).__name__}")
        if value.tzinfo is None or value.utcoffset() is None:
            raise NaiveDatetimeError(f"naive datetime {value.isoformat()}: pass a timezone-aware one")
        value = value.astimezone(UTC)
        # SQLite compares text: keep one format (naive UTC) so ranges order correctly.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def _json() -> JSON:
    # none_as_null: a Python None is SQL NULL, not the JSON literal 'null'.
    return JSON(none_as_null=True)


class Base(DeclarativeBase):
    """Declarative base with a naming convention Alembic can rely on."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class ProbeRun(Base):
    """One probe execution: a canary cycle, a burst or an A/B comparison."""

    __tablename__ = "probe_runs"
    __table_args__ = (
        CheckConstraint(_in("status", RUN_STATUSES), name="status"),
        CheckConstraint(_in("kind", RUN_KINDS), name="kind"),
        Index("ix_probe_runs_kind_started_at", "kind", "started_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    status: Mapped[str] = mapped_column(String(16), default="ok")
    error: Mapped[str | None] = mapped_column(Text)
    instance_id: Mapped[str] = mapped_column(String(128))
    model_version: Mapped[str] = mapped_column(String(128), default="")
    config_hash: Mapped[str] = mapped_column(String(64), default="")
    device: Mapped[str] = mapped_column(String(32), default="")
    suite: Mapped[str] = mapped_column(String(64), default="")
    kind: Mapped[str] = mapped_column(String(16), default="cycle")
    # Burst probes only.
    rate_per_s: Mapped[float | None] = mapped_column(Float)
    requests: Mapped[int | None] = mapped_column(Integer)
    rejections: Mapped[int | None] = mapped_column(Integer)
    queue_wait_p95_s: Mapped[float | None] = mapped_column(Float)
    details: Mapped[dict[str, Any] | None] = mapped_column(_json())

    results: Mapped[list[ProbeResult]] = relationship(
        back_populates="run", cascade="all, delete-orphan", passive_deletes=True
    )


class ProbeResult(Base):
    """Aggregate of one run's canaries in one bucket x path x decoding x variant.

    count: requests sent (errors included); errors: requests that failed.
    Latencies in seconds over the successful requests; `at` repeats the run's
    start so time-window queries need no join.
    """

    __tablename__ = "probe_results"
    __table_args__ = (
        UniqueConstraint("run_id", "bucket", "path", "decoding", "variant"),
        Index("ix_probe_results_at_bucket", "at", "bucket"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("probe_runs.id", ondelete="CASCADE"))
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    bucket: Mapped[str] = mapped_column(String(16))
    path: Mapped[str] = mapped_column(String(16))
    decoding: Mapped[str] = mapped_column(String(16))
    variant: Mapped[str] = mapped_column(String(16), default=VARIANT_OPTIMIZED)
    count: Mapped[int] = mapped_column(Integer, default=0)
    errors: Mapped[int] = mapped_column(Integer, default=0)
    p50_s: Mapped[float | None] = mapped_column(Float)
    p95_s: Mapped[float | None] = mapped_column(Float)
    p99_s: Mapped[float | None] = mapped_column(Float)
    max_s: Mapped[float | None] = mapped_column(Float)
    ttft_p50_s: Mapped[float | None] = mapped_column(Float)
    ttft_p95_s: Mapped[float | None] = mapped_column(Float)
    per_token_p50_s: Mapped[float | None] = mapped_column(Float)
    input_tokens_min: Mapped[int | None] = mapped_column(Integer)
    input_tokens_mean: Mapped[float | None] = mapped_column(Float)
    input_tokens_max: Mapped[int | None] = mapped_column(Integer)
    padded_length: Mapped[int | None] = mapped_column(Integer)
    padding_waste: Mapped[float | None] = mapped_column(Float)
    output_tokens: Mapped[int] = mapped_column(Integer, default=0)
    drafts: Mapped[int] = mapped_column(Integer, default=0)
    draft_tokens: Mapped[int] = mapped_column(Integer, default=0)
    accepted_tokens: Mapped[int] = mapped_column(Integer, default=0)
    accepted_per_position: Mapped[list[int]] = mapped_column(_json(), default=list)
    # storage.sketches: the group's latencies, TTFTs and per-token times (windows merge
    # them); samples: the successful requests p50_s..max_s rest on.
    latency_sketch: Mapped[dict[str, Any]] = mapped_column(_json(), default=dict)
    ttft_sketch: Mapped[dict[str, Any]] = mapped_column(_json(), default=dict)
    per_token_sketch: Mapped[dict[str, Any]] = mapped_column(_json(), default=dict)
    samples: Mapped[int] = mapped_column(Integer, default=0)

    run: Mapped[ProbeRun] = relationship(back_populates="results")


class TrafficRollup(Base):
    """Real (non-canary) traffic of one minute; writers add to it via storage.rollups."""

    __tablename__ = "traffic_rollups"
    __table_args__ = (
        UniqueConstraint("minute", "instance_id", "bucket", "path", "decoding"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    minute: Mapped[datetime] = mapped_column(UTCDateTime)
    instance_id: Mapped[str] = mapped_column(String(128))
    bucket: Mapped[str] = mapped_column(String(16))
    path: Mapped[str] = mapped_column(String(16))
    decoding: Mapped[str] = mapped_column(String(16))
    requests: Mapped[int] = mapped_column(Integer, default=0)
    errors: Mapped[int] = mapped_column(Integer, default=0)
    rejections: Mapped[int] = mapped_column(Integer, default=0)
    overflow: Mapped[int] = mapped_column(Integer, default=0)
    latency_sum_s: Mapped[float] = mapped_column(Float, default=0.0)
    ttft_sum_s: Mapped[float] = mapped_column(Float, default=0.0)
    input_tokens_sum: Mapped[int] = mapped_column(BigInteger, default=0)
    padded_tokens_sum: Mapped[int] = mapped_column(BigInteger, default=0)
    output_tokens_sum: Mapped[int] = mapped_column(BigInteger, default=0)
    drafts: Mapped[int] = mapped_column(Integer, default=0)
    draft_tokens: Mapped[int] = mapped_column(Integer, default=0)
    accepted_tokens: Mapped[int] = mapped_column(Integer, default=0)
    accepted_per_position: Mapped[list[int]] = mapped_column(_json(), default=list)
    probation_requests: Mapped[int] = mapped_column(Integer, default=0)
    probation_draft_tokens: Mapped[int] = mapped_column(Integer, default=0)
    probation_accepted: Mapped[int] = mapped_column(Integer, default=0)
    # storage.sketches (0.35% relative accuracy, merged over any window): request latency,
    # TTFT, and each request's mean per-token time weighted by its tokens after the first.
    latency_sketch: Mapped[dict[str, Any]] = mapped_column(_json(), default=dict)
    ttft_sketch: Mapped[dict[str, Any]] = mapped_column(_json(), default=dict)
    per_token_sketch: Mapped[dict[str, Any]] = mapped_column(_json(), default=dict)
    # Exact input / output length counts {"<tokens>": requests}.
    input_lens: Mapped[dict[str, int]] = mapped_column(_json(), default=dict)
    output_lens: Mapped[dict[str, int]] = mapped_column(_json(), default=dict)


class BatchRollup(Base):
    """Batching of one minute; writers add to it via storage.batch_rollups.

    Request rows (real traffic): bucket, `batch` (the request's mean batch size class:
    "1", "2", "4", ... each class up to the next power of two) and decoding. Engine rows
    (bucket, batch and decoding "all"): the batching loop, sampled at each traffic flush:
    rows waiting and in the batch at each sample, step counts and seconds by phase since
    the previous sample.
    """

    __tablename__ = "batch_rollups"
    __table_args__ = (
        UniqueConstraint("minute", "instance_id", "bucket", "batch", "decoding"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    minute: Mapped[datetime] = mapped_column(UTCDateTime)
    instance_id: Mapped[str] = mapped_column(String(128))
    bucket: Mapped[str] = mapped_column(String(16))
    batch: Mapped[str] = mapped_column(String(16))
    decoding: Mapped[str] = mapped_column(String(16))
    # Request rows.
    requests: Mapped[int] = mapped_column(Integer, default=0)
    batched_requests: Mapped[int] = mapped_column(Integer, default=0)  # ran in the loop
    batch_size_sum: Mapped[float] = mapped_column(Float, default=0.0)  # of each mean
    batch_size_max: Mapped[int] = mapped_column(Integer, default=0)
    queue_wait_sum_s: Mapped[float] = mapped_column(Float, default=0.0)  # entry -> row
    batch_wait_sum_s: Mapped[float] = mapped_column(Float, default=0.0)  # row -> loop took it
    latency_sum_s: Mapped[float] = mapped_column(Float, default=0.0)
    output_tokens_sum: Mapped[int] = mapped_column(BigInteger, default=0)
    # Tokens after each request's first, their seconds, and those tokens times the
    # request's mean batch size: row_tokens_sum / decode_sum_s is the tokens per second
    # of the steps the requests took part in, all rows counted.
    decode_tokens_sum: Mapped[int] = mapped_column(BigInteger, default=0)
    decode_sum_s: Mapped[float] = mapped_column(Float, default=0.0)
    row_tokens_sum: Mapped[float] = mapped_column(Float, default=0.0)
    latency_sketch: Mapped[dict[str, Any]] = mapped_column(_json(), default=dict)
    # Engine rows.
    samples: Mapped[int] = mapped_column(Integer, default=0)
    rows_waiting_sum: Mapped[int] = mapped_column(Integer, default=0)
    rows_waiting_max: Mapped[int] = mapped_column(Integer, default=0)
    batch_now_sum: Mapped[int] = mapped_column(Integer, default=0)
    window_sum_s: Mapped[float] = mapped_column(Float, default=0.0)
    steps: Mapped[int] = mapped_column(Integer, default=0)
    encode_steps: Mapped[int] = mapped_column(Integer, default=0)
    encode_s: Mapped[float] = mapped_column(Float, default=0.0)
    decode_steps: Mapped[int] = mapped_column(Integer, default=0)
    decode_s: Mapped[float] = mapped_column(Float, default=0.0)
    verify_steps: Mapped[int] = mapped_column(Integer, default=0)
    verify_s: Mapped[float] = mapped_column(Float, default=0.0)


class MemorySample(Base):
    """Process and device memory at one moment (bytes; CUDA fields None on CPU)."""

    __tablename__ = "memory_samples"
    __table_args__ = (Index("ix_memory_samples_instance_id_at", "instance_id", "at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    instance_id: Mapped[str] = mapped_column(String(128))
    device: Mapped[str] = mapped_column(String(32), default="")
    rss_bytes: Mapped[int] = mapped_column(BigInteger)
    kv_cache_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    # engine.protocol.MemorySnapshot: the static self-attention part, and the peak of the
    # per-request cross-attention part since start (kv_cache_bytes = static + running now).
    kv_static_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    kv_request_peak_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    cuda_allocated_bytes: Mapped[int | None] = mapped_column(BigInteger)
    cuda_reserved_bytes: Mapped[int | None] = mapped_column(BigInteger)
    cuda_peak_bytes: Mapped[int | None] = mapped_column(BigInteger)
    cuda_alloc_retries: Mapped[int | None] = mapped_column(Integer)
    cuda_ooms: Mapped[int | None] = mapped_column(Integer)


class CompileEvent(Base):
    """Compile counters that changed between two snapshots (an engine.CompileDelta)."""

    __tablename__ = "compile_events"
    __table_args__ = (Index("ix_compile_events_instance_id_at", "instance_id", "at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    instance_id: Mapped[str] = mapped_column(String(128))
    run_id: Mapped[int | None] = mapped_column(ForeignKey("probe_runs.id", ondelete="SET NULL"))
    graphs: Mapped[int] = mapped_column(Integer, default=0)
    recompiles: Mapped[int] = mapped_column(Integer, default=0)
    recompile_reasons: Mapped[dict[str, int]] = mapped_column(_json(), default=dict)
    graph_breaks: Mapped[int] = mapped_column(Integer, default=0)
    graph_break_reasons: Mapped[dict[str, int]] = mapped_column(_json(), default=dict)
    compile_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    limit_hits: Mapped[int] = mapped_column(Integer, default=0)
    failures: Mapped[int] = mapped_column(Integer, default=0)


class Baseline(Base):
    """A reference value of a metric in a scope (labels), rolling or pinned by a person."""

    __tablename__ = "baselines"
    __table_args__ = (
        CheckConstraint(_in("kind", BASELINE_KINDS), name="kind"),
        Index("ix_baselines_metric_scope_key_active", "metric", "scope_key", "active"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    metric: Mapped[str] = mapped_column(String(64))
    scope: Mapped[dict[str, str]] = mapped_column(_json(), default=dict)
    scope_key: Mapped[str] = mapped_column(String(255), default="")  # storage.models.scope_key(scope)
    value: Mapped[float] = mapped_column(Float)
    samples: Mapped[int] = mapped_column(Integer, default=0)
    window_start: Mapped[datetime | None] = mapped_column(UTCDateTime)
    window_end: Mapped[datetime | None] = mapped_column(UTCDateTime)
    kind: Mapped[str] = mapped_column(String(16), default="rolling")
    model_version: Mapped[str] = mapped_column(String(128), default="")
    config_hash: Mapped[str] = mapped_column(String(64), default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    pinned_by: Mapped[str | None] = mapped_column(String(128))
    note: Mapped[str | None] = mapped_column(Text)
    # Robust sigma of the per-cycle values (pinned rows copy the rolling one's); None: unknown.
    spread: Mapped[float | None] = mapped_column(Float)
    # Quantile rules: median of the cycles' own sample medians (the canaries' body, beside a
    # tail quantile's centre); pinned rows copy the rolling one's; None: unknown.
    body: Mapped[float | None] = mapped_column(Float)
    active: Mapped[bool] = mapped_column(Boolean, default=True)


class Alert(Base):
    """One alert's lifecycle; at most one non-resolved alert per fingerprint."""

    __tablename__ = "alerts"
    __table_args__ = (
        CheckConstraint(_in("state", ALERT_STATES), name="state"),
        Index(
            "uq_alerts_fingerprint_open",
            "fingerprint",
            unique=True,
            sqlite_where=text("state != 'resolved'"),
            postgresql_where=text("state != 'resolved'"),
        ),
        Index("ix_alerts_state_started_at", "state", "started_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(64))
    rule: Mapped[str] = mapped_column(String(128))
    labels: Mapped[dict[str, str]] = mapped_column(_json(), default=dict)
    annotations: Mapped[dict[str, str]] = mapped_column(_json(), default=dict)
    severity: Mapped[str] = mapped_column(String(16), default="warning")
    state: Mapped[str] = mapped_column(String(16), default="pending")
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    fired_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    resolved_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_notified_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    value: Mapped[float | None] = mapped_column(Float)
    baseline: Mapped[float | None] = mapped_column(Float)
    relative_change: Mapped[float | None] = mapped_column(Float)
    threshold: Mapped[float | None] = mapped_column(Float)
    consecutive_breaches: Mapped[int] = mapped_column(Integer, default=0)
    consecutive_ok: Mapped[int] = mapped_column(Integer, default=0)

    transitions: Mapped[list[AlertTransition]] = relationship(
        back_populates="alert",
        cascade="all, delete-orphan",
        passive_deletes=True,
        order_by="AlertTransition.id",
    )


class AlertTransition(Base):
    """One state change of an alert (from_state None when the alert was created)."""

    __tablename__ = "alert_transitions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    alert_id: Mapped[int] = mapped_column(
        ForeignKey("alerts.id", ondelete="CASCADE"), index=True
    )
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    value: Mapped[float | None] = mapped_column(Float)
    baseline: Mapped[float | None] = mapped_column(Float)
    relative_change: Mapped[float | None] = mapped_column(Float)
    reason: Mapped[str | None] = mapped_column(Text)

    alert: Mapped[Alert] = relationship(back_populates="transitions")


class Incident(Base):
    """Alerts that fired together in a shared scope: one page, one probable cause.

    families/buckets/instances/cohorts: sorted JSON lists of what its members cover;
    cause: a kind (host_or_load, optimization, one_instance, one_bucket, unknown) with
    its `cause_text` and `evidence` (the numbers compared, alerts.cause); notified_members:
    the ids of the members firing at the last notification (an update goes out when the
    members firing change: one joined or one resolved).
    """

    __tablename__ = "incidents"
    __table_args__ = (
        CheckConstraint(_in("state", INCIDENT_STATES), name="state"),
        Index("ix_incidents_state_started_at", "state", "started_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    state: Mapped[str] = mapped_column(String(16), default="open")
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    resolved_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    severity: Mapped[str] = mapped_column(String(16), default="warning")
    families: Mapped[list[str]] = mapped_column(_json(), default=list)
    buckets: Mapped[list[str]] = mapped_column(_json(), default=list)
    instances: Mapped[list[str]] = mapped_column(_json(), default=list)
    cohorts: Mapped[list[str]] = mapped_column(_json(), default=list)
    summary: Mapped[str] = mapped_column(Text, default="")
    cause: Mapped[str] = mapped_column(String(32), default="unknown")
    cause_text: Mapped[str] = mapped_column(Text, default="")
    evidence: Mapped[dict[str, Any]] = mapped_column(_json(), default=dict)
    reopened: Mapped[int] = mapped_column(Integer, default=0)
    last_notified_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_resent_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # alertmanager_api
    notified_members: Mapped[list[int]] = mapped_column(_json(), default=list)
    # The severity in force at the last firing notification: a firing member more severe
    # is an escalation; a page told, with no page member firing any more, a de-escalation.
    notified_severity: Mapped[str | None] = mapped_column(String(16))
    # The cause the counter by cause counts it under, set once (its first cause other than
    # unknown, or the one it resolved with): `cause` is restated while it is open, and a
    # counter read from it would go down. Null: not counted yet.
    counted_cause: Mapped[str | None] = mapped_column(String(32))

    events: Mapped[list[IncidentEvent]] = relationship(
        back_populates="incident", cascade="all, delete-orphan", passive_deletes=True,
        order_by="IncidentEvent.id")
    members: Mapped[list[IncidentMember]] = relationship(
        back_populates="incident", cascade="all, delete-orphan", passive_deletes=True,
        order_by="IncidentMember.id")


class IncidentMember(Base):
    """An alert that joined an incident when it fired (an alert joins at most one)."""

    __tablename__ = "incident_members"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    incident_id: Mapped[int] = mapped_column(
        ForeignKey("incidents.id", ondelete="CASCADE"), index=True)
    alert_id: Mapped[int] = mapped_column(
        ForeignKey("alerts.id", ondelete="CASCADE"), unique=True)
    joined_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    incident: Mapped[Incident] = relationship(back_populates="members")
    alert: Mapped[Alert] = relationship()


class IncidentEvent(Base):
    """One step of an incident's timeline: opened, joined, left, resolved, reopened,
    deescalated, notified.

    A "notified" event's detail is the notification's idempotency key (its outbox rows).
    """

    __tablename__ = "incident_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    incident_id: Mapped[int] = mapped_column(
        ForeignKey("incidents.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    kind: Mapped[str] = mapped_column(String(16))
    alert_id: Mapped[int | None] = mapped_column(ForeignKey("alerts.id", ondelete="SET NULL"))
    detail: Mapped[str] = mapped_column(Text, default="")

    incident: Mapped[Incident] = relationship(back_populates="events")


class WebhookDelivery(Base):
    """One message to one webhook target (the outbox row a sender works off)."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        UniqueConstraint("target", "idempotency_key"),
        CheckConstraint(_in("state", DELIVERY_STATES), name="state"),
        Index("ix_webhook_deliveries_state_next_attempt_at", "state", "next_attempt_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    target: Mapped[str] = mapped_column(String(64))
    url: Mapped[str] = mapped_column(Text)
    format: Mapped[str] = mapped_column(String(32), default="alertmanager")
    payload: Mapped[dict[str, Any]] = mapped_column(_json())
    idempotency_key: Mapped[str] = mapped_column(String(128))
    alert_id: Mapped[int | None] = mapped_column(ForeignKey("alerts.id", ondelete="SET NULL"))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_status: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16), default="pending")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    retried_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # last manual retry: max age restarts


class Flag(Base):
    """A runtime flag value in a scope ("global" or a bucket label such as "64")."""

    __tablename__ = "flags"
    __table_args__ = (
        UniqueConstraint("name", "scope", "source"),
        CheckConstraint(_in("source", FLAG_SOURCES), name="source"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64))
    scope: Mapped[str] = mapped_column(String(64), default=FLAG_SCOPE_GLOBAL)
    value: Mapped[Any] = mapped_column(_json())
    source: Mapped[str] = mapped_column(String(16), default="manual")
    reason: Mapped[str | None] = mapped_column(Text)
    actor: Mapped[str] = mapped_column(String(128), default="")
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    alert_id: Mapped[int | None] = mapped_column(ForeignKey("alerts.id", ondelete="SET NULL"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class FlagAudit(Base):
    """One change to a flag: who, when, what, why (kept forever)."""

    __tablename__ = "flag_audits"
    __table_args__ = (Index("ix_flag_audits_name_scope_at", "name", "scope", "at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    name: Mapped[str] = mapped_column(String(64))
    scope: Mapped[str] = mapped_column(String(64), default=FLAG_SCOPE_GLOBAL)
    actor: Mapped[str] = mapped_column(String(128), default="")
    source: Mapped[str] = mapped_column(String(16), default="manual")
    action: Mapped[str] = mapped_column(String(16))  # e.g. set / clear / expire
    old_value: Mapped[Any] = mapped_column(_json(), nullable=True)
    new_value: Mapped[Any] = mapped_column(_json(), nullable=True)
    reason: Mapped[str | None] = mapped_column(Text)
    # The alert an automatic change answered (set, restore, revert, expire); None: manual.
    alert_id: Mapped[int | None] = mapped_column(ForeignKey("alerts.id", ondelete="SET NULL"))


class Report(Base):
    """A weekly assumption-review report; one per ISO week ("2026-W48")."""

    __tablename__ = "reports"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    week: Mapped[str] = mapped_column(String(10), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    markdown: Mapped[str] = mapped_column(Text, default="")
    html: Mapped[str] = mapped_column(Text, default="")
    summary: Mapped[dict[str, Any]] = mapped_column(_json(), default=dict)


class CanaryReference(Base):
    """The reference path's output of one canary in one cohort (model_version, config_hash).

    prompt_key: sha256 of max_new_tokens and the prompt (probes.quality.prompt_key): the
    same prompt asked for fewer tokens has another reference.
    """

    __tablename__ = "canary_references"
    __table_args__ = (UniqueConstraint("model_version", "config_hash", "prompt_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    model_version: Mapped[str] = mapped_column(String(128))
    config_hash: Mapped[str] = mapped_column(String(64))
    prompt_key: Mapped[str] = mapped_column(String(64))
    suite: Mapped[str] = mapped_column(String(64), default="")
    bucket: Mapped[str] = mapped_column(String(16), default="")
    output_ids: Mapped[list[int]] = mapped_column(_json(), default=list)
    text: Mapped[str | None] = mapped_column(Text)


class OutputAgreement(Base):
    """Outputs compared with their references, per run x bucket x path x decoding x variant.

    source: canary (run_id set) or traffic (a sampled real request replayed on the
    reference path; run_id None, one row per request, never its text unless
    quality.store_text). count: outputs compared; exact: those equal to the reference;
    agreement_sum: sum of per-output token agreement (share of positions equal up to the
    shorter length); length_diff_sum: sum of |len(output) - len(reference)|;
    first_divergence_min: the earliest first divergence (None: every output matched);
    worst: up to 3 {key, agreement, first_divergence, length_diff}, lowest agreement first.
    golden_count: outputs whose canary carries a golden answer (`expected` in a suites
    file); golden_exact: those equal to it (exact-match accuracy, probes.quality).
    """

    __tablename__ = "output_agreements"
    __table_args__ = (
        UniqueConstraint("run_id", "bucket", "path", "decoding", "variant"),
        Index("ix_output_agreements_at_bucket", "at", "bucket"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int | None] = mapped_column(ForeignKey("probe_runs.id", ondelete="CASCADE"))
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    source: Mapped[str] = mapped_column(String(16), default="canary")
    instance_id: Mapped[str] = mapped_column(String(128), default="")
    model_version: Mapped[str] = mapped_column(String(128), default="")
    config_hash: Mapped[str] = mapped_column(String(64), default="")
    bucket: Mapped[str] = mapped_column(String(16))
    path: Mapped[str] = mapped_column(String(16))
    decoding: Mapped[str] = mapped_column(String(16))
    variant: Mapped[str] = mapped_column(String(16), default=VARIANT_OPTIMIZED)
    count: Mapped[int] = mapped_column(Integer, default=0)
    exact: Mapped[int] = mapped_column(Integer, default=0)
    agreement_sum: Mapped[float] = mapped_column(Float, default=0.0)
    length_diff_sum: Mapped[int] = mapped_column(Integer, default=0)
    first_divergence_min: Mapped[int | None] = mapped_column(Integer)
    worst: Mapped[list[dict[str, Any]]] = mapped_column(_json(), default=list)
    text: Mapped[str | None] = mapped_column(Text)
    golden_count: Mapped[int] = mapped_column(Integer, default=0)
    golden_exact: Mapped[int] = mapped_column(Integer, default=0)


class SeriesChunk(Base):
    """One finished hour of one rule's per-cycle values in one scope and cohort.

    The stored aggregate rolling baselines are refreshed from (alerts.baselines), so an
    evaluation never re-reads raw history: scope_key is the baseline's scope
    (storage.models.scope_key of alerts.baselines.rule_scope), "" for the row that marks
    the hour done; values holds [cycle start (epoch s), value or None, samples] per cycle.
    """

    __tablename__ = "series_chunks"
    __table_args__ = (
        UniqueConstraint("rule", "scope_key", "model_version", "config_hash", "start",
                         name="uq_series_chunks_key"),
        Index("ix_series_chunks_rule_start", "rule", "start"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    rule: Mapped[str] = mapped_column(String(128))
    scope_key: Mapped[str] = mapped_column(String(255))
    model_version: Mapped[str] = mapped_column(String(128), default="")
    config_hash: Mapped[str] = mapped_column(String(64), default="")
    start: Mapped[datetime] = mapped_column(UTCDateTime)
    values: Mapped[list[list[Any]]] = mapped_column(_json(), default=list)


class RolloutVerdict(Base):
    """The latest judgement of a new cohort against the old one, per source x metric x bucket.

    verdict: pass / marginal / fail (alerts.rollout); p_value: one-sided Mann-Whitney U
    of the new cohort's per-cycle values being worse; relative_change: new median vs old
    median. One row per comparison, updated by every evaluation while both cohorts serve.
    """

    __tablename__ = "rollout_verdicts"
    __table_args__ = (
        UniqueConstraint("new_model_version", "new_config_hash", "old_model_version",
                         "old_config_hash", "source", "metric", "bucket",
                         name="uq_rollout_verdicts_key"),
        CheckConstraint("verdict IN ('pass', 'marginal', 'fail')", name="verdict"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    new_model_version: Mapped[str] = mapped_column(String(128))
    new_config_hash: Mapped[str] = mapped_column(String(64))
    old_model_version: Mapped[str] = mapped_column(String(128))
    old_config_hash: Mapped[str] = mapped_column(String(64))
    source: Mapped[str] = mapped_column(String(16), default="canary")
    metric: Mapped[str] = mapped_column(String(64))
    bucket: Mapped[str] = mapped_column(String(16))
    verdict: Mapped[str] = mapped_column(String(16))
    p_value: Mapped[float | None] = mapped_column(Float)
    relative_change: Mapped[float | None] = mapped_column(Float)
    threshold: Mapped[float] = mapped_column(Float)
    new_median: Mapped[float | None] = mapped_column(Float)
    old_median: Mapped[float | None] = mapped_column(Float)
    new_cycles: Mapped[int] = mapped_column(Integer, default=0)
    old_cycles: Mapped[int] = mapped_column(Integer, default=0)
    window_start: Mapped[datetime] = mapped_column(UTCDateTime)
    first_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class RuleSensitivity(Base):
    """What one rule can confirm on one series (scope x cohort) and the threshold in force.

    One row per rule, scope_key and cohort, rewritten by each estimate (alerts.sensitivity);
    baseline_id: the baseline row it was measured against. Thresholds and changes are
    relative and positive (0.15 = 15% in the rule's `direction`); detectable_change: the
    smallest shift confirmed within within_cycles cycles at p95 (None: not known);
    false_pages_30d: expected false pages per 30 days at `threshold` (the one in force),
    false_pages_configured at configured_threshold; budget_per_30d None: the budget is off;
    reason: why the threshold was widened, or why nothing is known.
    """

    __tablename__ = "rule_sensitivities"
    __table_args__ = (
        UniqueConstraint("rule", "scope_key", "model_version", "config_hash",
                         name="uq_rule_sensitivities_key"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    rule: Mapped[str] = mapped_column(String(128))
    metric: Mapped[str] = mapped_column(String(64))
    scope: Mapped[dict[str, str]] = mapped_column(_json(), default=dict)
    scope_key: Mapped[str] = mapped_column(String(255))
    model_version: Mapped[str] = mapped_column(String(128), default="")
    config_hash: Mapped[str] = mapped_column(String(64), default="")
    baseline_id: Mapped[int | None] = mapped_column(
        ForeignKey("baselines.id", ondelete="SET NULL"))
    computed_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    status: Mapped[str] = mapped_column(String(32))
    direction: Mapped[int] = mapped_column(Integer, default=1)  # +1 rising, -1 falling
    cycles: Mapped[int] = mapped_column(Integer, default=0)
    within_cycles: Mapped[int] = mapped_column(Integer)
    configured_threshold: Mapped[float] = mapped_column(Float)
    threshold: Mapped[float] = mapped_column(Float)
    detectable_change: Mapped[float | None] = mapped_column(Float)
    false_pages_30d: Mapped[float | None] = mapped_column(Float)
    false_pages_configured: Mapped[float | None] = mapped_column(Float)
    budget_per_30d: Mapped[float | None] = mapped_column(Float)
    reason: Mapped[str] = mapped_column(Text, default="")
    cpu_s: Mapped[float] = mapped_column(Float, default=0.0)


class AppliedBatch(Base):
    """The token of one committed storage Writer batch, written in the batch's transaction.

    A retry after an ambiguous commit (the connection lost after COMMIT was sent) finds its
    token here and writes nothing (storage.writer). Each writer deletes its committed
    tokens in bulk with a later batch, so the table holds at most
    storage.writer.TOKENS_KEPT rows per writer; retention prunes what stopped writers left.
    """

    __tablename__ = "applied_batches"

    token: Mapped[str] = mapped_column(String(32), primary_key=True)
    applied_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
