"""GET /v1/flags shows this instance's effective flags: its own "instance:<id>" scope
applies, another instance's never leaks (SQLite and PostgreSQL)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from alerts.flags import FlagSnapshot, FlagStore, instance_scope
from monitor.hub import services_of

HERE = "test-instance"  # tests.monitor.conftest.make_settings' instance_id


def _auto_compile_fallback(client: TestClient, instance_id: str, value: bool = False) -> None:
    """Store what the compile-storm policy stores: an automatic per-instance flag."""
    services = services_of(client.app)  # type: ignore[arg-type]
    with services.sessions.begin() as session:
        FlagStore().set(session, "compiled", instance_scope(instance_id), value,
                        reason="recompile storm", actor="policy:eager_on_storm", source="auto")
    # As a flip by the worker's policy: the engine sees it at the snapshot's next refresh.
    assert isinstance(services.flags, FlagSnapshot) and services.flags.refresh_now(10.0)


def _in_force(flags: dict) -> dict[str, bool]:
    return {f["scope"]: f["in_force"] for f in flags["flags"] if f["name"] == "compiled"}


def test_another_instances_fallback_does_not_leak(client: TestClient) -> None:
    _auto_compile_fallback(client, "other-replica")
    flags = client.get("/v1/flags").json()
    assert flags["effective"]["instance_id"] == HERE
    assert flags["effective"]["compiled"] is True
    assert _in_force(flags) == {"instance:other-replica": False}
    # The engine agrees with the view: this instance still serves compiled.
    assert client.post("/v1/generate", json={"text": "hello river"}).json()["path"] == \
        "compiled"


def test_this_instances_fallback_is_in_the_effective_view(client: TestClient,
                                                          auth: dict[str, str]) -> None:
    _auto_compile_fallback(client, "other-replica", value=True)
    _auto_compile_fallback(client, HERE)
    flags = client.get("/v1/flags").json()
    assert flags["effective"]["compiled"] is False
    assert _in_force(flags) == {f"instance:{HERE}": True, "instance:other-replica": False}
    assert client.post("/v1/generate", json={"text": "hello river"}).json()["path"] == "eager"
    # A manual instance override wins over the automatic fallback, and over global off.
    r = client.put("/v1/flags/compiled", json={"scope": f"instance:{HERE}", "value": True,
                                               "reason": "storm was a deploy"}, headers=auth)
    assert r.status_code == 200, r.text
    r = client.put("/v1/flags/compiled", json={"value": False, "reason": "fleet eager"},
                   headers=auth)
    assert r.status_code == 200, r.text
    flags = client.get("/v1/flags").json()
    assert flags["effective"]["compiled"] is True
    assert client.post("/v1/generate", json={"text": "hello river"}).json()["path"] == \
        "compiled"
