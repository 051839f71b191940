"""The engine the demo serves: the real runtime (or the fake) behind a fault-injection seam."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from engine.admission import AdmissionStats
from engine.config import BUILTIN_DIR, EngineConfig
from engine.protocol import (
    BatchSnapshot,
    CancelSignal,
    CompileSnapshot,
    DraftLengthSnapshot,
    Engine,
    EngineInfo,
    FlagOverride,
    FlagProvider,
    GenerateResult,
    GraphSnapshot,
    MemorySnapshot,
    RuntimeFlags,
    WarmupStatus,
)

# Relative noise (x each weight matrix's std) the demo's faulty int8 build adds to the
# target's weights (engine.quantize.noisy, the runtime's quantizer seam): enough to change
# most outputs of the built-in model, whose real int8 weights agree with float32.
FAULTY_INT8_NOISE = 0.5


def models_present() -> bool:
    """Return whether the built-in target and draft models are installed."""
    return all((BUILTIN_DIR / name / "model.safetensors").is_file()
               for name in ("target", "draft"))


class SlowableEngine:
    """Delegate to an Engine; `slow_down(s)` adds `s` seconds to every call until `restore()`.

    The delay stands for a slowed path (a regressed kernel, a slow tokenizer): it is
    slept inside generate() and included in the result's total_s, so canaries, traffic
    rollups and Prometheus all see it.
    """

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self._delay_s = 0.0
        self._lock = threading.Lock()

    def slow_down(self, delay_s: float) -> None:
        """Add `delay_s` seconds to every following call."""
        if delay_s < 0:
            raise ValueError(f"delay_s: must be >= 0, got {delay_s}")
        with self._lock:
            self._delay_s = delay_s

    def restore(self) -> None:
        """Stop adding latency."""
        self.slow_down(0.0)

    @property
    def delay_s(self) -> float:
        """Return the latency currently injected."""
        with self._lock:
            return self._delay_s

    @property
    def info(self) -> EngineInfo:
        return self.inner.info

    def generate(self, text: str, *, max_new_tokens: int | None = None, canary: bool = False,
                 override: FlagOverride | None = None, timeout_s: float | None = None,
                 cancel: CancelSignal | None = None) -> GenerateResult:
        delay = self.delay_s
        started = time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        result = self.inner.generate(text, max_new_tokens=max_new_tokens, canary=canary,
                                     override=override, timeout_s=timeout_s, cancel=cancel)
        if delay > 0:
            result = replace(result, total_s=time.perf_counter() - started)
        return result

    def bucket_for(self, input_tokens: int) -> str:
        return self.inner.bucket_for(input_tokens)

    def count_tokens(self, text: str) -> int:
        return self.inner.count_tokens(text)

    def warm_up(self, *, background: bool = True) -> None:
        self.inner.warm_up(background=background)

    def warmup_status(self) -> WarmupStatus:
        return self.inner.warmup_status()

    def compile_snapshot(self) -> CompileSnapshot:
        return self.inner.compile_snapshot()

    def memory_snapshot(self) -> MemorySnapshot:
        return self.inner.memory_snapshot()

    def queue_depth(self) -> int:
        return self.inner.queue_depth()

    def admission_stats(self) -> AdmissionStats:
        return self.inner.admission_stats()

    def flag_errors(self) -> int:
        return self.inner.flag_errors()

    def batch_snapshot(self) -> BatchSnapshot:
        return self.inner.batch_snapshot()

    def draft_length_snapshot(self) -> DraftLengthSnapshot:
        return self.inner.draft_length_snapshot()

    def graph_snapshot(self) -> GraphSnapshot:
        return self.inner.graph_snapshot()

    def flag_source(self) -> str:
        return self.inner.flag_source()

    def close(self) -> None:
        self.inner.close()


class Int8Rollout:
    """The service's flags, with int8 weights served only in the buckets rolled out to.

    Stands for a staged rollout written in config: the int8 target is loaded
    (engine.quantization: int8) but served nowhere until `roll_out(bucket)`. A stored
    per-bucket `quantized` row (the policy's fallback, an operator's override) still wins
    in that bucket, so the production flag path turns it off again.
    """

    def __init__(self, inner: FlagProvider) -> None:
        self.inner = inner
        self._lock = threading.Lock()
        self._buckets: frozenset[str] = frozenset()

    def roll_out(self, bucket: str) -> None:
        """Serve int8 weights in `bucket` from the next request on."""
        with self._lock:
            self._buckets = self._buckets | {bucket}

    @property
    def buckets(self) -> frozenset[str]:
        """Return the buckets int8 is rolled out to."""
        with self._lock:
            return self._buckets

    def flags(self) -> RuntimeFlags:
        stored = self.inner.flags()
        rolled = dict.fromkeys(self.buckets, True)
        return replace(stored, quantized_default=False, quantized={**rolled, **stored.quantized})

    def invalidate(self) -> None:
        self.inner.invalidate()


class DemoEngineFactory:
    """The service's engine factory: builds the engine, wraps it, and keeps the wrapper.

    fake: serve probes.fake.FakeEngine (no torch; latencies slept) instead of the
        built-in models, for developing the scenario quickly (it has no int8 path).
    int8_noise: with engine.quantization int8, build the int8 target with noisy float
        weights instead (engine.quantize.noisy): a faulty int8 build whose outputs drift.
    """

    def __init__(self, *, fake: bool = False, int8_noise: float = FAULTY_INT8_NOISE) -> None:
        self.fake = fake
        self.int8_noise = int8_noise
        self.engine: SlowableEngine | None = None
        self.rollout: Int8Rollout | None = None
        self.built = threading.Event()

    def __call__(self, config: EngineConfig, flags: FlagProvider) -> SlowableEngine:
        inner: Engine
        self.rollout = Int8Rollout(flags)
        flags = self.rollout
        if self.fake:
            from probes.fake import FakeEngine, FakeTimings

            inner = FakeEngine(buckets=config.buckets, max_input_tokens=config.max_input_tokens,
                               output_tokens=24, flags=flags,
                               # Near-zero shifted acceptance, as the built-in draft shows:
                               # speculating is then slower than decoding directly.
                               acceptance={"in_domain": 0.8, "shifted": 0.02},
                               timings=FakeTimings(sleep_scale=1.0))
        elif config.quantization == "int8":
            from engine.quantize import noisy
            from engine.runtime import Runtime

            inner = Runtime(config, flags, quantizer=noisy(self.int8_noise))
        else:
            from engine import load_engine

            inner = load_engine(config, flags=flags)
        self.engine = SlowableEngine(inner)
        self.built.set()
        return self.engine
