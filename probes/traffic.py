"""Real-traffic rollups: served requests folded into per-minute, per-shape counters.

Every served (non-canary) GenerateResult adds to the rollup of its minute x instance x
bucket x path x decoding; canary results are ignored. Rejections and failures have no
path: they are recorded under path "rejected"/"failed" and decoding "none".
Keys and deltas are storage.rollups' RollupKey/RollupDelta.
Memory is bounded by `buffer_max` rollups: a request that would open a new rollup past
the bound is dropped and counted (`dropped`). `flush(writer)` hands the rollups to the
storage Writer (the one write path), which adds them to the stored rows and retries
while the database is down: an outage delays rollups; past the writer's bound they are
dropped and counted in `writer.stats.dropped`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import fields
from datetime import UTC, datetime
from functools import partial

from engine.protocol import PATH_OVERFLOW, GenerateResult
from probes.measure import add_positions
from storage.rollups import RollupDelta, RollupKey, add_rollups
from storage.sketches import Sketch
from storage.writer import Writer

log = logging.getLogger(__name__)

PATH_REJECTED = "rejected"
PATH_FAILED = "failed"
DECODING_NONE = "none"


Rollup = tuple[RollupKey, RollupDelta]


class _Acc:
    """Mutable counters of one key (guarded by the recorder's lock)."""

    __slots__ = tuple(f.name for f in fields(RollupDelta))
    _SKETCHES = ("latency_sketch", "ttft_sketch", "per_token_sketch")
    requests: int
    errors: int
    rejections: int
    overflow: int
    input_tokens_sum: int
    padded_tokens_sum: int
    output_tokens_sum: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: tuple[int, ...]
    probation_requests: int
    probation_draft_tokens: int
    probation_accepted: int

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)
        self.latency_sum_s = 0.0
        self.ttft_sum_s = 0.0
        # Sketches stay objects while the minute fills; freeze() serializes them once.
        self.latency_sketch = Sketch()
        self.ttft_sketch = Sketch()
        self.per_token_sketch = Sketch()
        self.input_lens: dict[str, int] = {}
        self.output_lens: dict[str, int] = {}
        self.accepted_per_position = ()

    def freeze(self) -> RollupDelta:
        values = {n: getattr(self, n) for n in self.__slots__}
        for n in self._SKETCHES:
            values[n] = values[n].to_json()
        return RollupDelta(**values)


class TrafficRecorder:
    """Fold served requests into bounded in-memory per-minute rollups (thread-safe).

    Example:
        recorder = TrafficRecorder("replica-a", buffer_max=10_000)
        recorder.record(result)            # after each served request
        recorder.flush(writer)             # from a periodic job
    """

    def __init__(self, instance_id: str, *, buffer_max: int = 10_000,
                 clock: Callable[[], datetime] | None = None) -> None:
        if buffer_max < 1:
            raise ValueError(f"rollup_buffer_max: must be >= 1, got {buffer_max}")
        self.instance_id = instance_id
        self.buffer_max = buffer_max
        self.clock = clock
        self._lock = threading.Lock()
        # Plain-tuple keys (minute, bucket, path, decoding): record() runs on every request.
        self._accs: dict[tuple[datetime, str, str, str], _Acc] = {}
        self._minute_cache: tuple[int, datetime] = (-1, datetime.min.replace(tzinfo=UTC))
        self.dropped = 0  # requests lost because the buffer was full

    def __len__(self) -> int:
        with self._lock:
            return len(self._accs)

    def _minute(self) -> datetime:
        if self.clock is not None:
            return self.clock().replace(second=0, microsecond=0)
        epoch_minute = int(time.time() // 60)
        cached = self._minute_cache  # one tuple: read and replaced atomically
        if cached[0] != epoch_minute:
            cached = (epoch_minute, datetime.fromtimestamp(epoch_minute * 60, UTC))
            self._minute_cache = cached
        return cached[1]

    def _key(self, bucket: str, path: str, decoding: str) -> tuple[datetime, str, str, str]:
        return (self._minute(), bucket, path, decoding)

    def _acc(self, key: tuple[datetime, str, str, str]) -> _Acc | None:
        acc = self._accs.get(key)
        if acc is None:
            if len(self._accs) >= self.buffer_max:
                self.dropped += 1
                return None
            acc = self._accs[key] = _Acc()
        return acc

    def record(self, r: GenerateResult) -> None:
        """Add one served request; canary results are ignored."""
        if r.canary:
            return
        key = self._key(r.bucket, r.path, r.decoding)
        in_k, out_k = str(r.input_tokens), str(r.output_tokens)
        decode = r.decode_token_s
        spec = r.spec
        with self._lock:
            a = self._acc(key)
            if a is None:
                return
            a.requests += 1
            a.overflow += r.path == PATH_OVERFLOW
            a.latency_sum_s += r.total_s
            a.latency_sketch.add(r.total_s)
            a.ttft_sum_s += r.ttft_s
            a.ttft_sketch.add(r.ttft_s)
            if decode:
                # One update per request: its mean per-token time, weighted by its tokens.
                a.per_token_sketch.add(sum(decode) / len(decode), len(decode))
            a.input_tokens_sum += r.input_tokens
            a.padded_tokens_sum += r.padded_length
            a.output_tokens_sum += r.output_tokens
            a.input_lens[in_k] = a.input_lens.get(in_k, 0) + 1
            a.output_lens[out_k] = a.output_lens.get(out_k, 0) + 1
            if spec.drafts or spec.draft_tokens:
                a.drafts += spec.drafts
                a.draft_tokens += spec.draft_tokens
                a.accepted_tokens += spec.accepted_tokens
                a.accepted_per_position = add_positions(a.accepted_per_position,
                                                        spec.accepted_per_position)
            if r.probation:
                a.probation_requests += 1
                a.probation_draft_tokens += spec.draft_tokens
                a.probation_accepted += spec.accepted_tokens

    def record_rejection(self, bucket: str) -> None:
        """Count a request the engine refused (Overloaded) in `bucket`."""
        with self._lock:
            a = self._acc(self._key(bucket, PATH_REJECTED, DECODING_NONE))
            if a is not None:
                a.rejections += 1

    def record_error(self, bucket: str) -> None:
        """Count a request that failed inside the engine in `bucket`."""
        with self._lock:
            a = self._acc(self._key(bucket, PATH_FAILED, DECODING_NONE))
            if a is not None:
                a.errors += 1

    def drain(self) -> list[Rollup]:
        """Return and forget every rollup held."""
        with self._lock:
            accs, self._accs = self._accs, {}
        return [(RollupKey(k[0], self.instance_id, k[1], k[2], k[3]), a.freeze())
                for k, a in accs.items()]

    def flush(self, writer: Writer) -> int:
        """Hand every rollup to `writer` as one write; return how many rollups it took.

        Returns 0 when there was nothing to store or the writer refused (full or closed:
        it counts the drop).
        """
        records = self.drain()
        if not records:
            return 0
        if not writer.submit(partial(add_rollups, items=records)):
            log.warning("traffic: the storage writer refused %d rollups", len(records))
            return 0
        return len(records)
