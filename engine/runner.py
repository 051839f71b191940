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
# Granularity of the attended cache prefix (slots). Finer spans attend fewer stale slots;
# the span is a dynamic dimension, so the number of graphs does not grow with it.
SPAN_STEP = 32


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


def _unguarded_weights(entries: Sequence[Any]) -> list[bool]:
    """Keep every dynamo guard except those on the model argument `m` and its weights."""
    # Each compiled copy is only ever called with its own runner's frozen LeanT5, so guards
    # on its ~80 weight tensors and attributes can never fail; they are per-call overhead
    # (the gain was not measurable on the loaded 2-core box: README, Benchmarks).
    # Guard names are source expressions: "m", "m.eps", "m._parameters['qkv']", ...
    return [not (entry.name == "m" or entry.name.startswith(("m.", "m[")))
            for entry in entries]


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
        # The attended prefix of the cache per call, by the slots it must cover: spans are
        # multiples of SPAN_STEP (the last one all slots), each the corner of dec_bias with
        # its length marked dynamic, so every span runs the same compiled graph.
        spans: dict[int, torch.Tensor] = {}
        self._bias_for: list[torch.Tensor] = []
        for end in range(1, slots + 1):
            span = min(slots, -(-end // SPAN_STEP) * SPAN_STEP)
            if span not in spans:
                corner = self.dec_bias[:, :span, :span].contiguous()
                if span > 1:  # a size-1 dimension cannot be dynamic (torch specializes it)
                    torch._dynamo.mark_dynamic(corner, 1)
                    torch._dynamo.mark_dynamic(corner, 2)
                spans[span] = corner
            self._bias_for.append(spans[span])
        self.eager = Fns(t5.encode, t5.decode_steps, t5.decode_greedy)
        self._compiled: dict[object, Fns] = {}

    def bias_for(self, end: int) -> torch.Tensor:
        """Return the self-attention bias for a call whose positions all lie below `end`."""
        return self._bias_for[end - 1]

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
        if self._options.backend == "inductor" and self._options.mode != "default":
            kwargs["mode"] = self._options.mode  # torch.compile takes mode or options
        else:
            options: dict[str, Any] = {"guard_filter_fn": _unguarded_weights}
            if self._options.backend == "inductor":
                options.update(self._options.inductor)
            kwargs["options"] = options
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
            fns.step(m, self.start, self.positions[0], kv, cross, mask,
                     self.bias_for(self.steps), self.steps)
            if verify:
                toks = self.start.expand(1, self.verify_q).contiguous()
                fns.verify(m, toks, self.windows[0], kv, cross, mask,
                           self.bias_for(self.verify_q))
