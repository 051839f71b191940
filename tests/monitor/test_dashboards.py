"""The Grafana dashboard and provisioning files are well formed (PromQL runs in test_prometheus)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

from monitor.metrics import EngineCollector, Metrics
from probes.fake import FakeEngine

ROOT = Path(__file__).resolve().parents[2] / "dashboards"
OVERVIEW = ROOT / "grafana" / "dashboards" / "tailwatch-overview.json"


def test_dashboard_panels_are_well_formed() -> None:
    files = sorted((ROOT / "grafana" / "dashboards").glob("*.json"))
    assert files
    for path in files:
        dash = json.loads(path.read_text())
        assert dash["uid"] and dash["title"]
        names = {v["name"] for v in dash["templating"]["list"]}
        assert {"datasource", "job", "instance", "bucket"} <= names
        bucket = next(v for v in dash["templating"]["list"] if v["name"] == "bucket")
        # Canary-only buckets (no real traffic yet) are listed too.
        assert "tailwatch_(request|canary)_duration_seconds_count" in bucket["definition"]
        panels = [p for p in dash["panels"] if p["type"] != "row"]
        ids = [p["id"] for p in dash["panels"]]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        for p in panels:
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p["targets"], p["title"]
            for t in p["targets"]:
                assert t["expr"].strip() and t["refId"], p["title"]
                # Every tailwatch series follows the job and instance variables.
                for selector in re.findall(r"tailwatch_[a-z0-9_]+(?:\{[^}]*\})?", t["expr"]):
                    assert 'job=~"$job",instance=~"$instance"' in selector, (p["title"], selector)
            g = p["gridPos"]
            assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
        # Gauges read from SQL are the same on every replica: collapsed with max, not summed.
        for sql_gauge in ("tailwatch_flag_override", "tailwatch_alerts{",
                          "tailwatch_probe_success", "tailwatch_probe_duration_seconds",
                          "tailwatch_probe_last_run_timestamp_seconds",
                          "tailwatch_rule_detectable_change_ratio",
                          "tailwatch_rule_expected_false_pages", "tailwatch_rule_threshold_ratio"):
            for t in (t for p in panels for t in p["targets"] if sql_gauge in t["expr"]):
                assert "max by (" in t["expr"], t["expr"]
        for needed in ("offset 1d", "offset 7d", "histogram_quantile(0.99",
                       "tailwatch_spec_decode_num_accepted_tokens_per_pos_total",
                       "tailwatch_compile_recompiles_total", "tailwatch_memory_bytes",
                       "tailwatch_flag_enabled", "tailwatch_alerts_firing",
                       "tailwatch_probe_success", "tailwatch_job_duration_seconds_bucket",
                       "tailwatch_job_last_success_timestamp_seconds",
                       "tailwatch_rule_detectable_change_ratio",
                       "tailwatch_rule_expected_false_pages", "tailwatch_incidents_open",
                       "tailwatch_incidents_total", "tailwatch_gc_pause_seconds_sum"):
            assert needed in exprs, needed


def row_panels(dash: dict[str, Any], title: str) -> list[dict[str, Any]]:
    """Return the panels under the row titled `title` (nested in it when collapsed)."""
    panels = sorted(dash["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    rows = [i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == title]
    assert len(rows) == 1, f"{title!r}: {len(rows)} rows"
    row = panels[rows[0]]
    if row.get("collapsed"):
        return list(row["panels"])
    under = []
    for p in panels[rows[0] + 1:]:
        if p["type"] == "row":
            break
        under.append(p)
    return under


def test_the_batching_row_charts_the_batching_series_the_engine_exports() -> None:
    registry = CollectorRegistry()
    EngineCollector(Metrics(registry), FakeEngine)
    exported = {s.name for family in registry.collect() for s in family.samples}
    panels = row_panels(json.loads(OVERVIEW.read_text()), "Batching")
    assert panels
    queried = {name for p in panels for t in p["targets"]
               for name in re.findall(r"tailwatch_[a-z0-9_]+", t["expr"])}
    # A series renamed in monitor.metrics (or misspelled here) would chart nothing.
    assert queried <= exported, sorted(queried - exported)
    assert {"tailwatch_batch_current_size", "tailwatch_batch_max_size", "tailwatch_queue_size",
            "tailwatch_batch_window_seconds", "tailwatch_batch_steps_total",
            "tailwatch_batch_turn_steps_total"} <= queried


def test_provisioning_points_grafana_at_prometheus_and_the_dashboards() -> None:
    prov = ROOT / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "tailwatch.yml").read_text())
    assert ds["apiVersion"] == 1
    assert [d["type"] for d in ds["datasources"]] == ["prometheus"]
    dp = yaml.safe_load((prov / "dashboards" / "tailwatch.yml").read_text())
    assert dp["providers"][0]["type"] == "file"
    assert dp["providers"][0]["options"]["path"]
    prom = yaml.safe_load((ROOT / "prometheus" / "prometheus.yml").read_text())
    assert prom["rule_files"] == ["rules.yml"]
    assert prom["scrape_configs"][0]["job_name"] == "tailwatch"  # the rules select job="tailwatch"
