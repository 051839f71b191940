"""Engine exceptions.

EngineError
 ├── InvalidRequest (also ValueError): bad input; names the field and the limit
 │    └── InputTooLong: input over the hard cap (HTTP 413)
 │         └── DoesNotFit: the request cannot fit a batch row's static cache (HTTP 413)
 ├── Overloaded: the admission queue is full (HTTP 429/503 with Retry-After)
 ├── RequestTimeout: the call did not finish within its timeout
 ├── Cancelled: the caller cancelled the request; it left the queue or its batch
 ├── NotReady: the engine is not loaded yet
 ├── ModelLoadError: a model directory is missing files or is not a T5
 └── BoundaryError: a tensor handed to the C step is not what it computes on
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of engine errors."""


class InvalidRequest(EngineError, ValueError):
    """A request field is invalid."""

    def __init__(self, field: str, message: str, *, value: object = None, limit: object = None):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.value = value
        self.limit = limit


class InputTooLong(InvalidRequest):
    """The input has more tokens than the hard cap."""


class DoesNotFit(InputTooLong):
    """The request needs more decoder positions than a batch row's static cache holds."""


class Overloaded(EngineError):
    """The admission queue is full; retry later."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTimeout(EngineError):
    """The request did not finish in time."""


class Cancelled(EngineError):
    """The request was cancelled before it finished."""


class NotReady(EngineError):
    """The engine cannot serve yet."""


class ModelLoadError(EngineError):
    """A model directory cannot be loaded."""


class BoundaryError(EngineError):
    """A tensor handed to the C step has the wrong dtype, layout, shape or values."""

    def __init__(self, tensor: str, message: str):
        super().__init__(f"native step: {tensor}: {message}")
        self.tensor = tensor
