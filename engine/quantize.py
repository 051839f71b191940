"""int8 weights for the lean T5 forward (engine.quantization: int8).

Weight-only int8 for the decoder step: each linear weight it reads (self- and
cross-attention, feed-forward, lm head) is stored as int8 with one float scale per output
channel (symmetric, absmax / 127), and the C decode step (engine.native) multiplies them
as they are (docs/engine.md#int8-weights). By default the encoder (and the cross K/V
projection it computes) keeps the float weights, shared with the float model rather than
copied: the compiled float encoder is the fastest on the built-in target. `int8(encoder=True)`
(`engine.int8_encoder`) puts int8 weights in its products too, multiplied int8 x int8
(engine.encoder_int8; docs/engine.md#the-int8-encoder). Embeddings,
layer norms and position biases stay float and are shared too, so the int8 target holds
only its int8 decoder weights beyond the float model, whose own float decoder weights
int8 serving releases (engine.float_weights; docs/engine.md#what-int8-serving-holds).

Where the C step does not serve (no compiler, `native_step` off, eager), the forward
computes `linear(x, int8.to(dtype)) * scale`: the reference path dequantizes on demand.
`torch.ao.quantization.quantize_dynamic` does not fit: it only swaps `nn.Linear` modules
(the lean forward has none) and is deprecated in this torch (it warns).

`Quantizer` is the seam: the runtime builds its int8 target with `int8` unless given
another one (tests pass `noisy`, float weights with noise, to make outputs disagree).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from engine import encoder_int8
from engine.t5 import LeanT5

Quantizer = Callable[[LeanT5], LeanT5]
LINEAR_WEIGHTS = ("qkv", "o", "cq", "ckv", "co", "wi", "wo")
# The weights the decoder step reads (the C step's int8 weights; `ckv` is the encoder's).
STEP_WEIGHTS = ("qkv", "o", "cq", "co", "wi", "wo")


def shares_encoder(a: LeanT5, b: LeanT5) -> bool:
    """Return whether `a` and `b` compute one encoder: every tensor `engine.t5.encode` reads
    (embedding, encoder layers, final norm, position bias, cross K/V projection) is the
    same tensor in both, with the same dtype and epsilon."""

    def read(m: LeanT5) -> list[object]:
        return [m.embed, m.enc_rel, m.enc_final, *m.enc_layers.parameters(),
                *(layer.ckv for layer in m.dec_layers)]

    ta, tb = read(a), read(b)
    return (a.dtype == b.dtype and a.eps == b.eps and len(ta) == len(tb)
            and all(isinstance(x, torch.Tensor) and x is y for x, y in zip(ta, tb, strict=True)))


def step_names(lean: LeanT5) -> list[str]:
    """Return the parameter names of the weights int8 replaces (decoder step and lm head)."""
    return [f"dec_layers.{i}.{n}" for i in range(len(lean.dec_layers)) for n in STEP_WEIGHTS
            ] + ["lm_head"]


class Int8Weight(nn.Module):
    """A linear weight [out, in] as int8 with one scale per output channel."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.q = nn.Parameter(q.to(weight.device), requires_grad=False)
        self.scale = nn.Parameter(scale.to(device=weight.device, dtype=weight.dtype),
                                  requires_grad=False)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """Return x @ W.T with W = q * scale (the scale applied after the product)."""
        return F.linear(x, self.q.to(x.dtype)) * self.scale

    def dequantized(self) -> torch.Tensor:
        """Return the float weight this int8 weight stands for."""
        return self.q.to(self.scale.dtype) * self.scale[:, None]


def is_int8(w: object) -> bool:
    """Return whether a LeanT5 weight is an Int8Weight."""
    return isinstance(w, Int8Weight)


def _shared_copy(lean: LeanT5) -> LeanT5:
    """Return a copy of `lean`'s modules that shares every tensor with it (the memo answers
    each with itself): what the copy keeps is held once, what it replaces only in the copy."""
    memo: dict[int, object] = {id(t): t for t in [*lean.parameters(), *lean.buffers()]}
    return copy.deepcopy(lean, memo)


