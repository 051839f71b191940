"""Admission counters by origin (real traffic, synthetic probes) through the real app."""

from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from engine.errors import Overloaded
from tests.monitor.conftest import wait_for
from tests.monitor.fakes import FakeFactory


def test_admission_series_count_real_and_synthetic_requests_apart(
        client: TestClient, factory: FakeFactory, registry: CollectorRegistry,
        auth: dict[str, str]) -> None:
    engine = factory.engine
    assert engine is not None and engine.admission is not None
    get = registry.get_sample_value
    assert client.post("/v1/generate", json={"text": "hello river"}).status_code == 200
    r = client.post("/v1/probes/run", json={"kind": "cycle", "ab": False}, headers=auth)
    assert r.status_code == 200, r.text
    assert get("tailwatch_admission_admitted_total", {"origin": "real"}) == 1
    assert get("tailwatch_admission_admitted_total",
               {"origin": "synthetic"}) == engine.state.canary_calls > 0

    # One slot (engine.max_concurrency), four waiting (engine.max_queue): a synthetic call
    # holds the slot, four synthetic calls wait, then a real one arrives.
    engine.hang.set()
    errors: list[BaseException] = []

    def call(canary: bool) -> None:
        try:
            engine.generate("hello river", canary=canary)
        except Overloaded as exc:
            errors.append(exc)

    holder = threading.Thread(target=call, args=(True,))
    holder.start()
    wait_for(lambda: engine.admission is not None and engine.admission.running == 1)
    queued = [threading.Thread(target=call, args=(True,)) for _ in range(4)]
    for t in queued:
        t.start()
    wait_for(lambda: get("tailwatch_admission_waiting", {"origin": "synthetic"}) == 4)
    real = threading.Thread(target=call, args=(False,))
    real.start()
    wait_for(lambda: get("tailwatch_admission_waiting", {"origin": "real"}) == 1)
    with pytest.raises(Overloaded, match="real requests waiting"):
        engine.generate("hello river", canary=True)
    engine.release.set()
    for t in (holder, *queued, real):
        t.join(10)
    assert len(errors) == 1 and "shed" in str(errors[0])

    assert get("tailwatch_admission_rejected_total",
               {"origin": "synthetic", "reason": "shed"}) == 1
    assert get("tailwatch_admission_rejected_total",
               {"origin": "synthetic", "reason": "real_waiting"}) == 1
    assert get("tailwatch_admission_rejected_total",
               {"origin": "real", "reason": "queue_full"}) == 0
    assert get("tailwatch_admission_admitted_total", {"origin": "real"}) == 2
    text = client.get("/metrics").text
    assert 'tailwatch_admission_rejected_total{origin="synthetic",reason="shed"} 1.0' in text
    assert 'tailwatch_admission_waiting{origin="real"} 0.0' in text
