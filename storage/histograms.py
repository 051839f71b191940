"""Fixed-edge histograms stored as JSON count lists in traffic rollups.

A histogram over edges e[0] < ... < e[n-1] is a list of n + 1 counts: counts[0]
holds values <= e[0], counts[i] values in (e[i-1], e[i]], counts[n] values > e[n-1].
Upper-inclusive bins match buckets: a 64-token input fits bucket 64. Edges are
fixed so rollups from every instance and minute add element-wise.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence

from storage.errors import InvalidQuery

# Request latency, seconds.
LATENCY_EDGES_S: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 60.0,
)
# Input and output lengths, tokens; holds the default bucket edges (16..256).
TOKEN_EDGES: tuple[int, ...] = (
    4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
)


def empty(edges: Sequence[float]) -> list[int]:
    """Return an all-zero count list for `edges`."""
    return [0] * (len(edges) + 1)


def bin_index(value: float, edges: Sequence[float]) -> int:
    """Return the index of the bin `value` falls in."""
    return bisect_left(edges, value)


def counts(values: Iterable[float], edges: Sequence[float]) -> list[int]:
    """Return the histogram of `values` over `edges`."""
    out = empty(edges)
    for v in values:
        out[bisect_left(edges, v)] += 1
    return out


def add(a: Sequence[int], b: Sequence[int]) -> list[int]:
    """Return the element-wise sum of two count lists (the shorter one padded with 0)."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def quantile(hist: Sequence[int], edges: Sequence[float], q: float) -> float | None:
    """Return the q-quantile interpolated linearly inside its bin, or None when empty.

    The first bin is taken to start at 0; values in the overflow bin are reported
    as the last edge (a lower bound, so a caller can still tell it is large).
    """
    if not 0.0 <= q <= 1.0:
        raise InvalidQuery("q", f"must lie in [0, 1], got {q}", value=q)
    if len(hist) != len(edges) + 1:
        raise InvalidQuery("hist", f"has {len(hist)} bins, edges need {len(edges) + 1}")
    total = sum(hist)
    if total <= 0:
        return None
    rank = q * total
    seen = 0.0
    for i, c in enumerate(hist):
        if c <= 0:
            continue
        if seen + c >= rank:
            if i == len(edges):
                return float(edges[-1])
            lo = 0.0 if i == 0 else float(edges[i - 1])
            hi = float(edges[i])
            return lo + (hi - lo) * max(0.0, rank - seen) / c
        seen += c
    return float(edges[-1])


def share_above(hist: Sequence[int], edges: Sequence[float], threshold: float) -> float | None:
    """Return the share of values above `threshold` (interpolated inside a bin), or None."""
    total = sum(hist)
    if total <= 0:
        return None
    above = 0.0
    for i, c in enumerate(hist):
        lo = 0.0 if i == 0 else float(edges[i - 1])
        hi = float(edges[i]) if i < len(edges) else float("inf")
        if lo >= threshold:
            above += c
        elif hi > threshold and hi != float("inf"):
            above += c * (hi - threshold) / (hi - lo)
    return above / total
