"""The torch runtime: load, warm up, admit and run greedy requests.

A request is tokenized, admitted (bounded streams, bounded queue), padded to its
bucket, encoded, decoded directly or speculatively, and measured into a
GenerateResult. Flags are read on every request through GuardedFlags, so a flip
takes effect on the next request and a broken flag source never fails one.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import random
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from engine import aot, decoding, native, precompile, quantize, scheduler, t5, validation
from engine.admission import Admission, AdmissionStats
from engine.buckets import bucket_edge, bucket_label
from engine.compile_watch import shared_watch
from engine.config import BUILTIN_DIR, EngineConfig
from engine.draft_length import DraftLength
from engine.errors import (
    Cancelled,
    DoesNotFit,
    NotReady,
    RequestTimeout,
)
from engine.flags import GuardedFlags
from engine.loader import LoadedModel, load_model, pair_draft
from engine.protocol import (
    DECODING_DIRECT,
    DECODING_SPECULATIVE,
    PATH_COMPILED,
    PATH_EAGER,
    PATH_EXACT,
    PATH_OVERFLOW,
    BatchSnapshot,
    CompileSnapshot,
    DraftLengthSnapshot,
    EngineInfo,
    FlagOverride,
    FlagProvider,
    GenerateResult,
    InMemoryFlagProvider,
    MemorySnapshot,
    RuntimeFlags,
    WarmupStatus,
)
from engine.runner import CompileOptions, Fns, ModelRunner

log = logging.getLogger(__name__)

EXACT = "exact"
K_MAX = 8  # the largest draft length the adaptive choice may pick
# Greedy tokens per direct step call. More per call saves per-token overhead but the steps
# are unrolled in the graph, so compiling takes that many times longer.
STEPS_PER_CALL = 1
# Inductor options for every compiled function. realize_acc_reads_threshold=1 stores the
# RMS-normed input of each one-row product once instead of recomputing it inside the
# product's loop for every output row (identical tokens; docs/benchmarks.md#benchengine).
_INDUCTOR_OPTIONS: tuple[tuple[str, object], ...] = (("realize_acc_reads_threshold", 1),)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype: must be auto or one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def _package_only(config: EngineConfig) -> bool:
    """Return whether a start will likely load only the CPU encoder package and the C step,
    so inductor's ISA probe is not needed (a guess before the model is loaded: a wrong one
    costs only the probe's overlap, inductor then probes when it loads)."""
    # int8 weights too: their step runs in C beside the saved encoder packages.
    if not config.native_step or config.dtype not in ("float32", "auto"):
        return False
    root = precompile.cache_root(config) / "precompiled"
    return any(root.glob(f"*/*_{aot.cpu_key()}{aot.PACKAGE_SUFFIX}"))


