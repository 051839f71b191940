"""The flag API on SQLite and PostgreSQL: auth, audit, validation, effect on generate."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from monitor.hub import services_of
from storage.models import FlagAudit
from tests.monitor.conftest import OTHER_TOKEN, TOKEN


def test_flag_changes_need_a_token(client: TestClient) -> None:
    body = {"scope": "64", "value": False, "reason": "draft drifts on logs"}
    r = client.put("/v1/flags/speculative", json=body)
    assert r.status_code == 401
    assert r.headers["WWW-Authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "unauthorized"
    r = client.put("/v1/flags/speculative", json=body,
                   headers={"Authorization": "Bearer not-the-token"})
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "forbidden"
    r = client.delete("/v1/flags/speculative", params={"scope": "64", "reason": "x"})
    assert r.status_code == 401
    # Nothing was written by the refused calls.
    assert client.get("/v1/flags/audit").json() == []


def test_every_change_is_audited_with_actor_old_new_and_reason(client: TestClient) -> None:
    oncall = {"Authorization": f"Bearer {OTHER_TOKEN}"}
    plain = {"Authorization": f"Bearer {TOKEN}"}
    r = client.put("/v1/flags/speculative",
                   json={"scope": "64", "value": False, "reason": "acceptance 0.2 on logs"},
                   headers=oncall)
    assert r.status_code == 200, r.text
    assert r.json()["actor"] == "oncall"
    r = client.put("/v1/flags/speculative",
                   json={"scope": "64", "value": True, "reason": "draft retrained"},
                   headers=plain)
    assert r.status_code == 200
    r = client.delete("/v1/flags/speculative", params={"scope": "64", "reason": "back to auto"},
                      headers=oncall)
    assert r.status_code == 200
    assert r.json() == {"name": "speculative", "scope": "64", "cleared": True,
                        "actor": "oncall"}
    audit = client.get("/v1/flags/audit").json()
    got = [(a["action"], a["actor"], a["old_value"], a["new_value"], a["reason"])
           for a in reversed(audit)]
    assert got == [
        ("set", "oncall", None, False, "acceptance 0.2 on logs"),
        ("set", "api-token", False, True, "draft retrained"),
        ("clear", "oncall", True, None, "back to auto"),
    ]
    assert {a["scope"] for a in audit} == {"64"}
    # The rows are in the database, not only in the response.
    with services_of(client.app).sessions() as session:  # type: ignore[attr-defined]
        rows = session.scalars(select(FlagAudit).order_by(FlagAudit.id)).all()
    assert [r.actor for r in rows] == ["oncall", "api-token", "oncall"]


def test_flag_change_takes_effect_on_the_next_generate(client: TestClient,
                                                      auth: dict[str, str]) -> None:
    first = client.post("/v1/generate", json={"text": "hello river"}).json()
    assert (first["bucket"], first["decoding"], first["path"]) == ("16", "speculative",
                                                                   "compiled")
    r = client.put("/v1/flags/speculative",
                   json={"scope": "16", "value": False, "reason": "test"}, headers=auth)
    assert r.status_code == 200
    assert client.post("/v1/generate", json={"text": "hello river"}).json()["decoding"] == \
        "direct"
    r = client.put("/v1/flags/compiled", json={"value": False, "reason": "eager fallback"},
                   headers=auth)
    assert r.status_code == 200
    assert client.post("/v1/generate", json={"text": "hello river"}).json()["path"] == "eager"
    flags = client.get("/v1/flags").json()
    assert flags["effective"]["compiled"] is False
    assert flags["effective"]["speculative"] == {"16": False}
    assert {(f["name"], f["scope"], f["in_force"]) for f in flags["flags"]} == {
        ("speculative", "16", True), ("compiled", "global", True)}
    client.delete("/v1/flags/compiled", params={"reason": "recovered"}, headers=auth)
    assert client.post("/v1/generate", json={"text": "hello river"}).json()["path"] == \
        "compiled"


@pytest.mark.parametrize(("name", "body", "field"), [
    ("speculative", {"scope": "64", "value": False}, "reason"),
    ("speculative", {"scope": "64", "value": False, "reason": "   "}, "reason"),
    ("speculative", {"scope": "64", "reason": "x"}, "value"),
    ("speculative", {"scope": "64", "value": "off", "reason": "x"}, "value"),
    ("speculative", {"scope": "huge", "value": False, "reason": "x"}, "scope"),
    ("compiled", {"scope": "64", "value": False, "reason": "x"}, "scope"),
    ("warp_drive", {"value": True, "reason": "x"}, "name"),
    ("speculative_probation", {"value": 1.5, "reason": "x"}, "value"),
    ("compiled", {"value": False, "reason": "x", "expires_at": "2001-01-01T00:00:00Z"},
     "expires_at"),
    ("compiled", {"value": False, "reason": "x", "expires_at": "tomorrow"}, "expires_at"),
])
def test_bad_flag_changes_are_422_naming_the_field(client: TestClient, auth: dict[str, str],
                                                   name: str, body: dict, field: str) -> None:
    r = client.put(f"/v1/flags/{name}", json=body, headers=auth)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == field
    assert client.get("/v1/flags/audit").json() == []


def test_clear_without_reason_or_override(client: TestClient, auth: dict[str, str]) -> None:
    r = client.delete("/v1/flags/compiled", headers=auth)
    assert r.status_code == 422
    assert r.json()["error"]["field"] == "reason"
    r = client.delete("/v1/flags/compiled", params={"reason": "nothing set"}, headers=auth)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found"


def test_reads_are_open_unless_read_auth(client: TestClient) -> None:
    assert client.get("/v1/flags").status_code == 200
    assert client.get("/v1/flags/audit").status_code == 200
