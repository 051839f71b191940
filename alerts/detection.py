"""Change confirmation: a log-likelihood-ratio CUSUM tuned to each rule's threshold.

Each cycle's relative change x (in the alert direction) is scored against two
hypotheses with the baseline's relative noise sigma: "no change" N(0, sigma) and "a
change of exactly the threshold tau" N(tau, sigma). The log-likelihood ratio of one
cycle is tau * (x - tau / 2) / sigma**2; the CUSUM S_t = max(0, S_{t-1} + min(llr_t, cap))
confirms when S >= h. Why this design (see docs/detection.md#why-this-detector, `python -m bench.detection`):

* It adapts to noise by itself: on a quiet series a step of several sigmas confirms in the
  minimum number of cycles; on a noisy one it keeps collecting evidence
  instead of paging. The false-alarm rate depends on h, not on the noise: a CUSUM's
  average run length without change is at least e**h cycles (Lorden), e**14 ~ 1.2e6
  one-minute cycles, about two years.
* Spikes are bounded: one cycle contributes at most cap = h / min_cycles, so a single
  spike (or min_cycles - 1 consecutive ones) can never confirm a change.

Pooled quantiles (a canary p99 resting on the latest 25 cycles of 4 canaries) are not
independent from cycle to cycle: one slow request sits in 25 consecutive values. Scoring
each pooled value would count that request 25 times (`bench.detection` counts the false
alerts that makes). There the evidence of a cycle comes from its NEW samples only: a
Bernoulli CUSUM on how many of them exceed the baseline quantile q0 (the baseline of the
pooled q-quantile). Without a change a sample exceeds q0 with p0 = 1 - q by the
quantile's definition, whatever the latency distribution; the alternative is p1 =
EXCEEDANCE_RATIO x p0 (a shift of the rule's threshold pushes a whole canary's samples
past the old p99). Each sample counts once; the same cap per cycle applies.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from storage.sketches import Sketch, bin_of

# 1.4826 * MAD estimates sigma for normal data and ignores outliers.
_MAD_TO_SIGMA = 1.4826
# The 5-95% range of a normal sample spans 2 * 1.645 sigma.
_Q05_Q95_TO_SIGMA = 3.29
# Design alternative of the exceedance CUSUM: p1 = 10 x p0 (p99: 1% -> 10%), capped at 1/2.
EXCEEDANCE_RATIO = 10.0
# Quantiles from here up are scored by exceedances when pooled (alerts.rules).
TAIL_QUANTILE = 0.9
# A series whose false-page rate cannot be estimated yet (alerts.sensitivity).
INSUFFICIENT_HISTORY = "insufficient history"
# What such a series' stored reason ends with while the budget holds its pages.
HELD_SUFFIX = "; pages held as warnings until then"
# Why an estimate could not be made at all: no baseline yet (or one at zero).
NO_BASELINE = "no usable baseline yet"


@dataclass(frozen=True)
class Cusum:
    """Parameters of the LLR CUSUM.

    h: decision threshold in log-likelihood units (ARL without change >= e**h cycles).
    min_cycles: fewest cycles that can confirm; one cycle adds at most h / min_cycles.
    min_spread_rel: the baseline's relative noise is floored here, so a flat baseline
        (deterministic canaries) does not turn tiny moves into infinite evidence.
    """

    h: float = 14.0
    min_cycles: int = 3
    min_spread_rel: float = 0.02

    def __post_init__(self) -> None:
        if not self.h > 0:
            raise ValueError(f"cusum.h: must be > 0, got {self.h}")
        if self.min_cycles < 2 or self.min_cycles != int(self.min_cycles):
            raise ValueError(f"cusum.min_cycles: must be an integer >= 2 so a single cycle "
                             f"never confirms, got {self.min_cycles}")
        if not self.min_spread_rel > 0:
            raise ValueError(f"cusum.min_spread_rel: must be > 0, got {self.min_spread_rel}")

    @property
    def cap(self) -> float:
        """Return the most one cycle may add to S."""
        return self.h / self.min_cycles


@dataclass(frozen=True)
class BaselineStats:
    """A baseline summary: median and spread of per-cycle values.

    spread: the larger of 1.4826 x MAD (blind to a few outliers) and the 5-95% range /
    3.29 (not blind to a heavy tail), both sigma for normal data.
    """

    center: float
    spread: float
    cycles: int
    pinned: bool = False
    # Quantile rules: the median of the cycles' own median samples, where the canaries'
    # body sits (recovery reads it: alerts.rules.canaries_came_down); None: unknown.
    body: float | None = None
    # The relative threshold in force where the false-page budget widened the rule's on
    # this series' noise (alerts.sensitivity), and why; None: the configured one.
    threshold: float | None = None
    widened: str = ""
    # Why this series' pages are held as warnings: its history is too short to estimate
    # how often it would page on noise (alerts.sensitivity); "": it pages.
    held: str = ""

    @classmethod
    def of(cls, values: Iterable[float], *, pinned: bool = False,
           bodies: Iterable[float | None] = (), min_bodies: int = 1) -> BaselineStats | None:
        """Summarize per-cycle values; None when there are none.

        bodies: the cycles' own median samples (a quantile's); the body is their median
        where at least `min_bodies` are known.
        """
        known = [float(m) for m in bodies if m is not None and math.isfinite(m)]
        body = statistics.median(known) if known and len(known) >= min_bodies else None
        xs = [float(v) for v in values if v is not None and math.isfinite(v)]
        if not xs:
            return None
        center = statistics.median(xs)
        spread = _MAD_TO_SIGMA * statistics.median(abs(x - center) for x in xs)
        if len(xs) >= 20:
            # The MAD ignores a heavy tail that still makes false alarms (per-request
            # acceptance is such a mixture): take the 5-95% range when it is wider.
            xs.sort()
            q05, q95 = xs[int(0.05 * (len(xs) - 1))], xs[int(0.95 * (len(xs) - 1))]
            spread = max(spread, (q95 - q05) / _Q05_Q95_TO_SIGMA)
        return cls(center=center, spread=spread, cycles=len(xs), pinned=pinned, body=body)

    def relative_noise(self, params: Cusum) -> float:
        """Return spread / |centre|, floored at params.min_spread_rel (inf for a zero centre)."""
        return max(self.measured_noise(), params.min_spread_rel)

    def measured_noise(self) -> float:
        """Return spread / |centre| as measured, with no floor (inf for a zero centre)."""
        if self.center == 0:
            return math.inf
        return self.spread / abs(self.center)


def relative_change(value: float, center: float) -> float | None:
    """Return (value - center) / |center|, or None for a zero centre."""
    if center == 0:
        return None
    return (value - center) / abs(center)


def llr(x: float, threshold: float, sigma: float) -> float:
    """Return the log-likelihood ratio of "changed by threshold" vs "unchanged" for x."""
    return threshold * (x - threshold / 2.0) / (sigma * sigma)


def cusum_path(increments: Sequence[float], params: Cusum) -> list[float]:
    """Return S_t = max(0, S_{t-1} + min(inc_t, cap)) for each cycle, S_0 = 0."""
    out: list[float] = []
    s = 0.0
    for inc in increments:
        s = max(0.0, s + min(inc, params.cap))
        out.append(s)
    return out


def count_above(sketch: Sketch, level: float) -> int:
    """Return how many of the sketch's samples lie above `level`'s bin (a sample in the same
    bin is within the sketch's accuracy of it: not known to exceed it)."""
    if level <= 0:
        return sketch.count - sketch.zeros if level == 0 else sketch.count
    top = bin_of(level)
    return sum(c for k, c in sketch.bins.items() if k > top)


def exceedance_llr(above: int, n: int, q: float) -> float:
    """Return the LLR of n new samples, `above` of them over the baseline q-quantile.

    H0: each exceeds it with p0 = 1 - q (the quantile's definition); H1: with
    p1 = min(EXCEEDANCE_RATIO x p0, 1/2).
    """
    if not 0.0 < q < 1.0:
        raise ValueError(f"q: must lie in (0, 1), got {q}")
    if not 0 <= above <= n:
        raise ValueError(f"above: must lie in 0..n ({n}), got {above}")
    p0 = 1.0 - q
    p1 = min(EXCEEDANCE_RATIO * p0, 0.5)
    return above * math.log(p1 / p0) + (n - above) * math.log((1.0 - p1) / (1.0 - p0))
