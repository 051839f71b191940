"""Measured speedup of each optimization: paired per prompt within A/B cycles.

The one definition the weekly report, `GET /v1/probes/speedups`, the auto-fallback policy
(the C step's trigger, an arm's recovery) and the incident cause use. An A/B cycle runs
each canary prompt's optimized request and its fallback arms back to back in a random
order (probes.cycle) and stores them as `ProbeRun.details["pairs"]` (probes.sink). Each
(prompt, arm) of a cycle gives one ratio:

    eager/direct/exact/float32/compiled_step arms:    arm latency / optimized latency
    speculative/compiled/quantized/native_step arms:  optimized latency / arm latency
    (reverse arms run the optimization while its flag is off, so the ratio is inverted)

speedup > 1 means the optimization is faster than going without it. A forward arm and
its reverse measure the same optimization (on vs off), so their ratios are pooled. Per
bucket x optimization, and over all buckets together (bucket "all"), the speedup is the
median of the ratios (taken on their logarithms, so with an even count it is the geometric
mean of the two middle ratios) with the number of pairs and a distribution-free 95%
confidence interval for that median: the order statistics x_(k) and x_(n+1-k) of the sorted ratios, with k
the largest rank whose binomial(n, 1/2) tail P(B <= k-1) is at most 2.5% (coverage at
least 95%; none under 6 pairs).

Cycles stored before pairs were recorded (details without "pairs") are ignored: their
arms ran minutes after the optimized requests and do not pair. Per instance
(`instance_speedups`) is the same number over one instance's pairs.

Each pair keeps why its cycle ran the arms (`PairRecord.ab_reason`, details["ab_reason"],
probes.ab_schedule): "drawn" on the background share, "slowdown" on demand in the cycle
after a slow one, "requested" by a caller; "" on rows stored before the reason was,
when no arm ran on demand yet (they count as drawn). `load_pairs` returns every A/B
cycle's pairs: the incident cause reads them all (during a slowdown the on-demand cycles
are most of what measured it), as do the API and the auto-fallback policy. A number
meant for the whole week (the weekly report) reads the first list of `scheduled(pairs)`
only: the on-demand cycles crowd into slow periods, so with them the week's speedup
would over-sample its slow hours. Requested cycles are kept: their timing is the
caller's, not the latency the speedup measures (the demo, `tailwatch probe run --ab`,
`POST /v1/probes/run`).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.orm import Session

from storage.queries.runs import ab_cycle_pairs
from vocab import AbReason, Variant

ALL_BUCKETS = "all"
# The reasons whose cycles do not follow the latency they measure ("": stored before the
# reason was, drawn). Unknown reasons count as on demand: left out rather than biasing.
SCHEDULED_REASONS = frozenset({"", AbReason.DRAWN.value, AbReason.REQUESTED.value})
CONFIDENCE = 0.95
OPTIMIZED = Variant.OPTIMIZED.value
# A/B arm -> the optimization it measures (the arm turns it off, or a reverse arm back on).
OPTIMIZATION_OF_ARM: dict[str, str] = {
    Variant.EAGER.value: "compile", Variant.COMPILED.value: "compile",
    Variant.DIRECT.value: "speculative", Variant.SPECULATIVE.value: "speculative",
    Variant.EXACT.value: "bucketing",
    Variant.FLOAT32.value: "int8", Variant.QUANTIZED.value: "int8",
    Variant.COMPILED_STEP.value: "native_step", Variant.NATIVE_STEP.value: "native_step"}
# Reverse arms run the optimization while its flag is off: the ratio is inverted.
REVERSE_ARMS = (Variant.SPECULATIVE.value, Variant.COMPILED.value, Variant.QUANTIZED.value,
                Variant.NATIVE_STEP.value)


@dataclass(frozen=True)
class PairRecord:
    """One stored prompt pair: the latency of each variant of one prompt in one cycle."""

    run_id: int
    instance_id: str
    started_at: datetime
    bucket: str
    prompt: str
    latency_s: Mapping[str, float]
    ab_reason: str = ""  # why its cycle ran the arms (module docstring); "": not stored
    finished_at: datetime | None = None  # when its cycle finished (None: not stored)

    @property
    def at(self) -> datetime:
        """Return when its cycle finished (started, where that is not stored): when the
        cycle's canary rows are stamped (probes.sink)."""
        return self.finished_at or self.started_at


