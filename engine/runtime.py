"""The torch runtime: a request's path from its text to its GenerateResult.

A request is tokenized, admitted (bounded streams, bounded queue), routed to a bucket,
padded, encoded, decoded directly or speculatively (in the batching loop when there is
one), and measured into a GenerateResult. Flags are read on every request through
GuardedFlags, so a flip takes effect on the next request and a broken flag source never
fails one. The rest lives beside it: loading (engine.models), warm-up (engine.warmup),
KV and memory accounting (engine.memory), bucket traffic (engine.traffic).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from engine import aot, decoding, precompile, quantize, scheduler, validation
from engine.admission import Admission, AdmissionStats
from engine.buckets import bucket_edge, bucket_label
from engine.compile_watch import shared_watch
from engine.config import EngineConfig
from engine.draft_length import DraftLength
from engine.errors import (
    Cancelled,
    DoesNotFit,
    NotReady,
    RequestTimeout,
)
from engine.flags import GuardedFlags
from engine.graphs import GraphLedger, prepare_owner_thread
from engine.memory import KvAccount, memory_snapshot, static_bytes
from engine.models import (
    INDUCTOR_OPTIONS,
    compile_options,
    cudagraphs_off,
    device_of,
    dtype_of,
    load_models,
    package_only,
    single_owner,
)
from engine.owner import DeviceThread
from engine.protocol import (
    CUDAGRAPH_NONE,
    CUDAGRAPH_RECORDED,
    CUDAGRAPH_REPLAYED,
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
    GraphSnapshot,
    InMemoryFlagProvider,
    MemorySnapshot,
    RuntimeFlags,
    WarmupStatus,
)
from engine.runner import Fns, ModelRunner
from engine.traffic import BucketTraffic
from engine.warmup import Warmup

EXACT = "exact"
T = TypeVar("T")

log = logging.getLogger(__name__)


class Runtime:
    """The torch-backed Engine (see engine.protocol.Engine); thread-safe."""

    def __init__(self, config: EngineConfig, flags: FlagProvider | None = None, *,
                 quantizer: quantize.Quantizer | None = None) -> None:
        if config.kv_headroom < config.speculative_k:
            raise ValueError("kv_headroom: must be >= speculative_k (verification look-ahead)")
        self.config = config
        self.device = device_of(config.device)
        self.dtype = dtype_of(config.dtype, self.device)
        torch.set_num_threads(config.num_threads)
        self.cache_root = precompile.cache_root(config)
        precompile.point_inductor(self.cache_root)
        # Dynamo is imported (its recompile limit raised, the watch's hooks installed) by
        # the first runner that compiles: a warm CPU start serving the saved encoder package
        # and the C step never does.
        self._watch = shared_watch()
        options = compile_options(config)
        self._compile_on = options is not None
        if (self._compile_on and config.compile_backend == "inductor"
                and self.device.type == "cpu" and not package_only(config, self.cache_root)):
            aot.start_isa_probe()  # waits on a child process while the weights load
        self._t_created = time.perf_counter()
        # Why the compiled functions run without CUDA graphs (None: they use them).
        self.cudagraphs_off = cudagraphs_off(config, self.device) if self._compile_on \
            else "compile_mode off"
        self.ledger = GraphLedger(cudagraphs=self.cudagraphs_off is None)
        self.models = load_models(config, device=self.device, dtype=self.dtype,
                                  options=options, cache_root=self.cache_root,
                                  quantizer=quantizer, ledger=self.ledger)
        self.draft_length = DraftLength(k_max=self.k_max, k_initial=config.speculative_k)
        # Batched, a decode slot is a batch row (its caches); unbatched, a decode stream.
        self._rows = config.max_batch if config.max_batch > 1 else config.max_concurrency
        self._admission = Admission(self._rows, config.max_queue,
                                    max_queue_tokens=config.max_queue_tokens)
        provider = flags or InMemoryFlagProvider()
        # In-memory flags need no file: only a provider that can be unreachable keeps one.
        state_file = None if type(provider) is InMemoryFlagProvider else config.flags_file
        self._flags = GuardedFlags(provider, config.flag_timeout_s,
                                   state_file=state_file or None)
        with torch.no_grad():
            self._caches = [self._new_caches() for _ in range(self._rows)]
        self._kv = KvAccount(static_bytes(self._caches))
        self._lock = threading.Lock()
        self._compiled_step_lock = threading.Lock()
        self._compiled_step_warm: set[int] = set()  # id() of runners: see _warm_compiled_step
        self._deferred_warm = False  # the deferred float target warmed: see _warm_deferred
        self._rng = random.Random(0)
        self._traffic = BucketTraffic(self.cache_root)
        self._closed = False
        saved_dir = None
        if self._compile_on:
            saved_dir = precompile.saved_dir(self.cache_root, config, self.info.model_version,
                                             self.device.type, repr(INDUCTOR_OPTIONS))
            self._traffic.load()
        self.warmup = Warmup(self.models, buckets=config.buckets, compile_on=self._compile_on,
                             saved_dir=saved_dir, order=self.warm_order,
                             warm_bucket=self._warm_bucket, watch=self._watch,
                             created=self._t_created, closed=lambda: self._closed,
                             finished=self.ledger.warm_done, on_owner=self._on_owner)
        self._owned = self._compile_on and single_owner(config)
        self._scheduler: scheduler.Scheduler | None = None
        self._device_thread: DeviceThread | None = None
        self._start_threads()

    def _start_threads(self) -> None:
        """Start the batching loop (max_batch > 1) and, in the CUDA-graph modes, make one
        thread own every compiled call, warm-up included (cudagraph trees are per thread):
        the loop, else a device thread. Elsewhere the warm-up compiles on its own thread."""
        config = self.config
        if config.max_batch > 1:
            self._scheduler = scheduler.Scheduler(
                self, max_batch=config.max_batch, window_max_s=config.batch_window_max_s,
                waiting=lambda: self._admission.waiting)
        elif self._owned:
            self._device_thread = DeviceThread()
        owner = self._scheduler or self._device_thread
        if self._owned and owner is not None:
            self.ledger.set_owner(owner.thread)
            if self.cudagraphs_off is None:
                self._on_owner(prepare_owner_thread)

    @property
    def batch_scheduler(self) -> scheduler.Scheduler | None:
        """Return the batching loop (None: max_batch 1, nothing batched)."""
        return self._scheduler

    # --- what loading made (engine.models) ----------------------------------------------

    @property
    def target(self) -> ModelRunner:
        return self.models.target

    @property
    def target_q(self) -> ModelRunner | None:
        return self.models.target_q

    @property
    def draft(self) -> ModelRunner | None:
        return self.models.draft

    @property
    def tokenizer(self) -> Any:
        return self.models.tokenizer

    @property
    def slots(self) -> int:
        return self.models.slots

    @property
    def k_max(self) -> int:
        return self.models.k_max

    @property
    def step_kind(self) -> str:
        return self.models.step_kind

    @property
    def speculative_reason(self) -> str:
        return self.models.speculative_reason

    @property
    def _target_loaded(self) -> Any:
        return self.models.target_loaded

    def _new_caches(self) -> dict[str, torch.Tensor]:
        # Marked static only for a compiled step (the C step and eager need no mark).
        return {r.name: r.m.new_self_cache(self.slots,
                                           static=self._compile_on and r.native is None)
                for r in (self.target, self.draft) if r is not None}

    # --- Engine protocol ---------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self.models.info

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
        return memory_snapshot(self.device, self._kv, self.weight_bytes())

    def weight_bytes(self) -> int:
        """Return the bytes of the lean weights (target + draft), each storage counted once."""
        return self.models.weight_bytes()

    def kv_cache_bytes(self) -> int:
        """Return the KV bytes allocated now: static self caches plus running requests' K/V."""
        return self._kv.total()

    def draft_length_snapshot(self) -> DraftLengthSnapshot:
        """Return the draft length k chosen per bucket (0 = direct fallback) and its inputs."""
        view = self.draft_length.view()
        return DraftLengthSnapshot(
            k={b: v.k for b, v in view.items()},
            acceptance={b: v.acceptance for b, v in view.items() if v.acceptance is not None},
            expected_speedup={b: v.expected_speedup for b, v in view.items()
                              if v.expected_speedup is not None})

    def batch_snapshot(self) -> BatchSnapshot:
        """Return the batching scheduler's state (max_batch 1: nothing batched)."""
        if self._scheduler is None:
            return BatchSnapshot(max_batch=1)
        return self._scheduler.snapshot()

    def graph_snapshot(self) -> GraphSnapshot:
        """Return the compiled calls' graph counts (CUDA graphs recorded and replayed)."""
        return self.ledger.snapshot()

    def _on_owner(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the thread that owns the compiled calls (this one when none does)."""
        if self._owned and self._scheduler is not None:
            return cast(T, self._scheduler.call(fn))
        if self._device_thread is not None:
            return self._device_thread.call(fn)
        return fn()

    # --- warm-up (engine.warmup) -------------------------------------------------------

    def warm_up(self, *, background: bool = True) -> None:
        """Compile every bucket of the target and the draft (in a thread when background).

        Functions that `tailwatch engine precompile` saved are loaded from those files
        instead (no tracing); the buckets share them, so the first bucket pays the load.
        """
        self.warmup.start(background=background)

    def warmup_status(self) -> WarmupStatus:
        return self.warmup.status()

    def is_warm(self, edge: int) -> bool:
        """Return whether bucket `edge` has compiled graphs ready."""
        return self.warmup.is_warm(edge)

    def warm_order(self) -> list[int]:
        """Return the bucket edges busiest first (by the last run's traffic), then ascending."""
        return self._traffic.order(self.config.buckets)

    def precompiled(self) -> bool:
        """Return whether every function the buckets need is saved for this runtime."""
        return self.warmup.precompiled()

    def save_compiled(self) -> int:
        """Compile the shared functions ahead of time and save them (precompile); return how
        many."""
        return self.warmup.save_compiled()

    @property
    def saved_dir(self) -> Path | None:
        return self.warmup.saved_dir

    @property
    def saved_buckets(self) -> int:
        return self.warmup.saved_buckets

    @property
    def saved_failures(self) -> int:
        return self.warmup.saved_failures

    @property
    def cache_hit(self) -> bool | None:
        return self.warmup.cache_hit

    @property
    def bucket_compile_s(self) -> dict[int, float]:
        return self.warmup.bucket_compile_s

    def _warm_bucket(self, edge: int, loaded: bool) -> str:
        """Warm bucket `edge` (on every row's caches in the CUDA-graph modes); return what it
        left. Warmup runs it on the owner thread; `loaded`: from the saved functions."""
        recorded = self.ledger.recorded()
        skips = _cudagraph_skips()
        # Saved functions were called once as they loaded: enough unless graphs are to be
        # recorded on the rows (a warm CPU start so never imports dynamo to mark inputs).
        runners = self.models.warm_runners() if self._owned or not loaded else []
        for runner, verify in runners:
            name = "draft" if runner is self.draft else "target"
            # On the rows' own caches only where the owner thread serializes the warm-up
            # with the requests (a row decoding beside it would read the warm-up's writes).
            caches = [row[name] for row in self._caches] if self._owned else []
            runner.warm(edge, verify=verify, caches=caches, mark=not loaded)
        if self.cudagraphs_off is not None:
            return f"no CUDA graphs: {self.cudagraphs_off}"
        skipped = _cudagraph_skips() - skips
        if skipped:
            # The functions run, but as plain compiled code: the bucket is not what the
            # mode promises. Said as an error; the status and the metric carry it.
            raise RuntimeError(f"{skipped} graph(s) skipped by cudagraph trees "
                               "(TORCH_LOGS=cudagraphs says why)")
        return f"recorded {self.ledger.recorded() - recorded} CUDA graph(s)"

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
        self._traffic.count(label)
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
        runner = self.target_q if quantized and self.target_q is not None else self.target
        deadline = None if timeout_s is None else t_entry + timeout_s
        with runner.held() as reload_s:
            # Float weights int8 serving had released come back from disk first: that wait
            # is not the model's time (the float32 arm's latency measures the model), so
            # the request's times start after it; its deadline does not move.
            t_entry += reload_s
            # Likewise its compiled functions' first warm-up (int8 serving defers it).
            t_entry += self._warm_deferred(n, flags, runner)
            batch: scheduler.Job | None = None
            if not native:
                self._warm_compiled_step(n, flags, runner)
            # While it waits it carries its input and the most its row may decode.
            with self._admission.slot(deadline, synthetic=canary, tokens=n + max_new) as slot:
                t_slot = time.perf_counter()
                path, length, key = self._route(n, flags)
                recorded = self.ledger.recorded()
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
                cudagraph=self._cudagraph(key, recorded), **_batch_fields(batch, t_slot),
            )

    def _warm_deferred(self, n: int, flags: RuntimeFlags, runner: ModelRunner) -> float:
        """Warm the float target int8 serving left out of warm-up (Models.deferred) before
        its first compiled request takes a row; return the seconds it took (0.0: nothing).

        Before the admission slot, like the compiled step: a compile there would hold a
        decode row while other requests queue. A failure is counted and logged once; the
        request's own fallback then runs eager. `runner` is held by the caller.
        """
        if runner is not self.models.deferred or self._deferred_warm:
            return 0.0
        _path, _length, key = self._route(n, flags)
        if not isinstance(key, int):
            return 0.0  # eager, exact or overflow: nothing shared to warm
        started = time.perf_counter()
        with self._compiled_step_lock:
            if not self._deferred_warm:
                try:
                    self.warmup.warm_deferred(runner, key, verify=self.draft is not None)
                except Exception as exc:  # noqa: BLE001 - the request's own fallback runs eager
                    self._watch.record_failure()
                    log.error("engine: %s: its deferred warm-up failed: %s: %s",
                              runner.name, type(exc).__name__, str(exc)[:300])
                self._deferred_warm = True
        return time.perf_counter() - started

    def _warm_compiled_step(self, n: int, flags: RuntimeFlags, runner: ModelRunner) -> None:
        """Compile the compiled step beside the C step once per runner, before taking a row.

        The native_step flag off (the policy's fallback, the `compiled_step` A/B arm) runs
        it. Compiled inside the admission slot, its first call held the only decode row for
        the seconds a compile takes while real requests queued behind it; compiled here,
        with the length marked dynamic, one graph serves every bucket. Not at warm-up: a
        warm start from saved functions compiles nothing (the compiled step is not saved).
        `runner` (the target this request decodes with) is held by the caller.
        """
        runners = [(runner, self.draft is not None)]
        if self.draft is not None:
            runners.append((self.draft, False))
        if all(id(r) in self._compiled_step_warm for r, _ in runners):
            return
        _path, _length, key = self._route(n, flags)
        if not isinstance(key, int):
            return  # eager, exact or overflow: no compiled step
        with self._compiled_step_lock:
            for r, verify in runners:
                if id(r) in self._compiled_step_warm:
                    continue
                try:
                    r.warm_compiled_step(key, verify=verify)
                except Exception as exc:  # noqa: BLE001 - the request's own fallback runs eager
                    self._watch.record_failure()
                    log.error("engine: %s: the compiled step did not compile: %s: %s",
                              r.name, type(exc).__name__, str(exc)[:300])
                self._compiled_step_warm.add(id(r))

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

    def _cudagraph(self, key: int | str | None, recorded: int) -> str:
        """Return whether a request routed to `key` replayed CUDA graphs (a recording while
        it ran, its own or a batch-mate's, counts against it)."""
        if key is None or self.cudagraphs_off is not None:
            return CUDAGRAPH_NONE
        return CUDAGRAPH_REPLAYED if self.ledger.recorded() == recorded else CUDAGRAPH_RECORDED

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
            return (*self._on_owner(lambda: self._run(ids, length, key, slot, k, max_new,
                                                      deadline, quantized, native)), None)
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
            self._kv.hold(job.held, job.held)
            if job.k > 0 and self.draft is not None:
                draft = self.draft
                dfns = self._fns(draft, job.key, job.native)

                def encode_draft() -> decoding.Encoded:
                    # Run when the row first speculates (alone in the batch): a row that
                    # only ever decodes batched never pays for the draft's encoder.
                    denc = decoding.encode(draft, dfns, padded, mask)
                    job.held += denc.nbytes
                    self._kv.hold(denc.nbytes, job.held)
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
        self._kv.release(nbytes)

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
            self._kv.hold(held, held)
            try:
                if k > 0 and self.draft is not None:
                    dfns = self._fns(self.draft, key, native)
                    denc = decoding.encode(self.draft, dfns, padded, mask)
                    held += denc.nbytes
                    self._kv.hold(denc.nbytes, held)  # the peak is per request: both models
                    t_encoded = time.perf_counter()
                    decoded = decoding.speculative(
                        target, tfns, tenc, caches["target"], self.draft, dfns, denc,
                        caches["draft"], k, max_new, deadline)
                else:
                    t_encoded = time.perf_counter()
                    decoded = decoding.direct(target, tfns, tenc, caches["target"],
                                              max_new, deadline)
            finally:
                self._kv.release(held)
        return replace(decoded, kv_request_bytes=held), t_encoded, t_device

    def close(self) -> None:
        """Refuse new requests, stop background threads, remember the traffic per bucket."""
        if not self._closed and self._compile_on:
            self._traffic.save()
        self._closed = True
        if self._scheduler is not None:
            self._scheduler.close()
        if self._device_thread is not None:
            self._device_thread.close()
        self._flags.close()
        if self.target.weights is not None:
            self.target.weights.close()
        self.warmup.join(timeout=0.1)


def _cudagraph_skips() -> int:
    """Return the graphs cudagraph trees skipped so far (run without a CUDA graph)."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return 0  # nothing compiled yet
    from torch._dynamo.utils import counters

    return int(counters["inductor"].get("cudagraph_skips", 0))


def _batch_fields(job: scheduler.Job | None, t_slot: float) -> dict[str, Any]:
    """Return GenerateResult's batching fields for a request (None: not batched)."""
    if job is None:
        return {}
    steps = max(job.steps, 1)
    return dict(batch_wait_s=max(job.t_picked - t_slot, 0.0), batch_join_step=job.joined_step,
                batch_size_mean=job.batch_sum / steps if job.steps else 1.0,
                batch_size_max=max(job.batch_max, 1))
