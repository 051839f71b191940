"""A real Prometheus scrapes a real tailwatch; every dashboard and rule query runs on it.

Needs the `prometheus` and `promtool` binaries (`make test-deps` installs Debian's);
skipped with the reason when they are missing.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry

from engine.errors import Overloaded
from monitor.app import create_app
from monitor.hub import services_of
from monitor.loopback import free_port, wait_for
from monitor.settings import Settings
from storage.models import Alert, RolloutVerdict, RuleSensitivity, WebhookDelivery
from tests.monitor.conftest import TOKEN, suites
from tests.monitor.fakes import FakeFactory
from tests.monitor.live import LiveServer
from vocab import utcnow

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards" / "grafana" / "dashboards"
RULES = ROOT / "dashboards" / "prometheus" / "rules.yml"
RULES_TEST = ROOT / "dashboards" / "prometheus" / "rules_test.yml"
# Grafana variables, as the dashboard's "All" selection expands them.
VARIABLES = {"$__rate_interval": "1m", "$bucket": ".*", "$job": ".*", "$instance": ".*"}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("promtool") is None,
                       reason="prometheus/promtool not installed (make test-deps installs them)"),
]


@pytest.fixture
def db_kind() -> str:
    """Run this module on SQLite only (flag and metric tests cover PostgreSQL)."""
    return "sqlite"


def dashboard_exprs() -> list[str]:
    """Return every PromQL expression in the dashboards, variables expanded."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                found.append(node["expr"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for path in sorted(DASHBOARDS.glob("*.json")):
        walk(json.loads(path.read_text()))
    out = []
    for expr in found:
        for var, value in VARIABLES.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"unexpanded variable in {expr}"
        out.append(expr)
    return out


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
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "tailwatch",
                            "static_configs": [{"targets": [f"127.0.0.1:{server.port}"]}]}],
    }))
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _ready(url), timeout_s=60)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/-/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def query(prom: str, expr: str) -> dict[str, Any]:
    r = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    return body["data"]


def has_finite_data(data: dict[str, Any]) -> bool:
    if data["resultType"] == "scalar":
        return not math.isnan(float(data["result"][1]))
    return any(not math.isnan(float(s["value"][1])) for s in data["result"])


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
    assert "SUCCESS: 12 rules found" in check.stdout
    unit = subprocess.run(["promtool", "test", "rules", str(RULES_TEST)], capture_output=True,
                          text=True, timeout=120)
    assert unit.returncode == 0, unit.stdout + unit.stderr
    assert "SUCCESS" in unit.stdout
