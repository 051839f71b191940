"""What the C decode step trusts, checked before it is called (engine.native).

engine/native_step.c reads and writes raw pointers: a tensor of another dtype, layout or
shape would be read, or written, as if it were right. `Boundary` checks each tensor handed
to C against the model's dimensions and raises `BoundaryError` naming the tensor and what
was expected. The tensors a request keeps for all its steps (its slot's self-attention
cache, its cross K/V and padding mask) are checked when a step first sees them, so once per
request (a slot's cache, the same object request after request, once); a bias corner once per
thread (a runner has a few, reused by every request).
A batched step (`Boundary.rows`) keeps what passed per request, keyed by its cross K/V, so
each row is checked in full once per request too.
Positions and token ids change every call: the C entry points check them (engine/native_step.c
`check_call`, `check_rows`) and `raise_for` / `raise_for_row` turn their refusal into the same
error. A tensor is known by
identity: one re-laid out in place (`resize_`, `set_`, `as_strided_`) mid-request is not seen.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from engine.errors import BoundaryError

# Return codes of engine/native_step.c's entry points (its TW_* enum).
TW_OK, TW_BAD_TOKEN, TW_BAD_POSITION, TW_BAD_SPAN, TW_BAD_SIZE = range(5)
INTEGER = frozenset((torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8))


@dataclass(frozen=True)
class Dims:
    """The model dimensions the C step indexes its tensors with."""

    layers: int
    heads: int
    d_kv: int
    vocab: int

    @classmethod
    def of(cls, lean: Any) -> Dims:
        """Return the dimensions of a LeanT5's decoder."""
        head = getattr(lean.lm_head, "q", lean.lm_head)  # an int8 head: its int8 rows
        return cls(layers=len(lean.dec_layers), heads=int(lean.n_heads), d_kv=int(lean.d_kv),
                   vocab=int(head.shape[0]))


