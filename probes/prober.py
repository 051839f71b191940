"""Run probes and store them: the callables the scheduler's probe jobs invoke.

Results are stored through the storage Writer (the one write path): a database outage
delays probe rows, compile events and memory samples instead of losing them, and past
the writer's bound a result is dropped and counted in `writer.stats.dropped`.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from functools import partial

from engine.protocol import CompileDelta, Engine
from probes.burst import UNBATCHED, VARIANT_UNBATCHED, BurstResult, run_burst
from probes.canaries import CanarySuite
from probes.cycle import (
    ARMS,
    CANARIES_PER_BUCKET,
    CycleResult,
    JobActivity,
    Observer,
    ProbeCycle,
)
from probes.measure import VARIANT_DEFAULT
from probes.reference import OutputChecker, add_checked_cycle
from probes.settings import ProbeSettings
from probes.sink import add_burst, add_compile, add_cycle, compile_changed
from storage.queries.quality import AgreementGroup
from storage.writer import Writer
from vocab import utcnow

log = logging.getLogger(__name__)

Result = CycleResult | BurstResult


class Prober:
    """Run canary cycles and bursts against one engine and store them.

    Example:
        prober = Prober(engine, writer, load_suites(), instance_id="a", suite="in_domain")
        prober.run_cycle()   # the scheduler's "probe" job
    """

    def __init__(
        self,
        engine: Engine,
        writer: Writer,
        suites: Mapping[str, CanarySuite],
        *,
        instance_id: str,
        suite: str = "in_domain",
        canaries_per_bucket: int = CANARIES_PER_BUCKET,
        ab_share: float = 0.25,
        ab_on_slowdown: float | None = 0.15,
        ab_arms: Sequence[str] = tuple(ARMS),
        cycle_timeout_s: float = 120.0,
        burst_rate_per_s: float = 200.0,
        burst_duration_s: float = 2.0,
        burst_concurrency: int = 64,
        burst_unbatched: bool = True,
        rng: random.Random | None = None,
        clock: Callable[[], datetime] = utcnow,
        observers: Sequence[Observer] = (),
        checker: OutputChecker | None = None,
        activity: JobActivity | None = None,
    ) -> None:
        if suite not in suites:
            raise ValueError(f"probes.suite: unknown suite {suite!r}; known: {sorted(suites)}")
        self.engine = engine
        self.writer = writer
        self.suites = dict(suites)
        self.suite = suite
        self.instance_id = instance_id
        self.rng = rng or random.Random()
        self.clock = clock
        self.observers = tuple(observers)
        # Compares every cycle's outputs with the reference path's (None: not checked).
        self.checker = checker
        self.agreements: tuple[AgreementGroup, ...] = ()  # the latest cycle's
        self.activity = activity  # which scheduler jobs ran beside a cycle or burst
        self.cycle = ProbeCycle(
            engine, suites, instance_id=instance_id, canaries_per_bucket=canaries_per_bucket,
            ab_share=ab_share, ab_on_slowdown=ab_on_slowdown, ab_arms=ab_arms,
            timeout_s=cycle_timeout_s, rng=self.rng, clock=clock, observers=observers,
            activity=activity)
        self.burst_rate_per_s = burst_rate_per_s
        self.burst_duration_s = burst_duration_s
        self.burst_concurrency = burst_concurrency
        self.burst_unbatched = burst_unbatched
        self.last_burst_arms: tuple[BurstResult, ...] = ()  # the latest burst, every arm
        self.cycle_timeout_s = cycle_timeout_s
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
            if self.checker is not None:
                self.agreements = self._check(result)
                self.writer.submit(partial(add_checked_cycle, c=result,
                                           groups=self.agreements))
                return result
        self._store(result)
        return result

    def _check(self, result: CycleResult) -> tuple[AgreementGroup, ...]:
        assert self.checker is not None
        try:
            suite = self.suites[result.suite]
            return self.checker.check(result, max_new_tokens=suite.max_new_tokens,
                                      expected=suite.expected)
        except Exception:  # a quality-check bug must not lose the cycle's measurements
            log.exception("output agreement check failed")
            return ()

    def record_unprobed_compiles(self) -> CompileDelta | None:
        """Store the compile changes no cycle recorded (real traffic's recompiles).

        Returns the delta handed to the writer, or None when nothing changed or a cycle
        is running (its delta is not claimed yet: try again next time).
        """
        if not self._cycle_lock.acquire(blocking=False):
            return None
        try:
            now = self.engine.compile_snapshot()
            rest = now.diff(self._compile_mark)
            for claimed in self._compile_claimed:
                rest = rest.minus(claimed)
            self._compile_mark = now
            self._compile_claimed = []
            if not compile_changed(rest):
                return None
            self.writer.submit(partial(add_compile, delta=rest, at=self.clock(),
                                       instance_id=self.instance_id))
            return rest
        finally:
            self._cycle_lock.release()

    def run_burst(self, suite: str | None = None) -> BurstResult:
        """Run one burst probe with the suite's prompts, store it, and return it.

        On a batching engine (burst_unbatched) the `unbatched` arm runs the same arrivals
        and prompts with batching off, before or after it (drawn: neither arm always meets
        the other's leftovers); both are stored, the batched one is returned.
        """
        s = self.suites[suite or self.suite]
        seed = self.rng.getrandbits(64)
        snap = self.engine.batch_snapshot()
        arms = [VARIANT_DEFAULT]
        if self.burst_unbatched and snap.max_batch > 1:
            arms.insert(self.rng.randrange(2), VARIANT_UNBATCHED)
        out: dict[str, BurstResult] = {}
        for arm in arms:
            off = arm == VARIANT_UNBATCHED
            out[arm] = run_burst(
                self.engine, s.prompts, instance_id=self.instance_id, suite=s.name,
                rate_per_s=self.burst_rate_per_s, duration_s=self.burst_duration_s,
                concurrency=self.burst_concurrency, max_new_tokens=s.max_new_tokens,
                grace_s=self.cycle_timeout_s, rng=random.Random(seed), clock=self.clock,
                observers=self.observers, override=UNBATCHED if off else None, variant=arm,
                activity=self.activity)
        if len(out) > 1:
            out = {arm: replace(r, pair=f"{seed:016x}") for arm, r in out.items()}
        for r in out.values():
            self._store(r)
        self.last_burst_arms = tuple(out[arm] for arm in arms)
        return out[VARIANT_DEFAULT]

    def _store(self, result: Result) -> None:
        # The writer retries while the database is down; a full writer counts a drop.
        if isinstance(result, CycleResult):
            self.writer.submit(partial(add_cycle, c=result))
        else:
            self.writer.submit(partial(add_burst, b=result))


def prober_from_settings(settings: ProbeSettings, engine: Engine, writer: Writer, *,
                         instance_id: str, observers: Sequence[Observer] = (),
                         rng: random.Random | None = None,
                         clock: Callable[[], datetime] = utcnow,
                         suites: Mapping[str, CanarySuite] | None = None,
                         checker: OutputChecker | None = None,
                         activity: JobActivity | None = None) -> Prober:
    """Return the Prober the `probes` settings section describes."""
    from probes.canaries import load_suites

    p = settings
    return Prober(
        engine, writer, suites or load_suites(p.suites_file), instance_id=instance_id,
        suite=p.suite, canaries_per_bucket=p.canaries_per_bucket, ab_share=p.ab_share,
        ab_on_slowdown=p.ab_on_slowdown, ab_arms=p.ab_arms, cycle_timeout_s=p.cycle_timeout_s,
        burst_rate_per_s=p.burst_rate_per_s, burst_duration_s=p.burst_duration_s,
        burst_concurrency=p.burst_concurrency, burst_unbatched=p.burst_unbatched, rng=rng, clock=clock, observers=observers,
        checker=checker, activity=activity)
