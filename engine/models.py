"""The models a runtime serves: loaded, made lean, compiled per bucket, bound to the C step.

`load_models` reads the target (and the draft it pairs with), builds a ModelRunner per
model (and the int8 target where configured), binds the C decode step where it applies
and releases the checkpoint's weights, so the lean copies are resident once.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from engine import aot, byte_tokens, encoder_int8, native, quantize, t5
from engine.config import BUILTIN_DIR, EngineConfig
from engine.errors import ModelLoadError
from engine.float_weights import OnDemandWeights, releasable
from engine.graphs import GraphLedger
from engine.loader import (
    LoadedModel,
    fingerprint,
    load_model,
    pair_draft,
    read_config,
    read_weights,
)
from engine.protocol import EngineInfo
from engine.runner import CompileOptions, ModelRunner

log = logging.getLogger(__name__)

K_MAX = 8  # the largest draft length the adaptive choice may pick
# Greedy tokens per direct step call. More per call saves per-token overhead but the steps
# are unrolled in the graph, so compiling takes that many times longer.
STEPS_PER_CALL = 1
# Inductor options for every compiled function. realize_acc_reads_threshold=1 stores the
# RMS-normed input of each one-row product once instead of recomputing it inside the
# product's loop for every output row (the tokens are identical).
INDUCTOR_OPTIONS: tuple[tuple[str, object], ...] = (("realize_acc_reads_threshold", 1),)
# Modes whose compiled functions run as CUDA graphs on CUDA (inductor's cudagraph trees).
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_of(name: str) -> torch.device:
    """Return the torch device `engine.device` names ("auto": CUDA when available)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def dtype_of(name: str, device: torch.device) -> torch.dtype:
    """Return the torch dtype `engine.dtype` names ("auto": bfloat16 on CUDA, else float32)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype: must be auto or one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def compile_options(config: EngineConfig) -> CompileOptions | None:
    """Return how every function is compiled (None: compile_mode off)."""
    if config.compile_mode == "off":
        return None
    return CompileOptions(config.compile_mode, config.compile_backend,
                          config.recompile_limit, INDUCTOR_OPTIONS)


def single_owner(config: EngineConfig) -> bool:
    """Return whether every compiled call must run on one thread: the CUDA-graph modes
    (cudagraph trees are per thread; on CPU the same rule holds, so tests see it)."""
    return config.compile_mode in CUDAGRAPH_MODES


def cudagraphs_off(config: EngineConfig, device: torch.device) -> str | None:
    """Return why the compiled functions run without CUDA graphs (None: they use them)."""
    if device.type != "cuda":
        return f"{device.type} device"
    if config.compile_mode not in CUDAGRAPH_MODES:
        return f"compile_mode {config.compile_mode}"
    if config.compile_backend != "inductor":
        return f"compile_backend {config.compile_backend}"
    return None


def package_only(config: EngineConfig, cache_root: Path) -> bool:
    """Return whether a start will likely load only the CPU encoder package and the C step,
    so inductor's ISA probe is not needed (a guess before the model is loaded: a wrong one
    costs only the probe's overlap, inductor then probes when it loads)."""
    # int8 weights too: their step runs in C beside the saved encoder packages.
    if not config.native_step or config.dtype not in ("float32", "auto"):
        return False
    root = cache_root / "precompiled"
    return any(root.glob(f"*/*_{aot.cpu_key()}{aot.PACKAGE_SUFFIX}"))


@dataclass
class Models:
    """The runners one runtime serves and what identifies them."""

    target: ModelRunner
    target_q: ModelRunner | None  # int8 weights (engine.quantization: int8)
    draft: ModelRunner | None
    tokenizer: object
    speculative_reason: str
    step_kind: str  # what serves the decode step, said once in the log
    info: EngineInfo
    slots: int  # decoder cache slots per row: max_new_tokens_cap + kv_headroom
    k_max: int  # the largest draft length; verification covers k_max + 1 positions
    target_loaded: LoadedModel  # its weights released: the tokenizer and the hash stay
    draft_loaded: LoadedModel | None
    # The float target beside the int8 one, warmed on its first float request instead of at
    # warm-up (None: every compiled runner warms at warm-up); see deferred_float.
    deferred: ModelRunner | None = None

    def runners(self) -> list[ModelRunner]:
        """Return every runner (target, int8 target, draft) that is loaded."""
        return [r for r in (self.target, self.target_q, self.draft) if r is not None]

    def compiled_runners(self) -> list[tuple[ModelRunner, bool]]:
        """Return each compiled runner with whether it needs its verify function."""
        verify = self.draft is not None
        runners = [(self.target, verify)]
        if self.target_q is not None:
            runners.append((self.target_q, verify))
        if self.draft is not None:
            runners.append((self.draft, False))
        return runners

    def warm_runners(self) -> list[tuple[ModelRunner, bool]]:
        """Return the compiled runners warm-up warms: all but the deferred float target."""
        return [(r, v) for r, v in self.compiled_runners() if r is not self.deferred]

    def weight_bytes(self) -> int:
        """Return the bytes of the lean weights (target + draft), each storage counted once."""
        storages: dict[tuple[str, int], int] = {}
        for runner in self.runners():
            for p in runner.m.parameters():
                s = p.untyped_storage()
                storages[(str(p.device), s.data_ptr())] = s.nbytes()
        return sum(storages.values())


