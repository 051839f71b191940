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
stands above the long-run one), so 60 simulated days cost tens of milliseconds.
"""

from __future__ import annotations

import math
import random
import statistics
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from alerts.baselines import hour_of_day, hour_of_week, rule_scope
from alerts.detection import (
    TAIL_QUANTILE,
    BaselineStats,
    Cusum,
    count_above,
    exceedance_llr,
    llr,
    relative_change,
)
from alerts.rules import QUANTILE_METRICS, Point, Rule, evaluate_rule, quantile_samples
from alerts.series import Labels, sliced_cohort_series
from storage.models import scope_key
from storage.queries import baselines as baseline_queries
from storage.queries import sensitivity as sensitivity_queries
from storage.queries.baselines import StoredBaseline, decide_in_force
from storage.queries.sensitivity import SensitivityKey, StoredSensitivity
from storage.sketches import GAMMA, Sketch

OK = "ok"
INSUFFICIENT = "insufficient history"
NOT_DETECTABLE = "not detectable"  # no shift up to max_shift is confirmed in time
DAYS_30 = 30 * 86400.0
P95 = 0.95
# Episodes that pin a false-page rate well enough (about +-20%); counting stops there.
PRECISE_PAGES = 25
# The detectable shift is searched to this share of (1 + shift): a stated shift lies at
# most that far above the true p95 point.
SHIFT_RESOLUTION = 0.005


class Timeout(Exception):
    """The estimate ran past its CPU budget."""


@dataclass(frozen=True)
class SensitivityConfig:
    """How the estimate runs.

    within_cycles: N, the cycles after onset within which a shift must be confirmed.
    budget_per_30d: false pages per 30 days a series may cost; None: no budget (`off`).
    trials: resampled trials per shift tried.
    days: stationary days simulated for the false-page count (at least 30).
    min_history: fewest usable cycles an estimate rests on.
    block: fewest cycles resampled together; blocks span at least 4 of the rule's
        lookbacks (each join restarts the series' state: an excursion cut there, or the
        CUSUM build-up before it, would not page, undercounting false pages on an
        autocorrelated series) and a pooled quantile's pool.
    max_shift: the largest relative shift tried.
    cpu_s: CPU seconds one series may take (`Timeout` past it).
    """

    within_cycles: int = 10
    budget_per_30d: float | None = 0.5
    trials: int = 100
    days: float = 60.0
    min_history: int = 360
    block: int = 5
    max_shift: float = 3.0
    cpu_s: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.within_cycles < 1:
            raise ValueError(f"within_cycles: must be >= 1, got {self.within_cycles}")
        if self.budget_per_30d is not None and not self.budget_per_30d >= 0:
            raise ValueError(f"budget_per_30d: must be >= 0, got {self.budget_per_30d}")
        if self.trials < 20 or self.days < 30 or self.block < 1 or self.min_history < 10:
            raise ValueError("trials >= 20, days >= 30, block >= 1 and min_history >= 10")


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
             clock: Callable[[], float] = time.process_time) -> Sensitivity:
    """Estimate the rule's sensitivity and threshold in force on one series' history.

    budget_on: False where the rule or scope opted out (`budget: off`): the configured
    threshold stays whatever the noise costs.
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
    need = max(cfg.min_history, 3 * (rule.lookback_cycles + cfg.within_cycles))
    if baseline is None or baseline.center == 0 or baseline.cycles < rule.min_baseline_cycles:
        return replace(base, reason="insufficient history: no usable baseline yet")
    if len(pts) < need:
        return replace(base, reason=f"insufficient history: {len(pts)} of {need} cycles")
    noise = _Noise(rule, pts, baseline, max(cfg.block, 4 * rule.lookback_cycles))
    cycles = max(1, round(cfg.days * 86400.0 / rule.window_s))
    seq = noise.indices(rng, cycles)
    at_configured = noise.false_pages(rule, seq, timer)
    threshold, pages = rule.threshold, at_configured
    if budget is not None and at_configured > budget:
        threshold, pages = _widen(rule, noise, seq, budget, timer)
    in_force = replace(rule, threshold=threshold)
    detectable = _detectable(in_force, noise, cfg, rng, timer)
    reason = widening_reason(rule.direction, rule.threshold, threshold, at_configured) \
        if threshold > rule.threshold else ""
    return replace(base, status=OK if detectable is not None else NOT_DETECTABLE,
                   threshold=threshold, detectable_change=detectable, false_pages_30d=pages,
                   false_pages_configured=at_configured, reason=reason, cpu_s=timer.spent)


