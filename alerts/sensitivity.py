"""Sensitivity: what a rule can confirm on a series' own noise, and how often it pages on it.

For one rule and one series (scope x cohort, its recent cycles and its baseline) the
estimate replays the production rule (`alerts.rules.evaluate_rule`: its CUSUM, threshold,
`for` and pooling) over moving-block bootstrap copies of the series' own history, so the
cycle-to-cycle autocorrelation of a shared host stays in:

* detectable change: the smallest relative shift (in the rule's direction) that the rule
  confirms within `within_cycles` cycles of its onset in at least 95% of trials;
* false pages per 30 days: alert episodes on stationary resampled cycles at a threshold.

False-page budget: where the configured threshold would page more often than
`budget_per_30d` on the measured noise, the threshold in force is the smallest one that
meets it, never tighter than configured, and the reason says so
(`threshold +15% -> +27% (noise: 30 days would page 3 times at +15%)`).

Cost: the false-page count runs the CUSUM bound over every simulated cycle and the rule
only where that bound reaches h (a CUSUM restarted at the detector's window start never
stands above the long-run one), so most simulated cycles cost one vectorized step
(`bench.detection` measures it).
"""

from __future__ import annotations

import math
import random
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

import numpy as np
from sqlalchemy.orm import Session

from alerts.baselines import (
    CHUNK_S,
    alert_spans,
    hour_of_day,
    hour_of_week,
    hour_start,
    rule_scope,
)
from alerts.detection import (
    HELD_SUFFIX,
    INSUFFICIENT_HISTORY,
    NO_BASELINE,
    TAIL_QUANTILE,
    BaselineStats,
    Cusum,
    count_above,
    exceedance_llr,
    llr,
    relative_change,
)
from alerts.rules import (
    QUANTILE_METRICS,
    Point,
    Rule,
    breaches,
    evaluate_rule,
    has_limit,
    quantile_samples,
    with_min_delta,
    with_threshold,
)
from alerts.series import Labels, sliced_cohort_series
from storage.models import scope_key
from storage.queries import baselines as baseline_queries
from storage.queries import sensitivity as sensitivity_queries
from storage.queries.baselines import StoredBaseline, decide_in_force
from storage.queries.sensitivity import SensitivityKey, StoredSensitivity
from storage.sketches import GAMMA, Sketch, bin_of

OK = "ok"
INSUFFICIENT = INSUFFICIENT_HISTORY
NOT_DETECTABLE = "not detectable"  # no shift up to max_shift is confirmed in time
# A series too young to state its false pages grows with every cycle, not only when its
# baseline refreshes (hourly): once it could have the cycles it lacked, its estimate is
# due again this long after the last, so it states its pages (and stops holding them as
# warnings) minutes after its history suffices.
HELD_RECHECK_S = 600.0
DAYS_30 = 30 * 86400.0
P95 = 0.95
# Episodes that pin a false-page rate well enough (about +-14%); counting stops there.
PRECISE_PAGES = 50
# The detectable shift is searched to this share of (1 + shift): a stated shift lies at
# most that far above the true p95 point.
SHIFT_RESOLUTION = 0.005


# One-sided confidence of the false-page rate the budget is checked against: 80%. At 95%
# a single page in the simulated days (one rare excursion of a quiet host, well within the
# budget) failed every threshold up to where that one excursion stops paging.
UPPER_Z = 0.8416


def poisson_upper(k: int) -> float:
    """Return the one-sided 80% upper bound of a Poisson mean with k events seen
    (Wilson-Hilferty; 1.6 for none, 3.0 for one)."""
    n = k + 1
    return n * (1.0 - 1.0 / (9.0 * n) + UPPER_Z / (3.0 * math.sqrt(n))) ** 3


@dataclass(frozen=True)
class _Count:
    """Alert episodes counted over simulated cycles of `window_s` seconds."""

    pages: int
    cycles: int
    window_s: float

    @property
    def per_30d(self) -> float:
        """Return the rate per 30 days (the point estimate stated)."""
        return self.pages * DAYS_30 / self.window_s / max(1, self.cycles)

    @property
    def upper_30d(self) -> float:
        """Return its 80% upper bound: what the budget is checked against."""
        return poisson_upper(self.pages) * DAYS_30 / self.window_s / max(1, self.cycles)


class Timeout(Exception):
    """The estimate ran past its CPU budget."""


@dataclass(frozen=True)
class SensitivityConfig:
    """How the estimate runs.

    within_cycles: N, the cycles after onset within which a shift must be confirmed.
    budget_per_30d: false pages per 30 days a series may cost; None: no budget (`off`).
    trials: resampled trials per shift tried.
    days: stationary days simulated for the false-page count (at least 30); with a
        budget, as many as it takes for a count of none to meet it (`budget_days`).
    max_days: the most days simulated for a budget (a budget of 0 is met by none in them).
    min_history: fewest usable cycles an estimate rests on.
    min_history_s: the least time they span (a host's month is not read off an hour).
    max_history_s: the furthest back the job reads a series (`reach_s`): the raw
        retention, past which its rows are pruned.
    block: fewest cycles resampled together; blocks span at least 4 of the rule's
        lookbacks (each join restarts the series' state: an excursion cut there, or the
        CUSUM build-up before it, would not page, undercounting false pages on an
        autocorrelated series) and a pooled quantile's pool.
    max_shift: the largest relative shift tried (twice the threshold a rule's `min_delta`
        asks of the baseline, where that is larger).
    cpu_s: CPU seconds one series may take (`Timeout` past it), of the calling thread:
        the job shares its process with threads that serve and probe, whose CPU is not
        this estimate's.
    """

    within_cycles: int = 10
    budget_per_30d: float | None = 0.5
    trials: int = 100
    days: float = 60.0
    max_days: float = 360.0
    min_history: int = 360
    min_history_s: float = 6 * 3600.0
    max_history_s: float = 14 * 86400.0
    block: int = 5
    max_shift: float = 3.0
    cpu_s: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.within_cycles < 1:
            raise ValueError(f"within_cycles: must be >= 1, got {self.within_cycles}")
        if self.budget_per_30d is not None and not self.budget_per_30d >= 0:
            raise ValueError(f"budget_per_30d: must be >= 0, got {self.budget_per_30d}")
        if self.trials < 20 or self.days < 30 or self.block < 1 or self.min_history < 10 \
                or self.max_days < self.days:
            raise ValueError("trials >= 20, days >= 30, max_days >= days, block >= 1 and "
                             "min_history >= 10")
        if self.max_history_s < self.min_history_s:
            raise ValueError(f"max_history_s: must be >= min_history_s "
                             f"({self.min_history_s:g}), got {self.max_history_s:g}")

    def budget_days(self, budget: float | None) -> float:
        """Return the days simulated: enough for one page in them to meet `budget` at the
        upper bound (180 for 0.5 per 30 days), within [days, max_days]."""
        if budget is None:
            return self.days
        if budget <= 0:
            return self.max_days
        # A hair more, so that rounding to whole cycles never leaves the bound over it.
        return min(self.max_days, max(self.days, 30.0 * poisson_upper(1) / budget * 1.001))


