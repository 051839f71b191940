"""Make the OpenAPI document say what the service answers: the error shape, auth, limits.

FastAPI documents only the 200 body and its own 422 shape. Every route here answers its
errors as `{"error": {"code", "message", "field"?}}` (monitor.api.errors), so each
operation gets that body for the statuses it can answer:

    every operation      422 invalid_request, 503 database_unavailable (+ Retry-After)
    with a bearer token  401 unauthorized, 403 forbidden
    with a request body  413 input_too_long (the BodyLimit middleware)
    with path parameters 404 not_found
    POST /v1/generate    429 overloaded, 503 not_ready (+ Retry-After), 504 timeout

A status a route declares itself keeps its description; its body becomes the error shape.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA: dict[str, Any] = {
    "title": "ErrorBody",
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["code", "message"],
        "properties": {
            "code": {"type": "string", "description": "stable machine-readable code"},
            "message": {"type": "string"},
            "field": {"type": "string", "description": "the request field at fault"},
        },
    }},
}
_REF = {"$ref": "#/components/schemas/ErrorBody"}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying",
                                "schema": {"type": "integer", "minimum": 1}}}
_DESCRIPTIONS = {
    401: "Missing bearer token", 403: "Unknown token", 404: "No such resource",
    409: "Conflict with the resource's state", 413: "Request body or input over the limit",
    422: "Invalid field (`error.field` names it)", 429: "Queue full; see Retry-After",
    503: "Database unreachable or engine not ready; see Retry-After", 504: "Timed out",
}
# Routes that answer their own body on a status (not the error shape).
_OWN_BODIES = {("/readyz", "get", "503")}
_GENERATE = ("/v1/generate", "post")


def install_openapi(app: FastAPI) -> None:
    """Replace `app.openapi` with the generator below (built once, then cached)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def document(app: FastAPI) -> dict[str, Any]:
    """Return the app's OpenAPI document with the error responses described above."""
    doc = get_openapi(title=app.title, version=app.version, summary=app.summary,
                      description=app.description, routes=app.routes)
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    schemas["ErrorBody"] = ERROR_SCHEMA
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            _document_errors(path, method, op)
    return doc


def _document_errors(path: str, method: str, op: dict[str, Any]) -> None:
    statuses = {422, 503}
    if op.get("security"):
        statuses |= {401, 403}
    if "requestBody" in op:
        statuses.add(413)
    if any(p.get("in") == "path" for p in op.get("parameters", ())):
        statuses.add(404)
    if (path, method) == _GENERATE:
        statuses |= {413, 429, 503, 504}
    responses = op.setdefault("responses", {})
    statuses |= {int(s) for s in responses if s.isdigit() and int(s) >= 400}
    for status in sorted(statuses):
        key = str(status)
        if (path, method, key) in _OWN_BODIES:
            continue
        entry = responses.setdefault(key, {"description": _DESCRIPTIONS.get(status, "Error")})
        entry["content"] = {"application/json": {"schema": _REF}}
        if status in (429, 503):
            entry["headers"] = _RETRY_AFTER
