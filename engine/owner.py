"""The one thread that makes an unbatched runtime's compiled calls (CUDA graphs need it).

cudagraph trees are per thread: a graph recorded on one thread does not serve another, so
the warm-up and every request must call the compiled functions on the same thread. With
the batching scheduler that thread is its loop (engine.scheduler); without it, this one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from engine.errors import NotReady

T = TypeVar("T")


class DeviceThread:
    """Run submitted functions one at a time on one thread, in order; thread-safe."""

    def __init__(self, name: str = "engine-device") -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], object], Future] | None] = \
            queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the thread and return its result (or raise its error)."""
        if threading.current_thread() is self.thread:
            return fn()  # already on it (a task that calls back in)
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise NotReady("engine is closed")
            self._queue.put((fn, future))
        return future.result()

    def close(self) -> None:
        """Finish the functions already submitted, then stop."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=5.0)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - the caller gets it
                future.set_exception(exc)
