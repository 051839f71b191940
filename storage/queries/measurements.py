"""Raw measurement rows of a window, as the alert series aggregate them per cycle."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Label, Row, Text, cast, select
from sqlalchemy.orm import InstrumentedAttribute, Session

from storage.batch_rollups import ENGINE_SCOPE
from storage.models import (
    VARIANT_OPTIMIZED,
    BatchRollup,
    CompileEvent,
    MemorySample,
    ProbeResult,
    ProbeRun,
    TrafficRollup,
)
from vocab import RunKind


def _text(column: InstrumentedAttribute[Any]) -> Label[str]:
    # A sketch as its stored JSON text: the caller decodes only the ones it reads.
    return cast(column, Text).label(column.key)


# The columns the alert series read: plain rows, not ORM objects (an evaluation reads
# thousands of them a minute; identity-mapped entities cost more than the query).
# Sketches come as JSON text (see `_text`).
# Quantiles come from the sketches: the stored per-row quantiles are not read.
CANARY_COLUMNS = (ProbeResult.at, ProbeResult.bucket, ProbeResult.path, ProbeResult.decoding,
                  ProbeResult.count, ProbeResult.errors,
                  _text(ProbeResult.latency_sketch), _text(ProbeResult.ttft_sketch),
                  _text(ProbeResult.per_token_sketch), ProbeResult.padding_waste,
                  ProbeResult.draft_tokens, ProbeResult.accepted_tokens)
TRAFFIC_COLUMNS = (TrafficRollup.minute, TrafficRollup.bucket, TrafficRollup.path,
                   TrafficRollup.decoding, TrafficRollup.instance_id, TrafficRollup.requests,
                   TrafficRollup.errors, TrafficRollup.rejections, TrafficRollup.overflow,
                   TrafficRollup.latency_sum_s, _text(TrafficRollup.latency_sketch),
                   _text(TrafficRollup.ttft_sketch), _text(TrafficRollup.per_token_sketch),
                   TrafficRollup.ttft_sum_s, TrafficRollup.input_tokens_sum,
                   TrafficRollup.padded_tokens_sum, TrafficRollup.output_tokens_sum,
                   TrafficRollup.draft_tokens, TrafficRollup.accepted_tokens)


def canary_cycle_results(session: Session, start: datetime, end: datetime) -> list[Row[Any]]:
    """Return CANARY_COLUMNS + instance_id of the optimized-variant results of "cycle" runs
    in [start, end) (A/B arms left out)."""
    # The run looked up per result row (its primary key), not joined: a join lets both
    # SQLite and PostgreSQL drive it from every cycle run ever, when the window's results
    # come cheaply from their `at` index.
    inst = (select(ProbeRun.instance_id)
            .where(ProbeRun.id == ProbeResult.run_id, ProbeRun.kind == RunKind.CYCLE.value)
            .scalar_subquery().label("instance_id"))
    q = select(*CANARY_COLUMNS, inst).where(ProbeResult.at >= start, ProbeResult.at < end,
                                            ProbeResult.variant == VARIANT_OPTIMIZED)
    # No instance: the run is not a cycle run (A/B or burst).
    rows: list[Row[Any]] = list(session.execute(q))
    return [r for r in rows if r.instance_id is not None]


def failed_cycle_runs(session: Session, start: datetime,
                      end: datetime) -> list[tuple[datetime, str]]:
    """Return (started_at, instance_id) of "cycle" runs in [start, end) that failed as a whole."""
    q = select(ProbeRun.started_at, ProbeRun.instance_id).where(
        ProbeRun.started_at >= start, ProbeRun.started_at < end, ProbeRun.kind == "cycle",
        ProbeRun.status != "ok")
    return [(at, inst) for at, inst in session.execute(q)]


def traffic_rollups(session: Session, start: datetime, end: datetime) -> list[Row[Any]]:
    """Return TRAFFIC_COLUMNS of the traffic rollup rows of minutes in [start, end)."""
    q = select(*TRAFFIC_COLUMNS).where(TrafficRollup.minute >= start, TrafficRollup.minute < end)
    return list(session.execute(q))


BATCH_COLUMNS = (BatchRollup.minute, BatchRollup.bucket, BatchRollup.decoding,
                 BatchRollup.instance_id, BatchRollup.batch, BatchRollup.requests,
                 BatchRollup.latency_sum_s, BatchRollup.queue_wait_sum_s,
                 BatchRollup.batch_wait_sum_s, BatchRollup.row_tokens_sum,
                 BatchRollup.decode_sum_s, _text(BatchRollup.latency_sketch))


def batch_minutes(session: Session, start: datetime, end: datetime) -> list[Row[Any]]:
    """Return BATCH_COLUMNS of the batch rollup rows of minutes in [start, end), the
    engine's own rows (ENGINE_SCOPE) left out."""
    q = (select(*BATCH_COLUMNS)
         .where(BatchRollup.minute >= start, BatchRollup.minute < end,
                BatchRollup.bucket != ENGINE_SCOPE)
         .order_by(BatchRollup.minute, BatchRollup.id))
    return list(session.execute(q))


def burst_runs(session: Session, start: datetime, end: datetime) -> list[ProbeRun]:
    """Return the burst runs started in [start, end)."""
    q = select(ProbeRun).where(ProbeRun.started_at >= start, ProbeRun.started_at < end,
                               ProbeRun.kind == "burst")
    return list(session.scalars(q))


def compile_events(session: Session, start: datetime, end: datetime) -> list[Row[Any]]:
    """Return (at, instance_id, recompiles, limit_hits, failures) of compile events in range."""
    c = CompileEvent
    q = select(c.at, c.instance_id, c.recompiles, c.limit_hits, c.failures).where(
        c.at >= start, c.at < end)
    return list(session.execute(q))


def memory_samples(session: Session, start: datetime, end: datetime) -> list[Row[Any]]:
    """Return (at, instance_id, cuda_allocated_bytes, rss_bytes) of memory samples in range."""
    m = MemorySample
    q = select(m.at, m.instance_id, m.cuda_allocated_bytes, m.rss_bytes).where(
        m.at >= start, m.at < end)
    return list(session.execute(q))