@dataclass(frozen=True)
class ArmSpeedup:
    """Speedup of one optimization in one bucket (or ALL_BUCKETS) over a window.

    arms: the A/B arms that measured it (a forward arm, its reverse, or both when the
    optimization's flag changed within the window).
    pairs: prompts where both the optimized request and an arm succeeded; runs: the
    cycles they came from. speedup: median of the per-pair ratios (module docstring);
    ci_low/ci_high: its 95% confidence interval (None under 6 pairs).
    optimized_p50_s / arm_p50_s: median latency of each side over the same pairs.
    off_p50_s / on_p50_s: median latency without and with the optimization over the same
    pairs (a reverse arm's request is the one with it on). Where forward and reverse arms
    are pooled, the optimized request runs with the optimization in some pairs and
    without it in others, so only these two read in the speedup's direction.
    """

    bucket: str
    optimization: str
    arms: tuple[str, ...]
    pairs: int
    runs: int
    speedup: float
    ci_low: float | None
    ci_high: float | None
    optimized_p50_s: float
    arm_p50_s: float
    off_p50_s: float
    on_p50_s: float


def ab_speedups(session: Session, start: datetime, end: datetime, *,
                instance_id: str | None = None,
                arms: Collection[str] | None = None,
                on_demand: bool = True) -> list[ArmSpeedup]:
    """Return the speedup per bucket x optimization, and over all buckets, in [start, end).

    on_demand=False leaves out the cycles that ran the arms after a slow one (`scheduled`).
    """
    pairs = load_pairs(session, start, end, instance_id=instance_id)
    return speedups(pairs if on_demand else scheduled(pairs)[0], arms=arms)


def instance_speedups(session: Session, start: datetime, end: datetime, optimization: str, *,
                      instance_id: str | None = None,
                      arms: Collection[str] | None = None) -> dict[str, ArmSpeedup]:
    """Return instance -> the speedup of `optimization` over all its buckets in [start, end)."""
    by_instance: dict[str, list[PairRecord]] = defaultdict(list)
    for p in load_pairs(session, start, end, instance_id=instance_id):
        by_instance[p.instance_id].append(p)
    out = {}
    for inst, pairs in sorted(by_instance.items()):
        found = overall(speedups(pairs, arms=arms), optimization)
        if found is not None:
            out[inst] = found
    return out


def overall(rows: Iterable[ArmSpeedup], optimization: str) -> ArmSpeedup | None:
    """Return the ALL_BUCKETS row of `optimization` in `rows`, or None when unmeasured."""
    return next((s for s in rows if s.bucket == ALL_BUCKETS and s.optimization == optimization),
                None)


def load_pairs(session: Session, start: datetime, end: datetime, *,
               instance_id: str | None = None) -> list[PairRecord]:
    """Return the prompt pairs of every A/B cycle started in [start, end), whatever ran
    its arms (`scheduled` splits off the on-demand ones)."""
    if end <= start:
        raise ValueError("end: must be after start")
    out = []
    for c in ab_cycle_pairs(session, start, end, instance_id=instance_id):
        for p in c.pairs:
            if not isinstance(p, dict) or not isinstance(p.get("bucket"), str):
                continue  # not a pair the sink wrote
            latency = p.get("latency_s")
            if not isinstance(latency, dict):
                continue
            # JSON numbers as the sink wrote them; speedups() skips anything else.
            out.append(PairRecord(c.run_id, c.instance_id, c.started_at, p["bucket"],
                                  str(p.get("prompt", "")), latency, c.reason,
                                  c.finished_at))
    return out


def scheduled(pairs: Iterable[PairRecord]) -> tuple[list[PairRecord], list[PairRecord]]:
    """Return (the pairs of drawn or requested cycles, those of cycles run on demand).

    Rows without a reason count as drawn; see the module docstring for why the week's
    speedup reads the first list only.
    """
    kept: list[PairRecord] = []
    on_demand: list[PairRecord] = []
    for p in pairs:
        (kept if p.ab_reason in SCHEDULED_REASONS else on_demand).append(p)
    return kept, on_demand


