"""Retention deletes what is past its time, keeps the rest, and bounds the database size."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from storage import migrate
from storage.db import make_engine, make_sessionmaker
from storage.errors import InvalidQuery
from storage.models import (
    Alert,
    AlertTransition,
    AppliedBatch,
    Baseline,
    CanaryReference,
    FlagAudit,
    MemorySample,
    OutputAgreement,
    ProbeResult,
    ProbeRun,
    RolloutVerdict,
    SeriesChunk,
    TrafficRollup,
    WebhookDelivery,
)
from storage.retention import prune
from storage.synthetic import simulate
from tests.storage.builders import T0, probe_run

DAY = timedelta(days=1)
NOW = T0 + 100 * DAY


def _count(s: Session, model: type) -> int:
    return s.scalar(select(func.count()).select_from(model)) or 0


def test_prune_keeps_each_kind_for_its_days(sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        for age in (20, 10):
            at = NOW - age * DAY
            s.add(probe_run(at, [{"bucket": "16"}, {"bucket": "64"}]))
            s.add(MemorySample(at=at, instance_id="i", rss_bytes=1))
        for age in (95, 30):
            s.add(TrafficRollup(minute=NOW - age * DAY, instance_id="i", bucket="64",
                                path="compiled", decoding="direct"))
            s.add(WebhookDelivery(target="t", url="http://x", payload={}, state="delivered",
                                  idempotency_key=f"d{age}", created_at=NOW - age * DAY))
        s.add(WebhookDelivery(target="t", url="http://x", payload={}, state="pending",
                              idempotency_key="p", created_at=NOW - 200 * DAY))
        old = Alert(fingerprint="a", rule="r", state="resolved", resolved_at=NOW - 95 * DAY)
        old.transitions.append(AlertTransition(at=NOW - 96 * DAY, to_state="resolved"))
        s.add_all([old, Alert(fingerprint="b", rule="r", state="firing",
                              started_at=NOW - 200 * DAY)])
        s.add_all([
            Baseline(metric="m", value=1, kind="rolling", active=False, created_at=NOW - 95 * DAY),
            Baseline(metric="m", value=1, kind="pinned", active=False, created_at=NOW - 95 * DAY),
        ])
        s.add(FlagAudit(at=NOW - 400 * DAY, name="speculative", action="set"))
    with sessionmaker.begin() as s:
        result = prune(s, NOW, raw_days=14, rollup_days=90)
    assert (result.probe_runs, result.probe_results, result.memory_samples) == (1, 2, 1)
    assert (result.traffic_rollups, result.webhook_deliveries, result.alerts) == (1, 1, 1)
    assert result.baselines == 1 and result.alert_transitions == 1 and result.total == 9
    with sessionmaker() as s:
        assert _count(s, ProbeRun) == 1 and _count(s, ProbeResult) == 2
        assert _count(s, TrafficRollup) == 1 and _count(s, WebhookDelivery) == 2
        assert _count(s, AlertTransition) == 0 and _count(s, Alert) == 1
        assert _count(s, FlagAudit) == 1 and _count(s, Baseline) == 1


def _verdict(age_days: int, new: str) -> RolloutVerdict:
    at = NOW - age_days * DAY
    return RolloutVerdict(new_model_version=new, new_config_hash="c", old_model_version="m0",
                          old_config_hash="c", source="canary", metric="p99_latency",
                          bucket="64", verdict="pass", threshold=0.15, window_start=at,
                          first_at=at, updated_at=at)


def test_prune_covers_agreements_chunks_and_verdicts(sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        for age in (20, 10):
            at = NOW - age * DAY
            run = probe_run(at, [{"bucket": "64"}])
            s.add(run)
            s.flush()
            # A canary comparison (with its run) and a sampled request's (no run).
            for run_id, source in ((run.id, "canary"), (None, "traffic")):
                s.add(OutputAgreement(run_id=run_id, at=at, source=source, bucket="64",
                                      path="compiled", decoding="speculative", count=1))
        for age in (95, 30):
            at = NOW - age * DAY
            s.add(SeriesChunk(rule="gone_rule", scope_key="", start=at, values=[]))
            s.add(SeriesChunk(rule="p99", scope_key="bucket=64", start=at, values=[[0, 1.0, 4]]))
            s.add(_verdict(age, f"m{age}"))
        s.add(CanaryReference(model_version="m0", config_hash="c", prompt_key="k",
                              created_at=NOW - 400 * DAY))
    with sessionmaker.begin() as s:
        result = prune(s, NOW, raw_days=14, rollup_days=90)
    assert (result.output_agreements, result.series_chunks, result.rollout_verdicts) == (2, 2, 1)
    with sessionmaker() as s:
        kept = s.scalars(select(OutputAgreement.at)).all()
        assert sorted(kept) == [NOW - 10 * DAY] * 2
        assert set(s.scalars(select(SeriesChunk.start))) == {NOW - 30 * DAY}
        assert s.scalars(select(RolloutVerdict.new_model_version)).all() == ["m30"]
        assert _count(s, CanaryReference) == 1  # references stay: a cohort may come back


def test_prune_drops_batch_tokens_stopped_writers_left(
        sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        s.add_all([AppliedBatch(token="old", applied_at=NOW - 15 * DAY),
                   AppliedBatch(token="recent", applied_at=NOW - 13 * DAY)])
    with sessionmaker.begin() as s:
        assert prune(s, NOW, raw_days=14, rollup_days=90).applied_batches == 1
    with sessionmaker() as s:
        assert s.scalars(select(AppliedBatch.token)).all() == ["recent"]


def test_prune_refuses_bad_retention(sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker() as s:
        with pytest.raises(InvalidQuery, match="raw_days"):
            prune(s, NOW, raw_days=0, rollup_days=90)
        with pytest.raises(InvalidQuery, match="rollup_days"):
            prune(s, NOW, raw_days=14, rollup_days=7)


@pytest.mark.slow
def test_thirty_days_on_five_buckets_stay_under_200_mb(tmp_path: Path) -> None:
    path = tmp_path / "month.db"
    url = f"sqlite:///{path}"
    migrate.upgrade(url)
    engine = make_engine(url)
    try:
        counts = simulate(engine, T0, days=30)  # 1-minute cycles, 5 buckets
        assert counts.probe_results >= 30 * 24 * 60 * 5
        with make_sessionmaker(engine).begin() as s:
            result = prune(s, T0 + 30 * DAY, raw_days=14, rollup_days=90)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM")
        with make_sessionmaker(engine)() as s:
            kept_results = _count(s, ProbeResult)
            oldest = s.scalar(select(func.min(ProbeResult.at)))
    finally:
        engine.dispose()
    assert result.probe_results == counts.probe_results - kept_results
    assert oldest is not None and oldest >= T0 + 16 * DAY
    size_mb = path.stat().st_size / 1e6
    assert size_mb < 200, f"{size_mb:.0f} MB"
