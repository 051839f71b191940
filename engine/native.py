"""The CPU decode step in C (engine/native_step.c), built with the system compiler.

On the CPU a direct decode step is a few dozen one-row products whose weights stream
from cache each token, so the step is bound by reading weights. Inductor's generated loop
keeps one accumulator per output row; the C step keeps four rows and their accumulators
in flight, closer to the cache's bandwidth, all of the step in one call
(docs/engine.md#the-c-decode-step; figures in docs/benchmarks.md). It computes what
`engine.t5.decode_steps` and `decode_greedy` compute, on the same cache, cross K/V and
bias tensors, so they are interchangeable per call; greedy tokens are tested equal to
Hugging Face. A model whose decoder step weights are engine.quantize.Int8Weight (int8 rows,
one scale per output row) is served too: C reads the int8 rows as they are and multiplies
them by activations quantized per row (docs/engine.md#int8-weights).

    lib = native.load(cache_dir)           # None: no compiler, or the build failed
    if native.applicable(lean) is None:    # else a reason: CUDA, bf16, mixed weights, ...
        fn = lib.bind(lean)                # Fns.step; fn.verify is Fns.verify
        tokens = fn(m, token, pos, self_kv, cross_kv, mask_bias, dec_bias, steps)

Built once per source, compiler (its path and what `--version` prints), flags and CPU into
<cache_dir>/native/ (-O3 -march=native; seconds). The folder is created 0700; a library
there that is not owned by this process's user, is writable by group or others, or is a link
is rebuilt, never loaded, and a folder owned by another user is not used at all. A build
failure is logged once and the compiled graph serves instead. Every tensor handed to C is
checked first (engine.native_checks): the weights once, when bound.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from engine import aot, quantize, t5
from engine.errors import BoundaryError, EngineError
from engine.native_checks import (
    INTEGER,
    Boundary,
    Dims,
    check_tokens,
    check_weights,
    expect,
    raise_for,
    raise_for_row,
)
from engine.quantize import is_int8

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "native_step.c"
_ACTS = {"relu": 0, "gelu_new": 1, "gelu_pytorch_tanh": 1, "gelu": 2, "silu": 3}
_F = ctypes.POINTER(ctypes.c_float)
_FF = ctypes.POINTER(_F)
_Q = ctypes.POINTER(ctypes.c_int8)
_QQ = ctypes.POINTER(_Q)
_C = ctypes.POINTER(ctypes.c_int32)
_CC = ctypes.POINTER(_C)


_LAYER_WEIGHTS = ("ln_att", "qkv", "o", "ln_cross", "cq", "co", "ln_ff", "wi", "wo")
_LINEAR = ("qkv", "o", "cq", "co", "wi", "wo")  # the decoder step's linear weights
_W_FLOAT, _W_INT8 = 0, 1  # engine/native_step.c's W_* (how the linear weights are held)
_FIELDS: list[tuple[str, Any]] = [
    *((name, ctypes.c_int64) for name in (
        "layers", "d_model", "heads", "d_kv", "inner", "d_ff", "vocab", "gated", "act")),
    ("eps", ctypes.c_float), ("out_scale", ctypes.c_float),
    ("embed", _F), ("lm_head", _F), ("final_ln", _F),
    *((name, _FF) for name in _LAYER_WEIGHTS),
    ("wmode", ctypes.c_int64), ("lm_head_q", _Q), ("lm_head_s", _F), ("lm_head_c", _C),
    *((f"{name}_q", _QQ) for name in _LINEAR),
    *((f"{name}_s", _FF) for name in _LINEAR),
    *((f"{name}_c", _CC) for name in _LINEAR),
    ("lm_head_p", _C), *((f"{name}_p", _CC) for name in _LINEAR)]


class _Model(ctypes.Structure):
    """engine/native_step.c's Model, field for field."""

    _fields_ = _FIELDS


# Every flag the library is built with (each is part of the cache key: another flag, another
# library).
FLAGS: tuple[str, ...] = ("-O3", "-march=native", "-shared", "-fPIC")
LIBS: tuple[str, ...] = ("-lm",)