def speedups(pairs: Iterable[PairRecord], *,
             arms: Collection[str] | None = None) -> list[ArmSpeedup]:
    """Return the speedup per bucket x optimization and over ALL_BUCKETS of `pairs`.

    arms: read only these A/B arms (None: every arm in OPTIMIZATION_OF_ARM).
    """
    wanted = set(OPTIMIZATION_OF_ARM) if arms is None else set(arms) & set(OPTIMIZATION_OF_ARM)
    # (bucket, optimization) -> (optimized s, arm s, arm, run id) per pair
    sides: dict[tuple[str, str], list[tuple[float, float, str, int]]] = defaultdict(list)
    for p in pairs:
        opt = _seconds(p.latency_s.get(OPTIMIZED))
        if opt is None:
            continue
        for arm, raw in p.latency_s.items():
            lat = _seconds(raw) if arm in wanted else None
            if lat is not None:
                row = (opt, lat, arm, p.run_id)
                sides[(p.bucket, OPTIMIZATION_OF_ARM[arm])].append(row)
                sides[(ALL_BUCKETS, OPTIMIZATION_OF_ARM[arm])].append(row)
    out = []
    for (bucket, optimization), xs in sides.items():
        ratios = [(o / a) if arm in REVERSE_ARMS else (a / o) for o, a, arm, _ in xs]
        mid, lo, hi = median_ci(ratios)
        out.append(ArmSpeedup(
            bucket=bucket, optimization=optimization,
            arms=tuple(sorted({arm for _, _, arm, _ in xs})), pairs=len(xs),
            runs=len({r for _, _, _, r in xs}), speedup=mid, ci_low=lo, ci_high=hi,
            optimized_p50_s=statistics.median(o for o, _, _, _ in xs),
            arm_p50_s=statistics.median(a for _, a, _, _ in xs),
            off_p50_s=statistics.median(o if arm in REVERSE_ARMS else a for o, a, arm, _ in xs),
            on_p50_s=statistics.median(a if arm in REVERSE_ARMS else o for o, a, arm, _ in xs)))
    return sorted(out, key=lambda s: (_bucket_key(s.bucket), s.optimization))


def median_ci(ratios: Sequence[float],
              confidence: float = CONFIDENCE) -> tuple[float, float | None, float | None]:
    """Return (median, low, high) of positive ratios: median of logs, order-statistic CI."""
    if not ratios:
        raise ValueError("ratios: must not be empty")
    xs = sorted(ratios)
    n = len(xs)
    # The log is monotone: the median of the logs is that of the sorted ratios, and with
    # an even count the mean of the two middle logs is their geometric mean.
    mid = xs[n // 2] if n % 2 else math.sqrt(xs[n // 2 - 1] * xs[n // 2])
    k = order_rank(n, (1.0 - confidence) / 2)
    if k == 0:
        return mid, None, None
    return mid, xs[k - 1], xs[n - k]


# Above this many values the binomial tail is summed from 8 standard deviations below the
# mean on: the terms below add up to under 1e-14, and the sum takes ~16 sd steps.
_EXACT_UP_TO = 1000


def order_rank(n: int, tail: float, q: float = 0.5) -> int:
    """Return the largest k >= 1 with P(Binomial(n, q) <= k-1) <= tail, else 0: the
    x_(k) of n sorted values is below the q-quantile with probability at least 1 - tail
    (for the other side, x_(n+1-k) with k = order_rank(n, tail, 1 - q))."""
    sd = math.sqrt(n * q * (1.0 - q))
    start = 0 if n <= _EXACT_UP_TO else max(0, int(n * q - 8 * sd))
    log_q, log_p = math.log(q), math.log1p(-q)
    cum, k = 0.0, start
    for j in range(start, n + 1):
        cum += math.exp(_log_choose(n, j) + j * log_q + (n - j) * log_p)
        if cum > tail:
            break
        k = j + 1
    return k


def _seconds(x: object) -> float | None:
    """Return `x` when it is a positive JSON number as the sink writes latencies, else None."""
    if isinstance(x, int | float) and not isinstance(x, bool) and x > 0:
        return float(x)
    return None


def _log_choose(n: int, j: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(j + 1) - math.lgamma(n - j + 1)


def _bucket_key(bucket: str) -> tuple[int, str]:
    if bucket == ALL_BUCKETS:
        return (1 << 31, bucket)
    return (int(bucket), "") if bucket.isdigit() else (1 << 30, bucket)
