"""Add batching counts to per-minute batch rollups (insert or add, on both databases).

The traffic recorder (probes.traffic) folds served requests and batching-loop samples
into `BatchDelta`s and hands them to the storage Writer with `add_batch_rollups`. Rows
are locked and inserted in key order, and a lost insert race adds to the winner's row,
as storage.rollups does for traffic rollups.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from storage import sketches
from storage.models import BatchRollup
from storage.rollups import truncate_minute
from storage.upsert import RollupTable, add_deltas

# Bucket, batch and decoding of the rows that sample the batching loop itself.
ENGINE_SCOPE = "all"
_MAXES = ("batch_size_max", "rows_waiting_max")
_SKETCHES = ("latency_sketch",)


def batch_class(size: float) -> str:
    """Return the batch-size class of a mean batch size: "1", "2", "4", ... (each class
    holds sizes up to the next power of two: 3 is in "4")."""
    n = 1
    while n < size:
        n *= 2
    return str(n)


@dataclass(frozen=True)
class BatchKey:
    """What identifies a batch rollup row; `minute` is truncated on construction."""

    minute: datetime
    instance_id: str
    bucket: str
    batch: str
    decoding: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "minute", truncate_minute(self.minute))


@dataclass(frozen=True)
class BatchDelta:
    """Counts to add to one batch rollup row (storage.models.BatchRollup names them)."""

    requests: int = 0
    batched_requests: int = 0
    batch_size_sum: float = 0.0
    batch_size_max: int = 0
    queue_wait_sum_s: float = 0.0
    batch_wait_sum_s: float = 0.0
    latency_sum_s: float = 0.0
    output_tokens_sum: int = 0
    decode_tokens_sum: int = 0
    decode_sum_s: float = 0.0
    row_tokens_sum: float = 0.0
    latency_sketch: dict[str, Any] = field(default_factory=dict)
    samples: int = 0
    rows_waiting_sum: int = 0
    rows_waiting_max: int = 0
    batch_now_sum: int = 0
    window_sum_s: float = 0.0
    steps: int = 0
    encode_steps: int = 0
    encode_s: float = 0.0
    decode_steps: int = 0
    decode_s: float = 0.0
    verify_steps: int = 0
    verify_s: float = 0.0

    def merge(self, other: BatchDelta) -> BatchDelta:
        """Return the sum of two deltas (maxima take the larger, sketches merge)."""
        return BatchDelta(**{f.name: _add(f.name, getattr(self, f.name), getattr(other, f.name))
                             for f in fields(self)})


def _add(name: str, a: Any, b: Any) -> Any:
    if name in _SKETCHES:
        return sketches.add_json(a, b)
    if name in _MAXES:
        return max(a or 0, b or 0)
    return (a or 0) + b


def add_batch_rollups(session: Session, items: Iterable[tuple[BatchKey, BatchDelta]]) -> int:
    """Add each delta to its row, creating missing rows; return the rows touched."""
    merged: dict[BatchKey, BatchDelta] = {}
    for key, delta in items:
        prev = merged.get(key)
        merged[key] = delta if prev is None else prev.merge(delta)
    return add_deltas(session, TABLE, merged)


def _new_value(name: str, value: Any) -> Any:
    return dict(value) if isinstance(value, dict) else value


TABLE: RollupTable[BatchKey, BatchDelta, BatchRollup] = RollupTable(
    BatchRollup, BatchKey, _add, _new_value)
