"""One probe cycle: every bucket's canaries through the engine, measured and timed out.

The engine calls run in a worker thread; the caller waits at most `timeout_s` and then
returns a `timeout` result, so a hung model call never wedges the scheduler. While a
timed-out worker is still stuck in the engine, later cycles return `timeout` at once
instead of stacking more threads on the hung engine.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from engine.errors import Overloaded, RequestTimeout
from engine.protocol import (
    DECODING_DIRECT,
    DECODING_SPECULATIVE,
    PATH_COMPILED,
    PATH_EAGER,
    PATH_OVERFLOW,
    CompileDelta,
    Engine,
    FlagOverride,
    GenerateResult,
    MemorySnapshot,
)
from probes.canaries import CanarySuite, by_bucket, missing_buckets
from probes.measure import VARIANT_DEFAULT, GroupResult, group
from vocab import RunStatus, Variant, utcnow

log = logging.getLogger(__name__)

STATUS_OK = RunStatus.OK.value
STATUS_ERROR = RunStatus.ERROR.value
STATUS_TIMEOUT = RunStatus.TIMEOUT.value
KIND_CYCLE = "cycle"

# A/B fallback arms: variant name -> the override that turns one optimization off.
ARMS: dict[str, FlagOverride] = {
    "eager": FlagOverride(compiled=False),
    "direct": FlagOverride(speculative=False),
    "exact": FlagOverride(bucketing=False),
}
# Reverse arms: when an optimization is already off (a fallback flag), measure it switched
# back on, so the auto-fallback policy can see whether it has recovered.
ARM_SPECULATIVE = Variant.SPECULATIVE.value
ARM_COMPILED = Variant.COMPILED.value
# int8 weights (engine.quantization: int8): float32 while they serve, int8 while they are off.
ARM_FLOAT32 = Variant.FLOAT32.value
ARM_QUANTIZED = Variant.QUANTIZED.value

Observer = Callable[[GenerateResult], None]


# Canaries per (bucket, path, decoding) per cycle. 10 would let a p99 rest on 100 samples
# pooled over 10 cycles instead of 25 (bench.detection: +20% confirmed at p95 in 17
# cycles instead of 39) for ~0.7 s more per cycle, but a cycle's canaries share the
# machine's noise (design effect 2.4 at the p99 on the compiled recording), the
# exceedance CUSUM counts them as independent, and it gave 28 false alerts per 30 days
# against 3 with 4 (docs/detection.md#limits).
CANARIES_PER_BUCKET = 4


@dataclass(frozen=True)
class CycleResult:
    """Everything one probe cycle measured.

    memory_before/after: engine.memory_snapshot() around the whole cycle.
    compile: compile-counter delta over the default-variant calls; ab_compile: over the
        A/B arms (an `exact` arm recompiles by design, so it is kept apart).
    rejected: canary calls refused with Overloaded (counted, the cycle goes on).
    """

    suite: str
    instance_id: str
    started_at: datetime
    finished_at: datetime
    status: str
    error: str | None = None
    kind: str = KIND_CYCLE
    ab: bool = False
    groups: tuple[GroupResult, ...] = ()
    rejected: int = 0
    missing_buckets: tuple[str, ...] = ()
    memory_before: MemorySnapshot | None = None
    memory_after: MemorySnapshot | None = None
    compile: CompileDelta | None = None
    ab_compile: CompileDelta | None = None
    model_version: str = ""
    config_hash: str = ""
    # (prompt, variant, result) of every call, for the output-quality check (probes.reference).
    outputs: tuple[tuple[str, str, GenerateResult], ...] = ()

    @property
    def duration_s(self) -> float:
        """Return the wall time of the cycle."""
        return (self.finished_at - self.started_at).total_seconds()

    @property
    def rss_growth_bytes(self) -> int | None:
        """Return RSS after minus before, or None when either is missing."""
        if self.memory_before is None or self.memory_after is None:
            return None
        return self.memory_after.rss_bytes - self.memory_before.rss_bytes

    @property
    def buckets(self) -> tuple[str, ...]:
        """Return the bucket labels measured, in order."""
        return tuple(dict.fromkeys(g.bucket for g in self.groups))


@dataclass
class _Progress:
    """What the worker has done so far (read by the caller after a timeout)."""

    pairs: list[tuple[str, GenerateResult]] = field(default_factory=list)
    outputs: list[tuple[str, str, GenerateResult]] = field(default_factory=list)
    rejected: int = 0
    memory_before: MemorySnapshot | None = None
    memory_after: MemorySnapshot | None = None
    compile: CompileDelta | None = None
    ab_compile: CompileDelta | None = None
    current: str = ""
    error: BaseException | None = None


class ProbeCycle:
    """Run canary cycles against one engine.

    Example:
        cycle = ProbeCycle(engine, load_suites(), instance_id="a", rng=random.Random(0))
        result = cycle.run("in_domain")
    """

    def __init__(
        self,
        engine: Engine,
        suites: Mapping[str, CanarySuite],
        *,
        instance_id: str,
        canaries_per_bucket: int = CANARIES_PER_BUCKET,
        ab_share: float = 0.25,
        ab_arms: Sequence[str] = tuple(ARMS),
        timeout_s: float = 120.0,
        rng: random.Random | None = None,
        clock: Callable[[], datetime] = utcnow,
        observers: Sequence[Observer] = (),
    ) -> None:
        if not 0.0 <= ab_share <= 1.0:
            raise ValueError(f"ab_share: must be in [0, 1], got {ab_share}")
        if timeout_s <= 0:
            raise ValueError(f"cycle_timeout_s: must be > 0, got {timeout_s}")
        if canaries_per_bucket < 1:
            raise ValueError(f"canaries_per_bucket: must be >= 1, got {canaries_per_bucket}")
        unknown = [a for a in ab_arms if a not in ARMS]
        if unknown:
            raise ValueError(f"ab_arms: unknown arm {unknown[0]!r}; known: {sorted(ARMS)}")
        self.engine = engine
        self.suites = dict(suites)
        self.instance_id = instance_id
        self.canaries_per_bucket = canaries_per_bucket
        self.ab_share = ab_share
        self.ab_arms = tuple(ab_arms)
        self.timeout_s = timeout_s
        self.rng = rng or random.Random()
        self.clock = clock
        self.observers = tuple(observers)
        self._stuck: threading.Thread | None = None
        self._plans: dict[str, dict[str, tuple[str, ...]]] = {}

    def run(self, suite: str, *, ab: bool | None = None) -> CycleResult:
        """Run one cycle of `suite`; never raises for engine failures (see status)."""
        if suite not in self.suites:
            raise ValueError(f"suite: unknown suite {suite!r}; known: {sorted(self.suites)}")
        started = self.clock()
        # Draw even when forced so the A/B schedule does not depend on forced runs.
        draw = self.rng.random() < self.ab_share
        ab = draw if ab is None else ab
        info = self.engine.info
        base: dict[str, Any] = {"suite": suite, "instance_id": self.instance_id, "started_at": started,
                "ab": ab, "model_version": info.model_version, "config_hash": info.config_hash}
        if self._stuck is not None and self._stuck.is_alive():
            return CycleResult(**base, finished_at=self.clock(), status=STATUS_TIMEOUT,
                               error="previous probe cycle is still waiting on a hung engine call")
        progress = _Progress()
        deadline = time.monotonic() + self.timeout_s
        worker = threading.Thread(target=self._work, args=(suite, ab, deadline, progress),
                                  name=f"probe-cycle-{suite}", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        pairs = list(progress.pairs)
        fields: dict[str, Any] = {
            **base, "groups": group(pairs), "rejected": progress.rejected,
            "missing_buckets": missing_buckets(self._plans.get(suite, {}), self.engine)
            if suite in self._plans else (),
            "memory_before": progress.memory_before, "memory_after": progress.memory_after,
            "compile": progress.compile, "ab_compile": progress.ab_compile,
            "outputs": tuple(progress.outputs),
        }
        if worker.is_alive():
            self._stuck = worker
            msg = (f"probe cycle exceeded cycle_timeout_s={self.timeout_s:g}"
                   f" (engine call in bucket {progress.current or '?'} did not return)")
            return CycleResult(**fields, finished_at=self.clock(), status=STATUS_TIMEOUT,
                               error=msg)
        if progress.error is not None:
            err = progress.error
            if isinstance(err, TimeoutError | RequestTimeout):
                return CycleResult(**fields, finished_at=self.clock(), status=STATUS_TIMEOUT,
                                   error=f"probe cycle timed out: {err}")
            return CycleResult(**fields, finished_at=self.clock(), status=STATUS_ERROR,
                               error=f"{type(err).__name__}: {err}")
        return CycleResult(**fields, finished_at=self.clock(), status=STATUS_OK)

    def _plan(self, suite: str) -> dict[str, tuple[str, ...]]:
        if suite not in self._plans:
            self._plans[suite] = by_bucket(self.suites[suite], self.engine,
                                           self.canaries_per_bucket)
        return self._plans[suite]

    def _work(self, suite: str, ab: bool, deadline: float, progress: _Progress) -> None:
        try:
            engine = self.engine
            plan = self._plan(suite)
            max_new = self.suites[suite].max_new_tokens
            progress.memory_before = engine.memory_snapshot()
            snap0 = engine.compile_snapshot()
            defaults: list[tuple[str, GenerateResult]] = []
            for bucket, prompts in plan.items():
                progress.current = bucket
                for prompt in prompts:
                    r = self._call(prompt, max_new, None, deadline, progress)
                    if r is not None:
                        defaults.append((prompt, r))
                        progress.pairs.append((VARIANT_DEFAULT, r))
                        progress.outputs.append((prompt, VARIANT_DEFAULT, r))
            snap1 = engine.compile_snapshot()
            progress.compile = snap1.diff(snap0)
            if ab:
                for prompt, first in defaults:
                    progress.current = first.bucket
                    for variant, override in self._arms_for(first):
                        r = self._call(prompt, max_new, override, deadline, progress)
                        if r is not None:
                            progress.pairs.append((variant, r))
                            progress.outputs.append((prompt, variant, r))
                progress.ab_compile = engine.compile_snapshot().diff(snap1)
            progress.memory_after = engine.memory_snapshot()
        except BaseException as exc:  # noqa: BLE001 - reported as the cycle's error
            progress.error = exc

    def _arms_for(self, first: GenerateResult) -> list[tuple[str, FlagOverride]]:
        """Return the fallback arms that differ from how `first` actually ran."""
        info = self.engine.info
        arms: list[tuple[str, FlagOverride]] = []
        for name in self.ab_arms:
            if name == "eager" and first.path in (PATH_EAGER, PATH_OVERFLOW):
                # Eager after warm-up means the `compiled` flag is off: probe the
                # compiled path at the A/B rate so recovery can be measured.
                if first.path == PATH_EAGER and self.engine.warmup_status().done:
                    arms.append((ARM_COMPILED, FlagOverride(compiled=True)))
                continue
            if name == "exact" and first.path != PATH_COMPILED:
                continue
            if name == "direct":
                if first.decoding == DECODING_DIRECT:
                    # Speculation is off here (fallback); measure it switched back on.
                    if info.speculative_available:
                        arms.append((ARM_SPECULATIVE, FlagOverride(speculative=True)))
                    continue
                if first.decoding != DECODING_SPECULATIVE:
                    continue
            arms.append((name, ARMS[name]))
        if first.quantized:
            arms.append((ARM_FLOAT32, FlagOverride(quantized=False)))
        elif info.quantization != "none":
            arms.append((ARM_QUANTIZED, FlagOverride(quantized=True)))
        return arms

    def _call(self, prompt: str, max_new: int | None, override: FlagOverride | None,
              deadline: float, progress: _Progress) -> GenerateResult | None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("cycle deadline passed")
        try:
            r = self.engine.generate(prompt, max_new_tokens=max_new, canary=True,
                                     override=override, timeout_s=remaining)
        except Overloaded:
            progress.rejected += 1
            return None
        for observe in self.observers:
            try:
                observe(r)
            except Exception:  # an observer bug must not fail the probe
                log.exception("probe observer %r failed", observe)
        return r
