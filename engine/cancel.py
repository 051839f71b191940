"""A request's cancellation signal: set by its caller, checked where its deadline is.

    cancel = CancelSignal()
    engine.generate(text, cancel=cancel)  # in a worker thread
    cancel.set()  # from anywhere: the request leaves the queue or its batch (Cancelled)

It is a threading.Event whose set() also wakes whoever registered with on_set(): a caller
waiting for an admission slot sleeps on a condition no Event can notify.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class CancelSignal(threading.Event):
    """An Event that cancels the request it is handed to once set."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], None]] = []
        self._callbacks_lock = threading.Lock()

    def set(self) -> None:
        """Cancel the request and wake whatever waits for it."""
        with self._callbacks_lock:
            super().set()
            callbacks = list(self._callbacks)
        # Outside the lock: a callback may take a lock its registrant holds while it
        # registers or checks is_set().
        for callback in callbacks:
            callback()

    def on_set(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` when set() is called later; return what unregisters it.

        A signal set before registering does not call it: check is_set() after
        registering, where the callback would have woken.
        """
        with self._callbacks_lock:
            self._callbacks.append(callback)

        def unregister() -> None:
            with self._callbacks_lock:
                if callback in self._callbacks:
                    self._callbacks.remove(callback)

        return unregister
