"""Real-traffic rollups: served requests folded into per-minute, per-shape counters.

Every served (non-canary) GenerateResult adds to the rollup of its minute x instance x
bucket x path x decoding; canary results are ignored. Rejections and failures have no
path: they are recorded under path "rejected"/"failed" and decoding "none".
Keys and deltas are storage.rollups' RollupKey/RollupDelta. The same fold adds each
request to the batching rollups (probes.batching), and `sample_batch` adds a reading of
the engine's batching loop; `flush` writes both.
`record` runs on every served request and only queues (minute, result) on a deque (no
lock); the queue is folded into the rollups, under the recorder's one lock, once FOLD_AT
results wait and before anything reads them (`drain`, `flush`, `len`, `dropped`), so a
request's minute is the one it was served in and nothing recorded is lost or weakened.
Memory is bounded by `buffer_max` rollups: a request that would open a new rollup past
the bound is dropped and counted (`dropped`). `flush(writer)` hands the rollups to the
storage Writer (the one write path), which adds them to the stored rows and retries
while the database is down: an outage delays rollups; past the writer's bound they are
dropped and counted in `writer.stats.dropped`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import fields
from datetime import UTC, datetime
from functools import partial

from sqlalchemy.orm import Session

from engine.protocol import PATH_OVERFLOW, BatchSnapshot, GenerateResult
from probes.batching import BatchFolder, BatchRollupItem
from probes.measure import add_positions
from storage.batch_rollups import add_batch_rollups
from storage.rollups import RollupDelta, RollupKey, add_rollups
from storage.sketches import Sketch
from storage.writer import Writer

log = logging.getLogger(__name__)

PATH_REJECTED = "rejected"
PATH_FAILED = "failed"
DECODING_NONE = "none"
FOLD_AT = 64  # queued requests the recording thread folds into the rollups at once


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
        # Keyed by int while the minute fills (no str() per request); JSON keys at freeze().
        self.input_lens: dict[int, int] = {}
        self.output_lens: dict[int, int] = {}
        self.accepted_per_position = ()

    def freeze(self) -> RollupDelta:
        values = {n: getattr(self, n) for n in self.__slots__}
        for n in self._SKETCHES:
            values[n] = values[n].to_json()
        for n in ("input_lens", "output_lens"):
            values[n] = {str(k): c for k, c in values[n].items()}
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
        self._pending: deque[tuple[datetime | float, GenerateResult]] = deque()
        self._dropped = 0
        self._batches = BatchFolder(instance_id, buffer_max=buffer_max)

    @property
    def dropped(self) -> int:
        """Return the requests lost because the buffer was full."""
        with self._lock:
            self._fold()
            return self._dropped

    @property
    def pending(self) -> int:
        """Return the served requests queued for the next fold."""
        return len(self._pending)

    def __len__(self) -> int:
        with self._lock:
            self._fold()
            return len(self._accs)

    def _minute(self) -> datetime:
        return self._minute_of(self.clock() if self.clock is not None else time.time())

    def _minute_of(self, stamp: datetime | float) -> datetime:
        """Return the minute of a clock reading or a time.time() stamp."""
        if isinstance(stamp, datetime):
            return stamp.replace(second=0, microsecond=0)
        epoch_minute = int(stamp // 60)
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
                self._dropped += 1
                return None
            acc = self._accs[key] = _Acc()
        return acc

    def record(self, r: GenerateResult) -> None:
        """Add one served request (queued for the next fold); canary results are ignored."""
        if r.canary:
            return
        pending = self._pending
        # The time it was served (its minute is worked out at the fold): one C call here.
        pending.append((self.clock() if self.clock is not None else time.time(), r))
        if len(pending) >= FOLD_AT:
            with self._lock:
                self._fold()

    def _fold(self) -> None:
        """Add every queued request to its rollup (the caller holds the lock)."""
        pending = self._pending
        groups: dict[tuple[datetime, str, str, str], list[GenerateResult]] = {}
        while pending:  # popleft, not a swap: an append racing the fold is never lost
            stamp, r = pending.popleft()
            key = (self._minute_of(stamp), r.bucket, r.path, r.decoding)
            group = groups.get(key)
            if group is None:
                group = groups[key] = []
            group.append(r)
        for key, rs in groups.items():
            a = self._acc(key)
            if a is None:
                self._dropped += len(rs) - 1  # _acc counted one
                continue
            self._add(a, key[2], rs)
        for key, rs in groups.items():
            self._batches.add(key[0], rs)

    @staticmethod
    def _add(a: _Acc, path: str, rs: list[GenerateResult]) -> None:
        """Add requests of one key to its counters and sketches (each value, in bulk)."""
        a.requests += len(rs)
        if path == PATH_OVERFLOW:
            a.overflow += len(rs)
        latencies, ttfts = [r.total_s for r in rs], [r.ttft_s for r in rs]
        a.latency_sketch.add_many(latencies)
        a.ttft_sketch.add_many(ttfts)
        add_per_token = a.per_token_sketch.add
        in_lens, out_lens = a.input_lens, a.output_lens
        specs = []
        for r in rs:
            decode = r.decode_token_s
            if decode:
                # One update per request: its mean per-token time, weighted by its tokens.
                add_per_token(sum(decode) / len(decode), len(decode))
            in_k, out_k = r.input_tokens, r.output_tokens
            in_lens[in_k] = in_lens.get(in_k, 0) + 1
            out_lens[out_k] = out_lens.get(out_k, 0) + 1
            spec = r.spec
            if spec.drafts or spec.draft_tokens:
                specs.append(spec)
            if r.probation:
                a.probation_requests += 1
                a.probation_draft_tokens += spec.draft_tokens
                a.probation_accepted += spec.accepted_tokens
        if specs:
            a.drafts += sum(s.drafts for s in specs)
            a.draft_tokens += sum(s.draft_tokens for s in specs)
            a.accepted_tokens += sum(s.accepted_tokens for s in specs)
            a.accepted_per_position = add_positions(
                a.accepted_per_position, *(s.accepted_per_position for s in specs))
        a.latency_sum_s += math.fsum(latencies)
        a.ttft_sum_s += math.fsum(ttfts)
        a.input_tokens_sum += sum(r.input_tokens for r in rs)
        a.padded_tokens_sum += sum(r.padded_length for r in rs)
        a.output_tokens_sum += sum(r.output_tokens for r in rs)

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

    def sample_batch(self, snapshot: BatchSnapshot) -> None:
        """Add one reading of the engine's batching loop to this minute."""
        with self._lock:
            self._batches.sample(self._minute(), snapshot)

    def drain_batches(self) -> list[BatchRollupItem]:
        """Return and forget every batching rollup held (queued requests folded in first)."""
        with self._lock:
            self._fold()
            return self._batches.drain()

    def drain(self) -> list[Rollup]:
        """Return and forget every rollup held (queued requests folded in first)."""
        with self._lock:
            self._fold()
            accs, self._accs = self._accs, {}
        return [(RollupKey(k[0], self.instance_id, k[1], k[2], k[3]), a.freeze())
                for k, a in accs.items()]

    def flush(self, writer: Writer) -> int:
        """Hand every rollup to `writer` as one write; return how many rollups it took.

        Returns 0 when there was nothing to store or the writer refused (full or closed:
        it counts the drop).
        """
        records = self.drain()
        batches = self.drain_batches()
        if not records and not batches:
            return 0
        # One write: a minute's traffic and batching rollups arrive (or are dropped) together.
        if not writer.submit(partial(add_minutes, traffic=records, batches=batches)):
            log.warning("traffic: the storage writer refused %d rollups", len(records))
            return 0
        return len(records)


def add_minutes(session: Session, traffic: list[Rollup], batches: list[BatchRollupItem]) -> int:
    """Add traffic and batch rollups in the caller's transaction; return the rows touched."""
    return add_rollups(session, traffic) + add_batch_rollups(session, batches)
