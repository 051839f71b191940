"""The CPU decode step in C (engine/native_step.c), built with the system compiler.

On the CPU a direct decode step is ~50 one-row products whose weights (10 MB for the
built-in target) stream from L3 each token. Inductor's generated loop keeps one
accumulator per output row and reaches ~35 GB/s here; the C step keeps four rows and
their accumulators in flight and reaches the cache's bandwidth (~65 GB/s), all of the
step in one call (docs/engine.md#the-c-decode-step). It computes what
`engine.t5.decode_steps` and `decode_greedy` compute, on the same cache, cross K/V and
bias tensors, so they are interchangeable per call; greedy tokens are tested equal to
Hugging Face.

    lib = native.load(cache_dir)           # None: no compiler, or the build failed
    if native.applicable(lean) is None:    # else a reason: CUDA, bf16, int8 weights, ...
        fn = lib.bind(lean)                # Fns.step; fn.verify is Fns.verify
        tokens = fn(m, token, pos, self_kv, cross_kv, mask_bias, dec_bias, steps)

Built once per source, compiler and CPU into <cache_dir>/native/ (-O3 -march=native;
about a second); a build failure is logged once and the compiled graph serves instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from engine import aot, t5

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "native_step.c"
_ACTS = {"relu": 0, "gelu_new": 1, "gelu_pytorch_tanh": 1, "gelu": 2, "silu": 3}
_F = ctypes.POINTER(ctypes.c_float)
_FF = ctypes.POINTER(_F)


_LAYER_WEIGHTS = ("ln_att", "qkv", "o", "ln_cross", "cq", "co", "ln_ff", "wi", "wo")
_FIELDS: list[tuple[str, Any]] = [
    *((name, ctypes.c_int64) for name in (
        "layers", "d_model", "heads", "d_kv", "inner", "d_ff", "vocab", "gated", "act")),
    ("eps", ctypes.c_float), ("out_scale", ctypes.c_float),
    ("embed", _F), ("lm_head", _F), ("final_ln", _F),
    *((name, _FF) for name in _LAYER_WEIGHTS)]


class _Model(ctypes.Structure):
    """engine/native_step.c's Model, field for field."""

    _fields_ = _FIELDS


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def build(cache_dir: str | Path) -> Path | None:
    """Return the shared library of the C step, building it when missing (None: cannot)."""
    cc = _compiler()
    if cc is None:
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + cc.encode() + aot.cpu_tag().encode()).hexdigest()[:16]
    out = Path(cache_dir) / "native" / f"step-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name
        cmd = [cc, "-O3", "-march=native", "-shared", "-fPIC", str(SOURCE), "-o", str(part),
               "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()
            log.warning("native step: build failed (%s); the compiled step serves instead",
                        said[-1] if said else f"exit {done.returncode}")
            return None
        os.replace(part, out)  # atomic: a concurrent build never sees half a file
    return out


def applicable(lean: t5.LeanT5) -> str | None:
    """Return why the C step cannot serve `lean` (None: it can)."""
    if lean.device_.type != "cpu":
        return f"device {lean.device_.type}"
    if lean.dtype != torch.float32:
        return f"dtype {lean.dtype}"
    for layer in lean.dec_layers:
        for name in _LAYER_WEIGHTS:
            if not isinstance(getattr(layer, name), torch.Tensor):
                return "quantized weights"
    act = getattr(lean, "act_name", None)
    if act not in _ACTS:
        return f"activation {act!r}"
    return None


class NativeStep:
    """The loaded library; `bind` makes a step function for one model."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        # tw_decode takes a pointer to q tokens; tw_chain one token and a step count.
        self._fn, self._chain = lib.tw_decode, lib.tw_chain
        for fn, first in ((self._fn, [p, i64]), (self._chain, [i64, i64])):
            fn.restype = None
            fn.argtypes = [ctypes.POINTER(_Model), *first, i64, p, i64, p, i64, p, p, i64, p, p]
        # tw_rows: per row a token, a position, a cache, cross K/V, its length and mask.
        self._rows = lib.tw_rows
        self._rows.restype = None
        self._rows.argtypes = [ctypes.POINTER(_Model), p, i64, p, p, i64, p, p, p, p, i64, p, p]

    def bind(self, lean: t5.LeanT5) -> BoundStep:
        """Return the step function for `lean` (see `applicable` first)."""
        return BoundStep(self._fn, self._chain, lean, self._rows)


class BoundStep:
    """A `Fns.step` for one LeanT5: (m, token, pos, self_kv, cross_kv, mask_bias, dec_bias,
    steps) -> the `steps` greedy tokens, as engine.t5.decode_steps returns them; `verify`
    is its `Fns.verify` (engine.t5.decode_greedy); `rows` is a batched step over several
    requests (engine.t5.decode_rows). A row verified or batched gets bitwise the logits of
    the same row decoded alone, so speculation and batching stay exact."""

    def __init__(self, fn: Any, chain: Any, lean: t5.LeanT5, rows: Any = None) -> None:
        self._fn, self._chain, self._rows_fn = fn, chain, rows
        # The C side holds raw pointers into these weights: keep the model alive with them.
        self._lean = lean
        layers = list(lean.dec_layers)
        self._keep: list[Any] = []  # the pointer arrays must outlive the struct

        def ptr(t: torch.Tensor) -> Any:
            if not t.is_contiguous() or t.dtype != torch.float32:
                raise ValueError("native step: weights must be contiguous float32")
            return ctypes.cast(t.data_ptr(), _F)

        def per_layer(name: str) -> Any:
            arr = (_F * len(layers))(*[ptr(getattr(layer, name)) for layer in layers])
            self._keep.append(arr)
            return ctypes.cast(arr, _FF)

        d_ff = layers[0].wo.shape[1]
        self._model = _Model(
            layers=len(layers), d_model=lean.d_model, heads=lean.n_heads, d_kv=lean.d_kv,
            inner=lean.inner, d_ff=d_ff, vocab=lean.lm_head.shape[0], gated=int(lean.gated),
            act=_ACTS[lean.act_name], eps=lean.eps, out_scale=lean.output_scale,
            embed=ptr(lean.embed), lm_head=ptr(lean.lm_head), final_ln=ptr(lean.dec_final),
            **{name: per_layer(name) for name in _LAYER_WEIGHTS})
        self._ref = ctypes.byref(self._model)
        # Scratch floats per decoded row (engine/native_step.c: x, h, qkv, att, u, logits).
        self._per_row = 2 * lean.d_model + 4 * lean.inner + (2 if lean.gated else 1) * d_ff \
            + lean.lm_head.shape[0]
        self._local = threading.local()  # scratch per thread: concurrent requests

    def _scratch(self, floats: int) -> int:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < floats:
            buf = self._local.buf = torch.empty(max(floats, 4096), dtype=torch.float32)
        return buf.data_ptr()

    def __call__(self, m: Any, token: torch.Tensor, pos: torch.Tensor, self_kv: torch.Tensor,
                 cross_kv: torch.Tensor, mask_bias: torch.Tensor, dec_bias: torch.Tensor,
                 steps: int) -> torch.Tensor:
        out = torch.empty(steps, dtype=torch.long)
        tail, _keep = self._tail(1, self_kv, cross_kv, mask_bias, dec_bias, out)
        # Every step in one C call: a draft proposes a whole round without a call per token.
        self._chain(self._ref, int(token), steps, int(pos), *tail)
        return out

    def verify(self, m: Any, tokens: torch.Tensor, positions: torch.Tensor,
               self_kv: torch.Tensor, cross_kv: torch.Tensor, mask_bias: torch.Tensor,
               dec_bias: torch.Tensor) -> torch.Tensor:
        """Return the greedy token after each of tokens [1, q] at consecutive positions."""
        q = tokens.shape[-1]
        first = int(positions[0])
        if int(positions[-1]) - first != q - 1:
            raise ValueError("native verify: positions must be consecutive")
        out = torch.empty(q, dtype=torch.long)
        flat = tokens.reshape(q).to(torch.long).contiguous()
        tail, _keep = self._tail(q, self_kv, cross_kv, mask_bias, dec_bias, out)
        self._fn(self._ref, flat.data_ptr(), q, first, *tail)
        return out

    def rows(self, m: Any, tokens: torch.Tensor, positions: torch.Tensor,
             caches: list[torch.Tensor], crosses: list[torch.Tensor],
             masks: list[torch.Tensor], dec_bias: torch.Tensor) -> torch.Tensor:
        """Return the greedy token after each row's token, all rows in one call.

        tokens [B] and positions [B] (int64); per row its self-attention cache, its cross
        K/V [L, 2, H, length, d_kv] and mask bias [1, 1, 1, length] (lengths may differ);
        dec_bias: the full causal table [H, slots, slots] (engine.runner.ModelRunner.dec_bias).
        """
        b = int(tokens.shape[0])
        toks = tokens.reshape(b).to(torch.long).contiguous()
        pos = positions.reshape(b).to(torch.long).contiguous()
        crosses = [c.contiguous() for c in crosses]
        lens = torch.tensor([c.shape[-2] for c in crosses], dtype=torch.long)
        ptrs = ctypes.c_void_p * b
        kv = ptrs(*[c.data_ptr() for c in caches])
        ckv = ptrs(*[c.data_ptr() for c in crosses])
        cb = ptrs(*[mk.data_ptr() for mk in masks])
        span = dec_bias.shape[-1]
        out = torch.empty(b, dtype=torch.long)
        scratch = self._scratch(b * self._per_row + max(span, int(lens.max())))
        self._rows_fn(self._ref, toks.data_ptr(), b, pos.data_ptr(), kv, caches[0].shape[-2],
                      ckv, lens.data_ptr(), cb, dec_bias.data_ptr(), span, scratch,
                      out.data_ptr())
        return out

    def _tail(self, rows: int, self_kv: torch.Tensor, cross_kv: torch.Tensor,
              mask_bias: torch.Tensor, dec_bias: torch.Tensor, out: torch.Tensor
              ) -> tuple[tuple[Any, ...], torch.Tensor]:
        """Return the arguments both C entry points end with (caches, biases, scratch for
        `rows` rows, out) and the cross K/V they point into (keep it alive for the call)."""
        cross_kv = cross_kv.contiguous()
        span, cross = dec_bias.shape[-1], cross_kv.shape[-2]
        scratch = self._scratch(rows * self._per_row + max(span, cross))
        return ((self_kv.data_ptr(), self_kv.shape[-2], cross_kv.data_ptr(), cross,
                 mask_bias.data_ptr(), dec_bias.data_ptr(), span, scratch, out.data_ptr()),
                cross_kv)

_lock = threading.Lock()
_loaded: dict[str, NativeStep | None] = {}


def load(cache_dir: str | Path) -> NativeStep | None:
    """Return the C step built under `cache_dir` (built now if missing), None if it cannot."""
    key = str(cache_dir)
    with _lock:
        if key not in _loaded:
            try:
                path = build(cache_dir)
                _loaded[key] = NativeStep(path) if path is not None else None
            except Exception as e:  # noqa: BLE001 - any failure here: the compiled step serves
                log.warning("native step: %s: %s; the compiled step serves instead",
                            type(e).__name__, e)
                _loaded[key] = None
        return _loaded[key]
