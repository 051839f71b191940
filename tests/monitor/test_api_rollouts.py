"""GET /v1/rollouts and the tailwatch_rollout_verdict gauge read from the stored verdicts."""

from __future__ import annotations

from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session, sessionmaker

from monitor.hub import services_of
from monitor.metrics import DatabaseCollector, Metrics
from storage.models import RolloutVerdict
from vocab import utcnow


@pytest.fixture
def db_kind() -> str:
    """SQLite only: the verdict queries run on both in tests/alerts/test_rollout.py."""
    return "sqlite"


def verdict(bucket: str, verdict: str, age: timedelta) -> RolloutVerdict:
    at = utcnow() - age
    return RolloutVerdict(
        new_model_version="v2", new_config_hash="c", old_model_version="v1",
        old_config_hash="c", source="canary", metric="p99_latency", bucket=bucket,
        verdict=verdict, p_value=1e-5, relative_change=0.9, threshold=0.15, new_median=0.19,
        old_median=0.1, new_cycles=29, old_cycles=29, window_start=at - timedelta(minutes=30),
        first_at=at, updated_at=at)


def test_rollouts_lists_verdicts_newest_first(client: TestClient) -> None:
    with services_of(client.app).sessions.begin() as s:  # type: ignore[attr-defined]
        s.add_all([verdict("64", "fail", timedelta(minutes=1)),
                   verdict("16", "pass", timedelta(hours=2))])
    body = client.get("/v1/rollouts").json()
    assert [(v["bucket"], v["verdict"]) for v in body] == [("64", "fail"), ("16", "pass")]
    assert body[0]["new"] == {"model_version": "v2", "config_hash": "c"}
    since = (utcnow() - timedelta(hours=1)).isoformat()
    assert [v["bucket"] for v in client.get("/v1/rollouts", params={"since": since}).json()] \
        == ["64"]
    r = client.get("/v1/rollouts", params={"since": "2026-11-30T12:00:00"})
    assert r.status_code == 422 and "since" in r.text


def test_database_collector_exports_recent_verdicts(sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        s.add_all([verdict("64", "fail", timedelta(minutes=1)),
                   verdict("16", "pass", timedelta(hours=2))])
    registry = CollectorRegistry()
    DatabaseCollector(Metrics(registry), sessionmaker)
    labels = {"cohort": "v2/c", "old_cohort": "v1/c", "source": "canary",
              "metric": "p99_latency"}
    assert registry.get_sample_value("tailwatch_rollout_verdict", {**labels, "bucket": "64"}) == 2
    # An hour without an update: the comparison is over, the series goes away.
    assert registry.get_sample_value("tailwatch_rollout_verdict",
                                     {**labels, "bucket": "16"}) is None
