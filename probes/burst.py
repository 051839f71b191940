"""Burst probe: open-loop Poisson arrivals for a bounded time, with a client thread cap.

Latency is measured from each request's scheduled arrival, not from when a client
thread picked it up, so a saturated engine shows up as latency instead of being hidden
(coordinated omission). Admission control is the engine's: `Overloaded` counts as a
rejection. Burst requests are synthetic (`canary=True`), so the engine sheds them before
real traffic (engine.admission): a burst measures admission on its own requests and never
turns a real request away; `rejected` counts its own refusals. The whole probe is bounded by `duration_s + grace_s`; hung calls are
abandoned, never waited for.

A/B: `override` runs the burst as an arm (its `variant` labels the result). The prober
runs the `unbatched` arm (batching off: every request alone, as engine.max_batch 1) on the
same arrivals and prompts as the batched burst, so batching's speedup and its tail cost
are measured under the burst's shape.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from engine.errors import Overloaded
from engine.protocol import Engine, FlagOverride, GenerateResult
from probes.cycle import (
    STATUS_ERROR,
    STATUS_OK,
    STATUS_TIMEOUT,
    JobActivity,
    Observer,
    jobs_between,
    read_activity,
)
from probes.measure import VARIANT_DEFAULT, GroupResult, group
from probes.stats import Distribution
from storage.sketches import Sketch
from vocab import Variant, utcnow

KIND_BURST = "burst"
# The burst's A/B arm: batching off, on the same arrivals.
UNBATCHED = FlagOverride(batching=False)
VARIANT_UNBATCHED = Variant.UNBATCHED.value


@dataclass(frozen=True)
class BurstResult:
    """What one burst measured.

    offered: arrivals scheduled; completed: answered; rejected: refused with Overloaded;
    errors: other failures; unfinished: still running when the probe stopped waiting.
    latency: scheduled arrival -> result (client view); queue_wait: scheduled arrival ->
    engine slot granted (client wait for a thread plus the engine's queue_wait_s).
    latency_sketch: the latencies as storage.sketches' stored form (windows merge bursts).
    jobs_during: the scheduler jobs running when the burst started or started during it
        (empty without a JobActivity).
    """

    instance_id: str
    suite: str
    started_at: datetime
    finished_at: datetime
    status: str
    rate_per_s: float
    duration_s: float
    concurrency: int
    offered: int
    completed: int
    rejected: int
    errors: int
    unfinished: int
    latency: Distribution
    queue_wait: Distribution
    groups: tuple[GroupResult, ...] = ()
    error: str | None = None
    kind: str = KIND_BURST
    model_version: str = ""
    config_hash: str = ""
    latency_sketch: dict[str, Any] = field(default_factory=dict)
    variant: str = VARIANT_DEFAULT  # the arm: optimized, or unbatched (UNBATCHED)
    pair: str = ""  # the same for the arms of one burst (their shared arrivals)
    jobs_during: tuple[str, ...] = ()

    @property
    def throughput_per_s(self) -> float:
        """Return completed requests per second of the burst's duration."""
        return self.completed / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def rejection_rate(self) -> float:
        """Return rejected / offered (0 when nothing was offered)."""
        return self.rejected / self.offered if self.offered else 0.0


def arrivals(rng: random.Random, rate_per_s: float, duration_s: float) -> list[float]:
    """Return Poisson arrival offsets (seconds) in [0, duration_s)."""
    if rate_per_s <= 0:
        raise ValueError(f"burst_rate_per_s: must be > 0, got {rate_per_s}")
    if duration_s <= 0:
        raise ValueError(f"burst_duration_s: must be > 0, got {duration_s}")
    out: list[float] = []
    t = rng.expovariate(rate_per_s)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate_per_s)
    return out


class _Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.results: list[GenerateResult] = []
        self.latency: list[float] = []
        self.queue_wait: list[float] = []
        self.rejected = 0
        self.errors = 0
        self.last_error: str | None = None


def run_burst(
    engine: Engine,
    prompts: Sequence[str],
    *,
    instance_id: str,
    suite: str = "",
    rate_per_s: float,
    duration_s: float,
    concurrency: int,
    max_new_tokens: int | None = None,
    grace_s: float = 30.0,
    rng: random.Random | None = None,
    clock: Callable[[], datetime] = utcnow,
    observers: Sequence[Observer] = (),
    override: FlagOverride | None = None,
    variant: str = VARIANT_DEFAULT,
    activity: JobActivity | None = None,
) -> BurstResult:
    """Run one burst against `engine` and return what it measured."""
    if concurrency < 1:
        raise ValueError(f"burst_concurrency: must be >= 1, got {concurrency}")
    if not prompts:
        raise ValueError("prompts: must not be empty")
    rng = rng or random.Random()
    offsets = arrivals(rng, rate_per_s, duration_s)
    chosen = [rng.choice(prompts) for _ in offsets]
    tally = _Tally()
    jobs_before = read_activity(activity)
    started = clock()
    t0 = time.monotonic()

    def call(prompt: str, scheduled: float) -> None:
        picked = time.monotonic()
        try:
            r = engine.generate(prompt, max_new_tokens=max_new_tokens, canary=True,
                                override=override, timeout_s=grace_s)
        except Overloaded:
            with tally.lock:
                tally.rejected += 1
            return
        except Exception as exc:  # counted; a burst reports failures, it does not raise
            with tally.lock:
                tally.errors += 1
                tally.last_error = f"{type(exc).__name__}: {exc}"
            return
        done = time.monotonic()
        with tally.lock:
            tally.results.append(r)
            tally.latency.append(done - scheduled)
            tally.queue_wait.append((picked - scheduled) + r.queue_wait_s)
        for observe in observers:
            # An observer bug must not fail the probe.
            with contextlib.suppress(Exception):
                observe(r)

    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="burst")
    futures = []
    try:
        for offset, prompt in zip(offsets, chosen, strict=True):
            delay = t0 + offset - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(call, prompt, t0 + offset))
        deadline = t0 + duration_s + grace_s
        for f in futures:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                f.result(timeout=remaining)
            except TimeoutError:
                break
    finally:
        # Abandon hung calls: their threads finish (or not) without us.
        pool.shutdown(wait=False, cancel_futures=True)
    jobs_during = jobs_between(jobs_before, read_activity(activity))
    with tally.lock:
        unfinished = sum(not f.done() or f.cancelled() for f in futures)
        results = list(tally.results)
        info = engine.info
        status = STATUS_OK
        error = None
        if unfinished:
            status = STATUS_TIMEOUT
            error = f"{unfinished} burst requests did not finish within duration + {grace_s:g} s"
        elif tally.errors and not results:
            status, error = STATUS_ERROR, tally.last_error
        return BurstResult(
            instance_id=instance_id, suite=suite, started_at=started, finished_at=clock(),
            status=status, error=error, rate_per_s=rate_per_s, duration_s=duration_s,
            concurrency=concurrency, offered=len(offsets), completed=len(results),
            rejected=tally.rejected, errors=tally.errors, unfinished=unfinished,
            latency=Distribution.of(tally.latency), queue_wait=Distribution.of(tally.queue_wait),
            groups=group((variant, r) for r in results), variant=variant,
            model_version=info.model_version, config_hash=info.config_hash,
            latency_sketch=Sketch.of(tally.latency).to_json(), jobs_during=jobs_during,
        )
