"""The C decode step's measured speedup per instance, for the auto-fallback policy.

Read from the A/B cycles' prompt pairs (`ProbeRun.details["pairs"]`, probes.cycle): the
`compiled_step` arm (the C step off while it serves) gives compiled-step latency /
optimized latency per pair, the reverse `native_step` arm (the C step back on while the
native_step flag is off) gives optimized latency / arm latency. The speedup is the median
of the ratios, taken on their logarithms, as probes.ab defines every measured speedup
(the alerts package does not import probes).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.orm import Session

from storage.queries.runs import ab_cycle_pairs
from vocab import Variant

OPTIMIZED = Variant.OPTIMIZED.value
COMPILED_STEP = Variant.COMPILED_STEP.value  # forward arm: the C step off
NATIVE_STEP = Variant.NATIVE_STEP.value  # reverse arm: the C step back on


@dataclass(frozen=True)
class StepSpeedup:
    """The C step against the compiled step on one instance: > 1 means the C step is faster."""

    instance_id: str
    speedup: float
    pairs: int


def step_speedups(session: Session, start: datetime, end: datetime, *,
                  arms: Collection[str] = (COMPILED_STEP, NATIVE_STEP),
                  instance_id: str | None = None) -> dict[str, StepSpeedup]:
    """Return instance -> the C step's speedup over the pairs of `arms` in [start, end)."""
    ratios: dict[str, list[float]] = defaultdict(list)
    for cycle in ab_cycle_pairs(session, start, end, instance_id=instance_id):
        for pair in cycle.pairs:
            latency = pair.get("latency_s") if isinstance(pair, dict) else None
            if not isinstance(latency, dict):
                continue
            opt = _positive(latency.get(OPTIMIZED))
            for arm in arms:
                lat = _positive(latency.get(arm))
                if opt is not None and lat is not None:
                    ratios[cycle.instance_id].append(
                        lat / opt if arm == COMPILED_STEP else opt / lat)
    return {inst: StepSpeedup(inst, _median(xs), len(xs)) for inst, xs in ratios.items()}


def _positive(x: object) -> float | None:
    """Return `x` as seconds when it is a positive JSON number, else None."""
    if isinstance(x, int | float) and not isinstance(x, bool) and x > 0:
        return float(x)
    return None


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else math.sqrt(s[n // 2 - 1] * s[n // 2])
