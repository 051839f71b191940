"""Baselines start learning once the engine is warm: no probe row is taken while it warms."""

from __future__ import annotations

from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from monitor.app import create_app
from monitor.hub import services_of
from monitor.settings import Settings
from storage.queries.series import cohort_since
from tests.monitor.conftest import suites, wait_for
from tests.monitor.fakes import FakeFactory
from vocab import utcnow


def test_probes_wait_for_a_warm_engine_so_baseline_windows_start_after_it(
        settings: Settings, auth: dict[str, str]) -> None:
    factory = FakeFactory(hold_warmup=True)
    app = create_app(settings, engine_factory=factory, registry=CollectorRegistry(),
                     suites=suites())
    with TestClient(app) as client:
        services = services_of(app)
        wait_for(lambda: services.engine_holder.get() is not None)
        assert client.get("/readyz").json()["status"] == "warming"
        # Real traffic is served while the buckets warm; probes are not taken.
        assert client.post("/v1/generate", json={"text": "hello river"}).status_code == 200
        assert services.probes.job("cycle")() is None
        assert services.probes.job("burst")() is None
        r = client.post("/v1/probes/run", json={"kind": "cycle", "ab": False}, headers=auth)
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        assert client.get("/v1/probes/runs").json() == []
        assert factory.engine is not None and factory.engine.state.canary_calls == 0

        factory.engine.finish_warmup.set()
        wait_for(lambda: client.get("/readyz").status_code == 200)
        warm_at = utcnow()
        assert services.probes.job("cycle")() is not None
        wait_for(lambda: [run["kind"] for run in client.get("/v1/probes/runs").json()]
                 == ["cycle"])  # stored through the write buffer
        # A cohort's baseline window starts at its first probe run (plus warm_in_s,
        # alerts.baselines): that run came after the engine was warm.
        with services.sessions() as session:
            since = cohort_since(session, utcnow())
        info = factory.engine.info
        assert since[(info.model_version, info.config_hash)] >= warm_at
