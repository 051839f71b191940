"""One probe cycle: every bucket's canaries through the engine, measured and timed out.

The engine calls run in a worker thread; the caller waits at most `timeout_s` and then
returns a `timeout` result, so a hung model call never wedges the scheduler. While a
timed-out worker is still stuck in the engine, later cycles return `timeout` at once
instead of stacking more threads on the hung engine.

A/B cycles run each canary prompt's optimized request and its fallback arms back to back,
in an order drawn per prompt from the cycle's rng, so that anything periodic in the
process (another job, a GC pause, a flag read) lands on every arm alike and the arms of
one prompt can be compared pair by pair (`CycleResult.pairs`,
`storage.queries.speedups`).

Which arms a prompt gets depends on how its optimized request ran (`_arms_for`): a bucket
whose speculation is off gets the reverse `speculative` arm instead of `direct`, a
request the C decode step served gets `compiled_step` (the C step off) and one it did
not serve while bound gets the reverse `native_step`, and so on. The cycle therefore plans a prompt's arms from the latest optimized result of its
bucket (this cycle's or an earlier one's, A/B or not), draws the order of the optimized
request among them, and reconciles once the optimized request has run: an arm it no
longer calls for is dropped (run, not recorded), an arm it newly calls for runs after it.
The order is drawn for every prompt except a bucket's very first (no result to plan
from: optimized first); an arm a flag change newly calls for runs after the optimized
request. Running every arm and reading the set afterwards would cost a call per stale
arm on every prompt; predicting it from the flags would duplicate the engine's path
choice (warm-up, probation, quantization) here. Compile deltas are taken around each call and summed per side, so
`compile` covers the optimized requests and `ab_compile` the arms, exactly.
"""

from __future__ import annotations

import hashlib
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
    CompileSnapshot,
    Engine,
    FlagOverride,
    GenerateResult,
    MemorySnapshot,
)
from probes.ab_schedule import AbSchedule, optimized_medians
from probes.canaries import CanarySuite, by_bucket, missing_buckets
from probes.measure import VARIANT_DEFAULT, GroupResult, group
from vocab import AbReason, RunStatus, Variant, utcnow

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
# The C decode step (engine.native): the compiled step while it serves, itself while the
# native_step flag is off.
ARM_COMPILED_STEP = Variant.COMPILED_STEP.value
ARM_NATIVE_STEP = Variant.NATIVE_STEP.value
NATIVE_STEP_OFF = FlagOverride(native_step=False)
NATIVE_STEP_ON = FlagOverride(native_step=True)

Observer = Callable[[GenerateResult], None]
# Job name -> (runs started so far, running now): what the process's scheduler did, read
# before and after a cycle so a probe row says which jobs shared the machine with it.
JobActivity = Callable[[], Mapping[str, tuple[int, bool]]]


# Canaries per (bucket, path, decoding) per cycle. More would let a pooled p99 rest on
# fewer cycles, but a cycle's canaries share the machine's noise while the exceedance
# CUSUM counts them as independent, so more canaries per cycle page more often on noise
# (docs/detection.md#limits).
CANARIES_PER_BUCKET = 4


@dataclass(frozen=True)
class PromptPair:
    """One canary prompt's optimized request and its arms, run back to back (A/B cycles).

    prompt: the first 12 hex digits of the SHA-256 of the prompt text (prompt_id).
    order: the variants (vocab.Variant values) in the order they ran.
    latency_s: variant -> GenerateResult.own_s (total_s less a pause for real requests).
    Both hold successful calls of the arm set the optimized request decided only.
    """

    bucket: str
    prompt: str
    order: tuple[str, ...]
    latency_s: Mapping[str, float]


