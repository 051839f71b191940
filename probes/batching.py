"""Batching rollups: served requests and batching-loop samples folded per minute.

The traffic recorder (probes.traffic) hands every served request it folds to a
`BatchFolder`: its minute x bucket x batch-size class x decoding counts what batching
did to it (queue wait, mean and max batch size over its steps, step throughput, latency).
`sample` reads the engine's BatchSnapshot at each traffic flush: rows waiting and in the
batch now, the window, and the steps and step seconds by phase since the previous sample,
kept in the engine row of the minute (bucket, batch and decoding "all").
Keys and deltas are storage.batch_rollups' BatchKey/BatchDelta. The caller holds its lock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import datetime

from engine.protocol import BatchSnapshot, GenerateResult
from storage.batch_rollups import ENGINE_SCOPE, BatchDelta, BatchKey, batch_class
from storage.sketches import Sketch

BatchRollupItem = tuple[BatchKey, BatchDelta]
_PHASES = ("encode", "decode", "verify")


class BatchFolder:
    """Per-minute batching counters of one instance, bounded like the traffic rollups.

    Example:
        folder = BatchFolder("replica-a", buffer_max=10_000)
        folder.add(minute, results)        # from the traffic recorder's fold
        folder.sample(minute, engine.batch_snapshot())
        items = folder.drain()             # handed to storage.batch_rollups
    """

    def __init__(self, instance_id: str, *, buffer_max: int) -> None:
        self.instance_id = instance_id
        self.buffer_max = buffer_max
        self._deltas: dict[tuple[datetime, str, str, str], BatchDelta] = {}
        self._last: BatchSnapshot | None = None
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._deltas)

    def add(self, minute: datetime, results: Iterable[GenerateResult]) -> None:
        """Fold served requests of one minute into their bucket x class x decoding rows."""
        groups: dict[tuple[datetime, str, str, str], list[GenerateResult]] = {}
        for r in results:
            key = (minute, r.bucket, batch_class(r.batch_size_mean), r.decoding)
            groups.setdefault(key, []).append(r)
        for key, rs in groups.items():
            self._merge(key, _requests(rs), len(rs))

    def sample(self, minute: datetime, snap: BatchSnapshot) -> None:
        """Add one reading of the batching loop (nothing while the engine is unbatched)."""
        if snap.max_batch <= 1:
            return
        last = self._last if self._last is not None and snap.steps >= self._last.steps \
            else BatchSnapshot()  # a restarted engine counts from zero again
        self._last = snap

        def count(phase: str) -> int:
            return snap.step_count.get(phase, 0) - last.step_count.get(phase, 0)

        def seconds(phase: str) -> float:
            return snap.step_seconds_sum.get(phase, 0.0) - last.step_seconds_sum.get(phase, 0.0)

        delta = BatchDelta(
            samples=1, rows_waiting_sum=snap.rows_waiting, rows_waiting_max=snap.rows_waiting,
            batch_now_sum=snap.batch_size, window_sum_s=snap.window_s,
            steps=snap.steps - last.steps,
            encode_steps=count("encode"), encode_s=seconds("encode"),
            decode_steps=count("decode"), decode_s=seconds("decode"),
            verify_steps=count("verify"), verify_s=seconds("verify"))
        self._merge((minute, ENGINE_SCOPE, ENGINE_SCOPE, ENGINE_SCOPE), delta, 1)

    def drain(self) -> list[BatchRollupItem]:
        """Return and forget every row held."""
        deltas, self._deltas = self._deltas, {}
        return [(BatchKey(k[0], self.instance_id, k[1], k[2], k[3]), d)
                for k, d in deltas.items()]

    def _merge(self, key: tuple[datetime, str, str, str], delta: BatchDelta, n: int) -> None:
        prev = self._deltas.get(key)
        if prev is None:
            if len(self._deltas) >= self.buffer_max:
                self.dropped += n
                return
            self._deltas[key] = delta
        else:
            self._deltas[key] = prev.merge(delta)


def _requests(rs: list[GenerateResult]) -> BatchDelta:
    """Return the counts of requests of one key."""
    decode_s = [math.fsum(r.decode_token_s) for r in rs]
    return BatchDelta(
        requests=len(rs), batched_requests=sum(r.batch_join_step >= 0 for r in rs),
        batch_size_sum=math.fsum(r.batch_size_mean for r in rs),
        batch_size_max=max(r.batch_size_max for r in rs),
        queue_wait_sum_s=math.fsum(r.queue_wait_s for r in rs),
        batch_wait_sum_s=math.fsum(r.batch_wait_s for r in rs),
        latency_sum_s=math.fsum(r.total_s for r in rs),
        output_tokens_sum=sum(r.output_tokens for r in rs),
        decode_tokens_sum=sum(len(r.decode_token_s) for r in rs),
        decode_sum_s=math.fsum(decode_s),
        row_tokens_sum=math.fsum(r.batch_size_mean * len(r.decode_token_s) for r in rs),
        latency_sketch=Sketch.of([r.total_s for r in rs]).to_json())

