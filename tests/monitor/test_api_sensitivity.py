"""GET /v1/rules/sensitivity, the sensitivity in GET /v1/baselines and `tailwatch alerts
sensitivity`, over real HTTP on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields
from datetime import UTC, datetime

import httpx
import pytest
from prometheus_client import CollectorRegistry

from monitor.api.sensitivity import SensitivityOut
from monitor.app import create_app
from monitor.cli import main
from monitor.settings import Settings
from storage.db import make_engine, make_sessionmaker
from storage.models import Baseline
from storage.queries import sensitivity as queries
from storage.queries.sensitivity import StoredSensitivity
from tests.monitor.conftest import TOKEN, wait_for
from tests.monitor.fakes import FakeFactory
from tests.monitor.live import LiveServer

AT = datetime(2026, 12, 3, 10, tzinfo=UTC)
WHY = "threshold +15% -> +27% (noise: 30 days would page 3 times at +15%)"


def estimate(bucket: str, baseline_id: int | None, **kw: object) -> StoredSensitivity:
    fields: dict[str, object] = dict(
        rule="p99_latency_regression", metric="p99_latency",
        scope={"source": "canary", "bucket": bucket}, scope_key=f"bucket={bucket},source=canary",
        model_version="m1", config_hash="c1", baseline_id=baseline_id, computed_at=AT,
        status="ok", direction=1, cycles=1440, within_cycles=10, configured_threshold=0.15,
        threshold=0.27, detectable_change=0.31, false_pages_30d=0.5,
        false_pages_configured=3.0, budget_per_30d=0.5, reason=WHY, cpu_s=0.4)
    fields.update(kw)
    return StoredSensitivity(**fields)  # type: ignore[arg-type]


@pytest.fixture
def server(settings: Settings) -> Iterator[LiveServer]:
    engine = make_engine(settings.database_url)
    try:
        with make_sessionmaker(engine).begin() as s:
            b = Baseline(metric="p99_latency", scope={"source": "canary", "bucket": "64"},
                         scope_key="bucket=64,source=canary", value=0.2, spread=0.03,
                         samples=1440, kind="rolling", model_version="m1", config_hash="c1",
                         created_at=AT, active=True)
            s.add(b)
            s.flush()
            queries.save(s, estimate("64", b.id))
            queries.save(s, estimate("16", None, status="insufficient history",
                                     threshold=0.15, detectable_change=None,
                                     false_pages_30d=None, false_pages_configured=None,
                                     reason="insufficient history: 100 of 360 cycles"))
    finally:
        engine.dispose()
    app = create_app(settings, engine_factory=FakeFactory(), registry=CollectorRegistry())
    with LiveServer(app) as live:
        wait_for(lambda: httpx.get(live.url + "/readyz").status_code == 200)
        yield live


def test_rules_sensitivity_lists_every_series_with_its_threshold_in_force(
        server: LiveServer) -> None:
    body = httpx.get(server.url + "/v1/rules/sensitivity").json()
    by_bucket = {s["scope"]["bucket"]: s for s in body}
    wide = by_bucket["64"]
    assert wide["widened"] is True and wide["threshold"] == 0.27
    assert wide["configured_threshold"] == 0.15 and wide["reason"] == WHY
    assert wide["pages_held"] is False
    assert wide["summary"] == ("confirms +31% within 10 cycles (p95); 0.5 false pages per "
                               f"30 days at +27%; {WHY}")
    short = by_bucket["16"]
    assert short["widened"] is False and short["detectable_change"] is None
    # Too young to state its false pages, with the budget on: its pages are warnings.
    assert short["pages_held"] is True
    assert short["summary"] == "insufficient history: 100 of 360 cycles; threshold +15% kept"
    assert httpx.get(server.url + "/v1/rules/sensitivity",
                     params={"rule": "acceptance_drop"}).json() == []
    bad = httpx.get(server.url + "/v1/rules/sensitivity", params={"rule": "x" * 65})
    assert bad.status_code == 422 and "rule" in bad.text


def test_the_api_serves_the_stored_view_and_what_it_implies(server: LiveServer) -> None:
    # Derived from storage's view, not a field-by-field copy: a field added there is served.
    assert issubclass(SensitivityOut, StoredSensitivity)
    internal = {"scope_key", "cpu_s"}  # `scope` says the first; the estimator's accounting
    derived = {"widened", "pages_held", "summary"}
    served = {f.name for f in fields(StoredSensitivity)} - internal | derived
    body = httpx.get(server.url + "/v1/rules/sensitivity").json()
    assert body and all(set(s) == served for s in body)
    schema = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"]
    out = schema["SensitivityOut"]["properties"]
    assert internal.isdisjoint(out)
    assert out["threshold"]["description"] == "the threshold in force"


def test_baselines_carry_their_series_sensitivity(server: LiveServer) -> None:
    [b] = httpx.get(server.url + "/v1/baselines").json()
    [s] = b["sensitivity"]
    assert s["baseline_id"] == b["id"] and s["threshold"] == 0.27 and s["reason"] == WHY


def test_cli_prints_the_table_and_each_widening(server: LiveServer,
                                                capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TAILWATCH_URL", server.url)
    monkeypatch.setenv("TAILWATCH_API_TOKEN", TOKEN)
    assert main(["alerts", "sensitivity"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["RULE", "SCOPE", "COHORT", "STATUS", "DETECTS",
                              "FALSE_PAGES_30D", "THRESHOLD", "BUDGET", "CYCLES"]
    row = next(line for line in out[1:] if "bucket=64" in line)
    assert "+31% in 10 cycles" in row and "+27% (configured +15%)" in row and "m1/c1" in row
    assert "p99_latency_regression [bucket=64,source=canary]: confirms +31%" in "\n".join(out)
    assert any("insufficient history: 100 of 360 cycles" in line for line in out)
    assert main(["alerts", "sensitivity", "--rule", "acceptance_drop"]) == 0
    assert capsys.readouterr().out.strip() == "(none)"
    assert main(["alerts", "--url", "http://127.0.0.1:9", "sensitivity"]) == 1
    err = capsys.readouterr().err
    assert "cannot reach tailwatch" in err and err.strip().count("\n") == 0