class Runtime:
    """The torch-backed Engine (see engine.protocol.Engine); thread-safe."""

    def __init__(self, config: EngineConfig, flags: FlagProvider | None = None, *,
                 quantizer: quantize.Quantizer | None = None) -> None:
        if config.kv_headroom < config.speculative_k:
            raise ValueError("kv_headroom: must be >= speculative_k (verification look-ahead)")
        self.config = config
        self.device = _device(config.device)
        self.dtype = _dtype(config.dtype, self.device)
        torch.set_num_threads(config.num_threads)
        if config.cache_dir is not None:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(config.cache_dir).resolve())
        else:
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path("var/compile-cache").resolve()))
        # Dynamo is imported (its recompile limit raised, the watch's hooks installed) by
        # the first runner that compiles: a warm CPU start serving the saved encoder package
        # and the C step never does.
        self._watch = shared_watch()
        self._compile_on = config.compile_mode != "off"
        if (self._compile_on and config.compile_backend == "inductor"
                and self.device.type == "cpu" and not _package_only(config)):
            aot.start_isa_probe()  # waits on a child process while the weights load
        options = (CompileOptions(config.compile_mode, config.compile_backend,
                                  config.recompile_limit, _INDUCTOR_OPTIONS)
                   if self._compile_on else None)
        self._t_created = time.perf_counter()

        target_dir = Path(config.model_dir) if config.model_dir else BUILTIN_DIR / "target"
        self._target_loaded = load_model(target_dir)
        self._draft_loaded, self.speculative_reason = pair_draft(config, self._target_loaded)
        # Said once, at start: a user model without draft_dir runs direct decoding.
        quiet = self._draft_loaded is not None or not config.use_draft
        (log.info if quiet else log.warning)("speculative decoding %s", self.speculative_reason)
        self.tokenizer = self._target_loaded.tokenizer
        self.slots = config.max_new_tokens_cap + config.kv_headroom
        # Verification covers k_max + 1 positions whatever k is chosen (one verification shape).
        self.k_max = max(config.speculative_k, min(K_MAX, config.kv_headroom))
        # A step call may run past max_new by steps - 1 positions: they must fit the slots.
        steps = max(1, min(STEPS_PER_CALL, config.kv_headroom + 1))
        self.target = self._runner(self._target_loaded, options, "target", self.k_max, steps)
        # engine.quantization: int8: a second target with int8 weights, served where the
        # `quantized` flag is on (`quantizer` is a test seam: noisy weights disagree).
        self.target_q: ModelRunner | None = None
        if config.quantization == "int8":
            with torch.no_grad():
                lean_q = (quantizer or quantize.int8)(self.target.m)
            self.target_q = ModelRunner(lean_q, edges=config.buckets, slots=self.slots,
                                        verify_q=self.k_max + 1, options=options,
                                        name="target-int8", steps=steps)
        self.draft = (self._runner(self._draft_loaded, options, "draft", self.k_max, 1,
                                   compile_encoder=False)
                      if self._draft_loaded is not None else None)
        self.draft_length = DraftLength(k_max=self.k_max, k_initial=config.speculative_k)
        self.step_kind = self._bind_native_step(config)
        # The lean copies hold the weights now: drop the checkpoint's so they are resident once.
        self._target_loaded = self._target_loaded.released()
        if self._draft_loaded is not None:
            self._draft_loaded = self._draft_loaded.released()
        gc.collect()

        # Batched, a decode slot is a batch row (its caches); unbatched, a decode stream.
        self._rows = config.max_batch if config.max_batch > 1 else config.max_concurrency
        self._admission = Admission(self._rows, config.max_queue)
        provider = flags or InMemoryFlagProvider()
        # In-memory flags need no file: only a provider that can be unreachable keeps one.
        state_file = None if type(provider) is InMemoryFlagProvider else config.flags_file
        self._flags = GuardedFlags(provider, config.flag_timeout_s,
                                   state_file=state_file or None)
        with torch.no_grad():
            self._caches = [self._new_caches() for _ in range(self._rows)]
        self._lock = threading.Lock()
        self._rng = random.Random(0)
        self._warm: set[int] = set()
        # KV bytes of tensors actually allocated: static self caches, per-request cross K/V.
        self._kv_static = sum(t.numel() * t.element_size()
                              for caches in self._caches for t in caches.values())
        self._kv_running = 0
        self._kv_request_peak = 0
        self._kv_peak = self._kv_static
        self._ready_seconds: float | None = None
        # Requests per bucket label, this run and (from the cache dir) earlier runs: the
        # warm-up compiles the busiest buckets first.
        self._traffic: dict[str, int] = {}
        self._traffic_before: dict[str, int] = {}
        self.cache_hit: bool | None = None  # set once the warm-up knows (see WarmupStatus)
        self.bucket_compile_s: dict[int, float] = {}
        self._warm_thread: threading.Thread | None = None
        self._warm_started: float | None = None
        self._warm_seconds = 0.0
        self._warm_done = False
        self._warm_error: str | None = None
        self._closed = False
        self._info = self._make_info()
        self.saved_dir: Path | None = None  # compiled functions saved by precompile
        self.saved_buckets = 0  # buckets this warm-up loaded from saved functions
        self.saved_failures = 0  # saved functions that failed to load (0 or 1: all compiled)
        self._scheduler: scheduler.Scheduler | None = None
        if config.max_batch > 1:
            self._scheduler = scheduler.Scheduler(
                self, max_batch=config.max_batch, window_max_s=config.batch_window_max_s,
                waiting=lambda: self._admission.waiting)
        if self._compile_on:
            self.saved_dir = precompile.saved_dir(config, self._info.model_version,
                                                  self.device.type, repr(_INDUCTOR_OPTIONS))
            self._traffic_before = self._load_traffic()

    def _runner(self, loaded: LoadedModel, options: CompileOptions | None, name: str,
                k: int, steps: int, *, compile_encoder: bool = True) -> ModelRunner:
        assert loaded.weights is not None, "runners are built before the weights are released"
        with torch.no_grad():
            lean = t5.LeanT5(loaded.config, loaded.weights, dtype=self.dtype, device=self.device)
        return ModelRunner(lean, edges=self.config.buckets, slots=self.slots, verify_q=k + 1,
                           options=options, name=name, steps=steps,
                           compile_encoder=compile_encoder)

    def _bind_native_step(self, config: EngineConfig) -> str:
        """Serve the optimized decode step in C where it applies; return what serves, said
        once in the log ("native" or "compiled (why)")."""
        if not self._compile_on:
            return "eager (compile_mode off)"
        if not config.native_step:
            return "compiled (native_step off)"
        lib = native.load(precompile.cache_root(config))
        if lib is None:
            kind = "compiled (no C compiler, or its build failed)"
            log.warning("decode step: %s", kind)
            return kind
        kinds = []
        for runner in (self.target, self.target_q, self.draft):  # target_q: int8 weights in C
            if runner is not None:
                why = native.applicable(runner.m)
                if why is None:
                    runner.native = lib.bind(runner.m)
                kinds.append(f"{runner.name} " + ("native" if why is None
                                                  else f"compiled ({why})"))
        kind = ", ".join(kinds)
        log.info("decode step: %s", kind)
        return kind

    def _new_caches(self) -> dict[str, torch.Tensor]:
        # Marked static only for a compiled step (the C step and eager need no mark).
        return {r.name: r.m.new_self_cache(self.slots,
                                           static=self._compile_on and r.native is None)
                for r in (self.target, self.draft) if r is not None}

    def _make_info(self) -> EngineInfo:
        h = hashlib.sha256(self._target_loaded.weights_hash.encode())
        if self._draft_loaded is not None:
            h.update(self._draft_loaded.weights_hash.encode())
        return EngineInfo(
            model_version=h.hexdigest()[:12],
            config_hash=self.config.config_hash(),
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            buckets=tuple(self.config.buckets),
            speculative_available=self.draft is not None,
            compile_mode=self.config.compile_mode,
            speculative_reason=self.speculative_reason,
            quantization=self.config.quantization,
            decode_step=self.step_kind,
        )

    # --- Engine protocol ---------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self._info

    def count_tokens(self, text: str) -> int:
        return len(self._tokenize(text))

    def bucket_for(self, input_tokens: int) -> str:
        return bucket_label(input_tokens, self.config.buckets)

    def queue_depth(self) -> int:
        return self._admission.waiting

    def admission_stats(self) -> AdmissionStats:
        return self._admission.stats()

    def flag_errors(self) -> int:
        return self._flags.errors

    def flag_source(self) -> str:
        return self._flags.source

    def compile_snapshot(self) -> CompileSnapshot:
        return self._watch.snapshot()

    def memory_snapshot(self) -> MemorySnapshot:
        import psutil

        rss = psutil.Process().memory_info().rss
        with self._lock:
            kv = dict(kv_cache_bytes=self._kv_static + self._kv_running,
                      kv_static_bytes=self._kv_static, kv_request_bytes=self._kv_running,
                      kv_request_peak_bytes=self._kv_request_peak, kv_peak_bytes=self._kv_peak,
                      weight_bytes=self.weight_bytes())
        if self.device.type != "cuda":
            return MemorySnapshot(device=str(self.device), rss_bytes=rss, **kv)
        stats = torch.cuda.memory_stats(self.device)
        return MemorySnapshot(
            device=str(self.device), rss_bytes=rss, **kv,
            cuda_allocated_bytes=int(torch.cuda.memory_allocated(self.device)),
            cuda_reserved_bytes=int(torch.cuda.memory_reserved(self.device)),
            cuda_peak_bytes=int(torch.cuda.max_memory_allocated(self.device)),
            cuda_alloc_retries=int(stats.get("num_alloc_retries", 0)),
            cuda_ooms=int(stats.get("num_ooms", 0)),
        )

    def weight_bytes(self) -> int:
        """Return the bytes of the lean weights (target + draft), each storage counted once."""
        storages: dict[tuple[str, int], int] = {}
        for runner in (self.target, self.target_q, self.draft):
            if runner is not None:
                for p in runner.m.parameters():
                    s = p.untyped_storage()
                    storages[(str(p.device), s.data_ptr())] = s.nbytes()
        return sum(storages.values())

    def kv_cache_bytes(self) -> int:
        """Return the KV bytes allocated now: static self caches plus running requests' K/V."""
        with self._lock:
            return self._kv_static + self._kv_running

    def _kv_hold(self, nbytes: int, request_bytes: int) -> None:
        """Count `nbytes` more K/V held by a request that now holds `request_bytes` in all."""
        with self._lock:
            self._kv_running += nbytes
            self._kv_request_peak = max(self._kv_request_peak, request_bytes)
            self._kv_peak = max(self._kv_peak, self._kv_static + self._kv_running)

    def _kv_release(self, nbytes: int) -> None:
        with self._lock:
            self._kv_running -= nbytes

    def draft_length_snapshot(self) -> DraftLengthSnapshot:
        """Return the draft length k chosen per bucket (0 = direct fallback) and its inputs."""
        view = self.draft_length.view()
        return DraftLengthSnapshot(
            k={b: v.k for b, v in view.items()},
            acceptance={b: v.acceptance for b, v in view.items() if v.acceptance is not None},
            expected_speedup={b: v.expected_speedup for b, v in view.items()
                              if v.expected_speedup is not None})

    # --- warm-up -----------------------------------------------------------------------

    def warm_up(self, *, background: bool = True) -> None:
        """Compile every bucket of the target and the draft (in a thread when background).

        Functions that `tailwatch engine precompile` saved are loaded from those files
        instead (no tracing); the buckets share them, so the first bucket pays the load.
        """
        with self._lock:
            running = self._warm_thread
            if self._warm_started is None:
                self._warm_started = time.perf_counter()
                if not self._compile_on:
                    self._warm_done = True
                    self._ready_seconds = time.perf_counter() - self._t_created
                    return
                if background:
                    self._warm_thread = threading.Thread(target=self._warm_all,
                                                         name="engine-warmup", daemon=True)
                    self._warm_thread.start()
                    return
                running = None
            elif running is None or background:
                return  # already warm, or warming in the background
        if running is not None:
            running.join()  # a blocking call waits for the warm-up already under way
        else:
            self._warm_all()

    def _runners(self) -> list[tuple[ModelRunner, bool]]:
        """Return each compiled runner with whether it needs its verify function."""
        verify = self.draft is not None
        runners = [(self.target, verify)]
        if self.target_q is not None:
            runners.append((self.target_q, verify))
        if self.draft is not None:
            runners.append((self.draft, False))
        return runners

    def precompiled(self) -> bool:
        """Return whether every function the buckets need is saved for this runtime."""
        saved = self.saved_dir
        return saved is not None and all(
            runner.has_saved(saved, verify=verify) for runner, verify in self._runners())

    def save_compiled(self) -> int:
        """Compile the shared functions ahead of time and save them (precompile); return how many."""
        assert self.saved_dir is not None
        saved = 0
        for runner, verify in self._runners():
            try:
                saved += runner.save(self.saved_dir, verify=verify)
            except Exception as exc:  # noqa: BLE001 - starts then compile, as before
                log.warning("engine: %s: compiled functions not saved: %s: %s",
                            runner.name, type(exc).__name__, str(exc)[:300])
        return saved

    def _load_saved(self, edge: int) -> bool:
        """Serve bucket `edge` from saved functions; False when it must be compiled."""
        saved = self.saved_dir
        runners = self._runners()
        if self.saved_failures:
            return False  # the buckets share the files: one failure stands for all
        if saved is None or not all(runner.has_saved(saved, verify=verify)
                                    for runner, verify in runners):
            return False  # never precompiled (or another shape): the usual compile
        try:
            for runner, verify in runners:
                runner.load_saved(edge, saved, verify=verify)
        except aot.AOTLoadError as exc:
            for runner, _verify in runners:
                runner.forget()
            with self._lock:
                self.saved_failures += 1
                first = self.saved_failures == 1
            # Once at warning: every bucket usually fails for the same reason.
            (log.warning if first else log.info)(
                "engine: bucket %d: saved compiled functions not used, compiling: %s",
                edge, exc)
            return False
        with self._lock:
            self.saved_buckets += 1
        return True

    def _warm_all(self) -> None:
        aot.join_isa_probe()  # loading or compiling would otherwise run the probe again
        for edge in self.warm_order():
            if self._closed:
                break
            started = time.perf_counter()
            try:
                if not self._load_saved(edge):
                    for runner, verify in self._runners():
                        runner.warm(edge, verify=verify)
            except Exception as exc:  # noqa: BLE001 - a bucket that fails to compile stays eager
                self._watch.record_failure()
                with self._lock:
                    self._warm_error = f"bucket {edge}: {type(exc).__name__}: {exc}"[:500]
                continue
            with self._lock:
                self._warm.add(edge)
                self.bucket_compile_s[edge] = time.perf_counter() - started
                self._warm_seconds = time.perf_counter() - (self._warm_started or 0.0)
                warm = len(self._warm)
            log.info("engine: bucket %d warm in %.1f s (%d of %d)", edge,
                     self.bucket_compile_s[edge], warm, len(self.config.buckets))
        with self._lock:
            self._warm_seconds = time.perf_counter() - (self._warm_started or 0.0)
            self._warm_done = True
            if len(self._warm) == len(self.config.buckets):
                self._ready_seconds = time.perf_counter() - self._t_created
            self.cache_hit = self.saved_buckets == len(self.config.buckets)

    def warmup_status(self) -> WarmupStatus:
        with self._lock:
            seconds = self._warm_seconds
            if self._warm_started is not None and not self._warm_done:
                seconds = time.perf_counter() - self._warm_started
            return WarmupStatus(total_buckets=len(self.config.buckets),
                                warm_buckets=len(self._warm), seconds=seconds,
                                done=self._warm_done, error=self._warm_error,
                                bucket_seconds={str(e): round(v, 3)
                                                for e, v in self.bucket_compile_s.items()},
                                cache_hit=self.cache_hit, ready_seconds=self._ready_seconds)

    def is_warm(self, edge: int) -> bool:
        """Return whether bucket `edge` has compiled graphs ready."""
        with self._lock:
            return edge in self._warm

    # --- generate ----------------------------------------------------------------------

    def _tokenize(self, text: object) -> list[int]:
        return list(self.tokenizer(validation.check_text(self.config, text)).input_ids)

    def _speculate(self, flags: RuntimeFlags, label: str) -> tuple[bool, bool]:
        if self.draft is None:
            return False, False
        if flags.speculative_for(label):
            return True, False
        share = flags.probation_for(label)
        if share > 0:
            with self._lock:
                draw = self._rng.random()
            if draw < share:
                return True, True
        return False, False

    def generate(self, text: str, *, max_new_tokens: int | None = None, canary: bool = False,
                 override: FlagOverride | None = None,
                 timeout_s: float | None = None) -> GenerateResult:
        """Generate greedily; raise InvalidRequest, Overloaded, RequestTimeout or NotReady."""
        t_entry = time.perf_counter()
        if self._closed:
            raise NotReady("engine is closed")
        validation.check_timeout(timeout_s)
        max_new = validation.max_new_tokens(self.config, max_new_tokens)
        ids = self._tokenize(text)
        n = len(ids)
        validation.check_input_tokens(self.config, n)
        label = bucket_label(n, self.config.buckets)
        with self._lock:
            self._traffic[label] = self._traffic.get(label, 0) + 1
        flags = self._flags.read()
        if override is not None:
            flags = override.apply(flags, label)
        speculate, probation = self._speculate(flags, label)
        # The measured draft length; 0 when speculation would be slower than direct here,
        # unless the caller asked for speculation explicitly (A/B arms, benchmarks).
        # Probation requests are the policy's measurement of recovery: they speculate too.
        forced = (override is not None and override.speculative is True) or probation
        fallback = self.config.speculative_fallback and not forced
        k = self.draft_length.choose(label, fallback=fallback) if speculate else 0
        speculate = k > 0
        probation = probation and speculate
        quantized = self.target_q is not None and flags.quantized_for(label)
        native = flags.native_step
        deadline = None if timeout_s is None else t_entry + timeout_s
        batch: scheduler.Job | None = None
        with self._admission.slot(deadline, synthetic=canary) as slot:
            t_slot = time.perf_counter()
            path, length, key = self._route(n, flags)
            try:
                decoded, t_encoded, t_device, batch = self._run_any(
                    ids, length, key, slot, k, max_new, deadline, quantized, native,
                    alone=not flags.batching)
            except (RequestTimeout, Cancelled, DoesNotFit, NotReady):
                raise
            except Exception:
                if key is None:
                    raise
                # A compile that fails must not fail the request: count it, run eager.
                self._watch.record_failure()
                path, key = PATH_EAGER, None
                decoded, t_encoded, t_device, batch = self._run_any(
                    ids, length, key, slot, k, max_new, deadline, quantized, native,
                    alone=not flags.batching)
        out = decoded.tokens
        if batch is not None:
            # What ran: a request that asked to speculate decodes direct while batched.
            speculate = decoded.spec.drafts > 0
            k = k if speculate else 0
        self._learn(label, decoded, t_encoded, speculate,
                    alone=batch is None or batch.batch_max <= 1)
        text_out = self.tokenizer.decode(out, skip_special_tokens=True)
        stamps = decoded.stamps
        return GenerateResult(
            text=text_out, output_ids=tuple(out), input_tokens=n, bucket=label,
            padded_length=length, output_tokens=len(out), path=path,
            decoding=DECODING_SPECULATIVE if speculate else DECODING_DIRECT,
            queue_wait_s=t_slot - t_entry, encoder_s=t_encoded - t_device,
            ttft_s=(stamps[0] - t_slot) if stamps else 0.0,
            decode_token_s=tuple(b - a for a, b in zip(stamps, stamps[1:], strict=False)),
            total_s=time.perf_counter() - t_entry, spec=decoded.spec, canary=canary,
            probation=probation, kv_request_bytes=decoded.kv_request_bytes, spec_k=k,
            quantized=quantized, native_step=self._on_native(key, quantized, native),
            **_batch_fields(batch, t_slot),
        )

    def _learn(self, label: str, decoded: decoding.Decoded, t_encoded: float,
               speculated: bool, *, alone: bool = True) -> None:
        """Feed the adaptive draft length with this request's acceptance and costs (a
        direct request's time only when it decoded alone: batch-mates change it)."""
        if speculated:
            c = decoded.costs
            self.draft_length.record_speculative(label, decoded.spec, draft_steps=c.draft_steps,
                                                 draft_s=c.draft_s, verifies=c.verifies,
                                                 verify_s=c.verify_s)
        elif decoded.stamps and self.draft is not None and alone:
            self.draft_length.record_direct(label, len(decoded.tokens),
                                            decoded.stamps[-1] - t_encoded)

    def _route(self, n: int, flags: RuntimeFlags) -> tuple[str, int, int | str | None]:
        """Return (path, padded length, compiled-function key or None for eager)."""
        edge = bucket_edge(n, self.config.buckets)
        if edge is None:
            return PATH_OVERFLOW, n, None
        compiled = flags.compiled and self._compile_on
        if not flags.bucketing:
            return (PATH_EXACT, n, EXACT) if compiled else (PATH_EAGER, n, None)
        if compiled and self.is_warm(edge):
            return PATH_COMPILED, edge, edge
        return PATH_EAGER, edge, None

    def _fns(self, runner: ModelRunner, key: int | str | None, native: bool = True) -> Fns:
        if key is None:
            return runner.eager
        # The native_step flag off: this request's compiled functions use the compiled
        # step even where the C step is bound (built on first use, kept apart).
        return runner.compiled(key) if native else runner.compiled_step(key)

    def _on_native(self, key: int | str | None, quantized: bool, native: bool) -> bool:
        """Return whether a request routed to `key` decodes its target with the C step."""
        target = self.target_q if quantized and self.target_q is not None else self.target
        return key is not None and native and target.native is not None

    def _run_any(self, ids: list[int], length: int, key: int | str | None, slot: int,
                 k: int, max_new: int, deadline: float | None, quantized: bool,
                 native: bool = True, *, alone: bool = False
                 ) -> tuple[decoding.Decoded, float, float, scheduler.Job | None]:
        """Decode in the batching loop when there is one, else in this thread."""
        if self._scheduler is None:
            return (*self._run(ids, length, key, slot, k, max_new, deadline, quantized,
                               native), None)
        job = scheduler.Job(ids=ids, length=length, key=key, k=k, max_new=max_new,
                            deadline=deadline, quantized=quantized, row=slot, native=native,
                            alone=alone)
        self._scheduler.submit(job)
        decoded = self._scheduler.wait(job)
        return replace(decoded, kv_request_bytes=job.held), job.t_encoded, job.t_device, job

    def row_room(self, k: int) -> int:
        """Return the most new tokens a batch row's cache holds for a request drafting k."""
        # A step writes position len(tokens) - 1 < max_new; a verification k_max + 1
        # positions from there (its padding included).
        return self.slots - (self.k_max if k > 0 else 0)

    def start_row(self, job: scheduler.Job) -> decoding.RowState:
        """Encode `job`'s input on the calling (loop) thread; return its row's decode state."""
        caches = self._caches[job.row]
        target = self.target_q if job.quantized and self.target_q is not None else self.target
        with torch.no_grad():
            job.t_device = time.perf_counter()
            padded, mask = self._padded(job.ids, job.length)
            tfns = self._fns(target, job.key, job.native)
            tenc = decoding.encode(target, tfns, padded, mask)
            job.held = tenc.nbytes
            self._kv_hold(job.held, job.held)
            if job.k > 0 and self.draft is not None:
                draft = self.draft
                dfns = self._fns(draft, job.key, job.native)

                def encode_draft() -> decoding.Encoded:
                    # Run when the row first speculates (alone in the batch): a row that
                    # only ever decodes batched never pays for the draft's encoder.
                    denc = decoding.encode(draft, dfns, padded, mask)
                    job.held += denc.nbytes
                    self._kv_hold(denc.nbytes, job.held)
                    return denc

                row = decoding.RowState(target, tfns, tenc, caches["target"], job.max_new,
                                        draft=draft, dfns=dfns, denc=encode_draft,
                                        dcache=caches["draft"], k=job.k)
            else:
                row = decoding.RowState(target, tfns, tenc, caches["target"], job.max_new)
            job.t_encoded = time.perf_counter()
        return row

    def kv_release(self, nbytes: int) -> None:
        """Forget `nbytes` of request K/V (a batched request left)."""
        self._kv_release(nbytes)

    def batch_snapshot(self) -> BatchSnapshot:
        """Return the batching scheduler's state (max_batch 1: nothing batched)."""
        if self._scheduler is None:
            return BatchSnapshot(max_batch=1)
        return self._scheduler.snapshot()

    def _padded(self, ids: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        padded = torch.full((1, length), self.target.m.pad_id, dtype=torch.long)
        padded[0, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask = torch.zeros((1, length), dtype=torch.long)
        mask[0, : len(ids)] = 1
        return padded.to(self.device), mask.to(self.device)

    def _run(self, ids: list[int], length: int, key: int | str | None, slot: int,
             k: int, max_new: int, deadline: float | None, quantized: bool = False,
             native: bool = True) -> tuple[decoding.Decoded, float, float]:
        caches = self._caches[slot]
        target = self.target_q if quantized and self.target_q is not None else self.target
        with torch.no_grad():
            t_device = time.perf_counter()
            padded, mask = self._padded(ids, length)
            tfns = self._fns(target, key, native)
            tenc = decoding.encode(target, tfns, padded, mask)
            held = tenc.nbytes
            self._kv_hold(held, held)
            try:
                if k > 0 and self.draft is not None:
                    dfns = self._fns(self.draft, key, native)
                    denc = decoding.encode(self.draft, dfns, padded, mask)
                    held += denc.nbytes
                    self._kv_hold(denc.nbytes, held)  # the peak is per request: both models
                    t_encoded = time.perf_counter()
                    decoded = decoding.speculative(
                        target, tfns, tenc, caches["target"], self.draft, dfns, denc,
                        caches["draft"], k, max_new, deadline)
                else:
                    t_encoded = time.perf_counter()
                    decoded = decoding.direct(target, tfns, tenc, caches["target"],
                                              max_new, deadline)
            finally:
                self._kv_release(held)
        return replace(decoded, kv_request_bytes=held), t_encoded, t_device

    def warm_order(self) -> list[int]:
        """Return the bucket edges busiest first (by the last run's traffic), then ascending."""
        share = self._traffic_before
        return sorted(self.config.buckets, key=lambda e: (-share.get(str(e), 0), e))

    def _traffic_file(self) -> Path:
        return precompile.cache_root(self.config) / "bucket-traffic.json"

    def _load_traffic(self) -> dict[str, int]:
        try:
            data = json.loads(self._traffic_file().read_text())
            return {str(k): int(v) for k, v in data.items()}
        except (OSError, ValueError, AttributeError):
            return {}  # no earlier run (or an unreadable file): warm in ascending order

    def _save_traffic(self) -> None:
        with self._lock:
            if not self._traffic:
                return
            merged = {label: count // 2 for label, count in self._traffic_before.items()}
            for label, count in self._traffic.items():
                merged[label] = merged.get(label, 0) + count  # recent runs weigh more
        try:
            path = self._traffic_file()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(merged, sort_keys=True))
        except OSError:
            pass  # the order is an optimization; a read-only cache dir only loses it

    def close(self) -> None:
        """Refuse new requests, stop background threads, remember the traffic per bucket."""
        if not self._closed and self._compile_on:
            self._save_traffic()
        self._closed = True
        if self._scheduler is not None:
            self._scheduler.close()
        self._flags.close()
        thread = self._warm_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=0.1)


def _batch_fields(job: scheduler.Job | None, t_slot: float) -> dict[str, Any]:
    """Return GenerateResult's batching fields for a request (None: not batched)."""
    if job is None:
        return {}
    steps = max(job.steps, 1)
    return dict(batch_wait_s=max(job.t_picked - t_slot, 0.0), batch_join_step=job.joined_step,
                batch_size_mean=job.batch_sum / steps if job.steps else 1.0,
                batch_size_max=max(job.batch_max, 1))
