"""Measured speedup of each optimization per bucket, from A/B probe rows.

A/B cycles store, in the same run, variant "optimized" (the engine's current flags)
and one row per fallback arm: "eager" (compile off), "direct" (speculation off),
"exact" (bucketing off); when a bucket's speculation is already off, the arm is
"speculative" (speculation forced on for the canary). Pairing rows of the same run
and bucket cancels slow drifts of the machine; the speedup is the median over runs.

speedup > 1 means the optimization is faster than going without it:
    eager/direct/exact arms:  arm p50 / optimized p50
    speculative arm:          optimized p50 / arm p50 (what turning speculation back on gains)
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.orm import Session

from probes.cycle import ARM_COMPILED, ARM_SPECULATIVE, ARMS
from probes.measure import VARIANT_DEFAULT
from storage.queries.runs import arm_p50s

OPTIMIZATION_OF_ARM = {"eager": "compile", "direct": "speculative", "exact": "bucketing",
                       ARM_SPECULATIVE: "speculative", ARM_COMPILED: "compile"}
# Reverse arms run the optimization while its flag is off: the ratio is inverted.
REVERSE_ARMS = (ARM_SPECULATIVE, ARM_COMPILED)


@dataclass(frozen=True)
class ArmSpeedup:
    """Speedup of one optimization in one bucket over a window of A/B runs."""

    bucket: str
    arm: str
    optimization: str
    runs: int  # runs where both the optimized variant and the arm were measured
    optimized_p50_s: float  # median over runs
    arm_p50_s: float
    speedup: float  # median over runs of the per-run ratio (see module docstring)


def ab_speedups(session: Session, start: datetime, end: datetime, *,
                instance_id: str | None = None) -> list[ArmSpeedup]:
    """Return the speedup per bucket x arm measured by A/B cycles in [start, end)."""
    if end <= start:
        raise ValueError("end: must be after start")
    variants = (VARIANT_DEFAULT, *ARMS, *REVERSE_ARMS)
    # (run, bucket, variant) -> (requests, p50): keep the row with most requests.
    best: dict[tuple[int, str, str], tuple[int, float]] = {}
    for row in arm_p50s(session, start, end, variants, instance_id=instance_id):
        key = (row.run_id, row.bucket, row.variant)
        if key not in best or row.requests > best[key][0]:
            best[key] = (row.requests, row.p50_s)
    pairs: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for (run_id, bucket, variant), (_, p50) in best.items():
        if variant == VARIANT_DEFAULT:
            continue
        opt = best.get((run_id, bucket, VARIANT_DEFAULT))
        if opt is not None and opt[1] > 0 and p50 > 0:
            pairs[(bucket, variant)].append((opt[1], p50))
    out = []
    for (bucket, arm), xs in pairs.items():
        ratios = [(o / a) if arm in REVERSE_ARMS else (a / o) for o, a in xs]
        out.append(ArmSpeedup(
            bucket=bucket, arm=arm, optimization=OPTIMIZATION_OF_ARM[arm], runs=len(xs),
            optimized_p50_s=statistics.median(o for o, _ in xs),
            arm_p50_s=statistics.median(a for _, a in xs), speedup=statistics.median(ratios)))
    return sorted(out, key=lambda s: (_bucket_key(s.bucket), s.arm))


def _bucket_key(bucket: str) -> tuple[int, str]:
    return (int(bucket), "") if bucket.isdigit() else (1 << 30, bucket)
