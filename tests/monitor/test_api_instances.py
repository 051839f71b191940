"""GET /v1/instances and the stable default instance id."""

from __future__ import annotations

import os
import socket
from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient

from monitor.hub import services_of
from monitor.settings import Settings
from storage.models import Alert, ProbeRun, TrafficRollup


@pytest.fixture
def db_kind() -> str:
    """SQLite only: the query itself runs on both in tests/alerts/test_incidents.py."""
    return "sqlite"


def test_instances_lists_live_and_stale_ones(client: TestClient) -> None:
    now = datetime.now(UTC)
    with services_of(client.app).sessions.begin() as s:  # type: ignore[attr-defined]
        s.add(ProbeRun(started_at=now - timedelta(minutes=1), status="ok", instance_id="web-1",
                       kind="cycle"))
        s.add(TrafficRollup(minute=now - timedelta(hours=2), instance_id="web-2", bucket="64",
                            path="compiled", decoding="direct"))
        s.add(Alert(fingerprint="f", rule="recompiles_per_hour", labels={"instance": "web-2"},
                    state="firing", started_at=now, updated_at=now))
    body = client.get("/v1/instances").json()
    assert body["stale_after_s"] == 900.0
    got = {i["instance_id"]: (i["state"], i["open_alerts"]) for i in body["instances"]}
    assert got["web-1"] == ("live", 0)
    assert got["web-2"] == ("stale", 1)
    assert [i["state"] for i in body["instances"]][-1] == "stale"  # live ones first
    r = client.get("/v1/instances", params={"lookback_s": -1})
    assert r.status_code == 422 and "lookback_s" in r.text


def test_flags_say_where_the_engine_got_them(client: TestClient) -> None:
    assert client.get("/v1/flags").json()["effective"]["source"] == "live"
    assert 'tailwatch_flag_source{source="live"} 1.0' in client.get("/metrics").text


def test_default_instance_id_is_stable_across_restarts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TAILWATCH_INSTANCE_ID", raising=False)
    monkeypatch.delenv("TAILWATCH_CONFIG", raising=False)
    instance_id = Settings().instance_id
    assert instance_id == socket.gethostname()
    assert str(os.getpid()) not in instance_id.split("-")
