"""One model's lean forward, its precomputed tables and its per-bucket compiled functions."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine import aot, compat, t5
from engine.compile_watch import shared_watch, specialize
from engine.float_weights import OnDemandWeights
from engine.graphs import GraphLedger

KIND_ENCODE = "encode"
KIND_STEP = "step"
KIND_VERIFY = "verify"
# Suffixes of the compiled functions' tags (and of their saved files).
ENC, STEP, VERIFY, ROWS = "enc", "step", "verify", "rows"
ENC_ROWS = "enc_rows"  # the encoder of several inputs at once (engine.group_encode)
COMPILED_STEP = "compiled_step"  # the compiled step beside a bound C step (native_step off)
# Key of the compiled functions every bucket edge shares: the input length (encoder) and
# the cross-attention length (decoder) are dynamic dimensions, so one graph per function
# serves every bucket. Per-bucket graphs are no faster per call and cost one compile per
# bucket and function, so warm-up would grow with the bucket count.
SHARED = "buckets"
_prepare_lock = threading.Lock()
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
    # step takes any `steps` (eager, the C step): a draft proposes a round in one call. A
    # compiled step is specialized to its `steps`.
    chain: bool = False
    # The fixed-row compiled step (t5.decode_fixed on engine.row_buffers' tensors): several
    # rows batched on a compiled step. None: batched rows use the C step's or eager `rows`,
    # or (the exact-shape path) one compiled step call per row.
    rows: Callable | None = None


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
    # on its weight tensors and attributes can never fail; they are per-call overhead
    # (docs/engine.md#torchcompile).
    # Guard names are source expressions: "m", "m.eps", "m._parameters['qkv']", ...
    return [not (entry.name == "m" or entry.name.startswith(("m.", "m[")))
            for entry in entries]


class ModelRunner:
    """Hold a LeanT5 with its bias tables and the compiled functions its buckets share."""

    def __init__(self, lean: t5.LeanT5, *, edges: Sequence[int], slots: int, verify_q: int,
                 options: CompileOptions | None, name: str, steps: int = 1,
                 compile_encoder: bool = True, ledger: GraphLedger | None = None,
                 tables_of: ModelRunner | None = None,
                 encoder_of: ModelRunner | None = None) -> None:
        """`tables_of`: a runner whose bias and position tables this one can share (same
        position-bias tensors, slots, verification width and edges), else built anew.
        `encoder_of`: a runner whose encoder reads the very tensors this one's would (the
        int8 target beside the float one): its encoder function serves this runner too,
        called with its own model, so it is compiled, saved and held once."""
        self.encoder_of = encoder_of
        self.m = lean
        self.name = name
        self.slots = slots
        self.verify_q = verify_q
        self.steps = steps  # greedy tokens per direct step call
        # The encoder runs once per request: for a small draft it is not worth a graph per
        # bucket (each costs tens of seconds of warm-up on a small CPU). Uncompiled, it runs
        # t5.encode_fused (its proposals only need to be close to the target's greedy ones).
        self.compile_encoder = compile_encoder
        self._options = options
        # Counts and checks every compiled call (engine.graphs); None: not counted.
        self.ledger = ledger
        self._lock = threading.Lock()
        self.edges = tuple(edges)
        # The float weights int8 serving reloads on demand (engine.float_weights); None:
        # every weight stays resident.
        self.weights: OnDemandWeights | None = None
        self.eager = Fns(t5.encode, t5.decode_steps, t5.decode_greedy, chain=True)
        self._compiled: dict[object, Fns] = {}
        self._enc_rows: Callable | None = None  # see encoder_rows
        # The bucket edges whose arrivals are encoded together, each checked at warm-up,
        # and why none are (engine.group_encode); empty: every input encodes alone.
        self.group_edges: set[int] = set()
        self.group_off: str | None = None
        self._loaded: dict[str, Callable] = {}  # saved functions read from disk, by kind
        # The C decode step (engine.native.BoundStep) when it serves this model: then no
        # step or verify graph is compiled or saved; every bucket calls it instead.
        self.native: Any = None
        self._prepared = False
        self.dec_bias: torch.Tensor
        self._enc_bias: dict[int, torch.Tensor]
        self.positions: list[torch.Tensor]
        self.windows: list[torch.Tensor]
        self.start: torch.Tensor
        self._bias_for: list[torch.Tensor] = []
        self._corners: list[torch.Tensor]
        if tables_of is not None and tables_of.can_share_tables(self):
            t = tables_of  # the int8 target beside the float one: the same tables, held once
            self.dec_bias, self._enc_bias, self.positions, self.windows, self.start = (
                t.dec_bias, t._enc_bias, t.positions, t.windows, t.start)
            self._bias_for, self._corners = t._bias_for, t._corners
            return
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
        # (Marked when something is first compiled: see _prepare_compile.)
        spans: dict[int, torch.Tensor] = {}
        for end in range(1, slots + 1):
            span = min(slots, -(-end // SPAN_STEP) * SPAN_STEP)
            if span not in spans:
                spans[span] = self.dec_bias[:, :span, :span].contiguous()
            self._bias_for.append(spans[span])
        self._corners = list(spans.values())

    def can_share_tables(self, other: ModelRunner) -> bool:
        """Return whether `other` may use this runner's tables: built from the same
        position-bias tensors for the same slots, verification width and edges."""
        a, b = self.m, other.m
        return (a.enc_rel.data_ptr() == b.enc_rel.data_ptr()
                and a.dec_rel.data_ptr() == b.dec_rel.data_ptr()
                and a.dtype == b.dtype and a.device_ == b.device_
                and (self.slots, self.verify_q, self.edges)
                == (other.slots, other.verify_q, other.edges))

    @contextmanager
    def held(self) -> Iterator[float]:
        """Keep every weight resident while the block runs (reloading released ones);
        yield the seconds a reload took (0.0: nothing to reload)."""
        if self.weights is None:
            yield 0.0
            return
        with self.weights.held() as seconds:
            yield seconds

    def tables(self) -> list[torch.Tensor]:
        """Return the precomputed bias tables (encoder bias per edge, self-attention corners)."""
        return [*self._enc_bias.values(), *self._corners]

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
        if isinstance(key, int):
            key = SHARED  # every bucket edge runs the same (length-dynamic) graphs
        with self._lock:
            fns = self._compiled.get(key)
            if fns is None:
                if self.encoder_of is not None:
                    encode = self._borrowed(self.encoder_of.compiled(key).encode)
                else:
                    encode = (self._compile(t5.encode, self._tag(key, ENC))
                              if self.compile_encoder else t5.encode_fused)
                if self.native is not None:
                    fns = Fns(encode, self.native, self.native.verify, chain=True)
                else:
                    fns = Fns(encode, self._compile(t5.decode_steps, self._tag(key, STEP)),
                              self._compile(t5.decode_greedy, self._tag(key, VERIFY)),
                              rows=self._fixed_rows(key))
                self._compiled[key] = fns
            return fns

    def encoder_rows(self) -> Callable:
        """Return the encoder of several inputs of one length (t5.encode_batch, compiled
        with the batch and the length dynamic: every bucket edge shares it), creating it."""
        if self.encoder_of is not None:
            return self._borrowed(self.encoder_of.encoder_rows())
        with self._lock:
            if self._enc_rows is None:
                self._enc_rows = self._compile(t5.encode_batch, self._tag(SHARED, ENC_ROWS))
            return self._enc_rows

    def _fixed_rows(self, key: int | str) -> Callable | None:
        """Return the fixed-row step of the bucket edges' shared functions (None for the
        exact-shape path: its cross-attention lengths are not the bucket edges')."""
        if key != SHARED:
            return None
        fn = self._compile(t5.decode_fixed, self._tag(key, ROWS))
        # It reads the whole causal table every call: at a fixed address, CUDA graphs read
        # it in place instead of copying it into the graph's inputs per replay.
        torch._dynamo.mark_static_address(self.dec_bias, guard=False)
        return fn

    def compiled_keys(self) -> list[object]:
        """Return the keys of the compiled (or loaded) functions this runner holds now."""
        with self._lock:
            return list(self._compiled)

    def compiled_step(self, key: int | str) -> Fns:
        """Return bucket `key`'s functions with the compiled step even where the C step is
        bound (the native_step flag off), compiling it on first use."""
        if self.native is None:
            return self.compiled(key)
        fns = self.compiled(key)
        shared = SHARED if isinstance(key, int) else key
        with self._lock:
            stepped = self._compiled.get((COMPILED_STEP, shared))
            if stepped is None:
                stepped = Fns(fns.encode,
                              self._compile(t5.decode_steps, self._tag(shared, COMPILED_STEP)),
                              self._compile(t5.decode_greedy, self._tag(shared, VERIFY)),
                              rows=self._fixed_rows(shared))
                self._compiled[(COMPILED_STEP, shared)] = stepped
            return stepped

    def _tag(self, key: int | str, kind: str) -> str:
        return f"{self.name}_{key}_{kind}"

    def _compile_kwargs(self, *, saved: bool) -> dict[str, Any]:
        assert self._options is not None
        kwargs: dict[str, Any] = {"dynamic": False, "backend": self._options.backend}
        if compat.has("compile_recompile_limit"):  # else set process-wide: _prepare_compile
            kwargs["recompile_limit"] = self._options.recompile_limit
        guards = aot.guard_filter(_unguarded_weights) if saved else _unguarded_weights
        if self._options.backend == "inductor" and self._options.mode != "default":
            if not saved:
                kwargs["mode"] = self._options.mode  # torch.compile takes mode or options
                return kwargs
            # A saved function needs the guard filter: the mode's own options carry it.
            from torch._inductor import list_mode_options

            kwargs["options"] = {**list_mode_options(self._options.mode),
                                 "guard_filter_fn": guards}
            return kwargs
        options: dict[str, Any] = {"guard_filter_fn": guards}
        if self._options.backend == "inductor":
            options.update(compat.inductor_options(dict(self._options.inductor)))
        kwargs["options"] = options
        return kwargs

    def _prepare_compile(self) -> None:
        """Set up what dynamo needs, once, before this runner first compiles anything.

        Not at construction: importing torch._dynamo is a noticeable part of a start, and
        a warm CPU start (saved encoder package, C step) never compiles.
        """
        with _prepare_lock:  # not self._lock: compiled() holds it while compiling
            if self._prepared:
                return
            self._prepared = True
        import torch._dynamo as dynamo

        shared_watch().attach()
        # Static shapes cost one cache entry per shape; the default limit (8) would
        # silently turn the exact-shape path eager after 8 lengths. The per-function limit
        # goes to torch.compile (CompileOptions); this one is thread-local and covers the
        # compiling thread.
        limit = self._options.recompile_limit if self._options is not None else 8
        dynamo.config.accumulated_recompile_limit = max(
            dynamo.config.accumulated_recompile_limit, 4 * limit)
        if not compat.has("compile_recompile_limit"):
            compat.raise_recompile_limit(limit)  # an older torch: no per-function limit
        for corner in self._corners:
            if corner.shape[-1] > 1:  # a size-1 dimension cannot be dynamic (specialized)
                dynamo.mark_dynamic(corner, 1)
                dynamo.mark_dynamic(corner, 2)

    def _compile(self, fn: Callable, tag: str) -> Callable:
        self._prepare_compile()
        return self._counted(torch.compile(specialize(fn, tag),
                                           **self._compile_kwargs(saved=False)), tag)

    def _counted(self, fn: Callable, tag: str) -> Callable:
        return fn if self.ledger is None else self.ledger.wrap(fn, tag)

    def _encode_example(self, edge: int, *, mark: bool = True) -> tuple[Any, ...]:
        """Return dummy encoder inputs of bucket `edge`, the input length marked dynamic
        (`mark`: for torch.compile; a saved function's inputs need no marks)."""
        m = self.m
        ids = torch.full((1, edge), m.eos_id, dtype=torch.long, device=m.device_)
        mask = m.mask_bias(torch.ones((1, edge), dtype=torch.long, device=m.device_))
        # Marked on fresh tensors and a view (markings live on the Python object): the
        # cached bias table itself stays unmarked for the exact-shape path's static graphs.
        bias = self.encoder_bias(edge)
        enc_bias = bias.view(bias.shape)  # [.., length, length]
        if mark:
            for tensor, dims in ((ids, (1,)), (mask, (3,)),
                                 (enc_bias, (bias.dim() - 2, bias.dim() - 1))):
                for dim in dims:
                    torch._dynamo.mark_dynamic(tensor, dim)
        return (m, ids, mask, enc_bias)

    def _examples(self, edge: int, encode: Callable, *, mark: bool = True
                  ) -> dict[str, tuple[Any, ...]]:
        """Return dummy inputs of bucket `edge` per function (runs `encode` for the rest)."""
        m = self.m
        enc = self._encode_example(edge, mark=mark)
        mask = enc[2]
        # A compiled call's output is copied before it feeds another compiled call: under
        # CUDA graphs the next replay overwrites it (the request path does the same).
        cross = encode(*enc).clone()
        if mark:
            torch._dynamo.mark_dynamic(cross, 3)  # [L, 2, H, length, d_kv]
        kv = m.new_self_cache(self.slots, static=self.native is None)
        toks = self.start.expand(1, self.verify_q).contiguous()
        return {ENC: enc,
                STEP: (m, self.start, self.positions[0], kv, cross, mask,
                       self.bias_for(self.steps), self.steps),
                VERIFY: (m, toks, self.windows[0], kv, cross, mask,
                         self.bias_for(self.verify_q))}

    def _borrowed(self, encode: Callable) -> Callable:
        """Return `encoder_of`'s `encode` called with its own model, whatever model it is
        given: it was traced and saved for that model (its guards on it are off)."""
        owner = self.encoder_of
        assert owner is not None

        def run(_m: Any, *tensors: Any) -> Any:
            return encode(owner.m, *tensors)

        return run

    def _shared_encode(self, loaded: dict[str, Callable]) -> Callable:
        """Return the encode function a runner serving saved functions uses."""
        if self.encoder_of is not None:
            # The owner loads first (Models.compiled_runners' order): its saved encoder.
            return self._borrowed(self.encoder_of.compiled(self.edges[0]).encode)
        return loaded.get(ENC, t5.encode if self.compile_encoder else t5.encode_fused)

    def _saved_kinds(self, verify: bool) -> dict[str, Callable]:
        kinds: dict[str, Callable] = ({ENC: t5.encode}
                                      if self.compile_encoder and self.encoder_of is None
                                      else {})
        if self.native is None:
            kinds[STEP] = t5.decode_steps
            if verify:
                kinds[VERIFY] = t5.decode_greedy
        return kinds

    def _packaged(self, kind: str) -> bool:
        """Return whether `kind` is saved as an AOTInductor package (the CPU encoder)."""
        o = self._options
        return (kind == ENC and self.m.device_.type == "cpu" and o is not None
                and o.backend == "inductor" and o.mode == "default")

    def saved_path(self, directory: Path, kind: str) -> Path:
        """Return where the saved `kind` function (shared by every bucket) lives."""
        # The shapes it was traced for are in the name: another cache size is another file.
        shape = f"s{self.slots}q{self.verify_q}n{self.steps}"
        if self._packaged(kind):
            # Machine code for this CPU's vector ISA: another CPU looks for its own file.
            return directory / f"{self._tag(SHARED, kind)}_{shape}_{aot.cpu_key()}" \
                               f"{aot.PACKAGE_SUFFIX}"
        return directory / f"{self._tag(SHARED, kind)}_{shape}{aot.SUFFIX}"

    def has_saved(self, directory: Path, *, verify: bool) -> bool:
        """Return whether every function the buckets need was saved under `directory`."""
        return all(self.saved_path(directory, kind).is_file()
                   for kind in self._saved_kinds(verify))

    def save(self, directory: Path, *, verify: bool) -> int:
        """AOT-compile the shared functions and save them; return how many."""
        self._prepare_compile()
        kinds = self._saved_kinds(verify)
        if not compat.has("aot_precompile") and not all(self._packaged(k) for k in kinds):
            raise aot.AOTLoadError(f"torch {torch.__version__} has no AOT precompile "
                                   "(torch.compile(...).aot_compile): nothing saved, a start "
                                   "compiles instead")
        with self.held():
            return self._save(directory, kinds)

    def _save(self, directory: Path, kinds: dict[str, Callable]) -> int:
        with torch.no_grad():
            examples = self._examples(self.edges[0], t5.encode)
        for kind, fn in kinds.items():
            path = self.saved_path(directory, kind)
            if self._packaged(kind):
                assert self._options is not None
                length = torch.export.Dim("length", min=2, max=max(max(self.edges), 2))
                # ids [1, B], mask bias [1, 1, 1, B], encoder bias [1, H, B, B]
                aot.save_package(fn, self._encode_example(self.edges[0], mark=False),
                                 ({1: length}, {3: length}, {2: length, 3: length}), path,
                                 dict(self._options.inductor))
                continue
            compiled = torch.compile(specialize(fn, self._tag(SHARED, kind)), fullgraph=True,
                                     **self._compile_kwargs(saved=True))
            aot.save(compiled, examples[kind], path)
        return len(kinds)

    def load_saved(self, edge: int, directory: Path, *, verify: bool) -> None:
        """Serve bucket `edge` from saved functions, without tracing; raise AOTLoadError.

        The files are read and their guards checked once (for the first bucket); each
        later bucket makes one call of each function on its own shapes.
        """
        kinds = self._saved_kinds(verify)
        with self._lock:
            loaded = dict(self._loaded)
        with torch.no_grad(), self.held():
            if ENC in kinds and ENC not in loaded:
                # The encoder's output feeds the other examples: load and check it first.
                path = self.saved_path(directory, ENC)
                loaded[ENC] = (aot.load_package(path) if self._packaged(ENC)
                               else aot.load(path, self._encode_example(edge, mark=False)))
            # Saved functions are called with their guards off: no dynamo marks needed.
            examples = self._examples(edge, self._shared_encode(loaded), mark=False)
            for kind in kinds:
                if kind not in loaded:
                    loaded[kind] = aot.load(self.saved_path(directory, kind), examples[kind])
            loaded = {kind: (fn if kind in self._loaded else self._counted(
                fn, self._tag(SHARED, kind))) for kind, fn in loaded.items()}
            step = self.native or loaded[STEP]
            try:  # one call each, as a warm-up would: the first call may still load code
                step(*examples[STEP])
                if VERIFY in loaded:
                    loaded[VERIFY](*examples[VERIFY])
                elif verify and self.native is not None:
                    self.native.verify(*examples[VERIFY])
            except Exception as exc:  # noqa: BLE001 - the caller compiles instead
                raise aot.AOTLoadError(f"bucket {edge}: first call failed: "
                                       f"{type(exc).__name__}: {exc}"[:500]) from exc
        with self._lock:
            if not self._loaded:
                encode = self._shared_encode(loaded)
                # A function not saved (verify without a draft) compiles on first use.
                verify_fn = (self.native.verify if self.native is not None
                             else loaded.get(VERIFY)
                             or self._compile(t5.decode_greedy, self._tag(SHARED, VERIFY)))
                self._compiled[SHARED] = Fns(
                    encode, step, verify_fn, chain=self.native is not None,
                    rows=None if self.native is not None else self._fixed_rows(SHARED))
                self._loaded = loaded

    def forget(self) -> None:
        """Drop the shared functions (a failed load), so the next use compiles."""
        with self._lock:
            self._compiled.pop(SHARED, None)
            self._loaded = {}

    def warm(self, edge: int, *, verify: bool, caches: Sequence[torch.Tensor] = (),
             mark: bool = True) -> None:
        """Compile bucket `edge` by running each function on dummy inputs.

        `caches`: the rows' self-attention caches requests use: the step and verify then
        run on each of them at every span a request can use, so a CUDA graph is recorded
        for each (its static inputs' addresses are part of it) here, not on a request.
        Each cache is restored after, so a request decoding in it meanwhile is unharmed.
        `mark`: mark the dynamic dimensions (False for saved functions: they need none).
        """
        fns = self.compiled(edge)
        with torch.no_grad(), self.held():
            examples = self._examples(edge, fns.encode, mark=mark)
            if not caches or self.native is not None:
                fns.step(*examples[STEP])
                if verify:
                    fns.verify(*examples[VERIFY])
                return
            # The first cache twice where cudagraph trees run each function's first call
            # as their warm-up and record from the next (fns.encode ran once in _examples).
            first = caches[:1] if self._tree_warmup else []
            if first:
                fns.encode(*examples[ENC])
            for cache in (*first, *caches):
                kept = cache.clone()
                try:
                    self._warm_spans(fns, examples, cache, verify=verify)
                finally:
                    cache.copy_(kept)

    def warm_rows(self, fns: Fns, buffers: Any) -> int:
        """Compile and run `fns`' fixed-row step for every batch-size class of `buffers`
        (engine.row_buffers.RowBuffers) on its scratch row, so that no batched request
        compiles or records a graph; return the calls made (0: no fixed-row step here)."""
        if fns.rows is None or buffers is None or not buffers.fixed:
            return 0
        calls = 0
        with torch.no_grad(), self.held():
            for size in buffers.sizes:
                # Twice where cudagraph trees run a function's first call as their warm-up
                # and record it on the next one.
                for _ in range(2 if self._tree_warmup else 1):
                    buffers.warm(fns.rows, self.m, size, self.dec_bias)
                    calls += 1
        return calls

    @property
    def _tree_warmup(self) -> bool:
        # The ledger counts as cudagraph trees do exactly where they would run.
        return self.ledger is not None and self.ledger.tree_warmup

    def warm_compiled_step(self, edge: int, *, verify: bool) -> None:
        """Compile the compiled step beside a bound C step on bucket `edge`'s dummy inputs.

        Length-dynamic like the other graphs: compiled on a request's unmarked inputs it
        specialized to that length and recompiled for every other bucket.
        """
        if self.native is None:
            return  # the compiled step is what serves: warm() compiled it
        stepped = self.compiled_step(edge)
        with torch.no_grad():
            examples = self._examples(edge, stepped.encode, mark=True)
            stepped.step(*examples[STEP])
            if verify:
                stepped.verify(*examples[VERIFY])

    def _warm_spans(self, fns: Fns, examples: dict[str, tuple[Any, ...]],
                    cache: torch.Tensor, *, verify: bool) -> None:
        """Call the step (and verify) on `cache` once per span a request can attend."""
        m, _tok, _pos, _kv, cross, mask, _bias, steps = examples[STEP]
        toks = examples[VERIFY][1]
        last_end: dict[int, int] = {}  # span corner -> the largest end it serves
        for end in range(1, self.slots + 1):
            last_end[id(self._bias_for[end - 1])] = end
        for end in last_end.values():
            bias = self.bias_for(end)
            if end >= steps:
                fns.step(m, self.start, self.positions[end - steps], cache, cross, mask,
                         bias, steps)
            if verify and end >= self.verify_q:
                fns.verify(m, toks, self.windows[end - self.verify_q], cache, cross, mask,
                           bias)
