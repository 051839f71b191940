"""The engine the demo serves: the real runtime (or the fake) behind a fault-injection seam."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from engine.config import BUILTIN_DIR, EngineConfig
from engine.protocol import (
    CompileSnapshot,
    Engine,
    EngineInfo,
    FlagOverride,
    FlagProvider,
    GenerateResult,
    MemorySnapshot,
    WarmupStatus,
)


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
                 override: FlagOverride | None = None,
                 timeout_s: float | None = None) -> GenerateResult:
        delay = self.delay_s
        started = time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        result = self.inner.generate(text, max_new_tokens=max_new_tokens, canary=canary,
                                     override=override, timeout_s=timeout_s)
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

    def flag_errors(self) -> int:
        return self.inner.flag_errors()

    def flag_source(self) -> str:
        return self.inner.flag_source()

    def close(self) -> None:
        self.inner.close()


class DemoEngineFactory:
    """The service's engine factory: builds the engine, wraps it, and keeps the wrapper.

    fake: serve probes.fake.FakeEngine (no torch; latencies slept) instead of the
        built-in models, for developing the scenario quickly.
    """

    def __init__(self, *, fake: bool = False) -> None:
        self.fake = fake
        self.engine: SlowableEngine | None = None
        self.built = threading.Event()

    def __call__(self, config: EngineConfig, flags: FlagProvider) -> SlowableEngine:
        inner: Engine
        if self.fake:
            from probes.fake import FakeEngine, FakeTimings

            inner = FakeEngine(buckets=config.buckets, max_input_tokens=config.max_input_tokens,
                               output_tokens=24, flags=flags,
                               # Near-zero shifted acceptance, as the built-in draft shows:
                               # speculating is then slower than decoding directly.
                               acceptance={"in_domain": 0.8, "shifted": 0.02},
                               timings=FakeTimings(sleep_scale=1.0))
        else:
            from engine import load_engine

            inner = load_engine(config, flags=flags)
        self.engine = SlowableEngine(inner)
        self.built.set()
        return self.engine
