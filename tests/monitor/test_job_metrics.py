"""The monitor's own cost through the real app: job series on /metrics, the job table in /readyz."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from monitor.app import create_app
from tests.monitor.conftest import make_settings, suites, wait_for
from tests.monitor.fakes import FakeFactory

FAST = {"enabled": True, "probes_enabled": False, "traffic_flush_interval_s": 0.05,
        "evaluate_interval_s": 0.1, "delivery_interval_s": 0.1}


def jobs(client: TestClient) -> dict[str, dict[str, Any]]:
    body = client.get("/readyz").json()
    return {j["name"]: j for j in body["jobs"]}


@pytest.mark.parametrize("in_process", [True, False])
def test_jobs_are_timed_and_listed(migrated_url: str, in_process: bool) -> None:
    app = create_app(make_settings(migrated_url, scheduler=FAST), engine_factory=FakeFactory(),
                     registry=CollectorRegistry(), suites=suites(),
                     analysis_in_process=in_process)
    with TestClient(app) as client:
        wait_for(lambda: client.get("/readyz").status_code == 200)
        wait_for(lambda: jobs(client)["traffic_flush"]["runs"] >= 2)
        table = jobs(client)
        flush = table["traffic_flush"]
        assert flush["failures"] == 0 and flush["last_success"] is not None
        assert flush["last_duration_s"] >= 0 and flush["leader"] is None
        text = client.get("/metrics").text
        label = '{scheduled_job="traffic_flush"}'
        assert f"tailwatch_job_duration_seconds_count{label}" in text
        assert f"tailwatch_job_last_success_timestamp_seconds{label}" in text
        assert f"tailwatch_job_failures_total{label} 0.0" in text
    if in_process:  # the demo's and tests' wiring: analysis beside the engine
        assert {"evaluate", "delivery", "retention", "report"} <= set(table)
    else:  # `serve`'s wiring: the worker runs them
        assert set(table) == {"traffic_flush", "memory_trim"}