def resolve_int8_encoder(config: EngineConfig, device: torch.device) -> EngineConfig:
    """Return `config` with engine.int8_encoder decided where int8 serves and it is unset:
    on with CUDA; on a CPU, on unless the int8 encoder's products measure slower than
    float32's past encoder_int8.SLOWER_LIMIT, or torch has no int8 product (said in the
    log at start either way). Decided before anything reads the config's hash: the saved
    packages and the cohort follow the encoder that serves."""
    if config.quantization != "int8" or config.int8_encoder is not None:
        return config
    if device.type != "cpu":
        return replace(config, int8_encoder=True)
    if not encoder_int8.available():
        log.warning("int8 encoder off: torch %s has no torch._int_mm (the int8 target "
                    "shares the float encoder)", torch.__version__)
        return replace(config, int8_encoder=False)
    target_dir = Path(config.model_dir) if config.model_dir else BUILTIN_DIR / "target"
    times = encoder_int8.time_products(encoder_int8.shapes(read_config(target_dir)))
    if times.int8_pays:
        log.info("int8 encoder on: %s", times.describe())
    else:
        log.warning("int8 encoder off: %s, past %gx; the int8 target shares the float "
                    "encoder (engine.int8_encoder: true keeps it)", times.describe(),
                    encoder_int8.SLOWER_LIMIT)
    return replace(config, int8_encoder=times.int8_pays)


def load_models(config: EngineConfig, *, device: torch.device, dtype: torch.dtype,
                options: CompileOptions | None, cache_root: Path,
                quantizer: quantize.Quantizer | None = None,
                ledger: GraphLedger | None = None) -> Models:
    """Load the target and its draft, build their runners, bind the C step where it applies."""
    target_dir = Path(config.model_dir) if config.model_dir else BUILTIN_DIR / "target"
    target_loaded = load_model(target_dir)
    draft_loaded, reason = pair_draft(config, target_loaded)
    # Said once, at start: a user model without draft_dir runs direct decoding.
    quiet = draft_loaded is not None or not config.use_draft
    (log.info if quiet else log.warning)("speculative decoding %s", reason)
    slots = config.max_new_tokens_cap + config.kv_headroom
    k_max = max(config.speculative_k, min(K_MAX, config.kv_headroom))
    # A step call may run past max_new by steps - 1 positions: they must fit the slots.
    steps = max(1, min(STEPS_PER_CALL, config.kv_headroom + 1))

    def runner(loaded: LoadedModel, name: str, k: int, steps: int, *,
               compile_encoder: bool = True) -> ModelRunner:
        assert loaded.weights is not None, "runners are built before the weights are released"
        with torch.no_grad():
            lean = t5.LeanT5(loaded.config, loaded.weights, dtype=dtype, device=device)
        return ModelRunner(lean, edges=config.buckets, slots=slots, verify_q=k + 1,
                           options=options, name=name, steps=steps,
                           compile_encoder=compile_encoder, ledger=ledger)

    target = runner(target_loaded, "target", k_max, steps)
    # engine.quantization: int8: a second target with int8 weights, served where the
    # `quantized` flag is on (`quantizer` is a test seam: noisy weights disagree).
    target_q: ModelRunner | None = None
    if config.quantization == "int8":
        with torch.no_grad():
            if device.type == "cpu":
                released = quantize.step_names(target.m)
                if config.int8_encoder_on and quantizer is None:  # int8 replaces them
                    released += quantize.encoder_names(target.m)
                _own_storages(target.m, released=released)
            lean_q = (quantizer or partial(quantize.int8, encoder=config.int8_encoder_on))(
                target.m)
        target_q = ModelRunner(lean_q, edges=config.buckets, slots=slots,
                               verify_q=k_max + 1, options=options, name="target-int8",
                               steps=steps, ledger=ledger, tables_of=target,
                               encoder_of=target if quantize.shares_encoder(target.m, lean_q)
                               else None)
    # The encoder runs once per request: for a small draft it is not worth a graph.
    draft = (runner(draft_loaded, "draft", k_max, 1, compile_encoder=False)
             if draft_loaded is not None else None)
    step_kind = _bind_native_step(config, options is not None, cache_root,
                                  (target, target_q, draft))
    info = _info(config, target_loaded, draft_loaded, device, dtype, reason, step_kind)
    if target_q is not None:
        target.weights = _on_demand(target, target_q, target_loaded, device=device, dtype=dtype)
    # The lean copies hold the weights now: drop the checkpoint's so they are resident once
    # (a dict of tensors: freed by reference counting, no cycle collection needed).
    target_loaded = target_loaded.released()
    if draft_loaded is not None:
        draft_loaded = draft_loaded.released()
    return Models(target=target, target_q=target_q, draft=draft,
                  tokenizer=byte_tokens.fast(target_loaded.tokenizer), speculative_reason=reason,
                  step_kind=step_kind, info=info, slots=slots, k_max=k_max,
                  target_loaded=target_loaded, draft_loaded=draft_loaded,
                  deferred=deferred_float(config, target, target_q))


