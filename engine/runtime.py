"""The torch runtime: a request's path from its text to its GenerateResult.

A request is tokenized, admitted (bounded streams, bounded queue), routed to a bucket
(engine.routing), padded, encoded, decoded directly or speculatively on its row
(engine.rows; in the batching loop, engine.scheduler, when there is one), and measured
into a GenerateResult. Flags are read on every request through GuardedFlags, so a flip
takes effect on the next request and a broken flag source never fails one. The rest
lives beside it: loading (engine.models), warm-up (engine.warmup, engine.warmers), KV and
memory accounting (engine.memory), bucket traffic (engine.traffic).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from engine import aot, decoding, group_encode, precompile, quantize, scheduler, validation
from engine.admission import Admission, AdmissionStats, PausePoint, unpaused
from engine.buckets import bucket_label
from engine.cancel import CancelSignal
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
from engine.memory import memory_snapshot
from engine.models import (
    INDUCTOR_OPTIONS,
    compile_options,
    cudagraphs_off,
    device_of,
    dtype_of,
    load_models,
    package_only,
    resolve_int8_encoder,
    single_owner,
)
from engine.owner import DeviceThread
from engine.protocol import (
    CUDAGRAPH_NONE,
    CUDAGRAPH_RECORDED,
    CUDAGRAPH_REPLAYED,
    DECODING_DIRECT,
    DECODING_SPECULATIVE,
    PATH_EAGER,
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
    WarmupStatus,
)
from engine.routing import Plan, Router
from engine.rows import Rows
from engine.runner import ModelRunner
from engine.traffic import BucketTraffic
from engine.warmers import BucketWarmer, FirstUseWarmer
from engine.warmup import Warmup

T = TypeVar("T")


@dataclass(frozen=True)
class _Ran:
    """What a request's decode ran: its route (after any eager fallback) and its times."""

    path: str
    length: int
    key: int | str | None
    recorded: int  # the ledger's recordings before it ran
    decoded: decoding.Decoded
    t_encoded: float
    t_device: float
    batch: scheduler.Job | None


