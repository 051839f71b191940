"""Probes, alerts, baselines and reports over the API, and the scheduler wiring."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from monitor.hub import services_of
from monitor.jobs import scheduled_jobs
from monitor.loopback import wait_for
from monitor.settings import Settings
from storage.models import Alert, Report
from tests.monitor.conftest import make_settings, start

T0 = datetime(2026, 11, 23, 6, 0, tzinfo=UTC)


@pytest.fixture
def db_kind() -> str:
    """Run this module on SQLite only (flag and metric tests cover PostgreSQL)."""
    return "sqlite"


def test_probe_run_is_stored_listed_and_scraped(client: TestClient, auth: dict[str, str],
                                                registry: CollectorRegistry) -> None:
    r = client.post("/v1/probes/run", json={"kind": "cycle", "ab": False}, headers=auth)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "ok"
    assert r.json()["actor"] == "api-token"
    assert r.json()["stored"] is True  # committed before the answer: listed right away
    runs = client.get("/v1/probes/runs").json()
    assert len(runs) == 1
    assert runs[0]["kind"] == "cycle" and runs[0]["status"] == "ok"
    assert runs[0]["result_rows"] >= 3  # one row per bucket x path x decoding
    # Canary results went through the metrics sink, not into real-traffic series.
    assert registry.get_sample_value("tailwatch_canary_duration_seconds_count", {
        "bucket": "16", "path": "compiled", "decoding": "speculative"}) >= 1
    assert registry.get_sample_value("tailwatch_request_duration_seconds_count", {
        "bucket": "16", "path": "compiled", "decoding": "speculative"}) is None
    assert registry.get_sample_value("tailwatch_probe_success",
                                     {"kind": "cycle", "suite": "in_domain"}) == 1


def test_probe_run_answers_unstored_while_the_writer_is_held(
        client: TestClient, auth: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from monitor.api import probes as probes_api

    monkeypatch.setattr(probes_api, "STORE_WAIT_S", 0.2)
    writer = services_of(client.app).writer  # type: ignore[arg-type]
    release = threading.Event()
    # A write that does not finish stands in for a database that does not answer.
    writer.submit(lambda _session: release.wait(30))
    r = client.post("/v1/probes/run", json={"kind": "cycle", "ab": False}, headers=auth)
    assert r.status_code == 200, r.text
    assert r.json()["stored"] is False
    release.set()
    assert writer.flush(timeout=30)  # delayed, not lost
    assert [run["kind"] for run in client.get("/v1/probes/runs").json()] == ["cycle"]


def test_probe_run_listing_offers_only_the_kinds_the_prober_writes(client: TestClient) -> None:
    # A/B arms are rows of `cycle` runs (details.pairs): there is no run of kind "ab".
    r = client.get("/v1/probes/runs", params={"kind": "ab"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "kind"
    assert "'cycle' or 'burst'" in r.text
    assert client.get("/v1/probes/runs", params={"kind": "burst"}).json() == []
    spec = client.get("/openapi.json").json()
    kind = next(p for p in spec["paths"]["/v1/probes/runs"]["get"]["parameters"]
                if p["name"] == "kind")
    assert "ab" not in str(kind["schema"])


def test_speedups_are_read_from_the_ab_cycles_stored(client: TestClient,
                                                     auth: dict[str, str]) -> None:
    assert client.get("/v1/probes/speedups").json() == []  # nothing measured yet
    for _ in range(2):
        r = client.post("/v1/probes/run", json={"kind": "cycle", "ab": True}, headers=auth)
        assert r.status_code == 200 and r.json()["stored"], r.text
    got = client.get("/v1/probes/speedups").json()
    from storage.queries.speedups import ab_speedups

    sessions = services_of(client.app).sessions  # type: ignore[arg-type]
    now = datetime.now(UTC)
    with sessions() as session:
        want = ab_speedups(session, now - timedelta(days=1), now + timedelta(seconds=1))
    assert [(g["bucket"], g["optimization"], g["pairs"]) for g in got] == [
        (w.bucket, w.optimization, w.pairs) for w in want]
    assert [g["speedup"] for g in got] == pytest.approx([w.speedup for w in want])
    every = {g["optimization"]: g for g in got if g["bucket"] == "all"}
    assert set(every) == {"compile", "speculative"} and every["compile"]["speedup"] > 1
    assert every["compile"]["arms"] == ["eager"] and every["compile"]["runs"] == 2
    r = client.get("/v1/probes/speedups", params={"since": "2026-11-30T00:00:00Z",
                                                  "until": "2026-11-29T00:00:00Z"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "until"
    r = client.get("/v1/probes/speedups", params={"since": "yesterday"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "since"


def test_speedups_leave_out_on_demand_cycles_unless_asked(client: TestClient,
                                                          auth: dict[str, str]) -> None:
    # The arms also run in the cycle after a slow one; those cycles crowd into slow
    # periods, so the day's speedup (like the weekly report's) reads the others only.
    from sqlalchemy import select

    from storage.models import ProbeRun

    for _ in range(2):
        r = client.post("/v1/probes/run", json={"kind": "cycle", "ab": True}, headers=auth)
        assert r.status_code == 200 and r.json()["stored"], r.text
    sessions = services_of(client.app).sessions  # type: ignore[arg-type]
    with sessions.begin() as session:
        run = session.scalars(select(ProbeRun).order_by(ProbeRun.id)).first()
        assert run is not None and run.details and run.details["ab_reason"] == "requested"
        run.details = {**run.details, "ab_reason": "slowdown"}

    def runs(**params: str) -> int:
        got = client.get("/v1/probes/speedups", params=params).json()
        return next(g["runs"] for g in got if (g["optimization"], g["bucket"]) == ("compile", "all"))

    assert runs() == 1
    assert runs(on_demand="true") == 2
    r = client.get("/v1/probes/speedups", params={"on_demand": "sometimes"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "on_demand"


def test_probe_run_validates_its_body(client: TestClient, auth: dict[str, str]) -> None:
    r = client.post("/v1/probes/run", json={"kind": "soak"}, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["field"] == "kind"
    r = client.post("/v1/probes/run", json={"suite": "nope"}, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["field"] == "suite"


def test_alerts_are_filtered_by_state(client: TestClient) -> None:
    with services_of(client.app).sessions.begin() as s:  # type: ignore[attr-defined]
        s.add_all([
            Alert(fingerprint="a", rule="p99_latency_up", state="firing", started_at=T0,
                  updated_at=T0 + timedelta(minutes=3), labels={"bucket": "64"},
                  relative_change=0.42),
            Alert(fingerprint="b", rule="acceptance_down", state="resolved",
                  started_at=T0 - timedelta(hours=1)),
        ])
    (open_,) = client.get("/v1/alerts").json()
    assert open_["rule"] == "p99_latency_up"
    # When an evaluation last judged it: a pending alert stuck on a stopped worker shows.
    assert datetime.fromisoformat(open_["updated_at"]) == T0 + timedelta(minutes=3)
    resolved = client.get("/v1/alerts", params={"state": "resolved"}).json()
    assert [a["rule"] for a in resolved] == ["acceptance_down"]
    assert len(client.get("/v1/alerts", params={"state": "all"}).json()) == 2
    r = client.get("/v1/alerts", params={"state": "burning"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "state"


def test_baselines_pin_list_unpin(client: TestClient, auth: dict[str, str]) -> None:
    r = client.post("/v1/baselines", headers=auth, json={
        "action": "pin", "metric": "p99_latency", "scope": {"bucket": "64"}, "value": 0.3})
    assert r.status_code == 200, r.text
    assert r.json()["baseline"]["pinned_by"] == "api-token"
    listed = client.get("/v1/baselines").json()
    assert [(b["metric"], b["kind"], b["value"]) for b in listed] == [
        ("p99_latency", "pinned", 0.3)]
    # No rolling baseline to copy a spread or a body from yet: both shown, unknown.
    assert (listed[0]["spread"], listed[0]["body"]) == (None, None)
    r = client.post("/v1/baselines", headers=auth, json={
        "action": "unpin", "metric": "p99_latency", "scope": "bucket=64"})
    assert r.json()["unpinned"] == 1
    assert client.get("/v1/baselines").json() == []
    r = client.post("/v1/baselines", headers=auth, json={
        "action": "pin", "metric": "p99_latency", "scope": "colour=red", "value": 1})
    assert r.status_code == 422 and r.json()["error"]["field"] == "scope"


def test_reports_by_accept_header_or_format(client: TestClient) -> None:
    with services_of(client.app).sessions.begin() as s:  # type: ignore[attr-defined]
        s.add(Report(week="2026-W47", markdown="# Week 47\n", html="<h1>Week 47</h1>",
                     summary={"violated": 1}))
    listed = client.get("/v1/reports").json()
    assert [r["week"] for r in listed] == ["2026-W47"]
    rid = listed[0]["id"]
    md = client.get(f"/v1/reports/{rid}")
    assert md.headers["content-type"].startswith("text/markdown")
    assert md.text == "# Week 47\n"
    html = client.get(f"/v1/reports/{rid}", headers={"Accept": "text/html"})
    assert html.headers["content-type"].startswith("text/html")
    assert html.text == "<h1>Week 47</h1>"
    js = client.get(f"/v1/reports/{rid}", params={"format": "json"},
                    headers={"Accept": "text/html"})
    assert js.json()["summary"] == {"violated": 1}
    missing = client.get("/v1/reports/999")
    assert missing.status_code == 404 and missing.json()["error"]["field"] == "report_id"


def test_scheduler_runs_the_wired_jobs(migrated_url: str) -> None:
    settings: Settings = make_settings(migrated_url, scheduler={
        "enabled": True, "probe_interval_s": 3600, "burst_interval_s": 0,
        "evaluate_interval_s": 3600, "delivery_interval_s": 3600,
        "traffic_flush_interval_s": 3600})
    app = start(settings)
    with TestClient(app) as client:
        wait_for(lambda: client.get("/readyz").status_code == 200)
        scheduler = services_of(app).scheduler
        assert set(scheduler.jobs()) == {"probe", "traffic_flush", "evaluate", "delivery",
                                         "retention", "report", "sensitivity", "memory_trim"}
        jobs = scheduled_jobs(services_of(app))
        client.post("/v1/generate", json={"text": "hello river"})
        jobs["traffic_flush"]()
        jobs["probe"]()
        jobs["evaluate"]()
        jobs["delivery"]()
        # No warm baseline yet: the sensitivity job estimates nothing and says so.
        assert getattr(jobs["sensitivity"](), "estimated", None) == 0
        # Scheduled jobs hand rows to the background writer and do not wait for it.
        assert services_of(app).writer.flush(timeout=30)
        assert len(client.get("/v1/probes/runs").json()) == 1
    from sqlalchemy import func, select

    from storage.db import make_engine, make_sessionmaker
    from storage.models import TrafficRollup

    engine = make_engine(migrated_url)
    try:
        with make_sessionmaker(engine)() as s:
            assert s.scalar(select(func.sum(TrafficRollup.requests))) == 1
    finally:
        engine.dispose()
