"""One model's lean forward, its precomputed tables and its per-bucket compiled functions."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine import t5
from engine.compile_watch import specialize

KIND_ENCODE = "encode"
KIND_STEP = "step"
KIND_VERIFY = "verify"


@dataclass(frozen=True)
class Fns:
    """The three functions a decode needs, compiled or eager.

    encode(m, ids, mask_bias, enc_bias) -> cross K/V; step(m, token, pos, self_kv, cross_kv,
    mask_bias, dec_bias, steps) -> `steps` greedy tokens; verify(m, tokens, positions, ...)
    -> the greedy choice at each position.
    """

    encode: Callable
    step: Callable
    verify: Callable


@dataclass(frozen=True)
class CompileOptions:
    """How torch.compile is called for every function."""

    mode: str
    backend: str
    # Passed to torch.compile itself: dynamo's config is thread-local in torch 2.13, so a
    # limit set on the loading thread would not hold on the request threads.
    recompile_limit: int = 8
    # Inductor options for the default mode (torch.compile takes mode or options, not both).
    inductor: tuple[tuple[str, object], ...] = ()


class ModelRunner:
    """Hold a LeanT5 with its bias tables and compiled functions per bucket."""

    def __init__(self, lean: t5.LeanT5, *, edges: Sequence[int], slots: int, verify_q: int,
                 options: CompileOptions | None, name: str, steps: int = 1,
                 compile_encoder: bool = True) -> None:
        self.m = lean
        self.name = name
        self.slots = slots
        self.verify_q = verify_q
        self.steps = steps  # greedy tokens per direct step call
        # The encoder runs once per request: for a small draft it is not worth a graph per
        # bucket (each costs tens of seconds of warm-up on a small CPU).
        self.compile_encoder = compile_encoder
        self._options = options
        self._lock = threading.Lock()
        with torch.no_grad():
            self.dec_bias = lean.decoder_bias(slots)
            self._enc_bias = {edge: lean.encoder_bias(edge) for edge in edges}
        # Built once: the loop indexes these instead of making tensors per token.
        self.positions = [torch.tensor([i], device=lean.device_) for i in range(slots)]
        self.windows = [torch.arange(i, i + verify_q, device=lean.device_)
                        for i in range(slots - verify_q + 1)]
        self.start = torch.full((1, 1), lean.decoder_start_id, dtype=torch.long,
                                device=lean.device_)
        self.eager = Fns(t5.encode, t5.decode_steps, t5.decode_greedy)
        self._compiled: dict[object, Fns] = {}

    def encoder_bias(self, length: int) -> torch.Tensor:
        """Return the encoder bias for `length` (precomputed for bucket edges)."""
        bias = self._enc_bias.get(length)
        if bias is None:
            with torch.no_grad():
                bias = self.m.encoder_bias(length)
        return bias

    def compiled(self, key: int | str) -> Fns:
        """Return the compiled functions for bucket edge `key` (or "exact"), creating them."""
        with self._lock:
            fns = self._compiled.get(key)
            if fns is None:
                encode = (self._compile(t5.encode, f"{self.name}_{key}_enc")
                          if self.compile_encoder else t5.encode)
                fns = Fns(encode,
                          self._compile(t5.decode_steps, f"{self.name}_{key}_step"),
                          self._compile(t5.decode_greedy, f"{self.name}_{key}_verify"))
                self._compiled[key] = fns
            return fns

    def _compile(self, fn: Callable, tag: str) -> Callable:
        assert self._options is not None
        kwargs: dict[str, Any] = {"dynamic": False, "backend": self._options.backend,
                                     "recompile_limit": self._options.recompile_limit}
        if self._options.backend == "inductor":
            if self._options.mode != "default":
                kwargs["mode"] = self._options.mode
            elif self._options.inductor:
                kwargs["options"] = dict(self._options.inductor)
        return torch.compile(specialize(fn, tag), **kwargs)

    def warm(self, edge: int, *, verify: bool) -> None:
        """Compile bucket `edge` by running each function once on dummy inputs."""
        fns = self.compiled(edge)
        m = self.m
        with torch.no_grad():
            ids = torch.full((1, edge), m.eos_id, dtype=torch.long, device=m.device_)
            mask = m.mask_bias(torch.ones((1, edge), dtype=torch.long, device=m.device_))
            cross = fns.encode(m, ids, mask, self.encoder_bias(edge))
            kv = m.new_self_cache(self.slots)
            fns.step(m, self.start, self.positions[0], kv, cross, mask, self.dec_bias, self.steps)
            if verify:
                toks = self.start.expand(1, self.verify_q).contiguous()
                fns.verify(m, toks, self.windows[0], kv, cross, mask, self.dec_bias)
