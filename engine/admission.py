"""Admission control: a bounded number of decode streams and a bounded wait queue."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from engine.errors import Overloaded, RequestTimeout


class Admission:
    """Grant at most `max_concurrency` slots; refuse callers beyond `max_queue` waiting."""

    def __init__(self, max_concurrency: int, max_queue: int, *, retry_after_s: float = 1.0):
        if max_concurrency < 1:
            raise ValueError("max_concurrency: must be >= 1")
        if max_queue < 0:
            raise ValueError("max_queue: must be >= 0")
        self._cond = threading.Condition()
        self._free = list(range(max_concurrency))
        self._capacity = max_concurrency
        self._waiting = 0
        self._max_queue = max_queue
        self._retry_after_s = retry_after_s

    @property
    def waiting(self) -> int:
        """Return callers waiting for a slot."""
        with self._cond:
            return self._waiting

    @property
    def running(self) -> int:
        """Return slots in use."""
        with self._cond:
            return self._capacity - len(self._free)

    @contextmanager
    def slot(self, deadline: float | None, *, synthetic: bool = False) -> Iterator[int]:
        """Hold a decode slot (its index) for the duration of the block."""
        with self._cond:
            if not self._free:
                if self._waiting >= self._max_queue:
                    raise Overloaded(
                        f"queue full: {self._waiting} waiting (max_queue={self._max_queue})",
                        retry_after_s=self._retry_after_s)
                self._waiting += 1
                try:
                    while not self._free:
                        remaining = None if deadline is None else deadline - time.perf_counter()
                        if remaining is not None and remaining <= 0:
                            raise RequestTimeout("timeout_s: no decode slot before the deadline")
                        self._cond.wait(remaining)
                finally:
                    self._waiting -= 1
            index = self._free.pop()
        try:
            yield index
        finally:
            with self._cond:
                self._free.append(index)
                self._cond.notify()