@dataclass(frozen=True)
class Sensitivity:
    """What one rule can see on one series.

    detectable_change: relative shift (positive, in the rule's direction) confirmed within
        within_cycles cycles at p95; None when insufficient or not detectable.
    threshold: the relative threshold in force (positive); configured_threshold: the rule's.
    false_pages_30d: expected false pages per 30 days at the threshold in force;
        false_pages_configured: at the configured one.
    reason: why the threshold was widened ("" when it was not), or why nothing is known.
    """

    rule: str
    status: str
    cycles: int
    within_cycles: int
    configured_threshold: float
    threshold: float
    detectable_change: float | None = None
    false_pages_30d: float | None = None
    false_pages_configured: float | None = None
    budget_per_30d: float | None = None
    reason: str = ""
    cpu_s: float = 0.0

    @property
    def widened(self) -> bool:
        """Return whether the threshold in force is wider than configured."""
        return self.threshold > self.configured_threshold


def widening_reason(direction: int, configured: float, threshold: float,
                    pages_configured: float, days: float = 30.0) -> str:
    """Return `threshold +15% -> +27% (noise: 30 days would page 3 times at +15%)`."""
    sign = "+" if direction > 0 else "-"
    times = f"{pages_configured:.3g} time" + ("" if pages_configured == 1 else "s")
    return (f"threshold {sign}{configured:.0%} -> {sign}{threshold:.0%} (noise: {days:g} "
            f"days would page {times} at {sign}{configured:.0%})")


class _Clock:
    def __init__(self, limit_s: float, clock: Callable[[], float]) -> None:
        self.clock, self.start, self.limit = clock, clock(), limit_s

    def check(self) -> None:
        if self.clock() - self.start > self.limit:
            raise Timeout(f"sensitivity estimate past its {self.limit:g} s CPU budget")

    @property
    def spent(self) -> float:
        return self.clock() - self.start


def usable(rule: Rule, history: Sequence[Point]) -> list[Point]:
    """Return the cycles of `history` the rule would judge (value and samples enough)."""
    need = max(rule.min_samples, quantile_samples(rule.metric))
    return [p for p in history if p.value is not None and p.samples >= need]


def estimate(rule: Rule, history: Sequence[Point], baseline: BaselineStats | None,
             config: SensitivityConfig | None = None, *, budget_on: bool = True,
             rng: random.Random | None = None,
             clock: Callable[[], float] = time.thread_time, limit: str = "") -> Sensitivity:
    """Estimate the rule's sensitivity and threshold in force on one series' history.

    budget_on: False where the rule or scope opted out (`budget: off`): the configured
    threshold stays whatever the noise costs.
    limit: why the history read can never hold the cycles needed ("" where it can), said
    in an insufficient estimate's reason (`read_limit`).
    Raises Timeout past config.cpu_s of `clock`.
    """
    cfg = config or SensitivityConfig()
    rng = rng or random.Random(cfg.seed)
    timer = _Clock(cfg.cpu_s, clock)
    pts = usable(rule, history)
    budget = cfg.budget_per_30d if budget_on else None
    base = Sensitivity(rule=rule.name, status=INSUFFICIENT, cycles=len(pts),
                       within_cycles=cfg.within_cycles, configured_threshold=rule.threshold,
                       threshold=rule.threshold, budget_per_30d=budget)
    need = needed_cycles(rule, cfg)
    # While it is, a budgeted series' pages are held as warnings (alerts.baselines): said.
    held = HELD_SUFFIX if budget is not None else ""
    if baseline is None or baseline.center == 0 or baseline.cycles < rule.min_baseline_cycles:
        return replace(base, reason=f"{INSUFFICIENT}: {NO_BASELINE}{held}")
    span = (pts[-1].at - pts[0].at).total_seconds() + rule.window_s if pts else 0.0
    if len(pts) < need or span < cfg.min_history_s:
        return replace(base, reason=f"{INSUFFICIENT}: {len(pts)} of {need} cycles, "
                       f"{span / 3600:.1f} of {cfg.min_history_s / 3600:g} h{limit}{held}")
    noise = _Noise(rule, history, baseline, cfg.block)
    cycles = max(1, round(cfg.budget_days(budget) * 86400.0 / rule.window_s))
    sim = _Sim(noise, noise.indices(rng, noise.warm + cycles))
    configured = noise.false_pages(rule, sim, timer)
    at_configured = configured.per_30d
    threshold, pages = rule.threshold, at_configured
    if budget is not None and configured.upper_30d > budget:
        threshold, pages = _widen(rule, noise, sim, budget, timer)
    in_force = with_threshold(rule, threshold)
    detectable = _detectable(in_force, noise, cfg, rng, timer)
    reason = widening_reason(rule.direction, rule.threshold, threshold, at_configured) \
        if threshold > rule.threshold else ""
    return replace(base, status=OK if detectable is not None else NOT_DETECTABLE,
                   threshold=threshold, detectable_change=detectable, false_pages_30d=pages,
                   false_pages_configured=at_configured, reason=reason, cpu_s=timer.spent)


