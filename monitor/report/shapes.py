"""Real-traffic input lengths against the bucket edges, and better edges from quantiles."""

from __future__ import annotations

import math
from dataclasses import dataclass

from monitor.report.data import LengthBin

EDGE_MULTIPLE = 8  # round proposed edges up so padded shapes stay kernel-friendly
MIN_GAIN = 0.02  # recommend new edges only when they cut padding waste by 2 points or more


@dataclass(frozen=True)
class ShapeSummary:
    """Distribution of real input lengths for the week.

    Quantiles are the upper end of the histogram bin holding them (exact for width-1 bins).
    padding_waste / proposed_waste are estimated from the histogram (bin midpoints),
    overflow excluded.
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
    """Return padding / padded tokens if inputs were padded to `edges` (overflow excluded)."""
    pad = padded = 0.0
    for b in bins:
        length = (b.lo + b.hi) / 2
        edge = next((e for e in edges if e >= b.hi), None)
        if edge is None or b.count == 0:
            continue
        pad += b.count * (edge - length)
        padded += b.count * edge
    return pad / padded if padded else None


def propose_edges(bins: tuple[LengthBin, ...], n_buckets: int) -> tuple[int, ...]:
    """Return n_buckets edges at equal-count quantiles, the largest at the p99 length."""
    qs = [i / n_buckets for i in range(1, n_buckets)] + [0.99]
    edges = sorted({_round_up(quantile(bins, q)) for q in qs})
    return tuple(edges)


def summarize(bins: tuple[LengthBin, ...], buckets: tuple[int, ...]) -> ShapeSummary | None:
    """Summarize the length histogram against `buckets`; None when there is no traffic."""
    total = sum(b.count for b in bins)
    if not total or not buckets:
        return None
    largest = max(buckets)
    fit = sum(b.count for b in bins if b.hi <= largest) / total
    proposed = propose_edges(bins, len(buckets))
    return ShapeSummary(
        requests=total,
        p50=quantile(bins, 0.50),
        p90=quantile(bins, 0.90),
        p99=quantile(bins, 0.99),
        max_length=max(b.hi for b in bins if b.count),
        buckets=tuple(buckets),
        fit_largest=fit,
        padding_waste=waste(bins, tuple(buckets)),
        proposed_edges=proposed,
        proposed_waste=waste(bins, proposed),
    )


def _round_up(n: int) -> int:
    return max(EDGE_MULTIPLE, int(math.ceil(n / EDGE_MULTIPLE)) * EDGE_MULTIPLE)
