"""Input-length buckets: pick the smallest edge that fits (pure, no torch)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.protocol import BUCKET_OVERFLOW


def bucket_edge(input_tokens: int, edges: Sequence[int]) -> int | None:
    """Return the smallest edge >= input_tokens, or None when the input overflows."""
    for edge in edges:
        if input_tokens <= edge:
            return edge
    return None


def bucket_label(input_tokens: int, edges: Sequence[int]) -> str:
    """Return str(edge) for the bucket of `input_tokens`, or "overflow"."""
    edge = bucket_edge(input_tokens, edges)
    return BUCKET_OVERFLOW if edge is None else str(edge)