def _widen(rule: Rule, noise: _Noise, sim: _Sim, budget: float,
           timer: _Clock) -> tuple[float, float]:
    """Return the smallest threshold (to a whole percent) whose false pages' upper bound
    is within `budget`, and its stated rate."""
    # A falling metric cannot fall by more than 100%; a rising one may.
    top = 1.0 if rule.direction < 0 else 50.0
    lo, hi = rule.threshold, rule.threshold
    count = _Count(PRECISE_PAGES, 1, rule.window_s)
    while count.upper_30d > budget:
        if hi >= top:  # nothing meets the budget: the widest threshold, its cost stated
            return hi, count.per_30d
        lo, hi = hi, min(hi * 1.5, top)
        count = noise.false_pages(with_threshold(rule, hi), sim, timer, budget)
    while hi - lo > 0.01:
        mid = math.ceil((lo + hi) / 2 * 100) / 100
        if mid >= hi:
            break
        c = noise.false_pages(with_threshold(rule, mid), sim, timer, budget)
        if c.upper_30d <= budget:
            hi, count = mid, c
        else:
            lo = mid
    return math.ceil(round(hi * 100, 6)) / 100, count.per_30d


def _detectable(rule: Rule, noise: _Noise, cfg: SensitivityConfig, rng: random.Random,
                timer: _Clock) -> float | None:
    """Return the smallest shift confirmed within N cycles in >= 95% of trials (to 0.5%)."""
    onset = noise.warm + rule.lookback_cycles
    trials = [_Sim(noise, noise.indices(rng, onset + cfg.within_cycles))
              for _ in range(cfg.trials)]

    def confirmed(shift: float) -> bool:
        allowed = cfg.trials - math.ceil(P95 * cfg.trials)
        misses = 0
        for sim in trials:
            if not noise.fires_within(rule, sim, onset, cfg.within_cycles, shift):
                misses += 1
                if misses > allowed:
                    return False
            timer.check()
        return True

    # No smaller shift fires than the threshold its min_delta asks of this baseline; where
    # that floor lies past max_shift, shifts up to twice it are tried.
    lo, hi = 0.0, with_min_delta(rule, noise.baseline).threshold
    top = max(cfg.max_shift, 2 * hi)
    while not confirmed(hi):
        if hi >= top:
            return None
        lo, hi = hi, min(hi * 2, top)
    # Fine steps: the confirmation rate climbs steeply near the detectable shift.
    while hi - lo > SHIFT_RESOLUTION * (1 + hi):
        mid = (lo + hi) / 2
        if confirmed(mid):
            hi = mid
        else:
            lo = mid
    return hi