def _widen(rule: Rule, noise: _Noise, seq: list[int], budget: float,
           timer: _Clock) -> tuple[float, float]:
    """Return the smallest threshold (to a whole percent) paging within `budget`."""
    # A falling metric cannot fall by more than 100%; a rising one may.
    top = 1.0 if rule.direction < 0 else 50.0
    lo, hi = rule.threshold, rule.threshold
    pages = math.inf
    while pages > budget:
        if hi >= top:  # nothing meets the budget: the widest threshold, its cost stated
            return hi, pages
        lo, hi = hi, min(hi * 1.5, top)
        pages = noise.false_pages(replace(rule, threshold=hi), seq, timer, budget)
    while hi - lo > 0.01:
        mid = math.ceil((lo + hi) / 2 * 100) / 100
        if mid >= hi:
            break
        p = noise.false_pages(replace(rule, threshold=mid), seq, timer, budget)
        if p <= budget:
            hi, pages = mid, p
        else:
            lo = mid
    return math.ceil(round(hi * 100, 6)) / 100, pages


def _detectable(rule: Rule, noise: _Noise, cfg: SensitivityConfig, rng: random.Random,
                timer: _Clock) -> float | None:
    """Return the smallest shift confirmed within N cycles in >= 95% of trials (to 0.5%)."""
    pre = rule.lookback_cycles
    trials = [noise.indices(rng, pre + cfg.within_cycles) for _ in range(cfg.trials)]

    def confirmed(shift: float) -> bool:
        allowed = cfg.trials - math.ceil(P95 * cfg.trials)
        misses = 0
        for idx in trials:
            if not noise.fires_within(rule, idx, pre, shift):
                misses += 1
                if misses > allowed:
                    return False
            timer.check()
        return True

    lo, hi = 0.0, rule.threshold
    while not confirmed(hi):
        if hi >= cfg.max_shift:
            return None
        lo, hi = hi, min(hi * 2, cfg.max_shift)
    # Fine steps: the confirmation rate climbs from 80% to 98% within a few percent.
    while hi - lo > SHIFT_RESOLUTION * (1 + hi):
        mid = (lo + hi) / 2
        if confirmed(mid):
            hi = mid
        else:
            lo = mid
    return hi


