"""Engine configuration (plain data, no torch)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

BUILTIN_DIR = Path(__file__).parent / "builtin"
DEFAULT_BUCKETS = (16, 32, 64, 128, 256)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "off")
QUANTIZATIONS = ("none", "int8")
MAX_BATCH = 256
# A window is a wait added to latency for a fuller step: beyond a second it is a queue.
MAX_BATCH_WINDOW_S = 1.0


@dataclass(frozen=True)
class EngineConfig:
    """How to load and run the model.

    model_dir / draft_dir: HF `save_pretrained` directories; None = built-in models.
    device: "auto" (CUDA when available), "cpu" or "cuda[:N]".
    dtype: "auto" (float32 on CPU, bfloat16 on CUDA), "float32", "bfloat16", "float16".
    buckets: input-length bucket edges in tokens, ascending.
    max_input_tokens: hard cap; longer inputs are rejected (HTTP 413). Inputs between the
        largest bucket and this cap take the eager overflow path.
    max_new_tokens / max_new_tokens_cap: default and largest allowed output length.
    kv_headroom: extra decoder cache slots beyond max_new_tokens (speculative look-ahead).
    compile_mode: one of COMPILE_MODES; compile_backend: torch.compile backend.
    num_threads: intra-op threads per decode stream (1 wins on small CPUs).
    speculative_k: tokens the draft proposes per verification step (the first choice; the
        engine then picks k per bucket from measured acceptance and costs).
    speculative_fallback: run a bucket direct where measured speculation would be slower
        (1 request in 16 still speculates, to notice recovery); off: the flags alone decide.
    max_concurrency: decode streams running at once; max_queue: callers allowed to wait.
    max_queue_tokens: the tokens the waiting callers may carry together (engine.admission),
        each caller's input tokens plus its max new tokens (what its row may decode: the
        worst case, known on arrival); a caller that would pass it gets 429 (reason
        token_budget). 0 (the default): off, the queue is bounded by max_queue alone, as
        before the budget existed; a default in tokens would refuse traffic an upgraded
        deployment serves today, and the right budget follows the model's tokens per
        second and the wait callers accept (about tokens/s x the longest acceptable
        queue wait). Otherwise at least max_input_tokens + max_new_tokens_cap: a smaller
        budget could never queue the largest request, which would then only get in when
        a row happened to be free (starved behind smaller ones).
    flags_file: where the last flags read from the provider are kept, so a restart while
        the database is down starts from them ("" keeps nothing; in-memory flags never do).
    quantization: "none", or "int8": also load the target with int8 weights (engine.quantize),
        served where the `quantized` flag is on and watched by output agreement.
    int8_encoder: with quantization int8, the int8 target's encoder multiplies int8 weights
        too (engine.encoder_int8, compiled) instead of sharing the float target's encoder,
        whose float weights int8 serving then reloads on demand like the decoder's
        (docs/engine.md#the-int8-encoder). None (the default): decided at start
        (engine.models.resolve_int8_encoder): on with CUDA; on a CPU, on unless its int8
        products measure more than twice as slow as float32's (torch's int8 GEMM is a
        fallback on a CPU without VNNI); False: the int8 target shares the float encoder;
        True: on wherever; True without int8 is refused.
    max_batch: rows decoded together by the batching scheduler (engine.scheduler): requests
        join and leave a running batch at step boundaries; 1 = no scheduler, each request
        decodes alone in its caller's thread with max_concurrency streams (as before
        batching; in the CUDA-graph compile modes they take turns on one device thread:
        engine.owner). Above 1 the rows replace the streams (max_concurrency is not used).
    batch_window_max_s: the longest the scheduler waits for more arrivals before a step
        while the batch is not full (0: never waits); it adapts below this to the queue.
    native_step: on the optimized path, run the decode steps and the speculative
        verification in C (engine.native) where it applies (CPU, float32, float weights, a
        C compiler found); the encoder stays compiled. Off: the compiled graphs.
    preempt_synthetic: a real caller that would wait while a synthetic one (a canary, a
        burst) holds a slot takes one extra decode row at once (engine.admission; one more
        static cache row): unbatched (max_batch 1) the synthetic requests pause at their
        next step boundary; batched, the real request joins the running batch at the next
        step and the loop pauses a synthetic row (its row and state kept) so that a step
        stays at max_batch rows (engine.scheduler). False: a running synthetic request is
        never interrupted, so a real caller may wait for it (as before preemption). Moot
        unbatched in the CUDA-graph compile modes, which run each decode whole on one
        thread (real ones first: engine.owner). Not in the config hash: it changes no
        compiled artifact.
    """

    model_dir: str | None = None
    draft_dir: str | None = None
    use_draft: bool = True
    device: str = "auto"
    dtype: str = "auto"
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    max_input_tokens: int = 1024
    max_new_tokens: int = 32
    max_new_tokens_cap: int = 256
    kv_headroom: int = 8
    compile_mode: str = "default"
    compile_backend: str = "inductor"
    recompile_limit: int = 64
    num_threads: int = 1
    speculative_k: int = 4
    speculative_fallback: bool = True
    max_concurrency: int = 1
    max_queue: int = 16
    max_queue_tokens: int = 0
    flag_timeout_s: float = 0.05
    cache_dir: str | None = None  # inductor on-disk cache; None = ./var/compile-cache
    flags_file: str = "./var/last-flags.json"
    extra: dict[str, str] = field(default_factory=dict)
    quantization: str = "none"
    int8_encoder: bool | None = None
    native_step: bool = True
    max_batch: int = 1
    batch_window_max_s: float = 0.0
    preempt_synthetic: bool = True

    def __post_init__(self) -> None:
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"buckets: must be ascending and unique, got {self.buckets}")
        if self.buckets[0] < 2:
            # The buckets share graphs whose length is a dynamic dimension, and torch
            # specializes a dimension of size 1.
            raise ValueError(f"buckets: the smallest edge must be >= 2, got {self.buckets[0]}")
        if self.max_input_tokens < self.buckets[-1]:
            raise ValueError("max_input_tokens: must be >= the largest bucket")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode: must be one of {COMPILE_MODES}")
        if not 1 <= self.max_new_tokens <= self.max_new_tokens_cap:
            raise ValueError("max_new_tokens: must be between 1 and max_new_tokens_cap")
        if self.speculative_k < 1:
            raise ValueError("speculative_k: must be >= 1")
        if not 0 < self.flag_timeout_s <= 10:
            raise ValueError("flag_timeout_s: must be > 0 and <= 10 seconds")
        if isinstance(self.max_batch, bool) or not 1 <= self.max_batch <= MAX_BATCH:
            raise ValueError(f"max_batch: must be between 1 and {MAX_BATCH}, "
                             f"got {self.max_batch!r}")
        if not 0 <= self.batch_window_max_s <= MAX_BATCH_WINDOW_S:
            raise ValueError(f"batch_window_max_s: must be between 0 and {MAX_BATCH_WINDOW_S}"
                             f" seconds, got {self.batch_window_max_s!r}")
        self._check_queue_tokens()
        if not isinstance(self.preempt_synthetic, bool):
            raise ValueError(f"preempt_synthetic: must be true or false, "
                             f"got {self.preempt_synthetic!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: must be one of {QUANTIZATIONS}, "
                             f"got {self.quantization!r}")
        if self.int8_encoder and self.quantization != "int8":
            raise ValueError("int8_encoder: needs quantization int8, got quantization "
                             f"{self.quantization!r}")

    def _check_queue_tokens(self) -> None:
        value = self.max_queue_tokens
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"max_queue_tokens: must be a whole number of tokens >= 0 "
                             f"(0: off), got {value!r}")
        largest = self.max_input_tokens + self.max_new_tokens_cap
        if 0 < value < largest:
            raise ValueError(f"max_queue_tokens: must be 0 (off) or at least "
                             f"max_input_tokens + max_new_tokens_cap ({largest}: the largest "
                             f"request), got {value}")

    @property
    def int8_encoder_on(self) -> bool:
        """Return whether the int8 target's encoder multiplies int8 weights (unset: on,
        until the runtime decides it at start and sets it)."""
        return self.quantization == "int8" and self.int8_encoder is not False

    def config_hash(self) -> str:
        """Return a short hash of everything that changes the optimized artifact."""
        keys = ("buckets", "compile_mode", "compile_backend", "speculative_k", "dtype",
                "use_draft", "kv_headroom")
        data = {k: asdict(self)[k] for k in keys}
        if self.quantization != "none":  # absent when off: earlier hashes stay valid
            data["quantization"] = self.quantization
        if self.int8_encoder_on:  # absent when off: earlier hashes stay valid
            data["int8_encoder"] = True
        if self.native_step:  # another step implementation: another artifact (cohort)
            data["step"] = "native"
        blob = json.dumps(data, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]
