"""Element-wise count lists (accepted tokens per draft position) stored as JSON lists.

Latency, TTFT and per-token distributions are quantile sketches (storage.sketches) and
lengths exact counts (fixed bins interpolate quantiles and cannot merge without error).
"""

from __future__ import annotations

from collections.abc import Sequence


def add(a: Sequence[int], b: Sequence[int]) -> list[int]:
    """Return the element-wise sum of two count lists (the shorter one padded with 0)."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]
