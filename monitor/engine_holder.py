"""The engine, loaded in a background thread, and how far loading and warm-up got."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from engine.config import EngineConfig
from engine.protocol import Engine, FlagProvider
from monitor import gc_heap

log = logging.getLogger(__name__)

LOADING = "loading"
WARMING = "warming"
READY = "ready"
FAILED = "failed"

EngineFactory = Callable[[EngineConfig, FlagProvider], Engine]


def default_engine_factory(config: EngineConfig, flags: FlagProvider) -> Engine:
    """Load the torch-backed engine (imports torch)."""
    from engine import load_engine

    return load_engine(config, flags=flags)


class EngineHolder:
    """Load the engine in a background thread, say how far it got, and freeze the heap once
    the engine is warm (`monitor.gc_heap.freeze`).

    Example:
        holder = EngineHolder(factory, config, flags)
        holder.start()
        holder.get()      # None until loaded; serves (eager) while buckets warm
        holder.state()    # ("warming", "3/5 buckets warm")
    """

    def __init__(self, factory: EngineFactory, config: EngineConfig,
                 flags: FlagProvider, *, freeze: Callable[[], int] = gc_heap.freeze) -> None:
        self._factory = factory
        self._freeze = freeze
        self._config = config
        self._flags = flags
        self._engine: Engine | None = None
        self._error: str | None = None
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self._settled = threading.Event()  # warm-up over and the heap frozen

    def start(self) -> None:
        """Begin loading and warming in a daemon thread."""
        self._thread = threading.Thread(target=self._load, name="tailwatch-engine-load",
                                        daemon=True)
        self._thread.start()

    def _load(self) -> None:
        started = time.perf_counter()
        try:
            engine = self._factory(self._config, self._flags)
        except Exception as exc:
            self._error = f"{type(exc).__name__}: {exc}"
            log.error("engine: failed to load: %s", self._error)
            return
        if self._closed.is_set():
            engine.close()
            return
        self._engine = engine
        log.info("engine: loaded in %.1f s; warming buckets", time.perf_counter() - started)
        try:
            engine.warm_up(background=False)
        except Exception as exc:
            # The engine still serves (eager for cold buckets); readiness reports it.
            self._error = f"warm-up failed: {type(exc).__name__}: {exc}"
            log.error("engine: %s", self._error)
        if self._closed.is_set():
            return
        # Warm (or as warm as it gets): what the process holds now lives until exit, and a
        # full garbage collection walking it would stall every request in flight. Before
        # readiness, so that the freeze's own collection stalls no routed traffic.
        started = time.perf_counter()
        try:
            frozen = self._freeze()
            log.info("engine: heap frozen (%d objects) in %.2f s", frozen,
                     time.perf_counter() - started)
        except Exception as exc:  # noqa: BLE001 - serving goes on; collections walk it all
            log.warning("engine: the heap could not be frozen: %s: %s", type(exc).__name__,
                        exc)
        finally:
            self._settled.set()

    def get(self) -> Engine | None:
        """Return the engine once loaded, else None."""
        return self._engine

    def state(self) -> tuple[str, str]:
        """Return (one of LOADING, WARMING, READY, FAILED, a human reason)."""
        engine = self._engine
        if engine is None:
            if self._error is not None:
                return FAILED, f"engine failed to load: {self._error}"
            return LOADING, "engine loading"
        status = engine.warmup_status()
        if status.error is not None or self._error is not None:
            return FAILED, f"engine warm-up failed: {status.error or self._error}"
        if not status.done:
            return WARMING, f"{status.warm_buckets}/{status.total_buckets} buckets warm"
        if not self._settled.is_set():
            return WARMING, "freezing the heap"
        return READY, "ready"

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop waiting for the load and close the engine if it exists."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._engine is not None:
            self._engine.close()
