"""engine.max_queue_tokens end to end: the real app on the real engine (a tiny random T5,
eager, batched) refuses a request whose tokens would pass the queue's budget with 429 and
Retry-After, and counts it under reason token_budget."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.protocol import Engine, FlagProvider
from monitor.app import create_app
from tests.monitor.conftest import make_settings, suites, wait_for

pytestmark = pytest.mark.slow

BUDGET = 192  # max_input_tokens 128 + max_new_tokens_cap 64: the smallest budget allowed


@pytest.fixture
def db_kind() -> str:
    """Run on SQLite only: admission involves no database."""
    return "sqlite"


class RealEngines:
    """The production loader (engine.load_engine), remembering the engine it built."""

    def __init__(self) -> None:
        self.engine: Engine | None = None

    def __call__(self, config: EngineConfig, flags: FlagProvider) -> Engine:
        from engine import load_engine

        self.engine = load_engine(config, flags=flags)
        return self.engine


@pytest.fixture
def served(migrated_url: str, tmp_path: Path) -> Iterator[tuple[TestClient, RealEngines,
                                                                 CollectorRegistry]]:
    from tests.engine.conftest import build_tiny_t5

    target = build_tiny_t5(tmp_path / "target", seed=0)
    settings = make_settings(migrated_url, engine={
        "model_dir": str(target), "use_draft": False, "device": "cpu",
        "compile_mode": "off", "buckets": (16, 32, 64), "max_input_tokens": 128,
        "max_new_tokens": 8, "max_new_tokens_cap": 64, "max_queue": 4, "max_batch": 2,
        "max_queue_tokens": BUDGET, "cache_dir": str(tmp_path / "cache"),
        "flags_file": ""})
    engines, registry = RealEngines(), CollectorRegistry()
    app = create_app(settings, engine_factory=engines, registry=registry, suites=suites())
    with TestClient(app) as client:
        wait_for(lambda: client.get("/readyz").status_code == 200)
        yield client, engines, registry


def test_a_request_over_the_queues_token_budget_gets_429_and_is_counted(served) -> None:
    client, engines, registry = served
    engine = engines.engine
    assert engine is not None and engine.batch_scheduler is not None
    get = registry.get_sample_value
    # Hold the batching loop between steps: the two rows stay taken by requests that
    # cannot finish, and the next callers wait in the admission queue.
    gate = threading.Event()
    holder = threading.Thread(target=engine.batch_scheduler.call, args=(gate.wait,))
    holder.start()
    answers: dict[str, int] = {}

    def post(name: str, text: str, max_new_tokens: int) -> None:
        r = client.post("/v1/generate", json={"text": text, "max_new_tokens": max_new_tokens})
        answers[name] = r.status_code

    callers = [threading.Thread(target=post, args=(f"row{i}", "hello river", 8))
               for i in range(2)]
    for t in callers:
        t.start()
    wait_for(lambda: engine.admission_stats().real_admitted == 2)
    # 99 bytes: 100 ByT5 tokens (EOS included) + 64 new = 164 of the 192 queued.
    queued = threading.Thread(target=post, args=("queued", "x" * 99, 64))
    queued.start()
    wait_for(lambda: engine.admission_stats().real_waiting_tokens == 164)
    try:
        # 5 bytes + EOS + 64 new = 70 more: 234 > 192. Its count (2 of 4) would fit.
        r = client.post("/v1/generate", json={"text": "hello", "max_new_tokens": 64})
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "overloaded"
        assert "max_queue_tokens=192" in r.json()["error"]["message"]
        assert int(r.headers["Retry-After"]) >= 1
        # The same text with fewer new tokens fits the budget (6 + 8: 178).
        fits = threading.Thread(target=post, args=("fits", "hello", 8))
        fits.start()
        wait_for(lambda: engine.admission_stats().real_waiting == 2)
    finally:
        gate.set()
    for t in (holder, *callers, queued, fits):
        t.join(60)
    assert answers == {"row0": 200, "row1": 200, "queued": 200, "fits": 200}
    assert get("tailwatch_admission_rejected_total",
               {"origin": "real", "reason": "token_budget"}) == 1
    assert get("tailwatch_admission_rejected_total",
               {"origin": "real", "reason": "queue_full"}) == 0
    assert get("tailwatch_admission_rejected_total",
               {"origin": "synthetic", "reason": "token_budget"}) == 0
    assert get("tailwatch_requests_rejected_total", {"reason": "overloaded"}) == 1
    text = client.get("/metrics").text
    assert ('tailwatch_admission_rejected_total{origin="real",reason="token_budget"} 1.0'
            in text)
