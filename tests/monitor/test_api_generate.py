"""POST /v1/generate: serving, error mapping, and what it records."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from engine.errors import Cancelled, DoesNotFit, Overloaded, RequestTimeout
from monitor.hub import services_of
from tests.monitor.fakes import FakeFactory


@pytest.fixture
def db_kind() -> str:
    """Run this module on SQLite only (flag and metric tests cover PostgreSQL)."""
    return "sqlite"


def test_generate_serves_and_records(client: TestClient, registry: CollectorRegistry) -> None:
    r = client.post("/v1/generate", json={"text": "hello river", "max_new_tokens": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["output_tokens"] == 4
    assert body["bucket"] == "16"
    assert body["path"] == "compiled"
    assert body["decoding"] == "speculative"
    labels = {"bucket": "16", "path": "compiled", "decoding": "speculative"}
    assert registry.get_sample_value("tailwatch_request_duration_seconds_count", labels) == 1
    assert registry.get_sample_value(
        "tailwatch_request_time_per_output_token_seconds_count", labels) == 3
    assert registry.get_sample_value(
        "tailwatch_spec_decode_num_draft_tokens_total",
        {"source": "traffic", "bucket": "16"}) > 0
    # Real traffic lands in the recorder's rollups, canaries never do.
    recorder = services_of(client.app).traffic
    records = recorder.drain()
    assert [(k.bucket, d.requests) for k, d in records] == [("16", 1)]


def test_missing_text_is_422_naming_the_field(client: TestClient) -> None:
    r = client.post("/v1/generate", json={"max_new_tokens": 4})
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["code"] == "invalid_request"
    assert err["field"] == "text"
    assert "text" in err["message"]


def test_bad_max_new_tokens_is_422_naming_the_field(client: TestClient) -> None:
    for value in (0, "many", 10_000):
        r = client.post("/v1/generate", json={"text": "hi", "max_new_tokens": value})
        assert r.status_code == 422, value
        assert r.json()["error"]["field"] == "max_new_tokens"
    # The runtime's own check and message (engine.validation), cap 64 in the test settings.
    assert r.json()["error"]["message"] == "max_new_tokens: must be between 1 and 64"


def test_blank_text_is_refused_with_the_runtime_message(client: TestClient) -> None:
    # The fake engine runs the runtime's checks (engine.validation), not its own copy.
    r = client.post("/v1/generate", json={"text": "   "})
    assert r.status_code == 422
    assert r.json()["error"] == {"code": "invalid_request", "field": "text",
                                 "message": "text: must not be empty"}


def test_unknown_field_is_422(client: TestClient) -> None:
    r = client.post("/v1/generate", json={"text": "hi", "temperature": 0.7})
    assert r.status_code == 422
    assert r.json()["error"]["field"] == "temperature"


def test_input_over_the_hard_cap_is_413(client: TestClient,
                                        registry: CollectorRegistry) -> None:
    r = client.post("/v1/generate", json={"text": "x" * 500})
    assert r.status_code == 413
    err = r.json()["error"]
    assert err == {"code": "input_too_long", "field": "text", "message": err["message"]}
    assert "128" in err["message"]
    assert registry.get_sample_value("tailwatch_requests_rejected_total",
                                     {"reason": "too_long"}) == 1


def test_overloaded_is_429_with_retry_after(client: TestClient, factory: FakeFactory,
                                           registry: CollectorRegistry) -> None:
    assert factory.engine is not None
    factory.engine.fail_with = Overloaded("queue full (4 waiting)", retry_after_s=2.5)
    r = client.post("/v1/generate", json={"text": "hello"})
    assert r.status_code == 429
    assert r.headers["Retry-After"] == "3"
    assert r.json()["error"]["code"] == "overloaded"
    assert registry.get_sample_value("tailwatch_requests_rejected_total",
                                     {"reason": "overloaded"}) == 1
    records = services_of(client.app).traffic.drain()  # type: ignore[attr-defined]
    assert [(k.path, d.rejections) for k, d in records] == [("rejected", 1)]


def test_a_request_that_cannot_fit_a_batch_row_is_413_naming_the_limit(
        client: TestClient, factory: FakeFactory) -> None:
    assert factory.engine is not None
    factory.engine.fail_with = DoesNotFit(
        "max_new_tokens", "300 tokens do not fit a batch row (264 slots after the look-ahead)",
        value=300, limit=264)
    r = client.post("/v1/generate", json={"text": "hello"})
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["code"] == "input_too_long" and err["field"] == "max_new_tokens"
    assert "264" in err["message"]


def test_timeout_is_504(client: TestClient, factory: FakeFactory) -> None:
    assert factory.engine is not None
    factory.engine.fail_with = RequestTimeout("no result within 2 s")
    r = client.post("/v1/generate", json={"text": "hello"})
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "timeout"


def test_cancelled_is_499_counted_and_no_traffic_sample(
        client: TestClient, factory: FakeFactory, registry: CollectorRegistry) -> None:
    # What a client that hung up would get (tests/monitor/test_api_generate_cancel.py).
    assert factory.engine is not None
    factory.engine.fail_with = Cancelled("request cancelled")
    r = client.post("/v1/generate", json={"text": "hello"})
    assert r.status_code == 499
    assert r.json()["error"]["code"] == "cancelled"
    assert registry.get_sample_value(
        "tailwatch_requests_rejected_total", {"reason": "cancelled"}) == 1
    assert services_of(client.app).traffic.drain() == []


def test_timeout_s_reaches_the_engine_and_bad_values_are_422_naming_it(
        client: TestClient, factory: FakeFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = factory.engine
    assert engine is not None
    seen: list[float | None] = []
    generate = engine.generate

    def recording(text, **kwargs):
        if text == "hello":  # the app's own probe cycle may call the engine meanwhile
            seen.append(kwargs.get("timeout_s"))
        return generate(text, **kwargs)

    monkeypatch.setattr(engine, "generate", recording)
    assert client.post("/v1/generate", json={"text": "hello", "timeout_s": 2.5}).status_code == 200
    assert client.post("/v1/generate", json={"text": "hello", "timeout_s": 3}).status_code == 200
    assert client.post("/v1/generate", json={"text": "hello"}).status_code == 200
    assert seen == [2.5, 3, None]
    for value in (0, -1, True, "soon", 1e9):
        r = client.post("/v1/generate", json={"text": "hello", "timeout_s": value})
        assert r.status_code == 422, value
        assert r.json()["error"]["field"] == "timeout_s"
    assert len(seen) == 3  # refused at the edge: the engine never saw them


def test_openapi_documents_every_route(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    for path in ("/v1/generate", "/v1/flags", "/v1/flags/{name}", "/v1/flags/audit",
                 "/v1/alerts", "/v1/probes/runs", "/v1/probes/run", "/v1/baselines",
                 "/v1/reports", "/v1/reports/{report_id}", "/healthz", "/readyz"):
        assert path in spec["paths"], path
    assert client.get("/docs").status_code == 200


def test_unknown_routes_and_methods_use_the_error_shape(client: TestClient) -> None:
    r = client.get("/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = client.get("/v1/generate")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_unexpected_engine_failure_is_500_in_the_error_shape(
        factory: FakeFactory, client: TestClient, registry: CollectorRegistry) -> None:
    assert factory.engine is not None
    factory.engine.fail_with = RuntimeError("CUDA error: device-side assert")
    r = TestClient(client.app, raise_server_exceptions=False).post(
        "/v1/generate", json={"text": "hello"})
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "internal_error"
    assert registry.get_sample_value("tailwatch_requests_rejected_total",
                                     {"reason": "error"}) == 1
    records = services_of(client.app).traffic.drain()  # type: ignore[attr-defined]
    assert [(k.path, d.errors) for k, d in records] == [("failed", 1)]
