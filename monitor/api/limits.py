"""Cap request bodies at the HTTP layer, before anything reads one whole.

A declared Content-Length over the cap is answered 413 at once, without reading the
body; a chunked body is counted as it streams and refused as soon as it passes the cap.
Either way memory stays flat: the server reads at most one chunk past the limit, and
the rest is discarded as it arrives (no "Connection: close": closing a socket with
unread data resets it, and the client would lose the 413 it was sent).

The default cap fits the largest text the engine could accept: `engine.max_input_tokens`
tokens of at most CHARS_PER_TOKEN_MAX characters each (the engine refuses longer text
before tokenizing), each character escaped as JSON "\\uXXXX", plus room for the rest of
the request.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CHARS_PER_TOKEN_MAX = 32  # engine/runtime.py refuses text longer than this per token
_BYTES_PER_CHAR = 6  # "\uXXXX": the most a BMP character takes in a JSON string
_OVERHEAD_BYTES = 16 * 1024


def default_max_body_bytes(max_input_tokens: int) -> int:
    """Return the body cap that still admits the longest text the engine could take."""
    return max_input_tokens * CHARS_PER_TOKEN_MAX * _BYTES_PER_CHAR + _OVERHEAD_BYTES


def max_body_bytes(settings: Any) -> int:
    """Return `api.max_body_bytes`, or the default sized from `engine.max_input_tokens`."""
    return settings.api.max_body_bytes or default_max_body_bytes(settings.engine.max_input_tokens)


def _message(limit: int, size: int | None) -> str:
    got = f"{size} bytes" if size is not None else "more"
    return f"request body: {got} is over the limit of {limit} bytes (api.max_body_bytes)"


class BodyLimit:
    """ASGI middleware: answer 413 to a request body over `limit` bytes, unread.

    Example:
        app.add_middleware(BodyLimit, limit=max_body_bytes(settings))
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limit:
            await _reject(send, _message(self.limit, declared))
            return
        received = 0
        started = False

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    # FastAPI re-raises an HTTPException from body reading: the app's
                    # handler answers it in the one error shape.
                    raise HTTPException(413, _message(self.limit, None))
            return message

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited, tracked)
        except HTTPException as exc:
            if exc.status_code != 413 or started:
                raise
            await _reject(send, str(exc.detail))


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _reject(send: Send, message: str) -> None:
    body = json.dumps({"error": {"code": "input_too_long", "message": message,
                                 "field": "body"}}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
