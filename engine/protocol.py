"""The engine's public contract: plain dataclasses and a protocol, no torch.

Everything outside `engine/` talks to the runtime only through what this module
defines, so `probes`, `alerts`, `storage` and `monitor` import without torch.
The torch-backed implementation is built by `engine.load_engine()`, which imports
torch lazily.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import vocab
from engine.admission import AdmissionStats as AdmissionStats  # Engine.admission_stats()
from engine.cancel import CancelSignal as CancelSignal  # Engine.generate(cancel=)
from vocab import Decoding, Path

# Path values: how the input shapes ran.
PATH_COMPILED = Path.COMPILED.value  # bucketed static shapes, compiled graphs
PATH_EXACT = Path.EXACT.value  # bucketing off: exact input shape, compiled (may recompile)
PATH_EAGER = Path.EAGER.value  # compile off (fallback) or bucket not warm yet
PATH_OVERFLOW = Path.OVERFLOW.value  # longer than the largest bucket: always eager, counted
PATHS = (PATH_COMPILED, PATH_EXACT, PATH_EAGER, PATH_OVERFLOW)

# Decoding values.
DECODING_DIRECT = Decoding.DIRECT.value
DECODING_SPECULATIVE = Decoding.SPECULATIVE.value
DECODINGS = (DECODING_DIRECT, DECODING_SPECULATIVE)

BUCKET_OVERFLOW = vocab.BUCKET_OVERFLOW

# GenerateResult.cudagraph values: whether a request's compiled calls replayed CUDA graphs.
CUDAGRAPH_REPLAYED = "replayed"  # every call replayed a graph recorded before it
CUDAGRAPH_RECORDED = "recorded"  # a graph was recorded while it ran (after warm-up: a miss)
CUDAGRAPH_NONE = "none"  # no CUDA graphs on its path (eager, CPU, compile_mode default)


@dataclass(frozen=True)
class SpecStats:
    """Speculative-decoding counters of one request (vLLM conventions).

    drafts: verification steps (one target forward over k proposed tokens).
    draft_tokens: tokens proposed by the draft model.
    accepted_tokens: proposed tokens the target agreed with.
    accepted_per_position: accepted_per_position[i] counts drafts whose
        (i+1)-th proposed token was accepted.
    target_forwards: target decoder forward passes (verification and plain steps).
    """

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
    target_forwards: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Return accepted / proposed, or None when nothing was proposed."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None


@dataclass(frozen=True)
class GenerateResult:
    """What one generate call did and how long each part took.

    Intervals (all seconds, from time.perf_counter):
    queue_wait_s: from the call entering the engine to a decode slot being granted.
    encoder_s: tokenized input on device -> encoder output ready (includes padding copy).
    ttft_s: slot granted -> first output token confirmed on the host. Direct: the end of
        the first step call (a call decodes several tokens, see engine.decoding);
        speculative: the end of the first verification, since no token is confirmed
        before the target has checked it.
    decode_token_s: one entry per output token after the first: the time between
        consecutive tokens being confirmed. Tokens confirmed together (one speculative
        round, one multi-token step call) share one confirmation time, so the first
        token of a round carries the round's time and the others 0.0.
    total_s: call entry -> result returned (queue wait + tokenize + generate + detokenize).
    preempted_s: the part of total_s a synthetic request spent paused for real requests:
        unbatched, at its step boundaries while a real request decoded on admission's
        extra slot (engine.admission); batched, its row left out of the loop's steps to
        make room for real rows (engine.scheduler). It is left out of decode_token_s and
        ttft_s (a batched row may pause before its first token), so those stay the
        request's own times; total_s - preempted_s is its latency had nobody preempted
        it. 0.0 for real requests, which never pause.
    batch_wait_s: decode slot (batch row) granted -> the batching loop took the request up
        (its encoder starts): the window and the step in flight; plus the steps its row sat
        out while another row took its turn (engine.scheduler), which ttft_s or
        decode_token_s also hold; 0.0 when not batched.

    Batching (engine.scheduler; unbatched requests read as one row throughout):
    batch_join_step: the loop's step count when the request joined the batch (-1: not
        batched). batch_size_mean / batch_size_max: rows in the steps it took part in, its
        own included (a speculative round counts as a step of one row).

    Bytes:
    kv_request_bytes: the cross-attention K/V tensors this request allocated (target and
        draft encoder outputs); the static self-attention caches are in MemorySnapshot.
    """

    text: str
    output_ids: tuple[int, ...]
    input_tokens: int
    bucket: str  # str(bucket edge), or "overflow"
    padded_length: int
    output_tokens: int
    path: str  # one of PATHS
    decoding: str  # one of DECODINGS
    queue_wait_s: float
    encoder_s: float
    ttft_s: float
    decode_token_s: tuple[float, ...]
    total_s: float
    preempted_s: float = 0.0
    spec: SpecStats = field(default_factory=SpecStats)
    canary: bool = False  # canary traffic never enters real-traffic statistics
    probation: bool = False  # speculated although the bucket's flag is off (recovery sampling)
    kv_request_bytes: int = 0
    spec_k: int = 0  # draft tokens per round this request used; 0 when it ran direct
    quantized: bool = False  # the target ran with int8 weights (engine.quantization: int8)
    native_step: bool = False  # the target decoded with the C step (engine.native)
    batch_wait_s: float = 0.0
    batch_join_step: int = -1
    batch_size_mean: float = 1.0
    batch_size_max: int = 1
    cudagraph: str = CUDAGRAPH_NONE  # one of the CUDAGRAPH_* values

    @property
    def padding_waste(self) -> float:
        """Return the share of the padded input that is padding."""
        if self.padded_length <= 0:
            return 0.0
        return (self.padded_length - self.input_tokens) / self.padded_length

    @property
    def own_s(self) -> float:
        """Return total_s less preempted_s: what a canary measures of the engine."""
        return self.total_s - self.preempted_s

    @property
    def per_token_s(self) -> float | None:
        """Return the mean time per output token after the first, or None."""
        if not self.decode_token_s:
            return None
        return sum(self.decode_token_s) / len(self.decode_token_s)


@dataclass(frozen=True)
class CompileDelta:
    """The difference between two compile snapshots."""

    graphs: int
    recompiles: int
    recompile_reasons: Mapping[str, int]
    graph_breaks: int
    graph_break_reasons: Mapping[str, int]
    compile_seconds: float
    recompile_limit_hits: int
    compile_failures: int

    @classmethod
    def none(cls) -> CompileDelta:
        """Return the delta of an interval in which nothing compiled."""
        return cls(graphs=0, recompiles=0, recompile_reasons={}, graph_breaks=0,
                   graph_break_reasons={}, compile_seconds=0.0, recompile_limit_hits=0,
                   compile_failures=0)

    def plus(self, other: CompileDelta) -> CompileDelta:
        """Return both deltas together (the intervals of the two must not overlap).

        Probe cycles sum the deltas of single calls this way, so what compiled between
        two calls (real traffic) is left out of either sum.
        """

        def add(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
            return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}

        return CompileDelta(
            graphs=self.graphs + other.graphs,
            recompiles=self.recompiles + other.recompiles,
            recompile_reasons=add(self.recompile_reasons, other.recompile_reasons),
            graph_breaks=self.graph_breaks + other.graph_breaks,
            graph_break_reasons=add(self.graph_break_reasons, other.graph_break_reasons),
            compile_seconds=self.compile_seconds + other.compile_seconds,
            recompile_limit_hits=self.recompile_limit_hits + other.recompile_limit_hits,
            compile_failures=self.compile_failures + other.compile_failures,
        )

    def minus(self, other: CompileDelta) -> CompileDelta:
        """Return what this delta holds beyond `other` (never below zero)."""

        def sub(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
            return {k: v - b.get(k, 0) for k, v in a.items() if v - b.get(k, 0) > 0}

        return CompileDelta(
            graphs=max(0, self.graphs - other.graphs),
            recompiles=max(0, self.recompiles - other.recompiles),
            recompile_reasons=sub(self.recompile_reasons, other.recompile_reasons),
            graph_breaks=max(0, self.graph_breaks - other.graph_breaks),
            graph_break_reasons=sub(self.graph_break_reasons, other.graph_break_reasons),
            compile_seconds=max(0.0, self.compile_seconds - other.compile_seconds),
            recompile_limit_hits=max(0, self.recompile_limit_hits - other.recompile_limit_hits),
            compile_failures=max(0, self.compile_failures - other.compile_failures),
        )


@dataclass(frozen=True)
class CompileSnapshot:
    """Cumulative compile counters since process start, read from torch itself."""

    graphs: int = 0
    recompiles: int = 0
    recompile_reasons: Mapping[str, int] = field(default_factory=dict)
    graph_breaks: int = 0
    graph_break_reasons: Mapping[str, int] = field(default_factory=dict)
    compile_seconds: float = 0.0
    recompile_limit_hits: int = 0
    compile_failures: int = 0
    # CUDA graphs torch's cudagraph trees recorded: one per function and tree position, so
    # a signature seen before still records where it is called after a new predecessor.
    cudagraph_recordings: int = 0

    def diff(self, before: CompileSnapshot) -> CompileDelta:
        """Return what happened between `before` and this snapshot."""

        def sub(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
            return {k: v - b.get(k, 0) for k, v in a.items() if v - b.get(k, 0) > 0}

        return CompileDelta(
            graphs=self.graphs - before.graphs,
            recompiles=self.recompiles - before.recompiles,
            recompile_reasons=sub(self.recompile_reasons, before.recompile_reasons),
            graph_breaks=self.graph_breaks - before.graph_breaks,
            graph_break_reasons=sub(self.graph_break_reasons, before.graph_break_reasons),
            compile_seconds=self.compile_seconds - before.compile_seconds,
            recompile_limit_hits=self.recompile_limit_hits - before.recompile_limit_hits,
            compile_failures=self.compile_failures - before.compile_failures,
        )


@dataclass(frozen=True)
class MemorySnapshot:
    """Memory in bytes; CUDA fields are None on CPU.

    KV bytes are those of tensors actually allocated:
    kv_static_bytes: the self-attention caches, allocated once per decode stream (and,
        batched on a compiled step, each row's cross K/V buffer: engine.row_buffers).
    kv_request_bytes: cross-attention K/V of the requests running now (per request).
    kv_cache_bytes: kv_static_bytes + kv_request_bytes (now).
    kv_request_peak_bytes / kv_peak_bytes: the largest kv_request_bytes / kv_cache_bytes
        seen since start.
    """

    device: str
    rss_bytes: int
    kv_cache_bytes: int
    kv_static_bytes: int = 0
    kv_request_bytes: int = 0
    kv_request_peak_bytes: int = 0
    kv_peak_bytes: int = 0
    # Model weights resident on the device (target + draft), each storage counted once.
    weight_bytes: int = 0
    cuda_allocated_bytes: int | None = None
    cuda_reserved_bytes: int | None = None
    cuda_peak_bytes: int | None = None
    cuda_alloc_retries: int | None = None
    cuda_ooms: int | None = None


@dataclass(frozen=True)
class WarmupStatus:
    """Progress of compiling every bucket.

    bucket_seconds: str(bucket edge) -> seconds that bucket's warm-up took.
    cache_hit: whether the warm-up served every bucket from the compiled functions
      `tailwatch engine precompile` saved (None: not known yet, or compile off).
    ready_seconds: engine construction -> every bucket warm (None until then).
    """

    total_buckets: int
    warm_buckets: int
    seconds: float
    done: bool
    error: str | None = None
    bucket_seconds: Mapping[str, float] = field(default_factory=dict)
    cache_hit: bool | None = None
    ready_seconds: float | None = None
    # str(bucket edge) -> what its warm-up left: "recorded N CUDA graph(s)", "no CUDA
    # graphs: <why>" (CPU, compile_mode default), or "eager: <why>" (it failed: served eager).
    bucket_graphs: Mapping[str, str] = field(default_factory=dict)

    @property
    def eager_buckets(self) -> tuple[str, ...]:
        """Return the buckets whose warm-up failed, so they serve eager."""
        return tuple(b for b, g in self.bucket_graphs.items() if g.startswith("eager"))


@dataclass(frozen=True)
class GraphSnapshot:
    """Compiled calls since start, counted by signature (engine.graphs).

    A signature is what decides whether torch replays a recorded CUDA graph: the function,
    its inputs' shapes and its static inputs' addresses. Counted on every device; only
    where `cudagraphs` is True does a new signature record a CUDA graph.
    recorded / replayed: calls with a new / an already seen signature.
    recorded_after_warmup: new signatures once the warm-up finished (a request paid for a
        recording; 0 when the warm-up covered what requests call).
    off_owner_calls: compiled calls made off the thread that owns them (must stay 0).
    aliased_inputs: inputs that shared storage with another compiled call's output (counted
        only where the runtime checks it, tests; must stay 0).
    """

    cudagraphs: bool = False
    signatures: int = 0
    recorded: int = 0
    recorded_after_warmup: int = 0
    replayed: int = 0
    off_owner_calls: int = 0
    aliased_inputs: int = 0


# Upper edges (seconds) of the step-duration histogram buckets (BatchSnapshot.step_buckets).
STEP_SECONDS_EDGES = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


@dataclass(frozen=True)
class BatchSnapshot:
    """The batching scheduler now, and its step times since start.

    Read through the engine's `batch_snapshot()` (Engine).

    max_batch: rows the scheduler may run (1: not batched, the other fields stay 0).
    batch_size: rows in the running batch now.
    rows_waiting: requests waiting for a row (the admission queue) or admitted and not yet
        taken up by the loop.
    window_s / window_max_s: the batching window now (adapted) and its configured maximum.
    steps: steps run since start (a batched decode step or a speculative round each).
    turn_steps: those of them in which rows waited their turn (engine.scheduler: one row
        stepped alone while the others waited).
    step_count / step_seconds_sum / step_buckets, by phase ("encode": one request's encoder
        as it joins; "decode": one batched direct step of every row; "verify": one
        speculative round, draft and verification): how many, their total seconds, and
        cumulative counts per STEP_SECONDS_EDGES edge (a Prometheus histogram's buckets).
    """

    max_batch: int = 1
    batch_size: int = 0
    rows_waiting: int = 0
    window_s: float = 0.0
    window_max_s: float = 0.0
    steps: int = 0
    turn_steps: int = 0
    step_count: Mapping[str, int] = field(default_factory=dict)
    step_seconds_sum: Mapping[str, float] = field(default_factory=dict)
    step_buckets: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class DraftLengthSnapshot:
    """Per bucket (str(edge)): the speculative draft length k the engine chose from the
    measured acceptance and costs (0: the bucket falls back to direct decoding), and the
    per-token acceptance estimate it used (absent until measured)."""

    k: Mapping[str, int] = field(default_factory=dict)
    acceptance: Mapping[str, float] = field(default_factory=dict)
    expected_speedup: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineInfo:
    """What identifies the running model and its optimizations (baselines key on it)."""

    model_version: str
    config_hash: str
    device: str
    dtype: str
    buckets: tuple[int, ...]
    speculative_available: bool
    compile_mode: str
    # Why speculation is on or off, said once at start ("off: no engine.draft_dir ...").
    speculative_reason: str = ""
    quantization: str = "none"  # "int8": int8 target weights are loaded (the quantized flag)
    # Which decode step serves the optimized path: "target native, draft native" (the C
    # step, engine.native), "compiled (...)" with why, or "eager (compile_mode off)".
    decode_step: str = ""


@dataclass(frozen=True)
class RuntimeFlags:
    """Switches the engine reads on every request.

    speculative: per-bucket override keyed by str(bucket edge); a bucket not in the
        mapping uses speculative_default.
    speculative_probation: share (0..1) of requests in a bucket whose speculative flag
        is off that still speculate, so acceptance recovery can be measured.
    compiled: False forces the eager fallback.
    bucketing: False runs exact input shapes (for experiments; recompiles).
    manual_off: scopes ("global" or bucket labels) where a person turned speculation off;
        probation never applies there (manual wins, a kill switch must not leak).
    quantized: per-bucket int8 weights, keyed like speculative; a bucket not in the
        mapping uses quantized_default (both are moot unless engine.quantization is int8).
    native_step: False decodes with the compiled step where the C step is bound (moot
        where it is not).
    batching: False runs each request with no batch-mates, as engine.max_batch 1 would
        (moot where max_batch is 1).
    """

    speculative_default: bool = True
    speculative: Mapping[str, bool] = field(default_factory=dict)
    speculative_probation: float = 0.0
    compiled: bool = True
    bucketing: bool = True
    manual_off: frozenset[str] = frozenset()
    quantized_default: bool = True
    quantized: Mapping[str, bool] = field(default_factory=dict)
    native_step: bool = True
    batching: bool = True

    def quantized_for(self, bucket: str) -> bool:
        """Return whether the target runs with int8 weights for `bucket` (when loaded)."""
        return self.quantized.get(bucket, self.quantized_default)

    def speculative_for(self, bucket: str) -> bool:
        """Return whether speculation is on for `bucket`."""
        return self.speculative.get(bucket, self.speculative_default)

    def probation_for(self, bucket: str) -> float:
        """Return the probation share of `bucket` (0 where a manual flag turned it off)."""
        if "global" in self.manual_off or bucket in self.manual_off:
            return 0.0
        return self.speculative_probation


@dataclass(frozen=True)
class FlagOverride:
    """Per-call override used by A/B probes: None leaves the flag as provided."""

    compiled: bool | None = None
    speculative: bool | None = None
    bucketing: bool | None = None
    quantized: bool | None = None
    native_step: bool | None = None
    batching: bool | None = None

    def apply(self, flags: RuntimeFlags, bucket: str) -> RuntimeFlags:
        """Return `flags` with this override applied for `bucket`."""
        out = flags
        if self.compiled is not None:
            out = replace(out, compiled=self.compiled)
        if self.bucketing is not None:
            out = replace(out, bucketing=self.bucketing)
        if self.speculative is not None:
            out = replace(out, speculative={**out.speculative, bucket: self.speculative},
                          speculative_probation=0.0)
        if self.quantized is not None:
            out = replace(out, quantized={**out.quantized, bucket: self.quantized})
        if self.native_step is not None:
            out = replace(out, native_step=self.native_step)
        if self.batching is not None:
            out = replace(out, batching=self.batching)
        return out


# The reference path outputs are compared with (probes.quality): eager, direct decoding,
# the exact input shape, float32 weights.
REFERENCE = FlagOverride(compiled=False, speculative=False, bucketing=False, quantized=False)


@runtime_checkable
class FlagProvider(Protocol):
    """Source of runtime flags; may raise or be slow (the engine guards it).

    A provider whose `flags()` only returns flags it already holds in memory (never I/O,
    never a lock held across I/O) says so with a class attribute `in_memory = True`: the
    engine then reads it on the request's thread (engine.flags.GuardedFlags).
    """

    def flags(self) -> RuntimeFlags: ...

    def invalidate(self) -> None:
        """Forget any cached flags so the next `flags()` reads the source (may be a no-op)."""
        ...


class InMemoryFlagProvider:
    """Thread-safe in-memory flags (the default provider)."""

    in_memory = True  # FlagProvider: read on the request's thread

    def __init__(self, flags: RuntimeFlags | None = None) -> None:
        self._lock = threading.Lock()
        self._flags = flags or RuntimeFlags()

    def flags(self) -> RuntimeFlags:
        with self._lock:
            return self._flags

    def invalidate(self) -> None:
        """Do nothing: in-memory flags are never stale."""

    def set(self, flags: RuntimeFlags) -> None:
        """Replace all flags."""
        with self._lock:
            self._flags = flags

    def update(self, **changes: object) -> RuntimeFlags:
        """Change some fields and return the new flags."""
        with self._lock:
            self._flags = replace(self._flags, **changes)  # type: ignore[arg-type]
            return self._flags


@runtime_checkable
class Engine(Protocol):
    """What probes and the service may call. Implementations are thread-safe."""

    @property
    def info(self) -> EngineInfo: ...

    def generate(
        self,
        text: str,
        *,
        max_new_tokens: int | None = None,
        canary: bool = False,
        override: FlagOverride | None = None,
        timeout_s: float | None = None,
        cancel: CancelSignal | None = None,
    ) -> GenerateResult:
        """Generate greedily; raise InvalidRequest, Overloaded or EngineError.

        timeout_s: seconds from the call to its result, the wait for a slot included;
        past them the request leaves the queue, or its batch at the next step, with
        RequestTimeout. cancel: once set (from any thread), the request leaves the same
        way, where the deadline is checked, with Cancelled; a batch-mate's tokens do not
        change.
        """
        ...

    def bucket_for(self, input_tokens: int) -> str:
        """Return the bucket label a request of `input_tokens` tokens would use."""
        ...

    def count_tokens(self, text: str) -> int:
        """Return the number of input tokens `text` encodes to (EOS included)."""
        ...

    def warm_up(self, *, background: bool = True) -> None:
        """Compile every bucket (in a thread when background)."""
        ...

    def warmup_status(self) -> WarmupStatus: ...

    def compile_snapshot(self) -> CompileSnapshot: ...

    def memory_snapshot(self) -> MemorySnapshot: ...

    def queue_depth(self) -> int:
        """Return requests waiting for a decode slot."""
        ...

    def admission_stats(self) -> AdmissionStats:
        """Return admission counters by origin (real traffic, synthetic probes)."""
        ...

    def flag_errors(self) -> int:
        """Return how often the flag provider raised or timed out."""
        ...

    def flag_source(self) -> str:
        """Return where the flags in use came from: "live", "file" (last known) or "defaults"."""
        ...

    def batch_snapshot(self) -> BatchSnapshot:
        """Return the batching scheduler's state (max_batch 1: nothing batched)."""
        ...

    def draft_length_snapshot(self) -> DraftLengthSnapshot:
        """Return the draft length k chosen per bucket (0: direct fallback) and its inputs."""
        ...

    def graph_snapshot(self) -> GraphSnapshot:
        """Return the compiled calls' graph counts (CUDA graphs recorded and replayed)."""
        ...

    def close(self) -> None: ...
