"""Delete data past its retention (the daily retention job calls `prune`).

Raw canary data (probe runs and results, memory samples) and output agreements (per run
or per sampled request) are kept `raw_days`; per-minute rollups (traffic and batch), compile events,
delivered or failed webhooks, resolved alerts (with their transitions), superseded
rolling baselines, hour chunks of the rule series (`series_chunks`, by hour) and rollout
verdicts (by their last update) are kept `rollup_days`. The evaluator already drops the
chunks older than each configured rule's baseline window; retention also removes those
of rules no longer configured. Flag audits, reports, flags and canary references (one
per cohort and prompt: what agreement is measured against when a cohort comes back) are
never pruned. Writer batch tokens (`applied_batches`: each running writer deletes its
own in bulk) left by writers that stopped are pruned after `raw_days`: a token matters
only while its batch is retried, which a reachable database ends within the writer's
backoff. The size this keeps: docs/operations.md#storage-and-retention (bench.storage;
tests/storage/test_retention.py holds a bound).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import CursorResult, Delete, delete, select, update
from sqlalchemy.orm import Session

from storage.errors import InvalidQuery
from storage.models import (
    Alert,
    AlertTransition,
    AppliedBatch,
    Baseline,
    BatchRollup,
    CompileEvent,
    MemorySample,
    OutputAgreement,
    ProbeResult,
    ProbeRun,
    RolloutVerdict,
    SeriesChunk,
    TrafficRollup,
    WebhookDelivery,
)


@dataclass(frozen=True)
class PruneResult:
    """Rows deleted per table."""

    probe_runs: int = 0
    probe_results: int = 0
    memory_samples: int = 0
    compile_events: int = 0
    traffic_rollups: int = 0
    batch_rollups: int = 0
    webhook_deliveries: int = 0
    alerts: int = 0
    alert_transitions: int = 0
    baselines: int = 0
    output_agreements: int = 0
    series_chunks: int = 0
    rollout_verdicts: int = 0
    applied_batches: int = 0

    @property
    def total(self) -> int:
        """Return all rows deleted."""
        return sum(getattr(self, f) for f in self.__dataclass_fields__)


def prune(session: Session, now: datetime, raw_days: int, rollup_days: int) -> PruneResult:
    """Delete rows older than their retention; the caller commits."""
    if raw_days < 1:
        raise InvalidQuery("raw_days", f"must be at least 1, got {raw_days}", value=raw_days)
    if rollup_days < raw_days:
        raise InvalidQuery("rollup_days", f"must be at least raw_days ({raw_days}), got "
                           f"{rollup_days}", value=rollup_days)
    raw_cut = now - timedelta(days=raw_days)
    rollup_cut = now - timedelta(days=rollup_days)

    def run(stmt: Delete) -> int:
        result = session.execute(stmt, execution_options={"synchronize_session": False})
        assert isinstance(result, CursorResult)
        return result.rowcount

    old_runs = select(ProbeRun.id).where(ProbeRun.started_at < raw_cut).scalar_subquery()
    # Children first: do not rely on ON DELETE CASCADE being enforced.
    results = run(delete(ProbeResult).where(ProbeResult.at < raw_cut))
    results += run(delete(ProbeResult).where(ProbeResult.run_id.in_(old_runs)))
    agreements = run(delete(OutputAgreement).where(OutputAgreement.at < raw_cut))
    agreements += run(delete(OutputAgreement).where(OutputAgreement.run_id.in_(old_runs)))
    old_alerts = select(Alert.id).where(Alert.state == "resolved",
                                        Alert.resolved_at < rollup_cut).scalar_subquery()
    transitions = run(delete(AlertTransition).where(AlertTransition.alert_id.in_(old_alerts)))
    compile_events = run(delete(CompileEvent).where(CompileEvent.at < rollup_cut))
    session.execute(
        update(CompileEvent).where(CompileEvent.run_id.in_(old_runs)).values(run_id=None)
    )
    return PruneResult(
        probe_results=results,
        compile_events=compile_events,
        probe_runs=run(delete(ProbeRun).where(ProbeRun.started_at < raw_cut)),
        memory_samples=run(delete(MemorySample).where(MemorySample.at < raw_cut)),
        traffic_rollups=run(delete(TrafficRollup).where(TrafficRollup.minute < rollup_cut)),
        batch_rollups=run(delete(BatchRollup).where(BatchRollup.minute < rollup_cut)),
        webhook_deliveries=run(delete(WebhookDelivery).where(
            WebhookDelivery.state.in_(("delivered", "failed")),
            WebhookDelivery.created_at < rollup_cut,
        )),
        alert_transitions=transitions,
        alerts=run(delete(Alert).where(Alert.state == "resolved", Alert.resolved_at < rollup_cut)),
        baselines=run(delete(Baseline).where(
            Baseline.kind == "rolling", Baseline.active.is_(False), Baseline.created_at < rollup_cut
        )),
        output_agreements=agreements,
        series_chunks=run(delete(SeriesChunk).where(SeriesChunk.start < rollup_cut)),
        rollout_verdicts=run(delete(RolloutVerdict).where(RolloutVerdict.updated_at < rollup_cut)),
        applied_batches=run(delete(AppliedBatch).where(AppliedBatch.applied_at < raw_cut)),
    )