class Runtime:
    """The torch-backed Engine (see engine.protocol.Engine); thread-safe."""

    def __init__(self, config: EngineConfig, flags: FlagProvider | None = None, *,
                 quantizer: quantize.Quantizer | None = None) -> None:
        if config.kv_headroom < config.speculative_k:
            raise ValueError("kv_headroom: must be >= speculative_k (verification look-ahead)")
        self.device = device_of(config.device)
        config = resolve_int8_encoder(config, self.device)
        self.config = config
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
        self.ledger = GraphLedger(cudagraphs=self.cudagraphs_off is None,
                                  tree_warmup=self._compile_on and single_owner(config))
        self.models = load_models(config, device=self.device, dtype=self.dtype,
                                  options=options, cache_root=self.cache_root,
                                  quantizer=quantizer, ledger=self.ledger)
        self.draft_length = DraftLength(k_max=self.k_max, k_initial=config.speculative_k)
        # Batched, a decode slot is a batch row (its caches); unbatched, a decode stream.
        rows = config.max_batch if config.max_batch > 1 else config.max_concurrency
        # A real caller that would wait while a synthetic one holds a row decodes on an
        # extra row (engine.admission): unbatched, the synthetic requests pause at their
        # step boundaries meanwhile; batched, the loop pauses as many synthetic rows as
        # keep its step at max_batch rows (engine.scheduler), which the CUDA-graph modes
        # allow too (the loop is the one thread making compiled calls, and no step grows
        # a batch-size class). Not unbatched in the CUDA-graph modes: a request paused on
        # the one device thread would hold up the real one it pauses for; there the
        # device thread runs a real request's decode before any synthetic one waiting
        # (engine.owner). engine.preempt_synthetic off keeps the old rule (a real caller
        # waits for a running synthetic one): for operators, and as an A/B's baseline arm.
        self._preempt = config.preempt_synthetic and not (
            self._compile_on and single_owner(config) and config.max_batch == 1)
        self._admission = Admission(rows, config.max_queue,
                                    max_queue_tokens=config.max_queue_tokens,
                                    preempt=self._preempt)
        self._flags = _guarded_flags(config, flags)
        self.rows = Rows(self.models, count=rows + self._preempt, device=self.device,
                         compile_on=self._compile_on, batched=config.max_batch > 1,
                         extra=self._preempt)
        self.router = Router(self.models, config.buckets, compile_on=self._compile_on,
                             is_warm=self.is_warm)
        self._traffic = BucketTraffic(self.cache_root)
        self._closed = False
        self._owned = self._compile_on and single_owner(config)
        self.warmup = self._new_warmup()
        self._first_use = FirstUseWarmer(self.models, self.warmup, self._watch,
                                         self.router.route, self.rows)
        self._scheduler: scheduler.Scheduler | None = None
        self._device_thread: DeviceThread | None = None
        self._start_threads()

    def _new_warmup(self) -> Warmup:
        """Return the warm-up of every bucket (its saved functions found, the last run's
        traffic read where the runtime compiles)."""
        saved_dir = None
        if self._compile_on:
            saved_dir = precompile.saved_dir(self.cache_root, self.config,
                                             self.info.model_version, self.device.type,
                                             repr(INDUCTOR_OPTIONS))
            self._traffic.load()
        warm_bucket = BucketWarmer(self.models, self.rows, self.ledger, owned=self._owned,
                                   cudagraphs_off=self.cudagraphs_off,
                                   group_size=self._group_size(), on_loop=self._on_loop)
        return Warmup(self.models, buckets=self.config.buckets, compile_on=self._compile_on,
                      saved_dir=saved_dir, order=self.warm_order,
                      warm_bucket=warm_bucket, watch=self._watch,
                      created=self._t_created, closed=lambda: self._closed,
                      finished=self.ledger.warm_done, on_owner=self._on_owner)

    def _group_size(self) -> int:
        """Return the most arrivals of one bucket the loop encodes in one call (below 2:
        each alone): batched CPU engines only (on CUDA the grouped encoder is unchecked)."""
        if self.config.max_batch < 2 or self.device.type != "cpu":
            return 0
        return min(self.config.max_batch, group_encode.GROUP_MAX)

    def _on_loop(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the batching loop's thread (this one when there is no loop)."""
        if self._scheduler is not None:
            return cast(T, self._scheduler.call(fn))
        return fn()

    def _start_threads(self) -> None:
        """Start the batching loop (max_batch > 1) and, in the CUDA-graph modes, make one
        thread own every compiled call, warm-up included (cudagraph trees are per thread):
        the loop, else a device thread. Elsewhere the warm-up compiles on its own thread."""
        config = self.config
        if config.max_batch > 1:
            self._scheduler = scheduler.Scheduler(
                self.rows, max_batch=config.max_batch, window_max_s=config.batch_window_max_s,
                waiting=lambda: self._admission.waiting,
                extra_row=self._admission.extra if self._preempt else None)
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
        """Return admission's counters; batched, with the loop's own preemptions and the
        rows it pauses now (engine.scheduler)."""
        stats = self._admission.stats()
        if self._scheduler is None:
            return stats
        return replace(stats, preemptions=stats.preemptions + self._scheduler.preemptions,
                       paused=stats.paused + self._scheduler.paused)

    def flag_errors(self) -> int:
        return self._flags.errors

    def flag_source(self) -> str:
        return self._flags.source

    def compile_snapshot(self) -> CompileSnapshot:
        return self._watch.snapshot()

    def memory_snapshot(self) -> MemorySnapshot:
        return memory_snapshot(self.device, self.rows.kv, self.weight_bytes())

    def weight_bytes(self) -> int:
        """Return the bytes of the lean weights (target + draft), each storage counted once."""
        return self.models.weight_bytes()

    def kv_cache_bytes(self) -> int:
        """Return the KV bytes allocated now: static self caches plus running requests' K/V."""
        return self.rows.kv.total()

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

    def _on_owner(self, fn: Callable[[], T], *, synthetic: bool = False) -> T:
        """Run `fn` on the thread that owns the compiled calls (this one when none does);
        `synthetic`: a probe's decode, which the device thread runs after real ones."""
        if self._owned and self._scheduler is not None:
            return cast(T, self._scheduler.call(fn))
        if self._device_thread is not None:
            return self._device_thread.call(fn, synthetic=synthetic)
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


    # --- generate ----------------------------------------------------------------------

    def _tokenize(self, text: object) -> list[int]:
        return list(self.tokenizer(validation.check_text(self.config, text)).input_ids)

    def generate(self, text: str, *, max_new_tokens: int | None = None, canary: bool = False,
                 override: FlagOverride | None = None, timeout_s: float | None = None,
                 cancel: CancelSignal | None = None) -> GenerateResult:
        """Generate greedily; raise InvalidRequest, Overloaded, RequestTimeout, Cancelled or
        NotReady."""
        t_entry = time.perf_counter()
        if self._closed:
            raise NotReady("engine is closed")
        plan = self._plan(text, max_new_tokens, override, timeout_s, t_entry, cancel)
        with plan.runner.held() as reload_s:
            # Float weights int8 serving had released come back from disk first: that wait
            # is not the model's time (the float32 arm's latency measures the model), so
            # the request's times start after it; its deadline does not move.
            t_entry += reload_s
            # Likewise its compiled functions' first warm-up (int8 serving defers it).
            t_entry += self._first_use.deferred(plan.n, plan.flags, plan.runner)
            if not plan.native:
                self._first_use.compiled_step(plan.n, plan.flags, plan.runner)
            # While it waits it carries its input and the most its row may decode.
            with self._admission.slot(plan.deadline, synthetic=canary,
                                      tokens=plan.n + plan.max_new, cancel=plan.cancel) as slot:
                t_slot = time.perf_counter()
                pause = PausePoint(self._admission, plan.deadline, plan.cancel) \
                    if canary and self._preempt and self._scheduler is None else None
                ran = self._decode(plan, slot, synthetic=canary, pause=pause)
            # Paused for real requests: at its step boundaries (unbatched), or its row left
            # out of the loop's steps (batched).
            if pause is not None:
                stamps, preempted_s = pause.unpaused(ran.decoded.stamps), pause.paused_s
            elif ran.batch is not None and ran.batch.pauses:
                stamps = unpaused(ran.decoded.stamps, ran.batch.pauses)
                preempted_s = ran.batch.preempted_s
            else:
                return self._result(plan, ran, canary=canary, t_entry=t_entry, t_slot=t_slot)
            ran = replace(ran, decoded=replace(ran.decoded, stamps=stamps))
            return self._result(plan, ran, canary=canary, t_entry=t_entry, t_slot=t_slot,
                                preempted_s=preempted_s)

    def _plan(self, text: str, max_new_tokens: int | None, override: FlagOverride | None,
              timeout_s: float | None, t_entry: float, cancel: CancelSignal | None = None
              ) -> Plan:
        """Check and tokenize a request, read the flags, and decide what it will run."""
        validation.check_timeout(timeout_s)
        max_new = validation.max_new_tokens(self.config, max_new_tokens)
        ids = self._tokenize(text)
        n = len(ids)
        validation.check_input_tokens(self.config, n)
        label = bucket_label(n, self.config.buckets)
        self._traffic.count(label)
        flags = self._flags.read()
        if self._scheduler is not None:
            # The batching flag off is max_batch 1: one row at a time, and the callers
            # after it wait in admission's bounded queue (max_queue, max_queue_tokens),
            # not in the loop's inbox, which nothing bounds. A per-request override (the
            # burst's unbatched arm) runs its own requests alone but limits no one else.
            self._admission.set_limit(self.config.max_batch if flags.batching else 1)
        if override is not None:
            flags = override.apply(flags, label)
        speculate, probation = self.router.speculate(flags, label)
        # The measured draft length; 0 when speculation would be slower than direct here,
        # unless the caller asked for speculation explicitly (A/B arms, benchmarks).
        # Probation requests are the policy's measurement of recovery: they speculate too.
        forced = (override is not None and override.speculative is True) or probation
        fallback = self.config.speculative_fallback and not forced
        k = self.draft_length.choose(label, fallback=fallback) if speculate else 0
        quantized = self.target_q is not None and flags.quantized_for(label)
        runner = self.target_q if quantized and self.target_q is not None else self.target
        return Plan(ids=ids, label=label, flags=flags, max_new=max_new, k=k,
                    probation=probation and k > 0, quantized=quantized,
                    native=flags.native_step, runner=runner,
                    deadline=None if timeout_s is None else t_entry + timeout_s, cancel=cancel)

    def _decode(self, plan: Plan, slot: int, *, synthetic: bool = False,
                pause: PausePoint | None = None) -> _Ran:
        """Decode `plan` on row `slot` (`pause`: a synthetic request's, unbatched); a
        compiled route that fails runs eager instead."""
        path, length, key = self.router.route(plan.n, plan.flags)
        recorded = self.ledger.recorded()
        try:
            decoded, t_encoded, t_device, batch = self._run_any(
                plan.ids, length, key, slot, plan.k, plan.max_new, plan.deadline,
                plan.quantized, plan.native, alone=not plan.flags.batching,
                synthetic=synthetic, cancel=plan.cancel, pause=pause)
        except (RequestTimeout, Cancelled, DoesNotFit, NotReady):
            raise
        except Exception:
            if key is None:
                raise
            # A compile that fails must not fail the request: count it, run eager.
            self._watch.record_failure()
            path, key = PATH_EAGER, None
            decoded, t_encoded, t_device, batch = self._run_any(
                plan.ids, length, key, slot, plan.k, plan.max_new, plan.deadline,
                plan.quantized, plan.native, alone=not plan.flags.batching,
                synthetic=synthetic, cancel=plan.cancel, pause=pause)
        return _Ran(path=path, length=length, key=key, recorded=recorded, decoded=decoded,
                    t_encoded=t_encoded, t_device=t_device, batch=batch)

    def _result(self, plan: Plan, ran: _Ran, *, canary: bool, t_entry: float,
                t_slot: float, preempted_s: float = 0.0) -> GenerateResult:
        """Learn from what `ran` decoded and return it measured as a GenerateResult."""
        decoded, batch, k = ran.decoded, ran.batch, plan.k
        speculate = k > 0
        out = decoded.tokens
        if batch is not None:
            # What ran: a request that asked to speculate decodes direct while batched.
            speculate = decoded.spec.drafts > 0
            k = k if speculate else 0
        self._learn(plan.label, decoded, ran.t_encoded, speculate,
                    alone=batch is None or (batch.batch_max <= 1 and not batch.turn_s))
        text_out = self.tokenizer.decode(out, skip_special_tokens=True)
        stamps = decoded.stamps
        return GenerateResult(
            text=text_out, output_ids=tuple(out), input_tokens=plan.n, bucket=plan.label,
            padded_length=ran.length, output_tokens=len(out), path=ran.path,
            decoding=DECODING_SPECULATIVE if speculate else DECODING_DIRECT,
            queue_wait_s=t_slot - t_entry, encoder_s=ran.t_encoded - ran.t_device,
            ttft_s=(stamps[0] - t_slot) if stamps else 0.0,
            decode_token_s=tuple(b - a for a, b in zip(stamps, stamps[1:], strict=False)),
            total_s=time.perf_counter() - t_entry, preempted_s=preempted_s, spec=decoded.spec,
            canary=canary, probation=plan.probation,
            kv_request_bytes=decoded.kv_request_bytes, spec_k=k, quantized=plan.quantized,
            native_step=self.router.on_native(ran.key, plan.quantized, plan.native),
            cudagraph=self._cudagraph(ran.key, ran.recorded), **_batch_fields(batch, t_slot),
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

    def _cudagraph(self, key: int | str | None, recorded: int) -> str:
        """Return whether a request routed to `key` replayed CUDA graphs (a recording while
        it ran, its own or a batch-mate's, counts against it)."""
        if key is None or self.cudagraphs_off is not None:
            return CUDAGRAPH_NONE
        return CUDAGRAPH_REPLAYED if self.ledger.recorded() == recorded else CUDAGRAPH_RECORDED


    def _run_any(self, ids: list[int], length: int, key: int | str | None, slot: int,
                 k: int, max_new: int, deadline: float | None, quantized: bool,
                 native: bool = True, *, alone: bool = False, synthetic: bool = False,
                 cancel: CancelSignal | None = None, pause: PausePoint | None = None
                 ) -> tuple[decoding.Decoded, float, float, scheduler.Job | None]:
        """Decode in the batching loop when there is one, else in this thread (`pause`:
        unbatched, at every step boundary)."""
        if self._scheduler is None:
            return (*self._on_owner(lambda: self.rows.run(ids, length, key, slot, k, max_new,
                                                           deadline, quantized, native,
                                                           cancel, pause),
                                    synthetic=synthetic), None)
        job = scheduler.Job(ids=ids, length=length, key=key, k=k, max_new=max_new,
                            deadline=deadline, quantized=quantized, row=slot, native=native,
                            alone=alone, synthetic=synthetic)
        if cancel is not None:
            job.cancelled = cancel  # the loop checks it at every step boundary
        self._scheduler.submit(job)
        decoded = self._scheduler.wait(job)
        return replace(decoded, kv_request_bytes=job.held), job.t_encoded, job.t_device, job


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




def _guarded_flags(config: EngineConfig, flags: FlagProvider | None) -> GuardedFlags:
    """Return the flags every request reads, guarded against a broken provider."""
    provider = flags or InMemoryFlagProvider()
    # In-memory flags need no file: only a provider that can be unreachable keeps one.
    state_file = None if type(provider) is InMemoryFlagProvider else config.flags_file
    return GuardedFlags(provider, config.flag_timeout_s, state_file=state_file or None)


def _batch_fields(job: scheduler.Job | None, t_slot: float) -> dict[str, Any]:
    """Return GenerateResult's batching fields for a request (None: not batched)."""
    if job is None:
        return {}
    steps = max(job.steps, 1)
    return dict(batch_wait_s=max(job.t_picked - t_slot, 0.0) + job.turn_s,
                batch_join_step=job.joined_step,
                batch_size_mean=job.batch_sum / steps if job.steps else 1.0,
                batch_size_max=max(job.batch_max, 1))
