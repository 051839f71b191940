"""The one thread that makes an unbatched runtime's compiled calls (CUDA graphs need it).

cudagraph trees are per thread: a graph recorded on one thread does not serve another, so
the warm-up and every request must call the compiled functions on the same thread. With
the batching scheduler that thread is its loop (engine.scheduler); without it, this one.

A function runs whole: a request's decode is not paused for another (a paused decode
would hold the thread the other needs), so a real request may wait for the one decode
running. It never waits for a synthetic one (a canary, a burst) queued here: the thread
takes every real call waiting before any synthetic one, and each kind in order of
arrival, as admission grants its slots (engine.admission).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from engine.errors import NotReady

T = TypeVar("T")
_Item = tuple[Callable[[], object], Future]


class DeviceThread:
    """Run submitted functions one at a time on one thread, real ones before synthetic
    ones waiting, each kind in order; thread-safe."""

    def __init__(self, name: str = "engine-device") -> None:
        self._real: deque[_Item] = deque()
        self._synthetic: deque[_Item] = deque()
        self._closed = False
        self._ready = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def call(self, fn: Callable[[], T], *, synthetic: bool = False) -> T:
        """Run `fn` on the thread and return its result (or raise its error); `synthetic`:
        after every real call waiting."""
        if threading.current_thread() is self.thread:
            return fn()  # already on it (a task that calls back in)
        future: Future[T] = Future()
        with self._ready:
            if self._closed:
                raise NotReady("engine is closed")
            (self._synthetic if synthetic else self._real).append((fn, future))
            self._ready.notify()
        return future.result()

    def close(self) -> None:
        """Finish the functions already submitted, then stop."""
        with self._ready:
            if self._closed:
                return
            self._closed = True
            self._ready.notify()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=5.0)

    def _next(self) -> _Item | None:
        """Wait for the next function to run (None: closed and none left)."""
        with self._ready:
            while not (self._real or self._synthetic or self._closed):
                self._ready.wait()
            queue = self._real or self._synthetic
            return queue.popleft() if queue else None

    def _loop(self) -> None:
        while (item := self._next()) is not None:
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - the caller gets it
                future.set_exception(exc)
