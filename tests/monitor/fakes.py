"""A fake engine for service tests: probes.fake.FakeEngine plus warm-up gating and caps."""

from __future__ import annotations

import threading

from engine import validation
from engine.admission import Admission
from engine.config import EngineConfig
from engine.protocol import (
    CancelSignal,
    FlagOverride,
    FlagProvider,
    GenerateResult,
    WarmupStatus,
)
from probes.fake import FakeEngine


class ServiceFakeEngine(FakeEngine):
    """Like the real runtime: its request checks (engine.validation), warm-up you can hold,
    the engine's admission control (engine.max_concurrency slots, engine.max_queue waiting).

    `hold_warmup` set: warm_up() blocks until `finish_warmup` is set, so /readyz can be
    observed reporting "warming".
    """

    def __init__(self, config: EngineConfig, flags: FlagProvider) -> None:
        super().__init__(buckets=config.buckets, max_input_tokens=config.max_input_tokens,
                         flags=flags, output_tokens=8,
                         admission=Admission(config.max_concurrency, config.max_queue))
        self.config = config
        self.hold_warmup = threading.Event()
        self.finish_warmup = threading.Event()
        self._warm = False
        self.closed = False

    def generate(self, text: str, *, max_new_tokens: int | None = None, canary: bool = False,
                 override: FlagOverride | None = None, timeout_s: float | None = None,
                 cancel: CancelSignal | None = None) -> GenerateResult:
        # The runtime's own checks, in its order (engine.runtime.Runtime._plan).
        validation.check_timeout(timeout_s)
        validation.max_new_tokens(self.config, max_new_tokens)
        validation.check_input_tokens(self.config,
                                      self.count_tokens(validation.check_text(self.config, text)))
        return super().generate(text, max_new_tokens=max_new_tokens, canary=canary,
                                override=override, timeout_s=timeout_s, cancel=cancel)

    def warm_up(self, *, background: bool = True) -> None:
        if self.hold_warmup.is_set():
            self.finish_warmup.wait(30)
        super().warm_up(background=background)
        self._warm = True

    def warmup_status(self) -> WarmupStatus:
        n = len(self.buckets)
        return WarmupStatus(n, n if self._warm else 0, 0.0, self._warm)

    def close(self) -> None:
        self.closed = True
        super().close()


class FakeFactory:
    """An engine factory that remembers the engine it built (and can hold warm-up)."""

    def __init__(self, *, hold_warmup: bool = False) -> None:
        self.engine: ServiceFakeEngine | None = None
        self.hold = hold_warmup
        self.built = threading.Event()

    def __call__(self, config: EngineConfig, flags: FlagProvider) -> ServiceFakeEngine:
        engine = ServiceFakeEngine(config, flags)
        if self.hold:
            engine.hold_warmup.set()
        self.engine = engine
        self.built.set()
        return engine
