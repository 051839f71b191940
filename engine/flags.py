"""Read runtime flags on every request without ever failing the request."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from engine.protocol import FlagProvider, InMemoryFlagProvider, RuntimeFlags


class GuardedFlags:
    """Wrap a provider: on an error or a timeout keep the last known flags and count it."""

    def __init__(self, provider: FlagProvider, timeout_s: float) -> None:
        self._provider = provider
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._last = RuntimeFlags()
        self._errors = 0
        # One worker: a hung provider blocks later reads from starting, not requests.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flags")
        self._pending = None

    def read(self) -> RuntimeFlags:
        """Return fresh flags, or the last known ones when the provider fails."""
        if type(self._provider) is InMemoryFlagProvider:
            return self._provider.flags()  # cannot fail or hang: skip the thread hop
        with self._lock:
            pending = self._pending
        if pending is not None and not pending.done():
            self._count_error()  # still stuck on an earlier call
            return self.last
        future = self._pool.submit(self._provider.flags)
        with self._lock:
            self._pending = future
        try:
            flags = future.result(timeout=self._timeout_s)
            if not isinstance(flags, RuntimeFlags):
                raise TypeError(f"flags: provider returned {type(flags).__name__}")
        except (FutureTimeout, Exception):  # noqa: BLE001 - a flag source must not fail requests
            self._count_error()
            return self.last
        with self._lock:
            self._last = flags
        return flags

    def _count_error(self) -> None:
        with self._lock:
            self._errors += 1

    @property
    def last(self) -> RuntimeFlags:
        """Return the last flags read successfully (defaults before the first)."""
        with self._lock:
            return self._last

    @property
    def errors(self) -> int:
        """Return how often the provider raised or timed out."""
        with self._lock:
            return self._errors

    def close(self) -> None:
        """Stop the reader thread without waiting for a hung provider."""
        self._pool.shutdown(wait=False, cancel_futures=True)
