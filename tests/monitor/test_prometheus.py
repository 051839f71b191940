"""A real Prometheus scrapes a real tailwatch; every dashboard and rule query runs on it.

Needs the `prometheus` and `promtool` binaries (`make test-deps` installs Debian's);
skipped with the reason when they are missing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry

from engine.errors import Overloaded
from monitor.app import create_app
from monitor.hub import services_of
from monitor.loopback import wait_for
from monitor.settings import Settings
from storage.models import Alert, RolloutVerdict, RuleSensitivity, WebhookDelivery
from tests.monitor.conftest import TOKEN, suites
from tests.monitor.fakes import FakeFactory
from tests.monitor.live import LiveServer
from tests.monitor.prometheus import dashboard_exprs, has_finite_data, query, running_prometheus
from vocab import utcnow

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "dashboards" / "prometheus" / "rules.yml"
RULES_TEST = ROOT / "dashboards" / "prometheus" / "rules_test.yml"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("promtool") is None,
                       reason="prometheus/promtool not installed (make test-deps installs them)"),
]


@pytest.fixture
def db_kind() -> str:
    """Run this module on SQLite only (flag and metric tests cover PostgreSQL)."""
    return "sqlite"


def rule_exprs() -> list[str]:
    data = yaml.safe_load(RULES.read_text())
    return [r["expr"] for g in data["groups"] for r in g["rules"]]


@pytest.fixture
def tailwatch(settings: Settings) -> Iterator[tuple[LiveServer, FakeFactory]]:
    factory = FakeFactory()
    # `serve`'s wiring: the scheduler runs the serving process's jobs (the job panels need
    # runs; probes are requested by the test), the analysis jobs are a worker's.
    scheduler = settings.scheduler.model_copy(update={
        "enabled": True, "probes_enabled": False, "traffic_flush_interval_s": 0.5})
    settings = settings.model_copy(update={"scheduler": scheduler})
    app = create_app(settings, engine_factory=factory, registry=CollectorRegistry(),
                     suites=suites(), analysis_in_process=False)
    with LiveServer(app) as server:
        wait_for(lambda: httpx.get(server.url + "/readyz").status_code == 200)
        yield server, factory


@pytest.fixture
def prometheus(tailwatch: tuple[LiveServer, FakeFactory],
               tmp_path: Path) -> Iterator[str]:
    server, _ = tailwatch
    with running_prometheus(server.port, tmp_path, rule_files=[RULES]) as url:
        yield url


class Traffic:
    """Send requests in the background so rates are positive while Prometheus scrapes."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.sent = 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        texts = ["hello river", "the old stone house by the green field",
                 "a small light over the water and the long road home to the sea"]
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while not self.stop.is_set():
                client.post("/v1/generate", json={"text": texts[self.sent % len(texts)]})
                self.sent += 1
                self.stop.wait(0.02)


def test_prometheus_scrapes_and_every_query_returns_data(
        tailwatch: tuple[LiveServer, FakeFactory], prometheus: str) -> None:
    server, factory = tailwatch
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with services_of(server.app).sessions.begin() as s:  # seed the DB-backed series
        s.add_all([Alert(fingerprint="f1", rule="p99_latency_up", severity="page",
                         state="firing"),
                   Alert(fingerprint="f2", rule="acceptance_down", state="pending"),
                   WebhookDelivery(target="t", url="http://x", payload={},
                                   idempotency_key="k", state="pending"),
                   RolloutVerdict(new_model_version="m2", new_config_hash="c2",
                                  old_model_version="m1", old_config_hash="c1",
                                  metric="p50_latency", bucket="64", verdict="pass",
                                  threshold=0.1, window_start=utcnow()),
                   RuleSensitivity(rule="p99_latency_regression", metric="p99_latency",
                                   scope={"bucket": "64"}, scope_key="bucket=64",
                                   status="ok", direction=1, cycles=1440, within_cycles=10,
                                   configured_threshold=0.15, threshold=0.27,
                                   detectable_change=0.31, false_pages_30d=0.5,
                                   false_pages_configured=3.0, budget_per_30d=0.5,
                                   reason="threshold +15% -> +27%", cpu_s=0.4)])
    assert httpx.put(server.url + "/v1/flags/speculative", headers=auth, json={
        "scope": "64", "value": False, "reason": "integration test"}).status_code == 200
    traffic = Traffic(server.url)
    traffic.thread.start()
    try:
        def probe() -> None:
            r = httpx.post(server.url + "/v1/probes/run", headers=auth,
                           json={"kind": "cycle", "ab": True}, timeout=60)
            assert r.status_code == 200 and r.json()["status"] == "ok", r.text

        # A counter's first scrape is its start: probe once, let Prometheus see the new
        # series, probe again, so increase() over canaries is positive.
        probe()
        wait_for(lambda: bool(query(prometheus, "count(tailwatch_canary_duration_seconds_count)")
                              ["result"]), timeout_s=60)
        probe()
        assert factory.engine is not None
        factory.engine.fail_with = Overloaded("queue full", retry_after_s=1)
        assert httpx.post(server.url + "/v1/generate", json={"text": "x"}).status_code == 429
        factory.engine.fail_with = None
        wait_for(lambda: has_finite_data(query(
            prometheus, "sum(rate(tailwatch_request_duration_seconds_count[1m])) > 0")),
            timeout_s=60)
        wait_for(lambda: has_finite_data(query(
            prometheus, "sum(increase(tailwatch_canary_duration_seconds_count[1m])) > 0")),
            timeout_s=60)

        targets = httpx.get(prometheus + "/api/v1/targets").json()["data"]["activeTargets"]
        assert [t["health"] for t in targets] == ["up"], targets

        exprs = dashboard_exprs()
        assert len(exprs) >= 30
        empty = []
        for expr in exprs:
            data = query(prometheus, expr)  # parses, or the assertion names it
            if "offset" in expr:
                # No history a day ago in a fresh Prometheus: the same query without the
                # offset must have data (the baseline side is the same series, shifted).
                data = query(prometheus, re.sub(r"\s+offset\s+\w+", "", expr))
            if not has_finite_data(data):
                empty.append(expr)
        assert empty == [], "dashboard queries without data:\n" + "\n".join(empty)

        for expr in rule_exprs():
            query(prometheus, expr)
            names = set(re.findall(r"\btailwatch_\w+", expr)) | ({"up"} if "up{" in expr else set())
            assert names, expr
            for name in sorted(names):
                assert query(prometheus, f"count({name})")["result"], f"{name} has no series"
        rules = httpx.get(prometheus + "/api/v1/rules").json()["data"]["groups"]
        loaded = [r for g in rules for r in g["rules"]]
        assert len(loaded) == len(rule_exprs())
        wait_for(lambda: all(r["health"] == "ok" for g in httpx.get(
            prometheus + "/api/v1/rules").json()["data"]["groups"] for r in g["rules"]))
    finally:
        traffic.stop.set()
        traffic.thread.join(10)
    assert traffic.sent > 0

    metrics = httpx.get(server.url + "/metrics").text
    lint = subprocess.run(["promtool", "check", "metrics"], input=metrics, text=True,
                          capture_output=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_promtool_checks_and_tests_the_rules() -> None:
    check = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 13 rules found" in check.stdout
    unit = subprocess.run(["promtool", "test", "rules", str(RULES_TEST)], capture_output=True,
                          text=True, timeout=120)
    assert unit.returncode == 0, unit.stdout + unit.stderr
    assert "SUCCESS" in unit.stdout
