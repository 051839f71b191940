"""Order statistics over small samples (pure Python, no numpy at probe time)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """Return the q-th percentile (0..100) with linear interpolation (numpy's default)."""
    if not values:
        raise ValueError("values: must not be empty")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q: must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Distribution:
    """Summary of one sample: count, mean, min, p50/p95/p99 and max (None when empty)."""

    count: int
    mean: float | None = None
    min: float | None = None
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        """Summarize `values`."""
        if not values:
            return cls(0)
        return cls(
            count=len(values),
            mean=sum(values) / len(values),
            min=min(values),
            p50=percentile(values, 50),
            p95=percentile(values, 95),
            p99=percentile(values, 99),
            max=max(values),
        )
