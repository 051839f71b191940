"""Read runtime flags on every request without ever failing the request.

Concurrent requests share one in-flight provider read: the first starts it, later ones
wait on the same read until `timeout_s` after it started, and whoever gives up keeps the
last known flags. Only real failures count: a read that raised, returned the wrong type, or is
still unfinished after `hang_s`. A waiting reader, or a slow read that does complete,
is not a failure (the flags it returns become the last known ones). A provider that holds
its flags in memory (`in_memory`: the in-memory provider, the monitor's refreshed snapshot)
is read on the request's own thread instead: it cannot hang, so no request waits on a
reader thread, a database or a file for its flags.

Last known flags survive a restart: with a `state_file`, every successful read that
changed the flags is written there atomically (temp file + rename), and a new guard
starts from that file, so a restart during a database outage keeps the fallbacks in
force instead of turning every optimization back on. `source` says where the flags in
use came from: "live" (a provider read), "file" (the state file) or "defaults".
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict
from pathlib import Path

from engine.protocol import FlagProvider, RuntimeFlags

log = logging.getLogger(__name__)
LOG_EVERY_S = 60.0  # at most one failure line per minute: bursts must not flood logs
FLAG_SOURCES = ("live", "file", "defaults")


def save_flags(path: Path, flags: RuntimeFlags) -> None:
    """Write `flags` to `path` atomically (a reader sees the old file or the new one)."""
    data = asdict(flags)
    data["speculative"] = dict(flags.speculative)
    data["quantized"] = dict(flags.quantized)
    data["manual_off"] = sorted(flags.manual_off)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".flags-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_flags(path: Path) -> RuntimeFlags:
    """Read flags written by `save_flags`; raise ValueError (or OSError) when unusable."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    spec = data.get("speculative", {})
    prob = data.get("speculative_probation", 0.0)
    bools = {k: data.get(k, True) for k in ("speculative_default", "compiled", "bucketing",
                                            "quantized_default", "native_step",
                                            "batching")}
    quantized = data.get("quantized", {})
    manual = data.get("manual_off", [])
    if (not isinstance(spec, dict) or not all(isinstance(v, bool) for v in spec.values())
            or not isinstance(quantized, dict)
            or not all(isinstance(v, bool) for v in quantized.values())
            or not all(isinstance(v, bool) for v in bools.values())
            or isinstance(prob, bool) or not isinstance(prob, int | float) or not 0 <= prob <= 1
            or not isinstance(manual, list) or not all(isinstance(m, str) for m in manual)):
        raise ValueError("unexpected field types")
    return RuntimeFlags(speculative={str(k): v for k, v in spec.items()},
                        speculative_probation=float(prob), manual_off=frozenset(manual),
                        quantized={str(k): v for k, v in quantized.items()}, **bools)


