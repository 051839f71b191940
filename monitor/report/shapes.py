"""Real-traffic input lengths against the bucket edges, and edges that minimize padding.

Lengths come as exact counts (width-1 LengthBins from storage's sparse length counts), so
waste is computed from the data. Proposed edges come from a small dynamic program over
candidate edges (observed lengths rounded up to EDGE_MULTIPLE) that minimizes the padded
tokens of the inputs the largest proposed edge covers; the proposal is the current
buckets whenever that is no worse, so a report never recommends a change that pads more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from monitor.report.data import LengthBin

EDGE_MULTIPLE = 8  # round proposed edges up so padded shapes stay kernel-friendly
MIN_GAIN = 0.02  # recommend new edges only when they cut padding waste by 2 points or more


@dataclass(frozen=True)
class ShapeSummary:
    """Distribution of real input lengths for the week.

    Quantiles are the upper end of the bin holding them (exact: bins are single lengths).
    padding_waste / proposed_waste: padding over padded tokens of the observed inputs,
    overflow excluded; proposed_edges are the current buckets when nothing is better.
    """

    requests: int
    p50: int
    p90: int
    p99: int
    max_length: int
    buckets: tuple[int, ...]
    fit_largest: float
    padding_waste: float | None
    proposed_edges: tuple[int, ...]
    proposed_waste: float | None


def quantile(bins: tuple[LengthBin, ...], q: float) -> int:
    """Return the smallest bin upper end with at least q of all counts at or below it."""
    ordered = sorted((b for b in bins if b.count > 0), key=lambda b: b.hi)
    total = sum(b.count for b in ordered)
    if not total:
        raise ValueError("bins: no counts")
    need = q * total
    seen = 0
    for b in ordered:
        seen += b.count
        if seen >= need - 1e-9:
            return b.hi
    return ordered[-1].hi


def waste(bins: tuple[LengthBin, ...], edges: tuple[int, ...]) -> float | None:
    """Return padding / padded tokens if inputs were padded to `edges` (overflow excluded).

    Exact for width-1 bins; a wider bin's inputs are taken at its midpoint.
    """
    pad = padded = 0.0
    ordered = sorted(edges)
    for b in bins:
        length = (b.lo + b.hi) / 2
        edge = next((e for e in ordered if e >= b.hi), None)
        if edge is None or b.count == 0:
            continue
        pad += b.count * (edge - length)
        padded += b.count * edge
    return pad / padded if padded else None


def propose_edges(bins: tuple[LengthBin, ...], n_buckets: int) -> tuple[int, ...]:
    """Return at most n_buckets edges minimizing padded tokens up to the p99 length.

    Candidates are the bins' upper ends rounded up to EDGE_MULTIPLE; the largest edge is
    the rounded p99 length (inputs above it overflow, as with the current largest bucket).
    """
    if n_buckets < 1:
        raise ValueError(f"n_buckets: must be >= 1, got {n_buckets}")
    top = _round_up(quantile(bins, 0.99))
    counts: dict[int, int] = {}
    for b in bins:
        if b.count > 0 and b.hi <= top:
            c = _round_up(b.hi)
            counts[c] = counts.get(c, 0) + b.count
    cands = sorted(set(counts) | {top})
    m = len(cands)
    prefix = [0]
    for c in cands:
        prefix.append(prefix[-1] + counts.get(c, 0))

    def cost(i: int, j: int) -> int:
        # Inputs of candidates i+1..j (0-based j) padded to cands[j]; i = -1: from the start.
        return (prefix[j + 1] - prefix[i + 1]) * cands[j]

    # best[k][j]: least padded tokens covering cands[0..j] with k edges, the last at j.
    inf = math.inf
    best = [[inf] * m for _ in range(n_buckets + 1)]
    back = [[-1] * m for _ in range(n_buckets + 1)]
    for j in range(m):
        best[1][j] = cost(-1, j)
    for k in range(2, n_buckets + 1):
        for j in range(m):
            for i in range(j):
                v = best[k - 1][i] + cost(i, j)
                if v < best[k][j]:
                    best[k][j], back[k][j] = v, i
    k = min(range(1, n_buckets + 1), key=lambda kk: (best[kk][m - 1], kk))
    edges = []
    j = m - 1
    while k >= 1 and j >= 0:
        edges.append(cands[j])
        j, k = back[k][j], k - 1
    return tuple(sorted(edges))


def summarize(bins: tuple[LengthBin, ...], buckets: tuple[int, ...]) -> ShapeSummary | None:
    """Summarize the length histogram against `buckets`; None when there is no traffic."""
    total = sum(b.count for b in bins)
    if not total or not buckets:
        return None
    largest = max(buckets)
    fit = sum(b.count for b in bins if b.hi <= largest) / total
    proposed = propose_edges(bins, len(buckets))
    current_waste = waste(bins, tuple(buckets))
    proposed_waste = waste(bins, proposed)
    if current_waste is not None and (proposed_waste is None or proposed_waste >= current_waste):
        proposed, proposed_waste = tuple(sorted(buckets)), current_waste
    return ShapeSummary(
        requests=total,
        p50=quantile(bins, 0.50),
        p90=quantile(bins, 0.90),
        p99=quantile(bins, 0.99),
        max_length=max(b.hi for b in bins if b.count),
        buckets=tuple(buckets),
        fit_largest=fit,
        padding_waste=current_waste,
        proposed_edges=proposed,
        proposed_waste=proposed_waste,
    )


def _round_up(n: int) -> int:
    return max(EDGE_MULTIPLE, int(math.ceil(n / EDGE_MULTIPLE)) * EDGE_MULTIPLE)
