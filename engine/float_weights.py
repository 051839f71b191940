"""A model's float weights that int8 serving does not need, resident only while used.

An engine with `quantization: int8` serves the int8 target, whose decoder step reads int8
weights; the float target beside it serves the float32 A/B arm, the reference path and
any bucket whose `quantized` flag is off. Everything the two share (embeddings, encoder,
cross K/V projection, norms, position biases) is one set of float tensors. The float
target's own decoder-step weights are `OnDemandWeights`: read back from the checkpoint
on disk (the original weights, not a dequantized int8 copy: the float32 arm measures
int8 against the real float32 model) when a float request comes, and released once none
has held them for `HOLD_S`. So int8 serving alone holds less than float32 serving alone,
and the float32 arm costs a reload when it finds them released
(docs/engine.md#what-the-float32-arm-costs).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from engine import malloc

log = logging.getLogger(__name__)

# Seconds the weights stay after the last float request lets go of them: a probe cycle's
# float32 arm calls follow each other closely, so one reload serves the whole cycle.
HOLD_S = 10.0


class Bound(Protocol):
    """What points at the weights outside torch (engine.native.BoundStep)."""

    def rebind(self) -> None: ...

    def unbind(self) -> None: ...


class OnDemandWeights:
    """Some parameters of a model, loaded while held and released when idle; thread-safe.

    Example:
        weights = OnDemandWeights(lean, ["dec_layers.0.qkv", ...], reload, bound=[step])
        with weights.held() as reload_s:  # 0.0 when they were resident
            ...  # run the model
    """

    def __init__(self, lean: torch.nn.Module, names: Sequence[str],
                 reload: Callable[[], Mapping[str, torch.Tensor]], *,
                 hold_s: float = HOLD_S, bound: Sequence[Bound] = ()) -> None:
        params = dict(lean.named_parameters())
        self._params = {name: params[name] for name in names}
        self._shapes = {name: (p.shape, p.dtype) for name, p in self._params.items()}
        self.nbytes = sum(p.numel() * p.element_size() for p in self._params.values())
        self._reload = reload
        self.hold_s = hold_s
        self._bound = list(bound)
        self._lock = threading.Lock()
        self._holders = 0
        self._resident = True
        self._timer: threading.Timer | None = None
        self._closed = False
        self.reloads = 0  # loads from the checkpoint since start
        self.reload_s = 0.0  # their seconds in all
        self.releases = 0

    @property
    def resident(self) -> bool:
        return self._resident

    @contextmanager
    def held(self) -> Iterator[float]:
        """Hold the weights (loading them if released); yield the seconds the load took."""
        seconds = self.acquire()
        try:
            yield seconds
        finally:
            self.release()

    def acquire(self) -> float:
        """Hold the weights, loading them if released; return the seconds that took."""
        with self._lock:
            self._holders += 1
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._resident:
                return 0.0
            t0 = time.perf_counter()
            try:
                self._load()
            except BaseException:
                self._holders -= 1
                raise
            seconds = time.perf_counter() - t0
            self.reloads += 1
            self.reload_s += seconds
        log.info("float weights: %.1f MiB reloaded in %.3f s", self.nbytes / 2**20, seconds)
        return seconds

    def release(self) -> None:
        """Let go of the weights; the last holder starts the countdown to releasing them."""
        with self._lock:
            self._holders -= 1
            if self._holders > 0 or self._closed:
                return
            if self.hold_s <= 0:
                self._drop()
                return
            self._timer = threading.Timer(self.hold_s, self.release_idle)
            self._timer.daemon = True
            self._timer.start()

    def release_idle(self) -> bool:
        """Release the weights now unless someone holds them; return whether they are
        released (the countdown calls it; so can a caller that will not wait for it)."""
        with self._lock:
            if self._holders == 0 and self._resident:
                self._drop()
            return not self._resident

    def close(self) -> None:
        """Stop the countdown (the engine is closing)."""
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _drop(self) -> None:
        for b in self._bound:  # before the memory goes: C must not read it after
            b.unbind()
        for p in self._params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._resident = False
        self.releases += 1
        # The freed tensors went back to malloc, which may keep them: return the pages.
        malloc.trim()

    def _load(self) -> None:
        fresh = self._reload()
        loaded: dict[str, torch.Tensor] = {}
        for name, (shape, dtype) in self._shapes.items():
            t = fresh.get(name)
            if t is None or t.shape != shape or t.dtype != dtype:
                got = "missing" if t is None else f"{tuple(t.shape)} {t.dtype}"
                raise RuntimeError(f"float weights: {name}: expected {tuple(shape)} {dtype}, "
                                   f"got {got}")
            loaded[name] = t
        for name, p in self._params.items():
            p.data = loaded[name]
        for b in self._bound:
            b.rebind()
        self._resident = True


def releasable(lean: torch.nn.Module, names: Sequence[str],
               keep: Sequence[torch.nn.Module]) -> list[str]:
    """Return those of `lean`'s parameters `names` whose storage nothing else holds: not
    its other parameters, nor any parameter of the `keep` models (dropping one of those
    would free nothing)."""
    wanted = set(names)

    def key(t: Any) -> int:
        return int(t.untyped_storage().data_ptr())

    # Every name, duplicates included: a parameter registered twice is held by both names.
    named = list(lean.named_parameters(remove_duplicate=False))
    kept = {key(p) for n, p in named if n not in wanted}
    for m in keep:
        kept |= {key(p) for p in m.parameters()}
    return [n for n, p in named if n in wanted and key(p) not in kept]