def _map_weights(lean: LeanT5, fn: Callable[[torch.Tensor], nn.Module | torch.Tensor], *,
                 step_only: bool = False) -> LeanT5:
    """Return a copy of `lean` with `fn` applied to its linear weights (`step_only`: the
    decoder step's and the lm head; the rest shared with `lean`)."""
    out = _shared_copy(lean)
    layers = list(out.dec_layers) if step_only else [*out.enc_layers, *out.dec_layers]
    for layer in layers:
        for name in STEP_WEIGHTS if step_only else LINEAR_WEIGHTS:
            w = getattr(layer, name, None)
            if isinstance(w, torch.Tensor):
                delattr(layer, name)
                new = fn(w)
                setattr(layer, name, new if isinstance(new, nn.Module)
                        else nn.Parameter(new, requires_grad=False))
    head = fn(out.lm_head)
    del out.lm_head
    # LeanT5 declares lm_head a Parameter; an Int8Weight module takes its place here.
    if isinstance(head, nn.Module):
        out.add_module("lm_head", head)
    else:
        out.register_parameter("lm_head", nn.Parameter(head, requires_grad=False))
    return out


def int8(lean: LeanT5, *, encoder: bool = False) -> LeanT5:
    """Return a copy of `lean` whose decoder step weights are int8 (see the module doc);
    `encoder`: its encoder's products (and the cross K/V projection) too (engine.encoder_int8),
    the float ones still shared, not copied."""
    with torch.no_grad():
        out = _map_weights(lean, Int8Weight, step_only=True)
        if encoder:
            _pack_encoder(out)
        return out


def _pack_encoder(lean: LeanT5) -> None:
    """Put an Int8EncoderWeight in place of each encoder product's float weight of `lean` (a
    copy whose modules are its own: the float model keeps its weights)."""
    if not encoder_int8.available():
        raise RuntimeError(f"int8 encoder: torch {torch.__version__} has no torch._int_mm")
    for layer, name in [*((layer, n) for layer in lean.enc_layers
                          for n in encoder_int8.ENCODER_WEIGHTS),
                        *((layer, "ckv") for layer in lean.dec_layers)]:
        w = getattr(layer, name)
        delattr(layer, name)
        setattr(layer, name, encoder_int8.Int8EncoderWeight(w))


def encoder_names(lean: LeanT5) -> list[str]:
    """Return the parameter names of the encoder products' float weights (those an int8
    encoder replaces, the decoder's cross K/V projection included)."""
    return [f"enc_layers.{i}.{n}" for i in range(len(lean.enc_layers))
            for n in encoder_int8.ENCODER_WEIGHTS] + [
        f"dec_layers.{i}.ckv" for i in range(len(lean.dec_layers))]


def int8_encoder(lean: LeanT5) -> bool:
    """Return whether `lean`'s encoder multiplies int8 weights (engine.encoder_int8)."""
    return any(encoder_int8.is_int8_encoder_weight(getattr(layer, name, None))
               for layer in lean.enc_layers for name in encoder_int8.ENCODER_WEIGHTS)


def dequantize(lean: LeanT5) -> LeanT5:
    """Return a float copy of an int8 `lean` (each weight its q * scale): the float
    reference the int8 step is tested against, built on demand, never kept for serving."""

    with torch.no_grad():
        out = _shared_copy(lean)
        for layer in [*out.enc_layers, *out.dec_layers]:
            for name in LINEAR_WEIGHTS:
                w = getattr(layer, name, None)
                if isinstance(w, Int8Weight | encoder_int8.Int8EncoderWeight):
                    delattr(layer, name)
                    setattr(layer, name, nn.Parameter(w.dequantized(), requires_grad=False))
        if isinstance(out.lm_head, Int8Weight):
            head = out.lm_head.dequantized()
            del out.lm_head
            out.register_parameter("lm_head", nn.Parameter(head, requires_grad=False))
    return out


def noisy(relative: float, seed: int = 0) -> Quantizer:
    """Return a test quantizer: float weights plus Gaussian noise of `relative` x their std."""

    def apply(lean: LeanT5) -> LeanT5:
        gen = torch.Generator().manual_seed(seed)

        def add(w: torch.Tensor) -> torch.Tensor:
            noise = torch.randn(w.shape, generator=gen, dtype=torch.float32)
            noise = noise.to(device=w.device, dtype=w.dtype)
            return (w + noise * w.float().std().to(w.dtype) * relative).detach()

        with torch.no_grad():
            return _map_weights(lean, add)

    return apply


def weight_bytes(lean: LeanT5, *, beyond: LeanT5 | None = None) -> int:
    """Return the bytes of `lean`'s parameters (int8 weights count one byte per value);
    `beyond`: only those it does not share with that model."""
    shared = {p.data_ptr() for p in beyond.parameters()} if beyond is not None else set()
    return sum(p.numel() * p.element_size() for p in lean.parameters()
               if p.data_ptr() not in shared)
