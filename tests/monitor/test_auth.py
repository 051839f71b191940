"""Bearer tokens: who may write, who may read, and that tokens never reach the logs."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from monitor.app import create_app
from monitor.auth import ANONYMOUS, Authenticator, AuthError
from monitor.loopback import wait_for
from tests.monitor.conftest import OTHER_TOKEN, TOKEN, make_settings
from tests.monitor.fakes import FakeFactory


@pytest.fixture
def db_kind() -> str:
    """Run this module on SQLite only (flag and metric tests cover PostgreSQL)."""
    return "sqlite"


def _auth(migrated: str = "sqlite://", **api: object) -> Authenticator:
    return Authenticator.from_settings(make_settings(migrated, api={
        "tokens": [{"name": "oncall", "token": OTHER_TOKEN}], **api}))


def test_authenticator_names_the_actor_of_each_token() -> None:
    auth = _auth()
    assert auth.actor(f"Bearer {TOKEN}") == "api-token"
    assert auth.actor(f"bearer   {OTHER_TOKEN} ") == "oncall"
    with pytest.raises(AuthError) as missing:
        auth.actor(None)
    assert missing.value.status == 401
    with pytest.raises(AuthError) as basic:
        auth.actor(f"Basic {TOKEN}")
    assert basic.value.status == 401
    with pytest.raises(AuthError) as wrong:
        auth.actor(f"Bearer {TOKEN}x")
    assert wrong.value.status == 403
    # Reads are open by default, and a valid token still names the reader.
    assert auth.actor(None, write=False) == ANONYMOUS
    assert auth.actor(f"Bearer {OTHER_TOKEN}", write=False) == "oncall"


def test_read_auth_protects_read_endpoints(migrated_url: str) -> None:
    settings = make_settings(migrated_url, api={"read_auth": True})
    app = create_app(settings, engine_factory=FakeFactory(), registry=CollectorRegistry())
    with TestClient(app) as client:
        wait_for(lambda: client.get("/readyz").status_code == 200)
        for path in ("/v1/flags", "/v1/alerts", "/v1/baselines", "/v1/probes/runs",
                     "/v1/reports", "/metrics"):
            assert client.get(path).status_code == 401, path
            assert client.get(path, headers={"Authorization": "Bearer nope"}).status_code \
                == 403, path
            assert client.get(path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code \
                == 200, path
        assert client.post("/v1/generate", json={"text": "hi"}).status_code == 401
        # Probes of liveness and readiness stay open for orchestrators.
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 200


def test_write_endpoints_need_a_token(client: TestClient) -> None:
    calls = [
        ("PUT", "/v1/flags/compiled", {"json": {"value": False, "reason": "x"}}),
        ("DELETE", "/v1/flags/compiled", {"params": {"reason": "x"}}),
        ("POST", "/v1/baselines", {"json": {"action": "unpin", "metric": "p99_latency"}}),
        ("POST", "/v1/probes/run", {"json": {}}),
    ]
    for method, path, kw in calls:
        assert client.request(method, path, **kw).status_code == 401, path
        r = client.request(method, path, headers={"Authorization": "Bearer wrong"}, **kw)
        assert r.status_code == 403, path


def test_tokens_never_appear_in_logs(migrated_url: str,
                                     caplog: pytest.LogCaptureFixture) -> None:
    wrong = "tw-wrong-token-5e5e5e"
    with caplog.at_level(logging.DEBUG):
        app = create_app(make_settings(migrated_url), engine_factory=FakeFactory(),
                         registry=CollectorRegistry())
        with TestClient(app) as client:
            wait_for(lambda: client.get("/readyz").status_code == 200)
            good = {"Authorization": f"Bearer {TOKEN}"}
            client.put("/v1/flags/compiled", json={"value": False, "reason": "x"},
                       headers=good)
            client.put("/v1/flags/compiled", json={"value": True, "reason": "x"},
                       headers={"Authorization": f"Bearer {wrong}"})
            client.put("/v1/flags/compiled", json={"value": "bad", "reason": "x"},
                       headers={"Authorization": f"Bearer {OTHER_TOKEN}"})
            client.post("/v1/generate", json={"text": "hi"}, headers=good)
            client.get("/metrics", headers=good)
    assert caplog.records, "the service logs something at DEBUG"
    assert any("rejected a request with an unknown token" in r.getMessage()
               for r in caplog.records)
    text = "\n".join(f"{r.getMessage()} {r.args!r} {r.exc_text or ''}" for r in caplog.records)
    for secret in (TOKEN, OTHER_TOKEN, wrong):
        assert secret not in text


@pytest.mark.parametrize("names", [["oncall", "oncall"], ["api-token"], ["anonymous"], [" "]])
def test_token_names_must_identify_one_actor(names: list[str]) -> None:
    tokens = [{"name": n, "token": f"t{i}"} for i, n in enumerate(names)]
    with pytest.raises(ValueError, match="api.tokens"):
        make_settings("sqlite://", api={"tokens": tokens})
