"""A deterministic engine implementing `engine.protocol.Engine` without torch.

Used by tests, benchmarks and demos: latencies are computed from the input and output
lengths (optionally also slept, scaled), speculative acceptance depends on the domain,
compile counters move like the real runtime's (a new shape on the exact path recompiles),
and it can hang (until released, or its call cancelled), leak memory, raise, or refuse
work when its bounded queue is full (`capacity`: a plain in-flight cap) or admit through
the engine's own admission control (`admission`: engine.admission.Admission, real traffic
before synthetic; a call's cancel signal ends its wait there too).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace

from engine.admission import Admission, AdmissionStats
from engine.errors import Cancelled, InvalidRequest, Overloaded
from engine.protocol import (
    BUCKET_OVERFLOW,
    DECODING_DIRECT,
    DECODING_SPECULATIVE,
    PATH_COMPILED,
    PATH_EAGER,
    PATH_EXACT,
    PATH_OVERFLOW,
    BatchSnapshot,
    CancelSignal,
    CompileSnapshot,
    DraftLengthSnapshot,
    EngineInfo,
    FlagOverride,
    FlagProvider,
    GenerateResult,
    GraphSnapshot,
    InMemoryFlagProvider,
    MemorySnapshot,
    SpecStats,
    WarmupStatus,
)

_IN_DOMAIN_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz .")
# A hung call looks at its cancel signal this often (a fake: nothing rides on the latency).
_HANG_POLL_S = 0.01


@dataclass
class FakeTimings:
    """Seconds the fake charges; eager/exact/direct multiply the compiled speculative cost."""

    base_s: float = 0.004
    per_input_token_s: float = 0.00002
    per_output_token_s: float = 0.003
    eager_factor: float = 1.5
    direct_factor: float = 1.4
    # A compiled/exact call's seconds when the C step is bound but off for it (the
    # native_step flag or override): the compiled step against the C step.
    compiled_step_factor: float = 1.2
    sleep_scale: float = 0.0  # real seconds slept per charged second (0: no sleeping)
    # Batching: each row beyond the first adds this share to a step's time (over-batching
    # in tests), and each call waits queue_wait_s for a row before it runs.
    per_row_factor: float = 0.0
    queue_wait_s: float = 0.0
    # (bucket, path, decoding) -> a call's total seconds there, overriding the formula
    # (ttft and per-token times scale with it): fixes each A/B arm's latency in tests.
    total_s: dict[tuple[str, str, str], float] = field(default_factory=dict)


@dataclass
class FakeState:
    """Counters the fake mutates (inspect them in tests)."""

    calls: int = 0
    canary_calls: int = 0
    in_flight: int = 0
    rss_bytes: int = 100_000_000
    kv_cache_bytes: int = 1_000_000
    graphs: int = 0
    recompiles: Counter[str] = field(default_factory=Counter)
    compiled_shapes: set[tuple[str, int]] = field(default_factory=set)


class FakeEngine:
    """Thread-safe fake engine; see the module docstring."""

    def __init__(
        self,
        *,
        buckets: tuple[int, ...] = (16, 32, 64, 128, 256),
        max_input_tokens: int = 1024,
        output_tokens: int = 24,
        acceptance: dict[str, float] | None = None,
        speculative_k: int = 4,
        timings: FakeTimings | None = None,
        flags: FlagProvider | None = None,
        capacity: int | None = None,
        admission: Admission | None = None,
        leak_bytes_per_call: int = 0,
        model_version: str = "fake-t5",
        native_step: bool = False,
    ) -> None:
        if capacity is not None and admission is not None:
            raise ValueError("capacity, admission: give one or neither")
        self.buckets = buckets
        self.max_input_tokens = max_input_tokens
        self.output_tokens = output_tokens
        self.acceptance = acceptance or {"in_domain": 0.8, "shifted": 0.2}
        self.k = speculative_k
        self.timings = timings or FakeTimings()
        self.flag_provider = flags or InMemoryFlagProvider()
        self.capacity = capacity  # concurrent calls admitted; None = unbounded
        self.admission = admission
        self.leak_bytes_per_call = leak_bytes_per_call
        self.state = FakeState()
        self.hang = threading.Event()  # set: calls block until `release` is set
        self.release = threading.Event()
        self.fail_with: BaseException | None = None
        self._lock = threading.Lock()
        # native_step: a C decode step is bound (the real engine's engine.native).
        self.native_step = native_step
        self.native_output_shift = 0  # added to the C step's output ids: a broken C step
        # The rows a call reports stepping with (None: its callers in flight); the batching
        # flag or override off runs every call alone.
        self.batch_rows: int | None = None
        self._info = EngineInfo(model_version=model_version, config_hash="fakecfg0001",
                                device="cpu", dtype="float32", buckets=buckets,
                                speculative_available=True, compile_mode="default",
                                decode_step=("target native, draft native" if native_step
                                             else "compiled (native_step off)"))

    @property
    def info(self) -> EngineInfo:
        return self._info

    def count_tokens(self, text: str) -> int:
        return len(text.encode()) + 1  # byte-level tokens plus EOS, like the built-in model

    def bucket_for(self, input_tokens: int) -> str:
        for edge in self.buckets:
            if input_tokens <= edge:
                return str(edge)
        return BUCKET_OVERFLOW

    def domain_of(self, text: str) -> str:
        """Return "in_domain" for lowercase words, else "shifted"."""
        return "in_domain" if set(text) <= _IN_DOMAIN_CHARS else "shifted"

    def generate(self, text: str, *, max_new_tokens: int | None = None, canary: bool = False,
                 override: FlagOverride | None = None, timeout_s: float | None = None,
                 cancel: CancelSignal | None = None) -> GenerateResult:
        n_in = self.count_tokens(text)
        if n_in > self.max_input_tokens:
            raise InvalidRequest("text", "too long", value=n_in, limit=self.max_input_tokens)
        if self.admission is not None:
            entered = time.perf_counter()
            deadline = None if timeout_s is None else entered + timeout_s
            with self.admission.slot(deadline, synthetic=canary, cancel=cancel):
                waited = time.perf_counter() - entered  # the runtime's queue_wait_s
                result = self._generate(text, n_in, max_new_tokens, canary, override, cancel)
            return replace(result, queue_wait_s=waited + result.queue_wait_s)
        with self._lock:
            if self.capacity is not None and self.state.in_flight >= self.capacity:
                raise Overloaded("queue full", retry_after_s=0.1)
            self.state.in_flight += 1
        try:
            return self._generate(text, n_in, max_new_tokens, canary, override, cancel)
        finally:
            with self._lock:
                self.state.in_flight -= 1

    def _hold(self, cancel: CancelSignal | None) -> None:
        """Block until `release` is set; raise Cancelled once `cancel` is set first."""
        if cancel is None:
            self.release.wait()
            return
        while not self.release.wait(_HANG_POLL_S):
            if cancel.is_set():
                raise Cancelled("request cancelled")

    def _generate(self, text: str, n_in: int, max_new: int | None, canary: bool,
                  override: FlagOverride | None,
                  cancel: CancelSignal | None = None) -> GenerateResult:
        if self.hang.is_set():
            self._hold(cancel)
        if self.fail_with is not None:
            raise self.fail_with
        bucket = self.bucket_for(n_in)
        flags = self.flag_provider.flags()
        if override is not None:
            flags = override.apply(flags, bucket)
        t = self.timings
        out = min(self.output_tokens, max_new or self.output_tokens)
        if bucket == BUCKET_OVERFLOW:
            path, padded = PATH_OVERFLOW, n_in
        elif not flags.compiled:
            path, padded = PATH_EAGER, n_in
        elif not flags.bucketing:
            path, padded = PATH_EXACT, n_in
        else:
            path, padded = PATH_COMPILED, int(bucket)
        speculative = flags.speculative_for(bucket)
        per_token = t.per_output_token_s * (1.0 if path in (PATH_COMPILED, PATH_EXACT)
                                            else t.eager_factor)
        spec = SpecStats()
        decoding = DECODING_DIRECT
        if speculative:
            decoding = DECODING_SPECULATIVE
            rate = self.acceptance.get(self.domain_of(text), 0.5)
            drafts = max(1, round(out / (1 + rate * self.k)))
            proposed = drafts * self.k
            accepted = round(proposed * rate)
            per_pos = tuple(round(drafts * rate ** (i + 1)) for i in range(self.k))
            spec = SpecStats(drafts=drafts, draft_tokens=proposed, accepted_tokens=accepted,
                             accepted_per_position=per_pos, target_forwards=drafts)
            per_token *= (1.0 + 0.3 * self.k) / (1 + rate * self.k)
        else:
            per_token *= t.direct_factor
        with self._lock:
            st = self.state
            # The callers in flight stand for the rows a batching engine would step together.
            join_step, rows = st.calls, max(st.in_flight, 1)
            if self.batch_rows is not None:
                rows = self.batch_rows
            if not flags.batching:
                rows = 1
            st.calls += 1
            st.canary_calls += canary
            st.rss_bytes += self.leak_bytes_per_call
            if path in (PATH_COMPILED, PATH_EXACT) and (path, padded) not in st.compiled_shapes:
                if st.compiled_shapes:
                    st.recompiles[f"tensor 'input_ids' size mismatch at index 1. "
                                  f"expected {max(p for _, p in st.compiled_shapes)},"
                                  f" actual {padded}"] += 1
                st.compiled_shapes.add((path, padded))
                st.graphs += 2
        per_token *= 1.0 + t.per_row_factor * (rows - 1)
        encoder = t.base_s + t.per_input_token_s * padded
        ttft = encoder + per_token
        decode = tuple([per_token] * (out - 1))
        total = ttft + per_token * (out - 1) + t.queue_wait_s
        fixed = t.total_s.get((bucket, path, decoding))
        if fixed is not None:
            scale = fixed / total
            encoder, ttft, per_token, total = (encoder * scale, ttft * scale,
                                               per_token * scale, fixed)
            decode = tuple([per_token] * (out - 1))
        stepped = self.native_step and path in (PATH_COMPILED, PATH_EXACT)
        native = stepped and flags.native_step
        ids = tuple(range(out))
        if native:
            ids = tuple(i + self.native_output_shift for i in ids)
        elif stepped:
            encoder, ttft, per_token, total = (x * t.compiled_step_factor
                                               for x in (encoder, ttft, per_token, total))
            decode = tuple([per_token] * (out - 1))
        if t.sleep_scale > 0:
            time.sleep(total * t.sleep_scale)
        return GenerateResult(
            text="x" * out, output_ids=ids, input_tokens=n_in, bucket=bucket, native_step=native,
            padded_length=padded, output_tokens=out, path=path, decoding=decoding,
            queue_wait_s=t.queue_wait_s, encoder_s=encoder, ttft_s=ttft, decode_token_s=decode,
            total_s=total, spec=spec, canary=canary, probation=False,
            batch_join_step=join_step, batch_size_mean=float(rows), batch_size_max=rows)

    def warm_up(self, *, background: bool = True) -> None:
        for edge in self.buckets:
            with self._lock:
                if (PATH_COMPILED, edge) not in self.state.compiled_shapes:
                    self.state.compiled_shapes.add((PATH_COMPILED, edge))
                    self.state.graphs += 2

    def warmup_status(self) -> WarmupStatus:
        return WarmupStatus(len(self.buckets), len(self.buckets), 0.0, True)

    def compile_snapshot(self) -> CompileSnapshot:
        with self._lock:
            rec = dict(self.state.recompiles)
            return CompileSnapshot(graphs=self.state.graphs, recompiles=sum(rec.values()),
                                   recompile_reasons=rec)

    def memory_snapshot(self) -> MemorySnapshot:
        with self._lock:
            return MemorySnapshot(device="cpu", rss_bytes=self.state.rss_bytes,
                                  kv_cache_bytes=self.state.kv_cache_bytes)

    def queue_depth(self) -> int:
        return 0 if self.admission is None else self.admission.waiting

    def admission_stats(self) -> AdmissionStats:
        return AdmissionStats() if self.admission is None else self.admission.stats()

    def batch_snapshot(self) -> BatchSnapshot:
        """Return the callers in flight as the running batch (no step times)."""
        with self._lock:
            return BatchSnapshot(max_batch=self.batch_rows or self.capacity or 1,
                                 batch_size=self.state.in_flight, steps=self.state.calls)

    def draft_length_snapshot(self) -> DraftLengthSnapshot:
        """Return no measured draft length (the fake engine does not adapt k)."""
        return DraftLengthSnapshot()

    def graph_snapshot(self) -> GraphSnapshot:
        """Return no graphs (the fake engine compiles nothing)."""
        return GraphSnapshot()

    def flag_errors(self) -> int:
        return 0

    def flag_source(self) -> str:
        return "live"

    def close(self) -> None:
        self.release.set()
