"""Add real-traffic counts to per-minute rollups (insert or add, on both databases).

Writers accumulate `RollupDelta`s in memory and call `add_rollups(session, ...)`
from a `storage.writer.Writer` job. Two instances never touch the same row
(instance_id is in the key), but two writers of one instance may race: the row is
locked (`FOR UPDATE` on PostgreSQL, in key order; SQLite writers are serialized
by BEGIN IMMEDIATE), and a lost insert race falls back to adding to the winner's row.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from storage import histograms, sketches
from storage.models import NaiveDatetimeError, TrafficRollup
from storage.upsert import RollupTable, add_deltas

_SKETCHES = ("latency_sketch", "ttft_sketch", "per_token_sketch")
_LENS = ("input_lens", "output_lens")
_LISTS = ("accepted_per_position",)


def _add(name: str, a: Any, b: Any) -> Any:
    """Return a + b for field `name` (sketches merge, counts add key- or element-wise)."""
    if name in _SKETCHES:
        return sketches.add_json(a, b)
    if name in _LENS:
        return sketches.lengths_add(a, b)
    if name in _LISTS:
        return histograms.add(a or (), b or ())
    return (a or 0) + b


def truncate_minute(at: datetime) -> datetime:
    """Return `at` truncated to its minute (must be timezone-aware)."""
    if at.tzinfo is None:
        raise NaiveDatetimeError(f"minute: naive datetime {at.isoformat()}")
    return at.replace(second=0, microsecond=0)


@dataclass(frozen=True)
class RollupKey:
    """What identifies a rollup row; `minute` is truncated on construction."""

    minute: datetime
    instance_id: str
    bucket: str
    path: str
    decoding: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "minute", truncate_minute(self.minute))


@dataclass(frozen=True)
class RollupDelta:
    """Counts to add to one rollup row.

    Sketches are storage.sketches' stored form; *_lens are exact {"<tokens>": requests}.
    """

    requests: int = 0
    errors: int = 0
    rejections: int = 0
    overflow: int = 0
    latency_sum_s: float = 0.0
    ttft_sum_s: float = 0.0
    input_tokens_sum: int = 0
    padded_tokens_sum: int = 0
    output_tokens_sum: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = field(default=())
    probation_requests: int = 0
    probation_draft_tokens: int = 0
    probation_accepted: int = 0
    latency_sketch: dict[str, Any] = field(default_factory=dict)
    ttft_sketch: dict[str, Any] = field(default_factory=dict)
    per_token_sketch: dict[str, Any] = field(default_factory=dict)
    input_lens: dict[str, int] = field(default_factory=dict)
    output_lens: dict[str, int] = field(default_factory=dict)

    @classmethod
    def for_request(
        cls,
        *,
        latency_s: float,
        ttft_s: float,
        input_tokens: int,
        padded_length: int,
        output_tokens: int,
        overflow: bool = False,
        drafts: int = 0,
        draft_tokens: int = 0,
        accepted_tokens: int = 0,
        accepted_per_position: Sequence[int] = (),
        probation: bool = False,
        per_token_s: float | None = None,
    ) -> RollupDelta:
        """Return the delta of one successful request."""
        per_token = sketches.Sketch()
        if per_token_s is not None and output_tokens > 1:
            per_token.add(per_token_s, output_tokens - 1)
        return cls(
            requests=1, overflow=int(overflow), latency_sum_s=latency_s,
            latency_sketch=sketches.Sketch.of([latency_s]).to_json(),
            ttft_sketch=sketches.Sketch.of([ttft_s]).to_json(),
            per_token_sketch=per_token.to_json(),
            ttft_sum_s=ttft_s, input_tokens_sum=input_tokens, padded_tokens_sum=padded_length,
            output_tokens_sum=output_tokens, input_lens=sketches.lengths_of([input_tokens]),
            output_lens=sketches.lengths_of([output_tokens]),
            drafts=drafts, draft_tokens=draft_tokens, accepted_tokens=accepted_tokens,
            accepted_per_position=tuple(accepted_per_position),
            probation_requests=int(probation),
            probation_draft_tokens=draft_tokens if probation else 0,
            probation_accepted=accepted_tokens if probation else 0,
        )

    def merge(self, other: RollupDelta) -> RollupDelta:
        """Return the sum of two deltas."""
        values = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            values[f.name] = _add(f.name, a, b)
            if f.name in _LISTS:
                values[f.name] = tuple(values[f.name])
        return RollupDelta(**values)


def _new_value(name: str, value: Any) -> Any:
    return list(value) if name in _LISTS else dict(value) if isinstance(value, dict) else value


def merge_deltas(items: Iterable[tuple[RollupKey, RollupDelta]]) -> dict[RollupKey, RollupDelta]:
    """Return the deltas summed per key."""
    merged: dict[RollupKey, RollupDelta] = {}
    for key, delta in items:
        prev = merged.get(key)
        merged[key] = delta if prev is None else prev.merge(delta)
    return merged


def add_rollups(session: Session, items: Iterable[tuple[RollupKey, RollupDelta]]) -> int:
    """Add each delta to its row, creating missing rows; return the rows touched."""
    return add_deltas(session, TABLE, merge_deltas(items))


TABLE: RollupTable[RollupKey, RollupDelta, TrafficRollup] = RollupTable(
    TrafficRollup, RollupKey, _add, _new_value)
