"""Issue 32, the monitor side: batching recorded per request and per minute, judged by the
shipped rules, and the `batching` fallback flag set by the shipped policy.

The app is the production wiring (`create_app` + lifespan + `scheduled_jobs`) on the fake
engine, SQLite and PostgreSQL; minutes are simulated through the app's clock seam (it
stamps traffic minutes and is the evaluator's "now"); requests go through /v1/generate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from alerts.flags import FlagStore
from alerts.series import RowCache
from monitor.app import create_app
from monitor.hub import Services, services_of
from monitor.jobs import Job, scheduled_jobs
from monitor.loopback import wait_for
from monitor.report.job import run_weekly_report
from monitor.report.week import last_seven_days
from monitor.settings import Settings
from storage.models import ProbeRun
from storage.queries.batching import batch_loop, batch_usage
from tests.monitor.conftest import TOKEN, make_settings, suites
from tests.monitor.fakes import FakeFactory, ServiceFakeEngine

# Flags expire on the wall clock (the SQL provider reads them now): stay near it.
T0 = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(hours=2)
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TEXT = "the river runs past"  # bucket 32 (20 byte tokens)


@dataclass(frozen=True)
class Running:
    """One running app: its client, services, every scheduled job and the fake engine."""

    settings: Settings
    client: TestClient
    services: Services
    jobs: dict[str, Job]
    engine: ServiceFakeEngine


@contextmanager
def running_app(url: str, clock: Callable[[], datetime] | None = None,
                **overrides: Any) -> Iterator[Running]:
    """Run the production app (`create_app`, its lifespan) on the fake engine until ready.

    Quality sampling is off; `overrides` are settings sections; `clock` is the app's seam
    (None: the production clock).
    """
    factory = FakeFactory()
    settings = make_settings(url, quality={"enabled": False}, **overrides)
    app = create_app(settings, engine_factory=factory, registry=CollectorRegistry(),
                     suites=suites(), clock=clock)
    with TestClient(app) as client:
        wait_for(lambda: client.get("/readyz").status_code == 200)
        services = services_of(app)
        assert factory.engine is not None
        yield Running(settings, client, services, scheduled_jobs(services), factory.engine)


def _serve(client: TestClient, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        r = client.post("/v1/generate", json={"text": TEXT}, headers=AUTH)
        assert r.status_code == 200, r.text
        out.append(r.json())
    return out


@pytest.mark.slow
def test_over_batching_and_queue_wait_fire_and_the_batching_flag_runs_the_instance_alone(
        migrated_url: str, tmp_path: Path) -> None:
    now = [T0]
    with running_app(migrated_url, lambda: now[0], alerts={"flags_ttl_s": 0.0}) as run:
        client, services, jobs, engine = run.client, run.services, run.jobs, run.engine
        # Each row beyond the first adds its share to a step: the tail at 8 rows is
        # several times that at 1.
        engine.timings.per_row_factor = 10.0
        for minute in range(4):
            now[0] = T0 + timedelta(minutes=minute, seconds=5)
            engine.batch_rows = 1
            alone = _serve(client, 100)
            engine.batch_rows = 8
            batched = _serve(client, 100)
            jobs["traffic_flush"]()  # samples the batching loop, then writes both rollups
        assert services.writer.flush(timeout=30) and services.writer.stats.failed == 0
        # Per request: what batching did to it is in the response.
        assert (alone[0]["batch_size_max"], batched[0]["batch_size_max"]) == (1, 8)
        assert batched[0]["batch_size_mean"] == 8.0 and batched[0]["queue_wait_s"] >= 0.0
        assert batched[0]["batch_join_step"] >= 0
        # The loop's series (TGI's and vLLM's as the guide), scraped from the app.
        scraped = {sample.name: sample.value for family in text_string_to_metric_families(
            client.get("/metrics").text) for sample in family.samples}
        assert scraped["tailwatch_batch_max_size"] == 8.0
        assert scraped["tailwatch_batch_steps_total"] >= 800  # the requests served above
        for idle in ("tailwatch_batch_current_size", "tailwatch_queue_size",
                     "tailwatch_batch_window_seconds"):
            assert scraped[idle] == 0.0

        # Per minute, per bucket and batch-size class (both databases).
        with services.sessions() as s:
            usage = {(u.bucket, u.batch): u for u in batch_usage(
                s, T0, T0 + timedelta(minutes=4))}
            loop = batch_loop(s, T0, T0 + timedelta(minutes=4))
        assert set(usage) == {("32", "1"), ("32", "8")}
        one, eight = usage["32", "1"], usage["32", "8"]
        assert (one.requests, eight.requests) == (400, 400)
        assert (one.batch_size_mean, eight.batch_size_max) == (1.0, 8)
        assert eight.latency_p99_s is not None and one.latency_p99_s is not None
        assert eight.latency_p99_s > 3 * one.latency_p99_s
        assert one.queue_wait_share is not None and one.queue_wait_share < 0.5
        # Each row costs a step more than it adds: 8 rows give fewer tokens per step-second.
        assert eight.step_tokens_per_s is not None and one.step_tokens_per_s is not None
        assert eight.step_tokens_per_s < one.step_tokens_per_s
        assert [(x.instance_id, x.samples) for x in loop] == [("test-instance", 4)]

        # The shipped rules judge the minutes; the shipped policy sets the flag.
        now[0] = T0 + timedelta(minutes=4, seconds=30)
        report = jobs["evaluate"]()
        firing = {(a.rule, tuple(sorted(a.labels.items()))) for a in report.firing}
        assert ("overbatching", (("instance", "test-instance"),)) in firing
        assert not any(rule == "queue_wait_share" for rule, _ in firing)
        throughput = [r for r in report.results if r.rule == "step_throughput_drop"]
        assert {r.labels["batch"] for r in throughput} == {"1", "8"}  # judged per class
        sets = [a for a in report.actions if a.kind == "set" and a.flag == "batching"]
        assert [(a.scope, a.value) for a in sets] == [("instance:test-instance", False)]
        assert "batching_off_on_overbatching: overbatching firing" in sets[0].reason
        with services.sessions() as s:
            assert FlagStore(lambda: now[0]).runtime_flags(s, "test-instance").batching is False

        # The engine reads it (its snapshot refreshes in the background: wait for that):
        # every request runs alone although 8 rows would be there.
        assert services.flags.refresh_now(10.0)
        assert {r["batch_size_max"] for r in _serve(client, 3)} == {1}
        flags = client.get("/v1/flags", headers=AUTH).json()
        assert any(f["name"] == "batching" and f["scope"] == "instance:test-instance"
                   and f["in_force"] for f in flags["flags"])
        assert flags["effective"]["batching"] is False

        # Callers now wait for a row longer than they run: the wait's share fires.
        engine.timings.queue_wait_s = 0.5
        for minute in range(5, 9):
            now[0] = T0 + timedelta(minutes=minute, seconds=5)
            waited = _serve(client, 30)
            jobs["traffic_flush"]()
        assert services.writer.flush(timeout=30)
        assert waited[0]["queue_wait_s"] >= 0.5
        now[0] = T0 + timedelta(minutes=9, seconds=30)
        report = jobs["evaluate"]()
        assert ("queue_wait_share", {"instance": "test-instance"}) in [
            (a.rule, dict(a.labels)) for a in report.firing]

        # Restored after the hold (nothing to measure while unbatched).
        with services.sessions.begin() as s:
            restored = [a for a in services.alerts.policy.apply(s, now[0] + timedelta(minutes=31))
                        if a.kind == "restore"]
        assert [(a.flag, a.scope) for a in restored] == [("batching", "instance:test-instance")]
        assert "held 1800s" in restored[0].reason

        # The weekly review's batching lines, from the same rows (and one burst's arms).
        engine.batch_rows = 8
        jobs["burst"]()
        assert services.writer.flush(timeout=30)
        at = datetime.now(UTC) + timedelta(minutes=5)
        outcome = run_weekly_report(services.sessions, run.settings, at,
                                    week=last_seven_days(at), out_dir=tmp_path)
        review = {o.name: o for o in outcome.report.optimizations}["continuous batching"]
        checks = {c.assumption.id: c for c in review.checks}
        gain = checks["batching-earns-its-keep"].verdict
        assert gain.value is not None and "median over 1 bursts' arm pairs" in gain.detail
        window = checks["window-within-token-time"].verdict
        assert window.value == 0.0 and window.status == "holds"  # the fake's window: 0
        spec = checks["speculation-pays-at-load"].verdict
        # Every fake request speculated: no batch size ran both ways, so no speedup.
        assert spec.value is None and "speculative share 100%" in spec.detail
        md = outcome.markdown_path.read_text()
        for line in ("Batching earns its keep", "The window stays within 1.5x the p50 token time",
                     "Speculation still pays at this load"):
            assert line in md


def test_the_burst_runs_its_unbatched_arm_on_the_same_arrivals(migrated_url: str) -> None:
    burst = {"burst_rate_per_s": 100.0, "burst_duration_s": 0.2, "burst_concurrency": 8}
    with running_app(migrated_url, probes=burst) as run:
        client, services, jobs, engine = run.client, run.services, run.jobs, run.engine
        engine.batch_rows = None  # unbatched engine (max_batch 1): one arm only
        jobs["burst"]()
        engine.batch_rows = 8  # a batching engine: the unbatched arm runs too
        jobs["burst"]()
        assert services.writer.flush(timeout=30) and services.writer.stats.failed == 0
        with services.sessions() as s:
            runs = sorted(s.scalars(select(ProbeRun).where(ProbeRun.kind == "burst")),
                          key=lambda r: r.id)
            arms = [(r.details or {}).get("variant") for r in runs]
            assert sorted(arms[1:]) == ["optimized", "unbatched"] and arms[0] == "optimized"
            batched, unbatched = sorted(runs[1:], key=lambda r: r.details["variant"])
            assert batched.requests == unbatched.requests  # the same arrivals
            assert {r.variant for r in unbatched.results} == {"unbatched"}
            assert unbatched.details["throughput_per_s"] >= 0
            # The burst rule reads the batched bursts only.
            rows = RowCache(s).rows("burst", T0 - timedelta(days=1),
                                    datetime.now(UTC) + timedelta(minutes=1))
            assert len(rows) == 2
        listed = client.get("/v1/probes/runs", params={"kind": "burst"}, headers=AUTH)
        assert listed.status_code == 200


# What changes after the healthy minutes, per rule judged on its baseline (relative change,
# below any absolute limit): every step of 8 rows 1.5x slower, or 2.5x the wait for a row.
SHIFTS = {"step_throughput_drop": ("per_output_token_s", 1.5),
          "queue_wait_share": ("queue_wait_s", 2.5)}


@pytest.mark.slow
@pytest.mark.parametrize("rule", sorted(SHIFTS))
def test_a_shift_at_the_same_batch_size_fires_its_rule_against_the_baseline(
        migrated_url: str, rule: str) -> None:
    """The shipped rules on their shipped thresholds: a baseline of healthy minutes at 8
    rows (a few percent of noise, as real steps have), then one shift; its rule fires on
    the relative change after `for: 3` cycles, never before, and the others stay quiet."""
    now = [T0]
    healthy, shifted = 32, 5
    knob, factor = SHIFTS[rule]
    with running_app(migrated_url, lambda: now[0]) as run:
        client, services, jobs, engine = run.client, run.services, run.jobs, run.engine
        engine.batch_rows = 8
        engine.timings.queue_wait_s = 0.004  # a share of ~10%, under the ceiling of 50%
        base = {k: getattr(engine.timings, k) for k in ("per_output_token_s", "queue_wait_s")}
        fired: dict[int, Any] = {}  # minute -> the evaluation that fired the rule
        for minute in range(healthy + shifted):
            noise = 1.0 + 0.01 * ((minute * 7) % 5 - 2)
            for k, v in base.items():
                setattr(engine.timings, k, v * noise * (
                    factor if k == knob and minute >= healthy else 1.0))
            now[0] = T0 + timedelta(minutes=minute, seconds=5)
            _serve(client, 25)
            jobs["traffic_flush"]()
            assert services.writer.flush(timeout=30) and services.writer.stats.failed == 0
            now[0] = T0 + timedelta(minutes=minute, seconds=55)
            report = jobs["evaluate"]()
            if any(a.rule == rule for a in report.firing):
                fired[minute] = report
        # Never on the healthy minutes; once the shifted ones are `for: 3` cycles long.
        assert fired and min(fired) >= healthy + 2, sorted(fired)
        report = fired[min(fired)]
        alert = next(a for a in report.firing if a.rule == rule)
        labels = {"instance": "test-instance"}
        if rule == "step_throughput_drop":
            labels["batch"] = "8"  # judged per batch-size class
        assert dict(alert.labels) == labels
        result = next(r for r in report.results if r.rule == rule)
        assert result.baseline is not None and result.current is not None
        assert result.relative_change is not None and abs(result.relative_change) >= 0.2
        assert "vs baseline" in result.reason and "CUSUM" in result.reason, result.reason
        others = {"overbatching", "queue_wait_share", "step_throughput_drop"} - {rule}
        assert not {a.rule for r in fired.values() for a in r.firing} & others
