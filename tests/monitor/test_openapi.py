"""The OpenAPI document declares the bearer scheme and the one error body."""

from __future__ import annotations

from fastapi.testclient import TestClient

ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}


def _json_schema(response: dict) -> dict:  # type: ignore[type-arg]
    return response["content"]["application/json"]["schema"]


def test_bearer_scheme_is_declared_on_the_operations_that_check_it(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    assert doc["components"]["securitySchemes"]["bearer"] == {
        "type": "http", "scheme": "bearer",
        "description": "An API token: TAILWATCH_API_TOKEN or a named api.tokens entry"}
    put = doc["paths"]["/v1/flags/{name}"]["put"]
    assert put["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/healthz"]["get"]


def test_errors_are_documented_in_the_shape_the_service_answers(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    put = doc["paths"]["/v1/flags/{name}"]["put"]["responses"]
    for status in ("401", "403", "404", "413", "422", "503"):
        assert _json_schema(put[status]) == ERROR_REF, status
    assert "Retry-After" in put["503"]["headers"]
    generate = doc["paths"]["/v1/generate"]["post"]["responses"]
    for status in ("413", "422", "429", "503", "504"):
        assert _json_schema(generate[status]) == ERROR_REF, status
    assert "Retry-After" in generate["429"]["headers"]
    # The service's actual 422 matches the documented body.
    r = client.put("/v1/flags/speculative", json={}, headers={"Authorization": "Bearer x"})
    assert r.status_code in (403, 422)
    assert set(r.json()) == {"error"} and {"code", "message"} <= set(r.json()["error"])