class _Noise:
    """A series' usable cycles, resampled in blocks; shifts injected as the series would
    carry them (a pooled quantile re-pooled from its cycles' own samples)."""

    def __init__(self, rule: Rule, pts: list[Point], baseline: BaselineStats,
                 block: int) -> None:
        self.pts, self.baseline = pts, baseline
        q = QUANTILE_METRICS.get(rule.metric)
        self.q = q
        self.tail = q is not None and q >= TAIL_QUANTILE
        pools = [math.ceil(p.samples / p.fresh.count) for p in pts
                 if p.fresh is not None and p.fresh.count and p.pooled]
        self.pool = round(statistics.median(pools)) if pools else 1
        # A pooled value stays correlated over its pool: its blocks must span it.
        self.block = min(max(block, self.pool), len(pts) // 3)
        self.rels = [relative_change(float(p.value), baseline.center)  # type: ignore[arg-type]
                     for p in pts]
        self.exceed: list[float | None] = [
            exceedance_llr(count_above(p.fresh, baseline.center), p.fresh.count, q)
            if self.tail and q is not None and p.fresh is not None and p.fresh.count else None
            for p in pts]

    def indices(self, rng: random.Random, n: int) -> list[int]:
        """Return n cycle indices: blocks of `block` consecutive cycles at random starts."""
        out: list[int] = []
        last = len(self.pts) - self.block
        while len(out) < n:
            s = rng.randint(0, last)
            out.extend(range(s, s + self.block))
        return out[:n]

    def _bounds(self, rule: Rule) -> list[float]:
        """Return per cycle an upper bound of what the rule's CUSUM adds for it."""
        sigma = self.baseline.relative_noise(rule.cusum)
        out = []
        for r, e in zip(self.rels, self.exceed, strict=True):
            s = llr(rule.direction * r, rule.threshold, sigma) if r is not None else -math.inf
            out.append(max(s, e) if e is not None and rule.direction > 0 else s)
        return out

    def false_pages(self, rule: Rule, seq: list[int], timer: _Clock,
                    enough: float | None = None) -> float:
        """Return alert episodes per 30 days the rule opens over the stationary cycles `seq`.

        enough: stop once the rate is known to exceed this many per 30 days, or once
        PRECISE_PAGES episodes are in (the rate then rests on the cycles run so far).
        """
        per_30d = DAYS_30 / rule.window_s
        limit = PRECISE_PAGES if enough is None else min(
            PRECISE_PAGES, math.floor(enough * len(seq) / per_30d) + 1)
        bound = self._bounds(rule)
        h, cap, n = rule.cusum.h, rule.cusum.cap, rule.lookback_cycles
        # Where the rule has an absolute limit, a cycle beyond it may fire without the CUSUM.
        beyond = [(rule.ceiling is not None and float(p.value) > rule.ceiling)  # type: ignore[arg-type]
                  or (rule.floor is not None and float(p.value) < rule.floor)  # type: ignore[arg-type]
                  for p in self.pts]
        reach = [r is not None and rule.direction * r >= rule.threshold for r in self.rels]
        pts = self.pts
        s = 0.0
        firing = False
        pages = 0
        # The rule is a function of its window: a window of history cycles seen before
        # (blocks repeat them: 60 simulated days resample 7 recorded ones) is judged once.
        judged: dict[tuple[int, ...], tuple[bool, bool]] = {}
        may: dict[tuple[int, ...], bool] = {}
        for t, i in enumerate(seq):
            s = max(0.0, s + min(bound[i], cap))
            if s < h and not firing and not beyond[i]:
                continue
            key = tuple(seq[max(0, t - n + 1):t + 1])
            if not firing and not beyond[i]:
                ok = may.get(key)
                if ok is None:
                    ok = may[key] = self._may_fire(list(key), bound, reach, rule.cusum,
                                                   rule.for_cycles)
                if not ok:
                    continue
            verdict = judged.get(key)
            if verdict is None:
                res = evaluate_rule(rule, {}, self.baseline, [pts[j] for j in key])
                verdict = judged[key] = (res.fired, res.recovered)
            fired, recovered = verdict
            if not firing and fired:
                firing, pages = True, pages + 1
                if pages >= limit:
                    return pages * per_30d / (t + 1)
            elif firing and recovered:
                firing = False
            timer.check()
        return pages * per_30d / len(seq)

    def _may_fire(self, idx: list[int], bound: list[float], reach: list[bool],
                  cusum: Cusum, for_cycles: int) -> bool:
        """Return False where the rule's window cannot confirm a change (a screen; the rule
        decides): its CUSUM, restarted at the window's start, stays under h; or a pooled
        latest value misses the threshold; or fewer than half of the current run's cycles
        reach it (their median must), the run being exact where the bound is the score."""
        if self.tail and self.pts[idx[-1]].pooled and not reach[idx[-1]]:
            return False
        s, start = 0.0, 0
        for k, j in enumerate(idx):
            s = max(0.0, s + min(bound[j], cusum.cap))
            if s == 0.0:
                start = k + 1
        if s < cusum.h:
            return False
        if self.tail:
            return True  # the bound may exceed the exceedance score: the run is not exact
        run = idx[start:]
        return len(run) >= for_cycles and 2 * sum(reach[j] for j in run) >= len(run)

    def fires_within(self, rule: Rule, idx: list[int], pre: int, shift: float) -> bool:
        """Return whether the rule fires within the cycles after `pre` shifted by `shift`."""
        factor = 1.0 + rule.direction * shift
        if factor <= 0:
            return True  # a fall to zero or below is beyond any relative threshold
        pts = [self.pts[i] for i in idx[:pre]]
        fresh = [p.fresh for p in pts]
        for i in idx[pre:]:
            p = self.pts[i]
            f = _scaled(p.fresh, factor) if p.fresh is not None else None
            fresh.append(f)
            if p.pooled and f is not None and self.q is not None:
                value = _pooled(fresh, p.samples, self.pool, self.q)
            else:
                value = float(p.value) * factor  # type: ignore[arg-type]
            pts.append(replace(p, value=value, fresh=f))
            if evaluate_rule(rule, {}, self.baseline, pts[-rule.lookback_cycles:]).fired:
                return True
        return False


def _scaled(sketch: Sketch, factor: float) -> Sketch:
    """Return the sketch of every sample times `factor` (to the sketch's accuracy)."""
    k = round(math.log(factor) / math.log(GAMMA))
    out = Sketch()
    out.bins = {b + k: c for b, c in sketch.bins.items()}
    out.zeros, out.count = sketch.zeros, sketch.count
    return out


def _pooled(fresh: list[Sketch | None], samples: int, pool: int, q: float) -> float:
    """Return the q-quantile of the latest cycles' samples, pooled as the series pools them
    (newest first until `samples` are in, at most `pool` cycles)."""
    merged = Sketch()
    for f in reversed(fresh[-pool:]):
        if f is not None:
            merged.merge(f)
        if merged.count >= samples:
            break
    v = merged.quantile(q)
    return 0.0 if v is None else v


# -- the scheduled refresh ----------------------------------------------------------------

TIMED_OUT = "timed out"
# Raw history one read holds: a rule's rows of this long a stretch at a time. Read whole,
# a day of every rule's raw cycles stayed in memory through the job, and its peak (and
# so the worker's resident memory) grew with a young install's history for a day.
READ_SLICE_S = 3600.0


@dataclass(frozen=True)
class RefreshReport:
    """What one refresh did: series estimated, left for the next run, CPU spent."""

    estimated: int = 0
    left: int = 0
    cpu_s: float = 0.0
    errors: tuple[str, ...] = ()
    rows_held: int = 0  # the most measurement rows one read held (a slice's, not the history's)


@dataclass(frozen=True)
class _Series:
    rule: Rule
    labels: dict[str, str]
    cohort: tuple[str, str]
    baseline: StoredBaseline
    points: list[Point]
    old: StoredSensitivity | None


def refresh(session: Session, rules: Sequence[Rule], config: SensitivityConfig, now: datetime,
            *, history_s: float = 86400.0, budget_s: float = 30.0,
            clock: Callable[[], float] = time.process_time) -> RefreshReport:
    """Re-estimate the series whose baseline, threshold or budget changed, stalest first,
    until `budget_s` CPU seconds of `clock` are spent (the rest wait for the next run).

    Off the evaluation path: a scheduled job of its own. Each series is judged against
    the baseline stored for it (its season's, for a seasonal rule) on its cycles of the
    last `history_s` (a seasonal one: those of its season).
    """
    start = clock()
    due, held = _due(session, rules, config, now, history_s)
    todo = sorted(due, key=lambda s: (s.old is not None, s.old.computed_at if s.old else now))
    done, errors = 0, list[str]()
    for i, s in enumerate(todo):
        if clock() - start >= budget_s:
            return RefreshReport(done, len(todo) - i, clock() - start, tuple(errors), held)
        try:
            _store(session, s, _estimate(s, config, clock), now)
            done += 1
        except Exception as e:  # noqa: BLE001 - one bad series must not stop the rest
            errors.append(f"{s.rule.name} {s.baseline.scope_key}: {type(e).__name__}: {e}")
    return RefreshReport(done, 0, clock() - start, tuple(errors), held)


def _estimate(s: _Series, config: SensitivityConfig,
              clock: Callable[[], float]) -> Sensitivity:
    b = s.baseline
    stats = BaselineStats(b.value, b.spread or 0.0, b.samples, body=b.body)
    budget = s.rule.budget_for(s.labels, config.budget_per_30d)
    cfg = replace(config, budget_per_30d=budget)
    seed = zlib.crc32(f"{s.rule.name}|{b.scope_key}|{s.cohort}".encode()) ^ config.seed
    try:
        return estimate(s.rule, s.points, stats, cfg, budget_on=budget is not None,
                        rng=random.Random(seed), clock=clock)
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
    with a due series reads its history, one rule and one slice at a time.
    """
    stored = sensitivity_queries.by_key(session, [r.name for r in rules])
    active = baseline_queries.active_by_metric(session, {r.metric for r in rules})
    out: list[_Series] = []
    held = 0
    for rule in rules:
        wanted = _candidates(rule, active[rule.metric], stored, config)
        if not wanted:
            continue
        per_scope, rows = sliced_cohort_series(rule, session,
                                               now - timedelta(seconds=history_s), now,
                                               READ_SLICE_S)
        held = max(held, rows)
        for c in wanted:
            pts = per_scope.get(c.labels, {}).get(c.cohort)
            if pts is not None:  # no cycles in the history: nothing to estimate on
                out.append(_Series(rule, dict(c.labels), c.cohort, c.baseline,
                                   _in_season(pts, c.season), c.old))
    return out, held


def _candidates(rule: Rule, rows: Mapping[str, list[StoredBaseline]],
                stored: Mapping[SensitivityKey, StoredSensitivity],
                config: SensitivityConfig) -> list[_Candidate]:
    """Return `rule`'s series (scope, cohort, season) whose rolling baseline has no
    matching estimate stored."""
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
                    or old.within_cycles != config.within_cycles:
                out.append(_Candidate(labels, cohort, b, season, old))
    return sorted(out, key=lambda c: (c.labels, c.cohort, c.season or ""))


def _pairs(key: str) -> list[tuple[str, str]]:
    return [tuple(kv.split("=", 1)) for kv in key.split(",") if "=" in kv]  # type: ignore[misc]


def _in_season(pts: list[Point], season: str | None) -> list[Point]:
    """Return the points of one season ("how<hour of week>" / "hod<hour of day>")."""
    if season is None:
        return pts
    kind, value = season[:3], int(season[3:])
    of = hour_of_week if kind == "how" else hour_of_day
    return [p for p in pts if of(p.at) == value]
