"""Map domain exceptions to one JSON error shape at the HTTP edge.

Every error body is `{"error": {"code": str, "message": str, "field": str?}}`.

    AuthError                  401 unauthorized / 403 forbidden
    RequestValidationError     422 invalid_request (field from the pydantic location)
    engine InputTooLong        413 input_too_long
    engine DoesNotFit          413 input_too_long (an InputTooLong: a batch row too small)
    engine InvalidRequest      422 invalid_request
    engine Overloaded          429 overloaded + Retry-After (every admission refusal:
                               queue full, token budget, shed, real requests waiting)
    engine NotReady            503 not_ready + Retry-After
    engine RequestTimeout      504 timeout
    engine Cancelled           499 cancelled (the client disconnected first; not logged)
    engine EngineError         500 engine_error
    NotFound                   404 not_found
    ValueError (domain)        422 invalid_request (field from `.field` when present)
    DataError, OverflowError   422 invalid_request (a value the database cannot store)
    IntegrityError             409 conflict
    SchemaBehind, SQL errors   503 database_unavailable
    anything else              500 internal_error (logged once, with its traceback: CatchAll)
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
from sqlalchemy.exc import DataError, IntegrityError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.errors import (
    Cancelled,
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
_BODY_PARSE_ERROR = "There was an error parsing the body"
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


def _error_field(error: Any) -> str:
    if error.get("type") == "json_invalid":
        # loc is ("body", <character offset>): the offset is no field name.
        return "body"
    return _field_of(tuple(error.get("loc", ()))) or "body"


def _error_message(error: Any) -> str:
    if error.get("type") == "json_invalid":
        offset = next((p for p in error.get("loc", ()) if isinstance(p, int)), None)
        where = f" at character {offset}" if offset is not None else ""
        return f"body: not valid JSON{where} ({error.get('ctx', {}).get('error', 'parse error')})"
    return f"{_error_field(error)}: {error.get('msg')}"


async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors() or [{"loc": (), "msg": "invalid request"}]
    messages = "; ".join(_error_message(e) for e in errors)
    return error_response(422, "invalid_request", messages, field=_error_field(errors[0]))


async def _http(request: Request, exc: HTTPException) -> JSONResponse:
    if exc.status_code == 400 and exc.detail == _BODY_PARSE_ERROR:
        # FastAPI's answer to a body that is not even text: the same 422 as bad JSON.
        return error_response(422, "invalid_request", "body: not valid JSON (not UTF-8 text)",
                              field="body")
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
    if isinstance(exc, Cancelled):
        # nginx's "client closed request": nobody reads it, the status only fills access logs.
        return error_response(499, "cancelled", str(exc) or "the request was cancelled")
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


async def _bad_value(request: Request, exc: Exception) -> JSONResponse:
    # The database refused a value the edge let through (a bound no model states yet):
    # the caller's input, not an outage. The statement and parameters stay in the log.
    log.warning("database refused a value on %s %s: %s", request.method, request.url.path,
                str(getattr(exc, "orig", exc)).splitlines()[0] if str(exc) else type(exc).__name__)
    if isinstance(exc, IntegrityError):
        return error_response(409, "conflict", "the change conflicts with stored data")
    return error_response(422, "invalid_request",
                          "a value is out of range or not storable (too long, too large, NUL)")


async def _database(request: Request, exc: Exception) -> JSONResponse:
    log.warning("database unavailable: %s", type(exc).__name__)
    message = str(exc) if isinstance(exc, SchemaBehind) else "the database is unreachable"
    return error_response(503, "database_unavailable", message,
                          headers=_retry_after(NOT_READY_RETRY_S))


class CatchAll:
    """ASGI middleware: answer an exception no handler took with a 500, logged once.

    Starlette's handler for `Exception` answers and then re-raises to the server, which
    logs the same traceback a second time; this answers and stops the exception here.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except HTTPException:
            raise  # BodyLimit (outside) answers its own 413
        except Exception as exc:
            log.error("unhandled %s on %s %s", type(exc).__name__, scope.get("method"),
                      scope.get("path"), exc_info=exc)
            if started:
                return  # half a response went out: nothing better to send
            response = error_response(500, "internal_error",
                                      f"internal error ({type(exc).__name__})")
            await response(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    """Register every mapping above on `app`."""
    app.add_exception_handler(RequestValidationError, _validation)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http)  # type: ignore[arg-type]
    app.add_exception_handler(AuthError, _auth)  # type: ignore[arg-type]
    app.add_exception_handler(EngineError, _engine_error)  # type: ignore[arg-type]
    app.add_exception_handler(NotFound, _not_found)  # type: ignore[arg-type]
    for bad in (DataError, IntegrityError, OverflowError):
        app.add_exception_handler(bad, _bad_value)
    for exc_type in (SchemaBehind, DatabaseUnavailable, OperationalError, PoolTimeout):
        app.add_exception_handler(exc_type, _database)
    app.add_exception_handler(ValueError, _value)  # type: ignore[arg-type]
    app.add_middleware(CatchAll)
