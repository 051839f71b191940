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

from sqlalchemy import select, tuple_
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from storage import sketches
from storage.models import BatchRollup
from storage.rollups import truncate_minute

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

    def sort_key(self) -> tuple[datetime, str, str, str, str]:
        """Return the key as a tuple (the order rows are locked in)."""
        return (self.minute, self.instance_id, self.bucket, self.batch, self.decoding)


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
    if not merged:
        return 0
    merged = dict(sorted(merged.items(), key=lambda kv: kv[0].sort_key()))
    existing = _load(session, list(merged))
    for key, row in existing.items():
        _apply(row, merged[key])
    missing = [k for k in merged if k not in existing]
    if missing:
        try:
            with session.begin_nested():
                session.add_all([_new_row(k, merged[k]) for k in missing])
        except IntegrityError:
            # Another writer inserted some of these rows meanwhile: add to theirs.
            for key in missing:
                won = _load(session, [key]).get(key)
                if won is not None:
                    _apply(won, merged[key])
                else:
                    with session.begin_nested():
                        session.add(_new_row(key, merged[key]))
    session.flush()
    return len(merged)


def _apply(row: BatchRollup, delta: BatchDelta) -> None:
    for f in fields(delta):
        value = getattr(delta, f.name)
        if value:
            # Assign a new value: JSON columns do not track in-place changes.
            setattr(row, f.name, _add(f.name, getattr(row, f.name), value))


def _new_row(key: BatchKey, delta: BatchDelta) -> BatchRollup:
    row = BatchRollup(minute=key.minute, instance_id=key.instance_id, bucket=key.bucket,
                      batch=key.batch, decoding=key.decoding)
    for f in fields(delta):
        value = getattr(delta, f.name)
        setattr(row, f.name, dict(value) if isinstance(value, dict) else value)
    return row


def _load(session: Session, keys: list[BatchKey]) -> dict[BatchKey, BatchRollup]:
    cols = (BatchRollup.minute, BatchRollup.instance_id, BatchRollup.bucket,
            BatchRollup.batch, BatchRollup.decoding)
    out: dict[BatchKey, BatchRollup] = {}
    for i in range(0, len(keys), 200):
        chunk = keys[i:i + 200]
        stmt = (select(BatchRollup)
                .where(tuple_(*cols).in_([k.sort_key() for k in chunk]))
                .order_by(*cols).with_for_update())
        for row in session.scalars(stmt):
            key = BatchKey(row.minute, row.instance_id, row.bucket, row.batch, row.decoding)
            out[key] = row
    return out