def deferred_float(config: EngineConfig, target: ModelRunner,
                   target_q: ModelRunner | None) -> ModelRunner | None:
    """Return the float target when int8 serving need not warm it at start (None: it warms).

    With an int8 encoder of its own, the int8 target serves every request the flags leave
    quantized without the float target's compiled functions; warmed at start, their graphs
    (or loaded packages) stayed resident in every int8 process for an A/B arm or flag flip
    that may never come. Its weights are released anyway (engine.float_weights); the
    CUDA-graph modes keep it in warm-up (their graphs are recorded on the owner thread).
    """
    if (target_q is None or target_q.encoder_of is not None or target.weights is None
            or single_owner(config)):
        return None
    return target


def _own_storages(lean: t5.LeanT5, *, released: list[str]) -> None:
    """Give `lean`'s parameters that int8 serving keeps storages of their own (tensors that
    shared one, a tied lm head and the embedding, keep sharing one; `released`: the others,
    left as they are): the checkpoint's tensors can be views of one buffer per file, and a
    kept view would hold the memory of every weight int8 serving releases."""
    copies: dict[tuple[int, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
    params = list(lean.named_parameters(remove_duplicate=False))
    names = set(released)
    for name, p in [*(x for x in params if x[0] not in names),
                    *(x for x in params if x[0] in names)]:
        key = (p.data_ptr(), tuple(p.shape), p.stride())
        if key not in copies:
            if name in names:
                continue  # not shared with a kept one: released, not copied
            copies[key] = p.data.clone()
        p.data = copies[key]


def _on_demand(target: ModelRunner, target_q: ModelRunner, loaded: LoadedModel, *,
               device: torch.device, dtype: torch.dtype) -> OnDemandWeights | None:
    """Return the float target's decoder-step weights (and its encoder's products' when the
    int8 target has an int8 encoder of its own) as weights reloaded from the checkpoint on
    demand (engine.float_weights), or None where they stay resident."""
    if device.type != "cpu":
        # CUDA graphs record the weights' addresses: a reload would need new graphs.
        return None
    names = quantize.step_names(target.m)
    if quantize.int8_encoder(target_q.m):
        names += quantize.encoder_names(target.m)
    names = releasable(target.m, names, keep=[target_q.m])
    if not names:
        return None
    stamp = fingerprint(loaded.path)
    path, cfg = loaded.path, loaded.config

    def reload() -> dict[str, torch.Tensor]:
        # The float32 arm measures int8 against the model that was loaded: not another
        # one put in its place since (restart to serve that).
        if fingerprint(path) != stamp:
            raise ModelLoadError(f"{path}: the weights changed on disk since the engine "
                                 "loaded them; the float32 weights are not reloaded from "
                                 "another model (restart the engine to serve it)")
        with torch.no_grad():
            fresh = t5.LeanT5(cfg, read_weights(path), dtype=dtype, device=device)
        params = dict(fresh.named_parameters())
        # Copies: a view would keep the whole checkpoint buffer resident while held.
        return {name: params[name].detach().clone() for name in names}

    weights = OnDemandWeights(target.m, names, reload,
                              bound=[target.native] if target.native is not None else [])
    # Released once warm-up (or the first float requests) stop holding them.
    weights.acquire()
    weights.release()
    return weights


def _bind_native_step(config: EngineConfig, compile_on: bool, cache_root: Path,
                      runners: tuple[ModelRunner | None, ...]) -> str:
    """Serve the optimized decode step in C where it applies; return what serves, said
    once in the log ("native" or "compiled (why)")."""
    if not compile_on:
        return "eager (compile_mode off)"
    if not config.native_step:
        return "compiled (native_step off)"
    lib = native.load(cache_root)
    if lib is None:
        kind = "compiled (no C compiler, or its build failed)"
        log.warning("decode step: %s", kind)
        return kind
    kinds = []
    for runner in runners:  # the int8 target's weights are read by the C step as int8
        if runner is not None:
            why = native.applicable(runner.m)
            if why is None:
                runner.native = lib.bind(runner.m)
            kinds.append(f"{runner.name} " + ("native" if why is None
                                              else f"compiled ({why})"))
    kind = ", ".join(kinds)
    log.info("decode step: %s", kind)
    return kind


def _info(config: EngineConfig, target: LoadedModel, draft: LoadedModel | None,
          device: torch.device, dtype: torch.dtype, reason: str, step_kind: str
          ) -> EngineInfo:
    h = hashlib.sha256(target.weights_hash.encode())
    if draft is not None:
        h.update(draft.weights_hash.encode())
    return EngineInfo(
        model_version=h.hexdigest()[:12],
        config_hash=config.config_hash(),
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        buckets=tuple(config.buckets),
        speculative_available=draft is not None,
        compile_mode=config.compile_mode,
        speculative_reason=reason,
        quantization=config.quantization,
        decode_step=step_kind,
    )