class BuildError(Exception):
    """The C step cannot be built or loaded here; the compiled step serves."""


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def compiler_version(cc: str) -> str:
    """Return what `cc --version` prints (an upgraded compiler builds a new library)."""
    try:
        done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"{cc} --version: {exc}") from exc
    if done.returncode != 0:
        said = _last_line(done.stderr or done.stdout)
        raise BuildError(f"{cc} --version: {said or f'exit {done.returncode}'}")
    return done.stdout + done.stderr


def build_key(cc: str, version: str, flags: tuple[str, ...], source: Path = SOURCE) -> str:
    """Return the cache key of a library built from `source` with `cc` and `flags`."""
    h = hashlib.sha256()
    for part in (source.read_bytes(), cc.encode(), version.encode(),
                 "\0".join(flags).encode(), aot.cpu_tag().encode()):
        h.update(hashlib.sha256(part).digest())  # each part hashed alone: no ambiguous joins
    return h.hexdigest()[:16]


def _own_folder(folder: Path) -> None:
    """Create `folder` owner-only (0700), or check an existing one is this user's and make it
    owner-only; raise BuildError when it is not this user's (nothing there can be trusted)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise BuildError(f"{folder} is not a folder (a link?): not used")
    if st.st_uid != os.geteuid():
        raise BuildError(f"{folder} is owned by uid {st.st_uid}, not this service's uid "
                         f"{os.geteuid()}: not used")
    if st.st_mode & 0o077:
        log.info("native step: %s was mode %o; made owner-only (700)", folder,
                 stat.S_IMODE(st.st_mode))
        os.chmod(folder, 0o700)


def untrusted(st: os.stat_result) -> str | None:
    """Return why a library with this (l)stat must not be loaded (None: it may)."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not this service's uid {os.geteuid()}"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _open_trusted(path: Path) -> int | None:
    """Open the library at `path` (never through a link) if it may be loaded; return its file
    descriptor, or None when it is missing or refused (said in the log: it is rebuilt)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a link
        log.warning("native step: %s refused (%s); rebuilt", path,
                    "a symbolic link" if os.path.islink(path) else exc.strerror)
        return None
    why = untrusted(os.fstat(fd))
    if why is not None:
        os.close(fd)
        log.warning("native step: %s refused (%s); rebuilt", path, why)
        return None
    return fd


def _compile(cc: str, flags: tuple[str, ...], libs: tuple[str, ...], out: Path,
             source: Path) -> None:
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name
        cmd = [cc, *flags, str(source), "-o", str(part), *libs]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as exc:
            raise BuildError(f"build failed ({exc})") from exc
        if done.returncode != 0:
            said = _last_line(done.stderr or done.stdout)
            raise BuildError(f"build failed ({said or f'exit {done.returncode}'})")
        os.chmod(part, 0o755)  # whatever the umask: never group/world-writable
        os.replace(part, out)  # atomic: a concurrent build never sees half a file


def build(cache_dir: str | Path) -> Path | None:
    """Return the shared library of the C step, building it when missing or refused (None: no
    compiler); raise BuildError when it cannot be built or the folder is not this user's."""
    path, fd = _build(cache_dir)
    if fd is not None:
        os.close(fd)
    return path


def _build(cache_dir: str | Path, source: Path = SOURCE) -> tuple[Path | None, int | None]:
    """`build`, also returning an open descriptor of the checked library (the loader checks
    that the file it loaded is that one)."""
    cc = _compiler()
    if cc is None:
        return None, None
    flags, libs = FLAGS, LIBS
    key = build_key(cc, compiler_version(cc), flags + libs, source)
    folder = Path(cache_dir) / "native"
    _own_folder(folder)
    out = folder / f"step-{key}.so"
    fd = _open_trusted(out)
    if fd is None:
        _compile(cc, flags, libs, out, source)
        fd = _open_trusted(out)
        if fd is None:
            raise BuildError(f"{out}: refused right after its build")
    return out, fd