def prompt_id(prompt: str) -> str:
    """Return the first 12 hex digits of the SHA-256 of `prompt` (UTF-8)."""
    return hashlib.sha256(prompt.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class CycleResult:
    """Everything one probe cycle measured.

    memory_before/after: engine.memory_snapshot() around the whole cycle.
    compile: compile-counter delta summed over the optimized calls; ab_compile: over the
        A/B arm calls (an `exact` arm recompiles by design, so it is kept apart). Each call
        is measured on its own, so what compiles between two calls belongs to neither.
    rejected: canary calls refused with Overloaded (counted, the cycle goes on).
    pairs: one per prompt of an A/B cycle whose optimized call succeeded.
    jobs_during: the scheduler jobs running when the cycle started or started during it
        (empty without a JobActivity).
    ab_reason: why the arms ran (probes.ab_schedule: "drawn", "slowdown" on demand after
        a slow cycle, "requested" by the caller); "" when they did not.
    """

    suite: str
    instance_id: str
    started_at: datetime
    finished_at: datetime
    status: str
    error: str | None = None
    kind: str = KIND_CYCLE
    ab: bool = False
    ab_reason: str = ""
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
    pairs: tuple[PromptPair, ...] = ()
    jobs_during: tuple[str, ...] = ()

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
    prompt_pairs: list[PromptPair] = field(default_factory=list)
    current: str = ""
    error: BaseException | None = None


class ProbeCycle:
    """Run canary cycles against one engine.

    Which cycles run the A/B arms is the `schedule`'s call (probes.ab_schedule: drawn on
    `ab_share` of the cycles, and on demand after a cycle whose optimized canaries rose
    more than `ab_on_slowdown`); a schedule given replaces those two.

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
        ab_on_slowdown: float | None = 0.15,
        ab_arms: Sequence[str] = tuple(ARMS),
        timeout_s: float = 120.0,
        rng: random.Random | None = None,
        clock: Callable[[], datetime] = utcnow,
        observers: Sequence[Observer] = (),
        activity: JobActivity | None = None,
        schedule: AbSchedule | None = None,
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
        self.schedule = schedule or AbSchedule(share=ab_share, on_slowdown=ab_on_slowdown)
        self.ab_arms = tuple(ab_arms)
        self.timeout_s = timeout_s
        self.rng = rng or random.Random()
        self.clock = clock
        self.observers = tuple(observers)
        self.activity = activity
        self._stuck: threading.Thread | None = None
        self._plans: dict[str, dict[str, tuple[str, ...]]] = {}
        # bucket -> the latest optimized result there: plans the arms of the next prompt.
        self._latest: dict[str, GenerateResult] = {}

    def run(self, suite: str, *, ab: bool | None = None) -> CycleResult:
        """Run one cycle of `suite`; never raises for engine failures (see status).

        ab: run the arms (True) or not (False) whatever the schedule says; None: as it says.
        """
        if suite not in self.suites:
            raise ValueError(f"suite: unknown suite {suite!r}; known: {sorted(self.suites)}")
        # Draw even when forced so the A/B schedule does not depend on forced runs.
        reason = self.schedule.due(self.rng)
        if ab is not None:
            reason = AbReason.REQUESTED if ab else None
        result = self._run(suite, reason)
        # Only a cycle whose arms actually ran pays off what a slow cycle owed.
        self.schedule.observe(optimized_medians(result.groups),
                              ab=result.ab and bool(result.groups))
        return result

    def _run(self, suite: str, reason: str | None) -> CycleResult:
        started = self.clock()
        ab = reason is not None
        info = self.engine.info
        base: dict[str, Any] = {"suite": suite, "instance_id": self.instance_id, "started_at": started,
                "ab": ab, "ab_reason": reason or "", "model_version": info.model_version,
                "config_hash": info.config_hash}
        if self._stuck is not None and self._stuck.is_alive():
            return CycleResult(**base, finished_at=self.clock(), status=STATUS_TIMEOUT,
                               error="previous probe cycle is still waiting on a hung engine call")
        jobs_before = read_activity(self.activity)
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
            "outputs": tuple(progress.outputs), "pairs": tuple(progress.prompt_pairs),
            "jobs_during": jobs_between(jobs_before, read_activity(self.activity)),
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
            progress.compile = CompileDelta.none()
            if ab:
                progress.ab_compile = CompileDelta.none()
            for bucket, prompts in plan.items():
                progress.current = bucket
                for prompt in prompts:
                    if ab:
                        self._paired(bucket, prompt, max_new, deadline, progress)
                        continue
                    r = self._call(prompt, max_new, None, deadline, progress)
                    if r is not None:
                        self._latest[bucket] = r
                        progress.pairs.append((VARIANT_DEFAULT, r))
                        progress.outputs.append((prompt, VARIANT_DEFAULT, r))
            progress.memory_after = engine.memory_snapshot()
        except BaseException as exc:  # noqa: BLE001 - reported as the cycle's error
            progress.error = exc

    def _paired(self, bucket: str, prompt: str, max_new: int | None, deadline: float,
                progress: _Progress) -> None:
        """Run `prompt` optimized and through its arms back to back, in a drawn order."""
        latest = self._latest.get(bucket)
        planned = dict(self._arms_for(latest)) if latest is not None else {}
        queue = [VARIANT_DEFAULT, *planned]
        self.rng.shuffle(queue)
        ran: list[tuple[str, GenerateResult]] = []
        tried: set[str] = set()
        arms: dict[str, FlagOverride] | None = None  # known once the optimized call ran
        while queue:
            variant = queue.pop(0)
            tried.add(variant)
            if variant != VARIANT_DEFAULT:
                override = (arms or planned)[variant]
                r = self._call(prompt, max_new, override, deadline, progress, arm=True)
                if r is not None:
                    ran.append((variant, r))
                continue
            first = self._call(prompt, max_new, None, deadline, progress)
            if first is None:
                return  # no optimized result: the arms would pair with nothing
            self._latest[bucket] = first
            ran.append((VARIANT_DEFAULT, first))
            arms = dict(self._arms_for(first))
            # Reconcile the plan with what this call decided (flags changed, first call).
            new = [v for v in arms if v not in tried and v not in queue]
            self.rng.shuffle(new)
            queue = [v for v in queue if v in arms] + new
        assert arms is not None  # the optimized variant is always queued
        kept = [(v, r) for v, r in ran if v == VARIANT_DEFAULT or v in arms]
        for v, r in kept:
            progress.pairs.append((v, r))
            progress.outputs.append((prompt, v, r))
        progress.prompt_pairs.append(PromptPair(
            bucket=bucket, prompt=prompt_id(prompt), order=tuple(v for v, _ in kept),
            latency_s={v: r.own_s for v, r in kept}))

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
        if first.native_step:
            arms.append((ARM_COMPILED_STEP, NATIVE_STEP_OFF))
        elif first.path == PATH_COMPILED and info.decode_step.startswith("target native"):
            # The C step is bound but off here (the native_step flag): measure it back on.
            arms.append((ARM_NATIVE_STEP, NATIVE_STEP_ON))
        return arms

    def _call(self, prompt: str, max_new: int | None, override: FlagOverride | None,
              deadline: float, progress: _Progress, *, arm: bool = False) -> GenerateResult | None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("cycle deadline passed")
        before = self.engine.compile_snapshot()
        try:
            r = self.engine.generate(prompt, max_new_tokens=max_new, canary=True,
                                     override=override, timeout_s=remaining)
        except Overloaded:
            progress.rejected += 1
            return None
        finally:
            self._charge(before, progress, arm=arm)
        for observe in self.observers:
            try:
                observe(r)
            except Exception:  # an observer bug must not fail the probe
                log.exception("probe observer %r failed", observe)
        return r

    def _charge(self, before: CompileSnapshot, progress: _Progress, *, arm: bool) -> None:
        """Add what compiled since `before` to the arms' or the optimized side's delta."""
        try:
            delta = self.engine.compile_snapshot().diff(before)
        except Exception:  # keep the call's own error; its compiles are stored later
            log.exception("compile snapshot failed")
            return
        if arm:
            progress.ab_compile = (progress.ab_compile or CompileDelta.none()).plus(delta)
        else:
            progress.compile = (progress.compile or CompileDelta.none()).plus(delta)


def read_activity(activity: JobActivity | None) -> Mapping[str, tuple[int, bool]]:
    """Return what `activity` reports (nothing without one, or when it fails)."""
    if activity is None:
        return {}
    try:
        return activity()
    except Exception:  # a broken seam must not fail the probe
        log.exception("job activity read failed")
        return {}


def jobs_between(before: Mapping[str, tuple[int, bool]],
                 after: Mapping[str, tuple[int, bool]]) -> tuple[str, ...]:
    """Return the jobs running at the start or started since, sorted by name."""
    names = {n for n, (_, running) in before.items() if running}
    names |= {n for n, (started, _) in after.items() if started > before.get(n, (0, False))[0]}
    return tuple(sorted(names))