def _shape_text(shape: Sequence[int | str]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def expect(name: str, t: object, shape: Sequence[int | str], *, contiguous: bool = True
           ) -> tuple[int, ...]:
    """Check that `t` is a float32 CPU tensor of `shape` (a str entry: any size >= 1, named)
    and, with `contiguous`, contiguous; return its shape."""
    # The usual case in a few cheap attribute reads, on every C call: is_cpu rather than
    # device.type (which builds a device object), and a loop rather than a generator.
    if (isinstance(t, torch.Tensor) and t.dtype is torch.float32 and t.is_cpu
            and (not contiguous or t.is_contiguous())):
        got = t.shape
        if len(got) == len(shape):
            for want, size in zip(shape, got, strict=True):  # a loop: no generator per call
                if (size < 1) if isinstance(want, str) else (size != want):
                    break
            else:
                return tuple(got)
    _explain(name, t, shape)


def _explain(name: str, t: object, shape: Sequence[int | str]) -> NoReturn:
    """Raise the BoundaryError that says what is wrong with `t`."""
    if not isinstance(t, torch.Tensor):
        raise BoundaryError(name, f"expected a tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise BoundaryError(name, f"expected float32, got {str(t.dtype).removeprefix('torch.')}")
    if t.device.type != "cpu":
        raise BoundaryError(name, f"expected a CPU tensor, got one on {t.device}")
    got = tuple(t.shape)
    if len(got) != len(shape) or any(isinstance(want, int) and want != size
                                      for want, size in zip(shape, got, strict=False)):
        raise BoundaryError(name, f"expected shape {_shape_text(shape)}, got {list(got)}")
    if any(isinstance(want, str) and size < 1 for want, size in zip(shape, got, strict=True)):
        raise BoundaryError(name, f"expected shape {_shape_text(shape)} with every size >= 1, "
                                  f"got {list(got)}")
    raise BoundaryError(name, f"expected a contiguous tensor, got strides {list(t.stride())}")


def expect_weight(name: str, t: object, dtype: torch.dtype, shape: Sequence[int]) -> None:
    """Check that a weight C reads is a contiguous CPU tensor of `dtype` and `shape`."""
    if (isinstance(t, torch.Tensor) and t.dtype == dtype and t.is_cpu and t.is_contiguous()
            and tuple(t.shape) == tuple(shape)):
        return
    what = str(dtype).removeprefix("torch.")
    if not isinstance(t, torch.Tensor):
        raise BoundaryError(name, f"expected a {what} tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise BoundaryError(name, f"expected {what}, got {str(t.dtype).removeprefix('torch.')}")
    if t.device.type != "cpu":
        raise BoundaryError(name, f"expected a CPU tensor, got one on {t.device}")
    if tuple(t.shape) != tuple(shape):
        raise BoundaryError(name, f"expected shape {_shape_text(shape)}, got {list(t.shape)}")
    raise BoundaryError(name, f"expected a contiguous tensor, got strides {list(t.stride())}")


def check_weights(lean: Any) -> None:
    """Check every weight the C step reads against the model's dimensions: float32 weights,
    or int8 linear weights (engine.quantize.Int8Weight: `.q` int8 [out, in] and `.scale`
    float32 [out]); raise BoundaryError naming the first wrong one (`dec_layers[2].wi.q`)."""
    D, inner = int(lean.d_model), int(lean.inner)
    layers = list(lean.dec_layers)
    wo = getattr(layers[0].wo, "q", layers[0].wo) if layers else None
    d_ff = int(wo.shape[-1]) if isinstance(wo, torch.Tensor) and wo.dim() == 2 else -1
    ff = 2 * d_ff if lean.gated else d_ff
    head = getattr(lean.lm_head, "q", lean.lm_head)
    vocab = int(head.shape[0]) if isinstance(head, torch.Tensor) and head.dim() == 2 else -1
    f32 = torch.float32
    embed = lean.embed
    # C indexes the embedding with any token id below the head's vocabulary.
    if isinstance(embed, torch.Tensor) and embed.dim() == 2 and embed.shape[0] >= vocab:
        expect_weight("embed", embed, f32, (int(embed.shape[0]), D))
    else:
        expect_weight("embed", embed, f32, (max(vocab, 1), D))
    expect_weight("dec_final", lean.dec_final, f32, (D,))

    def linear(name: str, w: Any, shape: tuple[int, int]) -> None:
        if hasattr(w, "q") and hasattr(w, "scale"):
            expect_weight(f"{name}.q", w.q, torch.int8, shape)
            expect_weight(f"{name}.scale", w.scale, f32, shape[:1])
        else:
            expect_weight(name, w, f32, shape)

    linear("lm_head", lean.lm_head, (vocab, D))
    for i, layer in enumerate(layers):
        for norm in ("ln_att", "ln_cross", "ln_ff"):
            expect_weight(f"dec_layers[{i}].{norm}", getattr(layer, norm), f32, (D,))
        for name, shape in (("qkv", (3 * inner, D)), ("o", (D, inner)), ("cq", (inner, D)),
                            ("co", (D, inner)), ("wi", (ff, D)), ("wo", (D, d_ff))):
            linear(f"dec_layers[{i}].{name}", getattr(layer, name), shape)


def check_request(dims: Dims, self_kv: object, cross_kv: object, mask_bias: object, *,
                  cache_checked: bool = False) -> None:
    """Check the tensors a request keeps for all its steps (`cache_checked`: but the
    self-attention cache, already checked)."""
    L, H, dk = dims.layers, dims.heads, dims.d_kv
    if not cache_checked:
        expect("self_kv", self_kv, (L, 2, H, "slots", dk))
    # The cross K/V is made contiguous by the caller when it is not (a copy: it is only read).
    cross = expect("cross_kv", cross_kv, (L, 2, H, "cross", dk), contiguous=False)[3]
    expect("mask_bias", mask_bias, (1, 1, 1, cross))


def check_bias(dims: Dims, dec_bias: object) -> None:
    """Check a decoder self-attention bias corner [heads, span, span]."""
    shape = expect("dec_bias", dec_bias, (dims.heads, "span", "span"))
    if shape[1] != shape[2]:
        raise BoundaryError("dec_bias", f"expected shape [{dims.heads}, span, span], "
                                        f"got {list(shape)}")


def check_tokens(name: str, t: object, count: int | None = None) -> None:
    """Check that `t` (token ids or positions) is an integer CPU tensor (of `count` elements
    when given)."""
    if (isinstance(t, torch.Tensor) and t.dtype in INTEGER and t.is_cpu
            and (count is None or t.numel() == count)):
        return
    if not isinstance(t, torch.Tensor):
        raise BoundaryError(name, f"expected an integer tensor, got {type(t).__name__}")
    if t.dtype not in INTEGER:
        raise BoundaryError(name, f"expected an integer tensor, got "
                                  f"{str(t.dtype).removeprefix('torch.')}")
    if t.device.type != "cpu":
        raise BoundaryError(name, f"expected a CPU tensor, got one on {t.device}")
    raise BoundaryError(name, f"expected {count} element(s), got {t.numel()}")


def raise_for(code: int, *, dims: Dims, tokens: Sequence[int], tokens_name: str, pos0: int,
              rows: int, slots: int, span: int, cross: int) -> None:
    """Raise the BoundaryError for a C entry point's refusal `code` (nothing for TW_OK)."""
    if code == TW_OK:
        return
    last = pos0 + rows - 1
    if code == TW_BAD_TOKEN:
        bad = [t for t in tokens if not 0 <= t < dims.vocab]
        raise BoundaryError(tokens_name, f"token id {bad[0] if bad else '?'} outside the "
                                         f"vocabulary [0, {dims.vocab})")
    if code == TW_BAD_POSITION:
        raise BoundaryError("pos", f"positions {pos0}..{last} outside the cache's slots "
                                   f"[0, {slots})")
    if code == TW_BAD_SPAN:
        raise BoundaryError("dec_bias", f"span {span} does not cover positions {pos0}..{last}")
    if code == TW_BAD_SIZE:
        raise BoundaryError("steps", f"expected >= 1 rows and non-empty tensors, got {rows} "
                                     f"rows, {slots} slots, {cross} cross positions, span {span}")
    raise BoundaryError("native step", f"refused with unknown code {code}")


def raise_for_row(code: int, row: int, *, dims: Dims, tokens: Sequence[int],
                  positions: Sequence[int], slots: int, span: int) -> None:
    """Raise the BoundaryError for tw_rows' refusal `code` of `row` (-1: the call's sizes)."""
    if code == TW_OK:
        return
    if row < 0 or row >= len(tokens):
        raise BoundaryError("tokens", f"expected >= 1 rows and non-empty tensors, got "
                                      f"{len(tokens)} rows, {slots} slots, span {span}")
    if code == TW_BAD_TOKEN:
        raise BoundaryError(f"tokens[{row}]", f"token id {tokens[row]} outside the "
                                              f"vocabulary [0, {dims.vocab})")
    if code == TW_BAD_POSITION:
        raise BoundaryError(f"positions[{row}]", f"position {positions[row]} outside the "
                                                 f"cache's slots [0, {slots})")
    if code == TW_BAD_SPAN:
        raise BoundaryError("dec_bias", f"span {span} does not cover row {row}'s position "
                                        f"{positions[row]}")
    if code == TW_BAD_SIZE:
        raise BoundaryError(f"crosses[{row}]", "expected a non-empty cross K/V")
    raise BoundaryError("native step", f"refused row {row} with unknown code {code}")


def _dead() -> None:
    return None


class Boundary:
    """The checks of one bound C step, remembering per thread what already passed."""

    def __init__(self, dims: Dims) -> None:
        self.dims = dims
        self._local = threading.local()
        self.full_checks = 0  # requests (and bias corners) checked in full, for tests

    def tensors(self, self_kv: Any, cross_kv: Any, mask_bias: Any, dec_bias: Any) -> None:
        """Check the tensors of a call: in full when first seen, else by identity (a few
        weak-reference reads: the draft's whole step is tens of microseconds)."""
        local = self._local
        seen = getattr(local, "seen", None)
        if seen is None:
            seen = local.seen = [_dead, _dead, _dead, _dead]
            local.corners = {}
        if seen[1]() is not cross_kv or seen[2]() is not mask_bias or seen[0]() is not self_kv:
            if seen[0]() is not self_kv:  # a slot's cache: the same object request after request
                expect("self_kv", self_kv, (self.dims.layers, 2, self.dims.heads, "slots",
                                            self.dims.d_kv))
                self.full_checks += 1
            check_request(self.dims, self_kv, cross_kv, mask_bias, cache_checked=True)
            seen[:3] = weakref.ref(self_kv), weakref.ref(cross_kv), weakref.ref(mask_bias)
            self.full_checks += 1
        if seen[3]() is not dec_bias:  # another span's corner: a runner has a few, kept
            self._bias(dec_bias)
            seen[3] = weakref.ref(dec_bias)

    def _bias(self, dec_bias: Any) -> None:
        """Check a bias corner in full unless this thread has seen it."""
        corners = getattr(self._local, "corners", None)
        if corners is None:
            corners = self._local.corners = {}
        known = corners.get(id(dec_bias))
        if known is None or known() is not dec_bias:
            check_bias(self.dims, dec_bias)
            if len(corners) >= 64:  # callers that make a corner per call: stay bounded
                corners.clear()
            corners[id(dec_bias)] = weakref.ref(dec_bias)
            self.full_checks += 1

    def rows(self, tokens: Any, positions: Any, caches: Sequence[Any], crosses: Sequence[Any],
             masks: Sequence[Any], dec_bias: Any) -> int:
        """Check a batched step's arguments and return the slot count its caches share.

        Each row's cache, cross K/V and mask are checked in full when the row's request is
        first seen, then by identity (a dict read and three weak-reference reads a row);
        the errors name the argument and the row (`caches[2]`). Token ids and positions are
        checked by C (engine/native_step.c `check_rows`, `raise_for_row`).
        """
        b = len(caches)
        if b < 1:
            raise BoundaryError("caches", "expected >= 1 rows, got none")
        check_tokens("tokens", tokens, b)
        check_tokens("positions", positions, b)
        if len(crosses) != b or len(masks) != b:
            name = "crosses" if len(crosses) != b else "masks"
            raise BoundaryError(name, f"expected one per row ({b}), got "
                                      f"{len(crosses) if name == 'crosses' else len(masks)}")
        known = getattr(self._local, "rows", None)
        if known is None:
            known = self._local.rows = {}
        slots = -1
        for r in range(b):
            cache, cross, mask = caches[r], crosses[r], masks[r]
            entry = known.get(id(cross))  # a request's cross K/V: its own, for all its steps
            if (entry is None or entry[1]() is not cross or entry[0]() is not cache
                    or entry[2]() is not mask):
                entry = self._row(r, cache, cross, mask, known)
            if slots < 0:
                slots = entry[3]
            elif entry[3] != slots:  # C takes one slot count for every row's cache
                raise BoundaryError(f"caches[{r}]", f"expected {slots} slots (row 0's), got "
                                                    f"{entry[3]}")
        self._bias(dec_bias)
        return slots

    def _row(self, r: int, cache: Any, cross: Any, mask: Any, known: dict[int, Any]
             ) -> tuple[Any, Any, Any, int]:
        """Check one row's tensors in full and remember them; return the remembered entry."""
        L, H, dk = self.dims.layers, self.dims.heads, self.dims.d_kv
        slots = expect(f"caches[{r}]", cache, (L, 2, H, "slots", dk))[3]
        # The cross K/V is made contiguous by the caller when it is not (only read).
        length = expect(f"crosses[{r}]", cross, (L, 2, H, "cross", dk), contiguous=False)[3]
        expect(f"masks[{r}]", mask, (1, 1, 1, length))
        if len(known) >= 256:  # requests come and go: stay bounded
            known.clear()
        entry = (weakref.ref(cache), weakref.ref(cross), weakref.ref(mask), slots)
        known[id(cross)] = entry
        self.full_checks += 1
        return entry
