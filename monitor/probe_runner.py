"""Run canary cycles and bursts one at a time, once the engine is warm."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from engine.errors import NotReady
from engine.protocol import Engine
from monitor.engine_holder import READY, EngineHolder
from probes.burst import BurstResult
from probes.cycle import CycleResult
from probes.prober import Prober

log = logging.getLogger(__name__)


class ProbeRunner:
    """Build the Prober once the engine is warm and run probes one at a time.

    Scheduled probes skip while the engine loads or warms (eager warm-up latencies
    would pollute baselines); requested ones raise NotReady (HTTP 503).
    """

    def __init__(self, holder: EngineHolder, build: Callable[[Engine], Prober]) -> None:
        self._holder = holder
        self._build = build
        self._prober: Prober | None = None
        self._lock = threading.Lock()

    def run(self, kind: str, *, suite: str | None = None,
            ab: bool | None = None) -> CycleResult | BurstResult:
        """Run a "cycle" or "burst" now, store it, and return it."""
        engine = self._holder.get()
        state, reason = self._holder.state()
        if engine is None or state != READY:
            raise NotReady(f"probes wait for a warm engine ({reason})")
        with self._lock:
            prober = self._get_prober(engine)
            if suite is not None and suite not in prober.suites:
                raise ValueError(f"suite: unknown suite {suite!r}; known: {sorted(prober.suites)}")
            if kind == "burst":
                return prober.run_burst(suite)
            return prober.run_cycle(suite, ab=ab)

    def _get_prober(self, engine: Engine) -> Prober:
        if self._prober is None:
            self._prober = self._build(engine)
        return self._prober

    def record_compiles(self) -> object:
        """Store recompiles that happened outside canary cycles (real traffic)."""
        engine = self._holder.get()
        if engine is None or self._holder.state()[0] != READY:
            return None
        prober = self._prober  # set once; a running cycle holds the lock for long
        if prober is None:
            with self._lock:
                prober = self._get_prober(engine)
        return prober.record_unprobed_compiles()

    def job(self, kind: str) -> Callable[[], object]:
        """Return a scheduler job running `kind` that skips while the engine is not ready."""

        def run() -> object:
            if self._holder.state()[0] != READY:
                log.info("probes: skipping a scheduled %s, engine not ready", kind)
                return None
            return self.run(kind)

        return run