class GuardedFlags:
    """Wrap a provider: share reads, keep the last known flags on failure, count failures.

    Example:
        guarded = GuardedFlags(SqlFlagProvider(sessions), timeout_s=0.05)
        flags = guarded.read()   # never raises, never waits longer than timeout_s
    """

    def __init__(self, provider: FlagProvider, timeout_s: float, *,
                 hang_s: float | None = None, state_file: str | Path | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._provider = provider
        self._timeout_s = timeout_s
        # A read unfinished this long is a failure (a slow one is not): count it once.
        self._hang_s = hang_s if hang_s is not None else max(1.0, 20 * timeout_s)
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._last = RuntimeFlags()
        self._source = "defaults"
        # A provider that holds its flags in memory (FlagProvider.in_memory) is read on
        # the request's thread: it cannot hang, so the shared read would only add a hop.
        self._in_memory = bool(getattr(provider, "in_memory", False))
        self._state_file = Path(state_file) if state_file else None
        self._saved: RuntimeFlags | None = None
        if self._state_file is not None and self._state_file.exists():
            try:
                self._last = self._saved = load_flags(self._state_file)
                self._source = "file"
            except (OSError, ValueError, TypeError) as exc:
                log.warning("flags: ignoring unreadable %s (%s); starting from defaults",
                            self._state_file, exc)
        self._errors = 0
        self._suppressed = 0
        self._logged_at: float | None = None
        # One worker: a hung provider blocks later reads from starting, not requests.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flags")
        self._pending: Future[RuntimeFlags | None] | None = None
        self._started_at = 0.0
        self._hang_counted = False

    def read(self) -> RuntimeFlags:
        """Return fresh flags, or the last known ones when the provider is slow or fails."""
        if self._in_memory:
            return self._read_held()
        future, started = self._shared_read()
        # Wait within the read's own deadline: during a hang requests do not each pay it.
        wait = self._timeout_s - (self._monotonic() - started)
        try:
            if wait <= 0:
                raise FutureTimeout
            flags = future.result(timeout=wait)
        except FutureTimeout:
            self._check_hang(future)
            return self.last
        return flags if flags is not None else self.last

    def _read_held(self) -> RuntimeFlags:
        """Read a provider that holds its flags in memory, on the caller's thread.

        No thread hop and no wait: a request never queues behind another reader or behind
        the state file's write, which goes to the reader thread instead.
        """
        flags = self._provider_flags()
        if flags is None:
            return self.last
        if flags is not self._last and self._book(flags):  # a new snapshot: booked once
            self._pool.submit(self._save, flags)
        return flags

    def _provider_flags(self) -> RuntimeFlags | None:
        """Return the provider's flags; None on a failure (counted)."""
        try:
            flags = self._provider.flags()
            if not isinstance(flags, RuntimeFlags):
                raise TypeError(f"flags: provider returned {type(flags).__name__}")
        except Exception as exc:  # noqa: BLE001 - a flag source must not fail requests
            self._failure(f"{type(exc).__name__}: {exc}")
            return None
        return flags

    def _book(self, flags: RuntimeFlags) -> bool:
        """Make `flags` the last known ones; return whether the state file needs them."""
        with self._lock:
            self._last = flags
            self._source = "live"
            return self._state_file is not None and flags != self._saved

    def _shared_read(self) -> tuple[Future[RuntimeFlags | None], float]:
        with self._lock:
            if self._pending is not None and not self._pending.done():
                return self._pending, self._started_at  # join the read in flight
            future = self._pool.submit(self._fetch)
            self._pending = future
            self._started_at = self._monotonic()
            self._hang_counted = False
            return future, self._started_at

    def _fetch(self) -> RuntimeFlags | None:
        # Runs in the reader thread; book-keeps before the future completes, so every
        # waiter sees the outcome. Returns None on a failure (counted here, once).
        flags = self._provider_flags()
        if flags is not None and self._book(flags):
            self._save(flags)
        return flags

    def _save(self, flags: RuntimeFlags) -> None:
        assert self._state_file is not None
        try:
            save_flags(self._state_file, flags)
        except OSError as exc:  # a full or read-only disk must not fail requests
            log.warning("flags: could not save the last known flags to %s: %s",
                        self._state_file, exc)
            return
        with self._lock:
            self._saved = flags

    def _check_hang(self, future: Future[RuntimeFlags | None]) -> None:
        with self._lock:
            stuck = (future is self._pending and not self._hang_counted
                     and self._monotonic() - self._started_at >= self._hang_s)
            if stuck:
                self._hang_counted = True
        if stuck:
            self._failure(f"read unfinished after {self._hang_s:g}s")

    def _failure(self, why: str) -> None:
        now = self._monotonic()
        with self._lock:
            self._errors += 1
            if self._logged_at is not None and now - self._logged_at < LOG_EVERY_S:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._logged_at = self._suppressed, 0, now
        more = f" ({suppressed} more since the last line)" if suppressed else ""
        log.warning("flags: provider read failed, keeping the last known flags: %s%s", why, more)

    @property
    def last(self) -> RuntimeFlags:
        """Return the last flags read successfully (defaults before the first)."""
        with self._lock:
            return self._last

    @property
    def source(self) -> str:
        """Return where the flags in use came from: "live", "file" or "defaults"."""
        with self._lock:
            return self._source

    @property
    def errors(self) -> int:
        """Return how many provider reads failed (raised, wrong type, or hung)."""
        with self._lock:
            return self._errors

    def settle(self, timeout_s: float) -> bool:
        """Wait for the provider read in flight, if any; return whether none is left.

        A read's outcome is booked before it completes, so after True `last`, `source`
        and `errors` include it.
        """
        with self._lock:
            pending = self._pending
        if pending is None:
            return True
        try:
            pending.result(timeout=timeout_s)
        except FutureTimeout:
            return False
        return True

    def close(self) -> None:
        """Stop the reader thread without waiting for a hung provider."""
        self._pool.shutdown(wait=False, cancel_futures=True)
