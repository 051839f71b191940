"""Run a blocking engine call in a worker thread and cancel it when its client leaves.

A plain-def route runs in the thread pool and cannot hear the client go; this runs the
call in that same pool (anyio's default limiter, as FastAPI's own threadpool) while the
request's task listens for the ASGI `http.disconnect`, and sets the call's CancelSignal
when it comes: the engine then drops the request at its next check (engine.cancel).

    result = await call_until_disconnect(request, lambda cancel: engine.generate(
        text, cancel=cancel))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread
from starlette.requests import Request
from starlette.types import Receive

from engine.protocol import CancelSignal

T = TypeVar("T")


async def call_until_disconnect(request: Request, call: Callable[[CancelSignal], T]) -> T:
    """Return `call(cancel)` run in a worker thread; set `cancel` if the client leaves first."""
    cancel = CancelSignal()
    results: list[T] = []
    errors: list[Exception] = []
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(_cancel_on_disconnect, request.receive, cancel)
        try:
            results.append(await anyio.to_thread.run_sync(call, cancel))
        except Exception as exc:  # noqa: BLE001 - raised below, as it is
            # Raised inside the task group it would leave wrapped in an ExceptionGroup, which
            # the error handlers (monitor.api.errors) would not recognise.
            errors.append(exc)
        finally:
            tasks.cancel_scope.cancel()  # the listener: the call is over
    if errors:
        raise errors[0]
    return results[0]


async def _cancel_on_disconnect(receive: Receive, cancel: CancelSignal) -> None:
    """Set `cancel` once the client disconnects (the route read the whole body before)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    cancel.set()