class _Noise:
    """A series' own cycles, resampled in blocks and read as the rule reads them.

    A pooled quantile is re-pooled along each resampled sequence from its cycles' own
    samples, newest first until `quantile_samples` are in (at most `rule.pool_cycles`),
    as `alerts.series` pools it; a block join therefore carries the pool and the CUSUM on
    instead of restarting them, and blocks need only span the cycles' own dependence, not
    the pool. Their length is read from the series (`block_length`): a host whose slow
    cycles cluster keeps its clusters, and short blocks recombine the history's slow
    cycles into runs it did not happen to hold (reusing whole days of it would state the
    excursions of that day, not the host's).
    """

    def __init__(self, rule: Rule, history: Sequence[Point], baseline: BaselineStats,
                 min_block: int) -> None:
        self.baseline = baseline
        self.q = QUANTILE_METRICS.get(rule.metric)
        self.need = quantile_samples(rule.metric)
        self.tail = self.q is not None and self.q >= TAIL_QUANTILE
        self.repool = self.q is not None and any(p.pooled for p in history)
        self.pts = [p for p in history if p.fresh is not None and p.fresh.count] \
            if self.repool else usable(rule, history)
        self.pool = rule.pool_cycles if self.repool else 1
        center = baseline.center
        counts = [p.fresh.count if p.fresh is not None else 0 for p in self.pts]
        self.counts = np.array(counts, dtype=np.int64)
        # A cycle's own value: its value (plain), or its own quantile (re-pooled).
        own = [(p.fresh.quantile(self.q) if self.repool and p.fresh is not None
                and self.q is not None else p.value) for p in self.pts]
        self.rels = np.array([(float(v) - center) / abs(center) if v is not None else np.nan
                              for v in own])
        # The exceedance score of a pooled tail quantile's new samples (rule.score_cycle).
        self.exceed = np.array([
            exceedance_llr(count_above(p.fresh, center), p.fresh.count, self.q)
            if self.tail and self.q is not None and p.fresh is not None and p.fresh.count
            else 0.0 for p in self.pts])
        # Each cycle's sketch bins, flat, for the pooled quantile's screen.
        self._bin_cycle = np.array([i for i, p in enumerate(self.pts) if p.fresh is not None
                                    for _ in p.fresh.bins], dtype=np.int64)
        self._bin_key = np.array([k for p in self.pts if p.fresh is not None
                                  for k in p.fresh.bins], dtype=np.int64)
        self._bin_count = np.array([c for p in self.pts if p.fresh is not None
                                    for c in p.fresh.bins.values()], dtype=np.float64)
        stats = [np.nan_to_num(self.rels)]
        if self.tail and self.repool:
            stats.append(self.exceed)
        self.block = block_length(stats, min_block, max(min_block, len(self.pts) // 8))

    def indices(self, rng: random.Random, n: int) -> np.ndarray:
        """Return n cycle indices: blocks of `block` consecutive cycles at random starts."""
        starts = [rng.randint(0, len(self.pts) - self.block)
                  for _ in range(-(-n // self.block))]
        return (np.array(starts, dtype=np.int64)[:, None]
                + np.arange(self.block, dtype=np.int64)[None, :]).ravel()[:n]

    @property
    def warm(self) -> int:
        """Return the cycles a simulated sequence runs before its first judged cycle."""
        return self.pool - 1

    def _scored_by_exceedance(self, rule: Rule) -> bool:
        return self.repool and self.tail and rule.direction > 0

    def increments(self, rule: Rule, sim: _Sim) -> np.ndarray:
        """Return the CUSUM increment of every simulated cycle (rules.score_cycle)."""
        sigma = self.baseline.relative_noise(rule.cusum)
        if not self.repool:
            r = self.rels[sim.seq] * rule.direction
            return np.where(np.isnan(r), -np.inf, rule.threshold * (r - rule.threshold / 2)
                            / (sigma * sigma))
        if self._scored_by_exceedance(rule):
            own = self.counts[sim.seq] >= self.need  # a cycle that needs no pool
            r = np.nan_to_num(self.rels[sim.seq] * rule.direction, nan=-np.inf)
            plain = rule.threshold * (r - rule.threshold / 2) / (sigma * sigma)
            return np.where(own, plain, self.exceed[sim.seq])
        # Any other re-pooled quantile is scored on its pooled value: read every cycle.
        out = np.full(len(sim.seq), -np.inf)
        for t in range(self.warm, len(sim.seq)):
            p = sim.point(t)
            if p.value is not None and p.samples >= self.need:
                out[t] = llr(rule.direction * (p.value - self.baseline.center)
                             / abs(self.baseline.center), rule.threshold, sigma)
        return out

    def may_reach(self, rule: Rule, sim: _Sim) -> np.ndarray:
        """Return, per simulated cycle, whether its pooled quantile may reach the threshold
        (a screen: the pooled count above the level's bin, one bin lenient)."""
        assert self.q is not None
        level = self.baseline.center * (1.0 + rule.threshold)
        k = bin_of(level) - 1
        above = np.bincount(self._bin_cycle[self._bin_key >= k],
                            weights=self._bin_count[self._bin_key >= k],
                            minlength=len(self.pts))
        c = np.concatenate(([0], np.cumsum(self.counts[sim.seq])))
        a = np.concatenate(([0.0], np.cumsum(above[sim.seq])))
        t1 = np.arange(1, len(sim.seq) + 1)
        s = np.searchsorted(c, c[1:] - self.need, side="right") - 1
        s = np.maximum(s, np.maximum(t1 - self.pool, 0))
        n = c[t1] - c[s]
        rank = self.q * (n - 1)
        return (n >= self.need) & (a[t1] - a[s] >= n - rank - 1e-9)

    def false_pages(self, rule: Rule, sim: _Sim, timer: _Clock,
                    budget: float | None = None) -> _Count:
        """Return the alert episodes the rule opens over the stationary cycles of `sim`
        (judged from its `warm`-th cycle on).

        budget: stop once the count's upper bound exceeds this many per 30 days over all
        the cycles; and once PRECISE_PAGES episodes are in (the rate then rests on the
        cycles run so far).
        """
        rule = with_min_delta(rule, self.baseline)  # the screens ask what the rule asks
        judged = len(sim.seq) - self.warm
        limit = PRECISE_PAGES
        if budget is not None:
            limit = 0  # the fewest pages whose upper bound over every cycle exceeds it
            while limit < PRECISE_PAGES \
                    and _Count(limit, judged, rule.window_s).upper_30d <= budget:
                limit += 1
            limit = max(limit, 1)
        h, cap, n = rule.cusum.h, rule.cusum.cap, rule.lookback_cycles
        # The CUSUM over the whole sequence (Lindley: S_t = C_t - min(0, min C_s)) bounds
        # the rule's, which restarts at its window's start: only cycles where it reaches h
        # can fire, and a pooled quantile only where its latest value may reach the
        # threshold; the rule decides on those.
        inc = np.minimum(self.increments(rule, sim), cap)
        inc[:self.warm] = 0.0
        run = np.cumsum(inc)
        s = run - np.minimum(0.0, np.minimum.accumulate(run))
        may = s >= h * (1.0 - 1e-9)  # the cumulative sums round differently from the rule's
        reach: np.ndarray | None = None
        if self._scored_by_exceedance(rule):
            may &= self.may_reach(rule, sim)
        elif not self.repool:
            # The run's median must reach the threshold: half its cycles at least.
            reach = np.nan_to_num(self.rels[sim.seq] * rule.direction, nan=-np.inf) \
                >= rule.threshold
        beyond = np.zeros(len(sim.seq), dtype=bool)
        if rule.ceiling is not None or rule.floor is not None:
            v = self.baseline.center * (1.0 + self.rels[sim.seq])
            beyond |= (v > rule.ceiling) if rule.ceiling is not None else False
            beyond |= (v < rule.floor) if rule.floor is not None else False
        may[:self.warm] = False
        # The CUSUM restarted at each candidate's window start (the rule's) must reach h.
        cand = np.flatnonzero(may)
        if len(cand):
            idx = cand[:, None] + np.arange(1 - n, 1)[None, :]
            win = np.where(idx >= 0, inc[np.maximum(idx, 0)], 0.0)
            run_w = np.cumsum(win, axis=1)
            final = run_w[:, -1] - np.minimum(0.0, run_w.min(axis=1))
            may[cand[final < h * (1.0 - 1e-6)]] = False
        may |= beyond
        may[:self.warm] = False
        pages, t = 0, 0
        for k, at in enumerate(np.flatnonzero(may).tolist()):
            if at < t:
                continue
            t = at
            if k % 64 == 0:
                timer.check()
            if not beyond[t] and not _window_may_fire(inc[max(0, t - n + 1):t + 1], reach if
                                                      reach is None else
                                                      reach[max(0, t - n + 1):t + 1],
                                                      rule.cusum, rule.for_cycles):
                continue
            if not rule_fires(rule, self.baseline, sim, t, n):
                continue
            pages += 1
            if pages >= limit:
                return _Count(pages, t + 1 - self.warm, rule.window_s)
            # Firing until the rule says it recovered; a new episode may start after.
            while t + 1 < len(sim.seq):
                t += 1
                if evaluate_rule(rule, {}, self.baseline, sim.window(t, n)).recovered:
                    break
            timer.check()
            t += 1
        return _Count(pages, judged, rule.window_s)

    def fires_within(self, rule: Rule, sim: _Sim, onset: int, within: int,
                     shift: float) -> bool:
        """Return whether the rule fires within `within` cycles of `onset`, every cycle
        from `onset` on scaled by 1 + shift (a pooled quantile re-pooled with them)."""
        rule = with_min_delta(rule, self.baseline)  # the screens ask what the rule asks
        factor = 1.0 + rule.direction * shift
        if factor <= 0:
            return True  # a fall to zero or below is beyond any relative threshold
        shifted = sim.shifted(onset, factor)
        return any(self._latest_may_fire(rule, shifted, t)
                   and rule_fires(rule, self.baseline, shifted, t, rule.lookback_cycles)
                   for t in range(onset, min(onset + within, len(sim.seq))))

    def _latest_may_fire(self, rule: Rule, sim: _Sim, t: int) -> bool:
        """Return False where the rule cannot fire at cycle t on its latest value alone (a
        screen; the rule decides): a judged pooled tail quantile confirms on its latest
        value (rules.run_change), which must reach the threshold; an unjudged one fires
        nothing."""
        if not (self.repool and self.tail) or has_limit(rule):
            return True
        p = sim.point(t)
        if p.value is None or p.samples < max(rule.min_samples, self.need):
            return False
        return not p.pooled or breaches(rule, relative_change(float(p.value),
                                                              self.baseline.center))


def _window_may_fire(inc: np.ndarray, reach: np.ndarray | None, cusum: Cusum,
                     for_cycles: int) -> bool:
    """Return False where the rule's window cannot confirm a change (a screen; the rule
    decides): its CUSUM, restarted at the window's start, stays under h; or, where the
    increments are the rule's own scores, fewer than half of its current run's cycles
    reach the threshold (their median must)."""
    s, start = 0.0, 0
    for k, x in enumerate(inc.tolist()):
        s = max(0.0, s + x)
        if s == 0.0:
            start = k + 1
    if s < cusum.h * (1.0 - 1e-9):
        return False
    if reach is None:
        return True
    run = reach[start:]
    return len(run) >= for_cycles and 2 * int(run.sum()) >= len(run)


def rule_fires(rule: Rule, baseline: BaselineStats, sim: _Sim, t: int, n: int) -> bool:
    """Return whether the production rule fires on the simulated window ending at t."""
    return evaluate_rule(rule, {}, baseline, sim.window(t, n)).fired


class _Sim:
    """One resampled sequence of a series' cycles, its points built as the rule reads
    them (a quantile pooled over the sequence's own latest cycles), cached."""

    def __init__(self, noise: _Noise, seq: np.ndarray, onset: int | None = None,
                 factor: float = 1.0, points: dict[int, Point] | None = None) -> None:
        self.noise, self.seq = noise, seq
        self.onset = len(seq) if onset is None else onset
        self.factor = factor
        self._points: dict[int, Point] = points if points is not None else {}
        self._fresh: dict[int, Sketch] = {}

    def shifted(self, onset: int, factor: float) -> _Sim:
        """Return this sequence with every cycle from `onset` on scaled by `factor`."""
        self.point(onset - 1)  # the unshifted points before onset are shared
        return _Sim(self.noise, self.seq, onset, factor,
                    {t: p for t, p in self._points.items() if t < onset})

    def fresh(self, t: int) -> Sketch | None:
        f = self.noise.pts[self.seq[t]].fresh
        if f is None or t < self.onset:
            return f
        out = self._fresh.get(t)
        if out is None:
            out = self._fresh[t] = _scaled(f, self.factor)
        return out

    def point(self, t: int) -> Point:
        """Return simulated cycle t as the rule reads it."""
        p = self._points.get(t)
        if p is not None:
            return p
        nz = self.noise
        src = nz.pts[int(self.seq[t])]
        if not nz.repool or nz.q is None:
            value = None if src.value is None else float(src.value) * (
                self.factor if t >= self.onset else 1.0)
            p = replace(src, value=value)
        else:
            merged = Sketch()
            for j in range(t, max(-1, t - nz.pool), -1):
                f = self.fresh(j)
                if f is not None:
                    merged.merge(f)
                if merged.count >= nz.need:
                    break
            p = Point(src.at, merged.quantile(nz.q), merged.count, fresh=self.fresh(t))
        self._points[t] = p
        return p

    def window(self, t: int, n: int) -> list[Point]:
        """Return the rule's window ending at cycle t (its last n cycles)."""
        return [self.point(j) for j in range(max(0, t - n + 1), t + 1)]


def _scaled(sketch: Sketch, factor: float) -> Sketch:
    """Return the sketch of every sample times `factor` (to the sketch's accuracy)."""
    k = round(math.log(factor) / math.log(GAMMA))
    out = Sketch()
    out.bins = {b + k: c for b, c in sketch.bins.items()}
    out.zeros, out.count = sketch.zeros, sketch.count
    return out


def block_length(stats: Sequence[np.ndarray], floor: int, cap: int) -> int:
    """Return the block length that keeps the series' autocorrelation (Politis 2003).

    Per statistic, m is the first lag after which K = max(5, sqrt(log10 n)) lags in a row
    have an insignificant autocorrelation (|r| < 2 sqrt(log10 n / n)); blocks span four
    times the largest m (twice, Politis' choice for a mean, cut enough of a strongly
    autocorrelated host's dependence at the joins to halve its stated false pages), at
    least `floor` and at most `cap` cycles.
    """
    m = 0
    for x in stats:
        n = len(x)
        if n < 4:
            continue
        x = x - x.mean()
        var = float(np.dot(x, x))
        if var <= 0:
            continue
        k_n = max(5, math.ceil(math.sqrt(math.log10(n))))
        band = 2.0 * math.sqrt(math.log10(n) / n)
        top = min(n - 1, cap + k_n)
        r = np.array([float(np.dot(x[:-k], x[k:])) / var for k in range(1, top + 1)])
        small = np.abs(r) < band
        for lag in range(0, top - k_n + 1):
            if small[lag:lag + k_n].all():
                m = max(m, lag)
                break
        else:
            m = max(m, cap)
    return int(min(max(floor, 4 * m), cap))


# -- the scheduled refresh ----------------------------------------------------------------

TIMED_OUT = "timed out"
# Raw history one read holds: a rule's rows of this long a stretch at a time. Read whole,
# a day of every rule's raw cycles stayed in memory through the job, and its peak (and
# so the worker's resident memory) grew with a young install's history for a day.
READ_SLICE_S = 3600.0
# A series is read back far enough to hold this many times the cycles its estimate needs
# at its own cadence (`reach_s`): cycles lost to an outage or to alerts' spans then leave
# it enough, where a read of exactly that many would hold a ten-minute rule's pages for
# as long as one cycle of it was missing.
READ_MARGIN = 2.0
# The time from one hour of a season to its next: a week (hour of the week), a day (of the day).
_SEASON_PERIOD_S = {"how": 7 * 86400.0, "hod": 86400.0}


@dataclass(frozen=True)
class RefreshReport:
    """What one refresh did: series estimated, left for the next run, CPU spent."""

    estimated: int = 0
    left: int = 0
    cpu_s: float = 0.0
    errors: tuple[str, ...] = ()
    rows_held: int = 0  # the most measurement rows one read held (a slice's, not the history's)
    # Narrower estimates not stored: a run under way at them (`narrowing_deferred`).
    deferred: int = 0


@dataclass(frozen=True)
class _Series:
    rule: Rule
    labels: dict[str, str]
    cohort: tuple[str, str]
    baseline: StoredBaseline
    points: list[Point]
    old: StoredSensitivity | None
    limit: str = ""  # why its read can never hold the cycles it needs (`read_limit`)


@dataclass(frozen=True)
class DueEstimates:
    """What a refresh's read phase estimated, for its write phase (`store_estimates`).

    found: the series estimated and their new estimates, in the order they ran.
    """

    found: tuple[tuple[_Series, Sensitivity], ...] = ()
    left: int = 0
    cpu_s: float = 0.0
    errors: tuple[str, ...] = ()
    rows_held: int = 0
    deferred: int = 0


def estimate_due(session: Session, rules: Sequence[Rule], config: SensitivityConfig,
                 now: datetime, *, history_s: float = 86400.0, budget_s: float = 30.0,
                 clock: Callable[[], float] = time.thread_time) -> DueEstimates:
    """Re-estimate the series whose baseline, threshold or budget changed, stalest first,
    until `budget_s` CPU seconds of `clock` are spent (the rest wait for the next run),
    writing nothing (the read phase).

    Off the evaluation path: a scheduled job of its own. Each series is judged against
    the baseline stored for it (its season's, for a seasonal rule) on its cycles of the
    last `history_s`, or as far back as its rule's cadence needs (`reach_s`; a seasonal
    one: the hours of its season). The reads and the estimates
    are the whole cost, so `session` may be a read-only one (`storage.db.reading`): on
    SQLite no write lock is held meanwhile and the serving process goes on writing.
    """
    start = clock()
    due, held = _due(session, rules, config, now, history_s)
    todo = sorted(due, key=lambda s: (s.old is not None, s.old.computed_at if s.old else now))
    found: list[tuple[_Series, Sensitivity]] = []
    deferred, errors = 0, list[str]()
    for i, s in enumerate(todo):
        if clock() - start >= budget_s:
            return DueEstimates(tuple(found), len(todo) - i, clock() - start, tuple(errors),
                                held, deferred)
        try:
            est = _estimate(s, config, clock)
            if narrowing_deferred(s.rule, s.old, est, s.baseline, s.points, now):
                # The stored (wider) estimate stays in force; still due, it is estimated
                # again on the next run and stored once the run at its threshold is over.
                deferred += 1
                continue
            found.append((s, est))
        except Exception as e:  # noqa: BLE001 - one bad series must not stop the rest
            errors.append(f"{s.rule.name} {s.baseline.scope_key}: {type(e).__name__}: {e}")
    return DueEstimates(tuple(found), 0, clock() - start, tuple(errors), held, deferred)


def store_estimates(session: Session, due: DueEstimates, now: datetime) -> RefreshReport:
    """Store the read phase's estimates over the stored ones (the write phase: short)."""
    done, errors = 0, list(due.errors)
    for s, est in due.found:
        try:
            # A savepoint: a baseline pruned since the read fails its estimate alone.
            with session.begin_nested():
                _store(session, s, est, now)
            done += 1
        except Exception as e:  # noqa: BLE001 - one bad series must not stop the rest
            errors.append(f"{s.rule.name} {s.baseline.scope_key}: {type(e).__name__}: {e}")
    return RefreshReport(done, due.left, due.cpu_s, tuple(errors), due.rows_held,
                         due.deferred)


def refresh(session: Session, rules: Sequence[Rule], config: SensitivityConfig, now: datetime,
            *, history_s: float = 86400.0, budget_s: float = 30.0,
            clock: Callable[[], float] = time.thread_time) -> RefreshReport:
    """Estimate what is due and store it in the caller's transaction (`estimate_due`, then
    `store_estimates`; the scheduled job runs the two in separate transactions)."""
    return store_estimates(session, estimate_due(session, rules, config, now,
                                                 history_s=history_s, budget_s=budget_s,
                                                 clock=clock), now)


def narrowing_deferred(rule: Rule, old: StoredSensitivity | None, est: Sensitivity,
                       baseline: StoredBaseline, points: Sequence[Point],
                       now: datetime) -> bool:
    """Return whether a new estimate that narrows the threshold in force must wait.

    The evaluator judges a series' latest `lookback` cycles at the threshold in force on
    each evaluation, so a narrower one re-judges at once every cycle of the detector's
    current run, cycles that were scored (and not confirmed) at the wider one: a run that
    held an ended slowdown's cycles then confirms on them and pages after its cause ended.
    A narrowing therefore takes force only between runs: where the rule at the narrower
    threshold, on the series' latest cycles, neither fires nor breaches and its CUSUM
    stands at zero. The stored estimate in force meanwhile is the previous, wider one.
    """
    in_force = old is not None and old.budget_per_30d is not None \
        and old.threshold > rule.threshold \
        and math.isclose(old.configured_threshold, rule.threshold)
    if old is None or not in_force or est.budget_per_30d is None \
            or est.threshold >= old.threshold:
        return False  # nothing wider in force, or the budget turned off (dropped at once)
    start = now - timedelta(seconds=rule.window_s * rule.lookback_cycles)
    window = [p for p in points if p.at >= start]
    if not window:
        return False
    stats = BaselineStats(baseline.value, baseline.spread or 0.0, baseline.samples,
                          body=baseline.body)
    r = evaluate_rule(with_threshold(rule, est.threshold), {}, stats, window)
    return r.fired or r.breaching or r.statistic > 0.0


def _estimate(s: _Series, config: SensitivityConfig,
              clock: Callable[[], float]) -> Sensitivity:
    b = s.baseline
    stats = BaselineStats(b.value, b.spread or 0.0, b.samples, body=b.body)
    budget = s.rule.budget_for(s.labels, config.budget_per_30d)
    cfg = replace(config, budget_per_30d=budget)
    seed = zlib.crc32(f"{s.rule.name}|{b.scope_key}|{s.cohort}".encode()) ^ config.seed
    try:
        return estimate(s.rule, s.points, stats, cfg, budget_on=budget is not None,
                        rng=random.Random(seed), clock=clock, limit=s.limit)
    except Timeout as e:
        return Sensitivity(rule=s.rule.name, status=TIMED_OUT, cycles=len(s.points),
                           within_cycles=cfg.within_cycles,
                           configured_threshold=s.rule.threshold, threshold=s.rule.threshold,
                           budget_per_30d=budget, reason=f"{e}: configured threshold kept")


def _store(session: Session, s: _Series, est: Sensitivity, now: datetime) -> None:
    b = s.baseline
    sensitivity_queries.save(session, StoredSensitivity(
        rule=s.rule.name, metric=s.rule.metric, scope=dict(b.scope), scope_key=b.scope_key,
        model_version=s.cohort[0], config_hash=s.cohort[1], baseline_id=b.id,
        computed_at=now, status=est.status, direction=s.rule.direction, cycles=est.cycles,
        within_cycles=est.within_cycles, configured_threshold=est.configured_threshold,
        threshold=est.threshold, detectable_change=est.detectable_change,
        false_pages_30d=est.false_pages_30d, false_pages_configured=est.false_pages_configured,
        budget_per_30d=est.budget_per_30d, reason=est.reason, cpu_s=est.cpu_s))


@dataclass(frozen=True)
class _Candidate:
    labels: Labels
    cohort: tuple[str, str]
    baseline: StoredBaseline
    season: str | None
    old: StoredSensitivity | None


def _due(session: Session, rules: Sequence[Rule], config: SensitivityConfig, now: datetime,
         history_s: float) -> tuple[list[_Series], int]:
    """Return the series whose stored estimate is missing or no longer matches, and the
    most rows one read held.

    What is due is decided from the stored baselines and estimates alone; only a rule
    with a due series reads its history, one rule and one slice at a time, back as far
    as its due series need (`reach_s`; a season's hours only).
    """
    stored = sensitivity_queries.by_key(session, [r.name for r in rules])
    active = baseline_queries.active_by_metric(session, {r.metric for r in rules})
    out: list[_Series] = []
    held = 0
    periods_of: dict[tuple[str, str, datetime], list[baseline_queries.AlertPeriod]] = {}
    for rule in rules:
        wanted = _candidates(rule, active[rule.metric], stored, config, now, history_s)
        if not wanted:
            continue
        since = [now - timedelta(seconds=reach_s(rule, c.season, config, history_s))
                 for c in wanted]
        spans = merge_spans([span for c, start in zip(wanted, since, strict=True)
                             for span in season_spans(c.season, start, now)])
        per_scope, rows = _read(rule, session, spans)
        held = max(held, rows)
        # As the rolling baselines do: the cycles of a regression (an alert of the metric
        # that fired, from its pending run on) are not the series' noise. Left in, a long
        # incident reads as noise, the threshold widens, and the alert it is part of
        # resolves while the regression goes on (a ramp paged twice).
        first = min(since)
        family = (rule.metric, rule.source, first)
        if family not in periods_of:  # rules of one metric and source share the read
            same = [r.name for r in rules if (r.metric, r.source) == family[:2]]
            periods_of[family] = baseline_queries.alert_periods(session, same, first)
        periods = periods_of[family]
        for c, start in zip(wanted, since, strict=True):
            pts = per_scope.get(c.labels, {}).get(c.cohort)
            if pts is None:  # no cycles in the history: nothing to estimate on
                continue
            gone = alert_spans(periods, rule, c.labels, now)
            kept = [p for p in _in_season(pts, c.season) if p.at >= start
                    and not any(a <= p.at.timestamp() < b for a, b in gone)]
            out.append(_Series(rule, dict(c.labels), c.cohort, c.baseline, kept, c.old,
                               read_limit(rule, c.season, config, history_s)))
    return out, held


def _read(rule: Rule, session: Session, spans: Sequence[tuple[datetime, datetime]]
          ) -> tuple[dict[Labels, dict[tuple[str, str], list[Point]]], int]:
    """Return the rule's cohort series over `spans` (oldest first, disjoint), each read a
    slice at a time, and the most rows one slice held."""
    out: dict[Labels, dict[tuple[str, str], list[Point]]] = {}
    held = 0
    for lo, hi in spans:
        part, rows = sliced_cohort_series(rule, session, lo, hi, READ_SLICE_S)
        held = max(held, rows)
        for labels, per_cohort in part.items():
            for cohort, pts in per_cohort.items():
                out.setdefault(labels, {}).setdefault(cohort, []).extend(pts)
    return out, held


def season_cycles(rule: Rule) -> int:
    """Return the cycles of `rule` one hour of a season holds."""
    return max(1, math.floor(CHUNK_S / rule.window_s))


def reach_s(rule: Rule, season: str | None, config: SensitivityConfig,
            history_s: float) -> float:
    """Return how far back a series of `rule` (of one season, if any) is read.

    At least `history_s`; far enough to hold READ_MARGIN times the cycles its estimate
    needs at the rule's own cadence (a ten-minute rule's 360 cycles span 60 hours, a
    season's one hour a day or a week); at most `config.max_history_s`, the raw retention.
    """
    need = READ_MARGIN * needed_cycles(rule, config)
    if season is None:
        span = need * rule.window_s
    else:
        span = math.ceil(need / season_cycles(rule)) * _SEASON_PERIOD_S[season[:3]]
    return min(config.max_history_s, max(history_s, span))


def readable_cycles(rule: Rule, season: str | None, config: SensitivityConfig,
                    history_s: float) -> int:
    """Return the most cycles a read of `reach_s` can hold for the series."""
    reach = reach_s(rule, season, config, history_s)
    if season is None:
        return math.floor(reach / rule.window_s)
    return math.floor(reach / _SEASON_PERIOD_S[season[:3]]) * season_cycles(rule)


def read_limit(rule: Rule, season: str | None, config: SensitivityConfig,
               history_s: float) -> str:
    """Return why the series' read can never hold the cycles its estimate needs, or ""."""
    most = readable_cycles(rule, season, config, history_s)
    if most >= needed_cycles(rule, config):
        return ""
    what = "" if season is None else f" of its season ({season})"
    return (f"; {config.max_history_s / 86400:g} d of history (at most "
            f"alerts.sensitivity_max_history_s, the raw retention) hold at most {most} "
            f"cycles{what}: not estimated within it")


def season_spans(season: str | None, since: datetime,
                 now: datetime) -> list[tuple[datetime, datetime]]:
    """Return the stretches of [since, now) a series of `season` reads, oldest first:
    all of it, or the hours of its season ("how<hour of week>" / "hod<hour of day>")."""
    if season is None:
        return [(since, now)]
    kind, value = season[:3], int(season[3:])
    of = hour_of_week if kind == "how" else hour_of_day
    period = timedelta(seconds=_SEASON_PERIOD_S[kind])
    hour = timedelta(seconds=CHUNK_S)
    t = hour_start(now)
    # The latest hour of the season that began by now (a UTC hour is one of the period's).
    t -= hour * ((of(t) - value) % round(period / hour))
    out: list[tuple[datetime, datetime]] = []
    while t + hour > since:
        out.append((max(t, since), min(t + hour, now)))
        t -= period
    return [s for s in reversed(out) if s[0] < s[1]]


def merge_spans(spans: Sequence[tuple[datetime, datetime]]) -> list[tuple[datetime, datetime]]:
    """Return `spans` merged where they overlap or touch, oldest first."""
    out: list[tuple[datetime, datetime]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _candidates(rule: Rule, rows: Mapping[str, list[StoredBaseline]],
                stored: Mapping[SensitivityKey, StoredSensitivity],
                config: SensitivityConfig, now: datetime,
                history_s: float) -> list[_Candidate]:
    """Return `rule`'s series (scope, cohort, season) whose rolling baseline has no
    matching estimate stored, or whose estimate held its pages `HELD_RECHECK_S` ago."""
    out = []
    for k, baselines in rows.items():
        pairs = dict(_pairs(k))
        season = pairs.pop("season", None)
        if season is not None and not rule.seasonality:
            continue
        labels = tuple((p, pairs[p]) for p in rule.per if p in pairs)
        if len(labels) != len(rule.per) \
                or scope_key(rule_scope(rule, dict(labels))) != scope_key(pairs):
            continue  # another rule's scope (same metric, other match or window)
        budget = rule.budget_for(dict(labels), config.budget_per_30d)
        for cohort in sorted({(b.model_version, b.config_hash) for b in baselines
                              if b.active and b.kind == "rolling"}):
            b = decide_in_force(baselines, cohort).rolling
            if b is None or b.spread is None or b.kind != "rolling":
                continue
            old = stored.get((rule.name, k, *cohort))
            if old is None or old.baseline_id != b.id \
                    or old.configured_threshold != rule.threshold \
                    or old.budget_per_30d != budget \
                    or old.within_cycles != config.within_cycles \
                    or _may_state(old, rule, config, now, season, history_s):
                out.append(_Candidate(labels, cohort, b, season, old))
    return sorted(out, key=lambda c: (c.labels, c.cohort, c.season or ""))


def needed_cycles(rule: Rule, config: SensitivityConfig) -> int:
    """Return the fewest usable cycles an estimate of `rule` rests on."""
    return max(config.min_history, 3 * (rule.lookback_cycles + config.within_cycles))


def _may_state(old: StoredSensitivity, rule: Rule, config: SensitivityConfig,
               now: datetime, season: str | None, history_s: float) -> bool:
    """Return whether a held estimate is due again: `HELD_RECHECK_S` old, and its series
    could have gained the cycles it lacked (one per `window_s` at most; a season's, an
    hour's worth per period begun), so a young series' history is not read every run for
    hours before it can suffice, nor one whose read can never hold them (`read_limit`)."""
    need = needed_cycles(rule, config)
    if old.status != INSUFFICIENT or readable_cycles(rule, season, config, history_s) < need:
        return False
    elapsed = (now - old.computed_at).total_seconds()
    gained = elapsed / rule.window_s if season is None else \
        (elapsed // _SEASON_PERIOD_S[season[:3]] + 1) * season_cycles(rule)
    return elapsed >= HELD_RECHECK_S and old.cycles + gained >= need


def _pairs(key: str) -> list[tuple[str, str]]:
    return [tuple(kv.split("=", 1)) for kv in key.split(",") if "=" in kv]  # type: ignore[misc]


def _in_season(pts: list[Point], season: str | None) -> list[Point]:
    """Return the points of one season ("how<hour of week>" / "hod<hour of day>")."""
    if season is None:
        return pts
    kind, value = season[:3], int(season[3:])
    of = hour_of_week if kind == "how" else hour_of_day
    return [p for p in pts if of(p.at) == value]
