"""Real-traffic sampling through POST /v1/generate on the real app: off the request path.

The engine's reference path is held on a gate (the test seam), so a response that comes
back while the gate is shut did not wait for its reference replay.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from engine.config import EngineConfig
from engine.protocol import REFERENCE, FlagOverride, FlagProvider, GenerateResult
from monitor.hub import services_of
from monitor.loopback import wait_for
from storage.models import OutputAgreement
from tests.monitor.conftest import make_settings, start
from tests.monitor.fakes import FakeFactory, ServiceFakeEngine


class SlowReferenceEngine(ServiceFakeEngine):
    """The service fake engine whose reference path blocks until `gate` is set."""

    def __init__(self, config: EngineConfig, flags: FlagProvider) -> None:
        super().__init__(config, flags)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.reference_calls = 0

    def generate(self, text: str, *, override: FlagOverride | None = None,
                 **kw: Any) -> GenerateResult:
        if override == REFERENCE:
            self.reference_calls += 1
            self.entered.set()
            assert self.gate.wait(30)
        return super().generate(text, override=override, **kw)


class SlowReferenceFactory(FakeFactory):
    """Build SlowReferenceEngine."""

    def __call__(self, config: EngineConfig, flags: FlagProvider) -> SlowReferenceEngine:
        engine = SlowReferenceEngine(config, flags)
        self.engine = engine
        self.built.set()
        return engine


def _run(migrated_url: str, *, store_text: bool) -> tuple[list[OutputAgreement], Any, Any]:
    settings = make_settings(migrated_url, quality={
        "traffic_sample_share": 1.0, "sample_queue_max": 2, "store_text": store_text})
    factory = SlowReferenceFactory()
    with TestClient(start(settings, factory)) as client:
        wait_for(lambda: client.get("/readyz").status_code == 200)
        engine = factory.engine
        assert isinstance(engine, SlowReferenceEngine)
        services = services_of(client.app)  # type: ignore[arg-type]
        sampler = services.sampler
        assert sampler is not None
        texts = ["hello river", "hello stone", "the river runs past the old stone",
                 "hello field", "hello house"]
        first = client.post("/v1/generate", json={"text": texts[0]})
        assert first.status_code == 200, first.text
        assert engine.entered.wait(10)  # the worker holds the first replay on the slow path
        bodies = [first.json()]
        for text in texts[1:]:  # answered while the reference path is still shut
            r = client.post("/v1/generate", json={"text": text})
            assert r.status_code == 200, r.text
            bodies.append(r.json())
        assert not engine.gate.is_set()
        stats = sampler.stats
        assert (stats.offered, stats.pending, stats.dropped) == (5, 2, 2)  # queue_max 2
        scrape = client.get("/metrics").text
        assert 'tailwatch_sampler_requests_total{outcome="dropped"} 2.0' in scrape
        assert "tailwatch_sampler_pending 2.0" in scrape
        engine.gate.set()
        wait_for(lambda: sampler.stats.replayed == 3)
        assert sampler.stats.failed == 0 and engine.reference_calls == 3
        assert services.writer.flush(timeout=30) and services.writer.stats.failed == 0
        with services.sessions() as s:
            rows = list(s.scalars(select(OutputAgreement).order_by(OutputAgreement.id)))
        return rows, engine.info, bodies


@pytest.mark.parametrize("store_text", [False, True])
def test_sampled_requests_are_replayed_off_the_request_path_and_stored(
        migrated_url: str, store_text: bool) -> None:
    rows, info, bodies = _run(migrated_url, store_text=store_text)
    assert len(rows) == 3  # the one replayed first and the two queued; two were dropped
    # Queued in arrival order: requests 0, 1 and 2 (3 and 4 found the queue full).
    assert [r.bucket for r in rows] == [b["bucket"] for b in bodies[:3]]
    assert {r.bucket for r in rows} == {"16", "64"}
    for r, body in zip(rows, bodies, strict=False):
        assert (r.source, r.run_id, r.count, r.exact) == ("traffic", None, 1, 1)
        assert (r.path, r.decoding, r.variant) == (body["path"], body["decoding"], "optimized")
        assert (r.model_version, r.config_hash) == (info.model_version, info.config_hash)
        assert r.model_version and r.config_hash
        assert r.text == (body["text"] if store_text else None)
