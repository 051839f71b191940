"""Run probes and store them: the callables the scheduler's probe jobs invoke.

A result that cannot be stored (database down) is kept in a bounded queue and stored
by a later run, so a database outage delays probe rows instead of losing them;
past `pending_max` the oldest unsaved result is dropped and counted.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from engine.protocol import CompileDelta, Engine
from probes.burst import BurstResult, run_burst
from probes.canaries import CanarySuite
from probes.cycle import ARMS, CycleResult, Observer, ProbeCycle, utcnow
from probes.sink import add_burst, add_cycle, compile_changed, compile_row

log = logging.getLogger(__name__)

Result = CycleResult | BurstResult


class Prober:
    """Run canary cycles and bursts against one engine and store them.

    Example:
        prober = Prober(engine, sessions, load_suites(), instance_id="a", suite="in_domain")
        prober.run_cycle()   # the scheduler's "probe" job
    """

    def __init__(
        self,
        engine: Engine,
        sessions: sessionmaker[Session],
        suites: Mapping[str, CanarySuite],
        *,
        instance_id: str,
        suite: str = "in_domain",
        canaries_per_bucket: int = 4,
        ab_share: float = 0.25,
        ab_arms: Sequence[str] = tuple(ARMS),
        cycle_timeout_s: float = 120.0,
        burst_rate_per_s: float = 4.0,
        burst_duration_s: float = 10.0,
        burst_concurrency: int = 4,
        pending_max: int = 100,
        rng: random.Random | None = None,
        clock: Callable[[], datetime] = utcnow,
        observers: Sequence[Observer] = (),
    ) -> None:
        if suite not in suites:
            raise ValueError(f"probes.suite: unknown suite {suite!r}; known: {sorted(suites)}")
        self.engine = engine
        self.sessions = sessions
        self.suites = dict(suites)
        self.suite = suite
        self.instance_id = instance_id
        self.rng = rng or random.Random()
        self.clock = clock
        self.observers = tuple(observers)
        self.cycle = ProbeCycle(
            engine, suites, instance_id=instance_id, canaries_per_bucket=canaries_per_bucket,
            ab_share=ab_share, ab_arms=ab_arms, timeout_s=cycle_timeout_s, rng=self.rng,
            clock=clock, observers=observers)
        self.burst_rate_per_s = burst_rate_per_s
        self.burst_duration_s = burst_duration_s
        self.burst_concurrency = burst_concurrency
        self.cycle_timeout_s = cycle_timeout_s
        self._pending: deque[Result] = deque()
        self.pending_max = pending_max
        self.dropped = 0
        self._lock = threading.Lock()
        # Compile changes outside cycles (real traffic, bursts) are stored by
        # record_unprobed_compiles: everything since the mark less what cycles stored.
        self._cycle_lock = threading.Lock()
        self._compile_mark = engine.compile_snapshot()
        self._compile_claimed: list[CompileDelta] = []

    def run_cycle(self, suite: str | None = None, *, ab: bool | None = None) -> CycleResult:
        """Run one canary cycle, store it, and return it."""
        with self._cycle_lock:
            result = self.cycle.run(suite or self.suite, ab=ab)
            # The A/B arms' compiles (the exact arm recompiles by design) are left out of
            # compile events on purpose; claim them so they are not stored later either.
            self._compile_claimed.extend(d for d in (result.compile, result.ab_compile)
                                         if d is not None)
        self._store(result)
        return result

    def record_unprobed_compiles(self) -> CompileDelta | None:
        """Store the compile changes no cycle recorded (real traffic's recompiles).

        Returns the stored delta, or None when nothing changed, a cycle is running (its
        delta is not claimed yet: try again next time) or the database is down (kept for
        the next call).
        """
        if not self._cycle_lock.acquire(blocking=False):
            return None
        try:
            now = self.engine.compile_snapshot()
            rest = now.diff(self._compile_mark)
            for claimed in self._compile_claimed:
                rest = rest.minus(claimed)
            if compile_changed(rest):
                try:
                    with self.sessions.begin() as session:
                        session.add(compile_row(rest, self.clock(), self.instance_id))
                except Exception as exc:
                    log.warning("cannot store compile changes yet: %s", exc)
                    return None
            self._compile_mark = now
            self._compile_claimed = []
            return rest if compile_changed(rest) else None
        finally:
            self._cycle_lock.release()

    def run_burst(self, suite: str | None = None) -> BurstResult:
        """Run one burst probe with the suite's prompts, store it, and return it."""
        s = self.suites[suite or self.suite]
        result = run_burst(
            self.engine, s.prompts, instance_id=self.instance_id, suite=s.name,
            rate_per_s=self.burst_rate_per_s, duration_s=self.burst_duration_s,
            concurrency=self.burst_concurrency, max_new_tokens=s.max_new_tokens,
            grace_s=self.cycle_timeout_s, rng=self.rng, clock=self.clock,
            observers=self.observers)
        self._store(result)
        return result

    @property
    def pending(self) -> int:
        """Return how many results wait to be stored."""
        with self._lock:
            return len(self._pending)

    def _store(self, result: Result) -> None:
        with self._lock:
            self._pending.append(result)
            while len(self._pending) > self.pending_max:
                self._pending.popleft()
                self.dropped += 1
            while self._pending:
                item = self._pending[0]
                try:
                    with self.sessions.begin() as session:
                        if isinstance(item, CycleResult):
                            add_cycle(session, item)
                        else:
                            add_burst(session, item)
                except Exception as exc:
                    log.warning("cannot store probe result yet (%d pending): %s",
                                len(self._pending), exc)
                    return
                self._pending.popleft()


def prober_from_settings(settings: Any, engine: Engine, sessions: sessionmaker[Session], *,
                         observers: Sequence[Observer] = (), rng: random.Random | None = None,
                         clock: Callable[[], datetime] = utcnow,
                         suites: Mapping[str, CanarySuite] | None = None) -> Prober:
    """Return a Prober configured from a monitor Settings object (`probes` section)."""
    from probes.canaries import load_suites

    # Duck-typed: probes never imports monitor.
    p = settings.probes
    return Prober(
        engine, sessions, suites or load_suites(p.suites_file), instance_id=settings.instance_id,
        suite=p.suite, canaries_per_bucket=p.canaries_per_bucket, ab_share=p.ab_share,
        ab_arms=p.ab_arms, cycle_timeout_s=p.cycle_timeout_s,
        burst_rate_per_s=p.burst_rate_per_s, burst_duration_s=p.burst_duration_s,
        burst_concurrency=p.burst_concurrency, rng=rng, clock=clock, observers=observers)
