"""Map domain exceptions to one JSON error shape at the HTTP edge.

Every error body is `{"error": {"code": str, "message": str, "field": str?}}`.

    AuthError                  401 unauthorized / 403 forbidden
    RequestValidationError     422 invalid_request (field from the pydantic location)
    engine InputTooLong        413 input_too_long
    engine InvalidRequest      422 invalid_request
    engine Overloaded          429 overloaded + Retry-After
    engine NotReady            503 not_ready + Retry-After
    engine RequestTimeout      504 timeout
    engine EngineError         500 engine_error
    NotFound                   404 not_found
    ValueError (domain)        422 invalid_request (field from `.field` when present)
    SchemaBehind, SQL errors   503 database_unavailable
    anything else              500 internal_error (logged with its traceback)
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError as PydanticValidationError
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException

from engine.errors import (
    EngineError,
    InputTooLong,
    InvalidRequest,
    NotReady,
    Overloaded,
    RequestTimeout,
)
from monitor.auth import AuthError
from storage.errors import DatabaseUnavailable, SchemaBehind

log = logging.getLogger(__name__)

NOT_READY_RETRY_S = 5
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")
_STATUS_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
                 405: "method_not_allowed", 406: "not_acceptable", 409: "conflict",
                 413: "input_too_long", 415: "unsupported_media_type",
                 422: "invalid_request", 429: "overloaded", 503: "not_ready"}


class NotFound(LookupError):
    """A named resource does not exist (HTTP 404)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def error_response(status: int, code: str, message: str, *, field: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """Return the one error shape every route uses."""
    body: dict[str, Any] = {"code": code, "message": message}
    if field:
        body["field"] = field
    return JSONResponse({"error": body}, status_code=status, headers=headers)


def _retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def _field_of(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts)


async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    field = _field_of(tuple(first.get("loc", ())))
    messages = [f"{_field_of(tuple(e.get('loc', ()))) or 'body'}: {e.get('msg')}" for e in errors]
    return error_response(422, "invalid_request", "; ".join(messages), field=field or None)


async def _http(request: Request, exc: HTTPException) -> JSONResponse:
    code = _STATUS_CODES.get(exc.status_code, "error")
    return error_response(exc.status_code, code, str(exc.detail),
                          headers=dict(exc.headers or {}))


async def _auth(request: Request, exc: AuthError) -> JSONResponse:
    if exc.status == 401:
        return error_response(401, "unauthorized", str(exc),
                              headers={"WWW-Authenticate": "Bearer"})
    return error_response(403, "forbidden", str(exc))


async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
    if isinstance(exc, InputTooLong):
        return error_response(413, "input_too_long", str(exc), field=exc.field)
    if isinstance(exc, InvalidRequest):
        return error_response(422, "invalid_request", str(exc), field=exc.field)
    if isinstance(exc, Overloaded):
        return error_response(429, "overloaded", str(exc),
                              headers=_retry_after(exc.retry_after_s))
    if isinstance(exc, NotReady):
        return error_response(503, "not_ready", str(exc) or "the engine is not ready",
                              headers=_retry_after(NOT_READY_RETRY_S))
    if isinstance(exc, RequestTimeout):
        return error_response(504, "timeout", str(exc) or "the request timed out")
    log.error("engine error: %s: %s", type(exc).__name__, exc)
    return error_response(500, "engine_error", f"{type(exc).__name__}: {exc}")


async def _not_found(request: Request, exc: NotFound) -> JSONResponse:
    return error_response(404, "not_found", str(exc), field=exc.field)


async def _value(request: Request, exc: ValueError) -> JSONResponse:
    if isinstance(exc, PydanticValidationError):
        # Our own data failed a response model: a bug, not the caller's bad input.
        log.error("internal validation error: %s", exc)
        return error_response(500, "internal_error", "internal error building the response")
    field = getattr(exc, "field", None)
    if not isinstance(field, str):
        # House convention: a ValueError's message starts with the field it names.
        match = _FIELD_PREFIX.match(str(exc))
        field = match.group(1) if match else None
    return error_response(422, "invalid_request", str(exc), field=field)


async def _database(request: Request, exc: Exception) -> JSONResponse:
    log.warning("database unavailable: %s", type(exc).__name__)
    message = str(exc) if isinstance(exc, SchemaBehind) else "the database is unreachable"
    return error_response(503, "database_unavailable", message,
                          headers=_retry_after(NOT_READY_RETRY_S))


async def _internal(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled %s on %s %s", type(exc).__name__, request.method, request.url.path,
              exc_info=exc)
    return error_response(500, "internal_error", f"internal error ({type(exc).__name__})")


def install_error_handlers(app: FastAPI) -> None:
    """Register every mapping above on `app`."""
    app.add_exception_handler(RequestValidationError, _validation)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http)  # type: ignore[arg-type]
    app.add_exception_handler(AuthError, _auth)  # type: ignore[arg-type]
    app.add_exception_handler(EngineError, _engine_error)  # type: ignore[arg-type]
    app.add_exception_handler(NotFound, _not_found)  # type: ignore[arg-type]
    for exc_type in (SchemaBehind, DatabaseUnavailable, OperationalError, PoolTimeout):
        app.add_exception_handler(exc_type, _database)
    app.add_exception_handler(ValueError, _value)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _internal)
