"""A real Prometheus for tests: start one scraping tailwatch, query it, read dashboards."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from monitor.loopback import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards" / "grafana" / "dashboards"
# Grafana variables, as the dashboard's "All" selection expands them.
VARIABLES = {"$__rate_interval": "1m", "$bucket": ".*", "$job": ".*", "$instance": ".*"}


def installed() -> bool:
    """Return whether the prometheus binary is on PATH."""
    return shutil.which("prometheus") is not None


@contextmanager
def running_prometheus(target_port: int, workdir: Path, *,
                       rule_files: Sequence[Path] = (),
                       extra_targets: Sequence[int] = (),
                       scrape_interval_s: int = 1) -> Iterator[str]:
    """Run a Prometheus scraping loopback `target_port` (and `extra_targets`); yield its URL."""
    port = free_port()
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": f"{scrape_interval_s}s", "evaluation_interval": "1s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [{"job_name": "tailwatch",
                            "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in
                                                            (target_port, *extra_targets)]}]}],
    }))
    with (workdir / "prometheus.log").open("w") as log:
        proc = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
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


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/-/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def query(prom: str, expr: str) -> dict[str, Any]:
    """Return the data of an instant query; fail the test naming the expression if refused."""
    r = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    return body["data"]


def has_finite_data(data: dict[str, Any]) -> bool:
    """Return whether a query result holds at least one finite value."""
    if data["resultType"] == "scalar":
        return not math.isnan(float(data["result"][1]))
    return any(not math.isnan(float(s["value"][1])) for s in data["result"])


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