def applicable(lean: t5.LeanT5) -> str | None:
    """Return why the C step cannot serve `lean` (None: it can)."""
    if lean.device_.type != "cpu":
        return f"device {lean.device_.type}"
    if lean.dtype != torch.float32:
        return f"dtype {lean.dtype}"
    # Float weights, or int8 ones (engine.quantize.Int8Weight) throughout: one mode per model.
    kinds = {"int8" if is_int8(w) else "float" if isinstance(w, torch.Tensor) else "other"
             for w in [lean.lm_head, *(getattr(layer, name) for layer in lean.dec_layers
                                       for name in _LINEAR)]}
    if kinds not in ({"float"}, {"int8"}):
        return f"weights {'/'.join(sorted(kinds))}"
    act = getattr(lean, "act_name", None)
    if act not in _ACTS:
        return f"activation {act!r}"
    return None


def _rows_cols(w: Any) -> tuple[int, int]:
    """Return a linear weight's [out, in] (a float tensor or an int8 one)."""
    t = w.q if is_int8(w) else w
    return int(t.shape[0]), int(t.shape[1])


class NativeStep:
    """The loaded library; `bind` makes a step function for one model."""

    def __init__(self, path: Path, fd: int | None = None) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        if fd is not None:
            # The file loaded is the one whose owner and mode were checked (the folder is
            # owner-only, so only this user could have swapped it in between).
            checked, now = os.fstat(fd), os.stat(path)
            if (checked.st_dev, checked.st_ino) != (now.st_dev, now.st_ino):
                raise BuildError(f"{path} changed between its check and its load")
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        # tw_decode takes a pointer to q tokens; tw_chain one token and a step count. Both
        # return 0, or why they refused the call (engine.native_checks.raise_for).
        self._fn, self._chain = lib.tw_decode, lib.tw_chain
        for fn, first in ((self._fn, [p, i64]), (self._chain, [i64, i64])):
            fn.restype = i64
            fn.argtypes = [ctypes.POINTER(_Model), *first, i64, p, i64, p, i64, p, p, i64, p, p]
        # tw_rows: per row a token, a position, a cache, cross K/V, its length and mask.
        # Returns 0, or why it refused with the first refused row in out[0] (raise_for_row).
        self._rows = lib.tw_rows
        self._rows.restype = i64
        self._rows.argtypes = [ctypes.POINTER(_Model), p, i64, p, p, i64, p, p, p, p, i64, p, p,
                               p]
        # Rows of scores the scratch holds: the queries C attends at once (attend_rows); a
        # source from before it (bench.batch_step --baseline) attends one at a time.
        att_rows = getattr(lib, "tw_att_rows", None)
        if att_rows is not None:
            att_rows.restype = i64
        self.att_rows = int(att_rows()) if att_rows is not None else 1
        # Whether its int8 products read weights repacked at bind (VNNI builds); a source
        # from before it repacks its own.
        packed = getattr(lib, "tw_q8_packed", None)
        if packed is not None:
            packed.restype = i64
        self.q8_packed = bool(packed()) if packed is not None else False
        # The float products alone (bench.batch_step); absent from a source before it.
        self._gemm = getattr(lib, "tw_gemm", None)
        if self._gemm is not None:
            self._gemm.restype = None
            self._gemm.argtypes = [p, p, p, i64, i64, i64]

    def products(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Return x [q, n] times w [rows, n] transposed through the step's float products."""
        if self._gemm is None:
            raise EngineError(f"native step: {self.path.name} has no tw_gemm (an older source)")
        q, n = expect("x", x, ("q", "n"))
        rows, _ = expect("w", w, ("rows", n))
        y = torch.empty(q, rows)
        self._gemm(w.data_ptr(), x.data_ptr(), y.data_ptr(), rows, n, q)
        return y

    def bind(self, lean: t5.LeanT5) -> BoundStep:
        """Return the step function for `lean` (see `applicable` first)."""
        return BoundStep(self._fn, self._chain, lean, self._rows, self.att_rows,
                         q8_packed=self.q8_packed)


def repack_int8(q: torch.Tensor) -> torch.Tensor:
    """Return int8 rows q [rows, n] in engine/native_step.c's repacked layout: blocks of
    sixteen rows, each [groups, 16] int32 holding four consecutive bytes of each row (rows
    past `rows` and bytes past n zero), groups padded to whole 64-byte chunks."""
    rows, n = q.shape
    r16, n64 = -(-rows // 16) * 16, -(-n // 64) * 64
    padded = torch.zeros(r16, n64, dtype=torch.int8)
    padded[:rows, :n] = q
    blocks = padded.view(r16 // 16, 16, n64 // 4, 4).permute(0, 2, 1, 3).contiguous()
    return blocks.view(torch.int32).view(r16 // 16, n64 // 4, 16)


class BoundStep:
    """A `Fns.step` for one LeanT5: (m, token, pos, self_kv, cross_kv, mask_bias, dec_bias,
    steps) -> the `steps` greedy tokens, as engine.t5.decode_steps returns them; `verify`
    is its `Fns.verify` (engine.t5.decode_greedy); `rows` is a batched step over several
    requests (engine.t5.decode_rows). A row verified or batched gets bitwise the logits of
    the same row decoded alone, so speculation and batching stay exact."""

    def __init__(self, fn: Any, chain: Any, lean: t5.LeanT5, rows: Any,
                 att_rows: int, *, q8_packed: bool = False) -> None:
        self._fn, self._chain, self._rows_fn = fn, chain, rows
        self._att_rows = att_rows
        self._q8_packed = q8_packed
        # The C side holds raw pointers into these weights: keep the model alive with them.
        self._lean = lean
        self._ref: Any = None
        self.rebind()
        self._local = threading.local()  # scratch per thread: concurrent requests
        self.boundary = Boundary(Dims.of(lean))

    def rebind(self) -> None:
        """Point C at the model's weights as they are now (checked again): after they were
        released and loaded anew (engine.float_weights), their addresses have changed."""
        lean = self._lean
        layers = list(lean.dec_layers)
        # Every weight C reads, checked once here (dtype, shape, layout): BoundaryError names it.
        check_weights(lean)
        self._keep: list[Any] = []  # the pointer arrays (and row sums) must outlive the struct

        def ptr(t: torch.Tensor, kind: Any = _F) -> Any:
            return ctypes.cast(t.data_ptr(), kind)

        def per_layer(get: Any, kind: Any, kinds: Any) -> Any:
            arr = (kind * len(layers))(*[ptr(get(layer), kind) for layer in layers])
            self._keep.append(arr)
            return ctypes.cast(arr, kinds)

        def row_sums(w: quantize.Int8Weight) -> torch.Tensor:
            # The int8 products' correction for their unsigned activations (engine/native_step.c).
            c = w.q.sum(1, dtype=torch.int32).contiguous()
            self._keep.append(c)
            return c

        def repacked(w: quantize.Int8Weight) -> torch.Tensor:
            # Made once here, so a product of a few inputs need not repack per call.
            p = repack_int8(w.q)
            self._keep.append(p)
            return p

        d_ff = _rows_cols(layers[0].wo)[1]
        vocab = _rows_cols(lean.lm_head)[0]
        fields: dict[str, Any] = {}
        head: Any = lean.lm_head  # a Parameter, or the Int8Weight module in its place
        if is_int8(head):
            self.wmode = _W_INT8
            fields.update(lm_head_q=ptr(head.q, _Q), lm_head_s=ptr(head.scale),
                          lm_head_c=ptr(row_sums(head), _C))
            for name in _LINEAR:
                fields[f"{name}_q"] = per_layer(lambda layer, n=name: getattr(layer, n).q, _Q, _QQ)
                fields[f"{name}_s"] = per_layer(lambda layer, n=name: getattr(layer, n).scale,
                                                _F, _FF)
                fields[f"{name}_c"] = per_layer(
                    lambda layer, n=name: row_sums(getattr(layer, n)), _C, _CC)
            if self._q8_packed:
                fields["lm_head_p"] = ptr(repacked(head), _C)
                for name in _LINEAR:
                    fields[f"{name}_p"] = per_layer(
                        lambda layer, n=name: repacked(getattr(layer, n)), _C, _CC)
        else:
            self.wmode = _W_FLOAT
            fields["lm_head"] = ptr(lean.lm_head)
            fields.update({name: per_layer(lambda layer, n=name: getattr(layer, n), _F, _FF)
                           for name in _LINEAR})
        self._model = _Model(
            layers=len(layers), d_model=lean.d_model, heads=lean.n_heads, d_kv=lean.d_kv,
            inner=lean.inner, d_ff=d_ff, vocab=vocab, gated=int(lean.gated),
            act=_ACTS[lean.act_name], eps=lean.eps, out_scale=lean.output_scale,
            embed=ptr(lean.embed), final_ln=ptr(lean.dec_final), wmode=self.wmode,
            **{name: per_layer(lambda layer, n=name: getattr(layer, n), _F, _FF)
               for name in ("ln_att", "ln_cross", "ln_ff")},
            **fields)
        self.vocab = vocab
        # Scratch floats per decoded row (engine/native_step.c: x, h, qkv, att, u, logits;
        # then the int8 activations, one row of qstride bytes, and their scale).
        widest = max(lean.d_model, lean.inner, d_ff)
        self._per_row = 2 * lean.d_model + 4 * lean.inner + (2 if lean.gated else 1) * d_ff \
            + vocab + (widest + 63) // 64 * 16 + 1
        self._ref = ctypes.byref(self._model)

    def unbind(self) -> None:
        """Forget the weights' addresses before they are released: a call then raises
        EngineError instead of reading freed memory."""
        self._ref = None
        self._keep = []

    def _bound(self) -> Any:
        ref = self._ref
        if ref is None:
            raise EngineError("native step: called while its model's weights are released")
        return ref

    def scratch_floats(self, rows: int, widest: int) -> int:
        """Return the scratch floats C uses for `rows` rows attending at most `widest` keys."""
        return rows * self._per_row + self._att_rows * widest

    def _scratch(self, floats: int) -> int:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < floats:
            buf = self._local.buf = torch.empty(max(floats, 4096), dtype=torch.float32)
        return buf.data_ptr()

    def __call__(self, m: Any, token: torch.Tensor, pos: torch.Tensor, self_kv: torch.Tensor,
                 cross_kv: torch.Tensor, mask_bias: torch.Tensor, dec_bias: torch.Tensor,
                 steps: int) -> torch.Tensor:
        self.boundary.tensors(self_kv, cross_kv, mask_bias, dec_bias)
        if getattr(token, "dtype", None) not in INTEGER:  # its value: checked by C
            check_tokens("token", token, 1)
        try:
            first, at = int(token), int(pos)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise BoundaryError("token" if getattr(token, "numel", int)() != 1 else "pos",
                                f"expected one value: {exc}") from exc
        out = torch.empty(max(steps, 0), dtype=torch.long)
        tail, _keep = self._tail(1, self_kv, cross_kv, mask_bias, dec_bias, out)
        # Every step in one C call: a draft proposes a whole round without a call per token.
        code = self._chain(self._bound(), first, steps, at, *tail)
        if code:
            self._refused(code, [first], "token", at, steps, self_kv, cross_kv, dec_bias)
        return out

    def verify(self, m: Any, tokens: torch.Tensor, positions: torch.Tensor,
               self_kv: torch.Tensor, cross_kv: torch.Tensor, mask_bias: torch.Tensor,
               dec_bias: torch.Tensor) -> torch.Tensor:
        """Return the greedy token after each of tokens [1, q] at consecutive positions."""
        self.boundary.tensors(self_kv, cross_kv, mask_bias, dec_bias)
        q = tokens.shape[-1]
        check_tokens("tokens", tokens, q)
        check_tokens("positions", positions, q)
        first = int(positions[0])
        if int(positions[-1]) - first != q - 1:
            raise BoundaryError("positions", f"expected {q} consecutive positions, got "
                                             f"{positions.tolist()}")
        out = torch.empty(q, dtype=torch.long)
        flat = tokens.reshape(q).to(torch.long).contiguous()
        tail, _keep = self._tail(q, self_kv, cross_kv, mask_bias, dec_bias, out)
        code = self._fn(self._bound(), flat.data_ptr(), q, first, *tail)
        if code:
            self._refused(code, flat.tolist(), "tokens", first, q, self_kv, cross_kv, dec_bias)
        return out

    def rows(self, m: Any, tokens: torch.Tensor, positions: torch.Tensor,
             caches: list[torch.Tensor], crosses: list[torch.Tensor],
             masks: list[torch.Tensor], dec_bias: torch.Tensor,
             logits: torch.Tensor | None = None) -> torch.Tensor:
        """Return the greedy token after each row's token, all rows in one call.

        tokens [B] and positions [B] (int64); per row its self-attention cache, its cross
        K/V [L, 2, H, length, d_kv] and mask bias [1, 1, 1, length] (lengths may differ);
        dec_bias: the full causal table [H, slots, slots] (engine.runner.ModelRunner.dec_bias).
        A refused call (a bad tensor, token id or position) raises BoundaryError naming the
        argument and the row, and writes no row's cache. `logits` (tests): a float32
        [B, vocab] tensor that receives the rows' logits.
        """
        slots = self.boundary.rows(tokens, positions, caches, crosses, masks, dec_bias)
        b = int(tokens.shape[0])
        if logits is not None:
            expect("logits", logits, (b, self.vocab))
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
        scratch = self._scratch(self.scratch_floats(b, max(span, int(lens.max()))))
        code = self._rows_fn(self._bound(), toks.data_ptr(), b, pos.data_ptr(), kv, slots, ckv,
                             lens.data_ptr(), cb, dec_bias.data_ptr(), span, scratch,
                             out.data_ptr(), None if logits is None else logits.data_ptr())
        if code:
            raise_for_row(code, int(out[0]), dims=self.boundary.dims, tokens=toks.tolist(),
                          positions=pos.tolist(), slots=slots, span=span)
        return out

    def _refused(self, code: int, tokens: list[int], name: str, pos0: int, rows: int,
                 self_kv: torch.Tensor, cross_kv: torch.Tensor, dec_bias: torch.Tensor) -> None:
        raise_for(code, dims=self.boundary.dims, tokens=tokens, tokens_name=name, pos0=pos0,
                  rows=rows, slots=self_kv.shape[-2], span=dec_bias.shape[-1],
                  cross=cross_kv.shape[-2])

    def _tail(self, rows: int, self_kv: torch.Tensor, cross_kv: torch.Tensor,
              mask_bias: torch.Tensor, dec_bias: torch.Tensor, out: torch.Tensor
              ) -> tuple[tuple[Any, ...], torch.Tensor]:
        """Return the arguments both C entry points end with (caches, biases, scratch for
        `rows` rows, out) and the cross K/V they point into (keep it alive for the call)."""
        cross_kv = cross_kv.contiguous()
        span, cross = dec_bias.shape[-1], cross_kv.shape[-2]
        scratch = self._scratch(self.scratch_floats(rows, max(span, cross)))
        return ((self_kv.data_ptr(), self_kv.shape[-2], cross_kv.data_ptr(), cross,
                 mask_bias.data_ptr(), dec_bias.data_ptr(), span, scratch, out.data_ptr()),
                cross_kv)

_lock = threading.Lock()
_loaded: dict[tuple[str, str | None, tuple[str, ...], str], NativeStep | None] = {}


def load(cache_dir: str | Path, source: Path = SOURCE) -> NativeStep | None:
    """Return the C step built from `source` under `cache_dir` (built now if missing), None if
    it cannot (said once in the log per cache folder, compiler, flags and source; another
    source: bench.batch_step's --baseline)."""
    key = (str(cache_dir), _compiler(), FLAGS, str(source))
    with _lock:
        if key not in _loaded:
            fd = None
            try:
                path, fd = _build(cache_dir, source)
                _loaded[key] = NativeStep(path, fd) if path is not None else None
            except Exception as e:  # noqa: BLE001 - any failure here: the compiled step serves
                said = str(e) if isinstance(e, BuildError) else f"{type(e).__name__}: {e}"
                log.warning("native step: %s; the compiled step serves instead", said)
                _loaded[key] = None
            finally:
                if fd is not None:
                    os.close(fd)
        return _loaded[key]
