"""Baselines: rolling per cohort (trailing window, alert periods left out) or pinned.

A rolling baseline is the median and robust spread of a rule's per-cycle values over the
trailing `rule.baseline_window_s` (7 days by default) in one cohort (model_version,
config_hash), leaving out the cycles when an alert on the same metric and scope was
firing or pending on its way to firing. It is stored as a `Baseline` row (value = median,
samples = cycles, spread = robust sigma) and refreshed when older than
`BaselineConfig.refresh_s` (jittered per scope so refreshes spread over the hour), or,
while its window is still filling, each time its data has doubled: the first cycles
after a start must not set the level for an hour.

Incremental: finished hours of every rule's series are stored once as `SeriesChunk`
rows; a refresh reads those plus the current hour's raw rows, never the raw history.

Cohorts: a cohort's window starts at its first run plus `warm_in_s`. While its own
baseline warms in, it is judged against the newest warmed-in baseline of another cohort
(inherited), so a rollout has no blind window and the old cohort's rules stay live. Its
pooled quantiles borrow the scope's other cohorts' samples until it has enough of its own
(`alerts.series.pooled_quantile`); such values stay out of its own chunks and baseline.
Seasonality (`seasonality: hour_of_week`): the baseline is built from the same hour of
the week only, once that hour has been seen in at least two weeks (one hour of pooled
quantiles is a handful of independent values: its median is too noisy a centre, and a
daily peak paged once a day against it). Until then it is built from the same hour of the
day (seen on two days or more, so from the second day on), and before that the plain
baseline is used; the reason names the fallback. Once both are in force, the more lenient
of the two in the rule's direction is used (for a rising metric, the higher centre): a
weekly peak still raises its hour, while an hour of the week that merely reads quiet (the
noise of two hours of pooled values) cannot page a regular daily peak. A young season
(each seen on fewer than `YOUNG_SEASON_HOURS` days) may only relax the plain baseline: one
that reads under the plain centre (for a rising metric) gives way to it.

Stored later: what a refresh computes (chunks, replaced and new rolling rows) is kept in
`BaselineWrites` until `apply`, so the evaluation computes it in a read-only transaction
and stores it in its short write transaction (`alerts.evaluator`).

A pinned baseline fixes the centre and keeps the spread measured when it was pinned.
Which stored baseline is in force is decided in one place:
`storage.queries.baselines.decide_in_force`.
"""

from __future__ import annotations

import math
import zlib
from array import array
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from itertools import chain
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from alerts.detection import HELD_SUFFIX, INSUFFICIENT_HISTORY, NO_BASELINE, BaselineStats
from alerts.errors import BaselineError
from alerts.rule_file import METRICS, SCOPE_LABELS, SOURCES
from alerts.rules import Point, Rule
from alerts.series import (
    Labels,
    RowCache,
    cohort_series,
    cycle_start,
    reach_back,
    read_slices,
    settled_end,
    slice_caches,
)
from storage.models import Baseline, scope_key
from storage.queries import baselines as baseline_queries
from storage.queries import sensitivity as sensitivity_queries
from storage.queries import series as series_queries
from storage.queries.baselines import AlertPeriod, StoredBaseline, decide_in_force
from storage.queries.sensitivity import SensitivityKey, StoredSensitivity
from storage.queries.series import NO_COHORT, Chunk, Cohort

_SCOPE_KEYS = (*SCOPE_LABELS, "source", "window")
BaselineView = StoredBaseline  # what the CLI and API show
CHUNK_S = 3600.0
CHUNK_SLICE_S = 600.0  # raw rows held at once while chunking or refreshing: 10 minutes'
HOUR_OF_WEEK = "hour_of_week"
HOUR_OF_DAY = "hour_of_day"
# A season seen on fewer hours than this may only relax the plain baseline, not tighten it.
YOUNG_SEASON_HOURS = 7


@dataclass(frozen=True)
class BaselineConfig:
    """How rolling baselines are kept: refresh age and warm-in after a version change."""

    refresh_s: float = 3600.0
    warm_in_s: float = 1800.0
    # Hours of raw history turned into chunks per rule per evaluation, newest first: the
    # first evaluations after an upgrade (or an outage) spread the backfill over minutes.
    backfill_hours: int = 6
    # alerts.false_page_budget_per_30d is set: stored widened thresholds apply.
    false_page_budget: bool = True
    # With the budget on, a series whose false-page estimate says insufficient history
    # (or, not estimated yet, whose baseline rests on fewer than hold_cycles cycles or
    # spans less than hold_s) fires warnings, not pages (alerts.rules.pages_held). 0: off.
    hold_cycles: int = 0
    hold_s: float = 0.0


@dataclass(frozen=True)
class CohortBaseline:
    """What one cohort's series is judged against; origin says where it came from.

    origin: "" (the cohort's own rolling baseline), "pinned", "hour_of_week",
    "hour_of_day" (the hour of week's fallback, or the more lenient of the two), or
    "inherited from <model_version>/<config_hash>" while the cohort warms in.
    """

    stats: BaselineStats | None
    origin: str = ""


def rule_scope(rule: Rule, labels: Mapping[str, str]) -> dict[str, str]:
    """Return the baseline scope of a rule's series: source, match labels, labels, window."""
    scope = {"source": rule.source, **rule.match, **labels}
    if rule.window_s != 60.0:
        scope["window"] = f"{rule.window_s:g}s"
    return scope


def hour_start(t: datetime) -> datetime:
    """Return the start of the (UTC, epoch-aligned) hour holding `t`."""
    ts = t.timestamp()
    return datetime.fromtimestamp(ts - ts % CHUNK_S, UTC)


def hour_of_week(t: datetime) -> int:
    """Return 0..167: Monday 00h UTC is 0."""
    u = t.astimezone(UTC)
    return u.weekday() * 24 + u.hour


def hour_of_day(t: datetime) -> int:
    """Return 0..23, the UTC hour."""
    return t.astimezone(UTC).hour


# season kind -> (the scope's season label prefix, the function giving a time's season),
# in the order a seasonal rule tries them (the hour of day stands in for a young week).
_SEASONS = {HOUR_OF_WEEK: ("how", hour_of_week), HOUR_OF_DAY: ("hod", hour_of_day)}


def cohort_label(cohort: Cohort) -> str:
    """Return "model_version/config_hash" for reasons and labels."""
    return f"{cohort[0] or '?'}/{cohort[1] or '?'}"


@dataclass
class BaselineWrites:
    """What computing baselines stores, kept until `apply` (the write transaction's)."""

    chunks: list[Chunk] = field(default_factory=list)
    chunks_before: dict[str, datetime] = field(default_factory=dict)  # rule -> drop hours before
    replaced: list[int] = field(default_factory=list)  # rolling rows made inactive (ids)
    rows: list[Baseline] = field(default_factory=list)  # new rolling rows

    def pending_chunks(self, rule: str, scope_keys: Collection[str],
                       cohorts: Collection[Cohort], start: datetime,
                       end: datetime) -> list[Chunk]:
        """Return the kept chunks that `series_queries.chunks` will return once stored."""
        return [ch for ch in self.chunks
                if ch.rule == rule and ch.scope_key and ch.scope_key in scope_keys
                and ch.cohort in cohorts and start <= ch.start < end]

    def replace(self, old: StoredBaseline) -> None:
        """Make `old` inactive: a stored row on `apply`, a kept one (no id yet) at once."""
        if old.id is not None:
            self.replaced.append(old.id)
            return
        for row in self.rows:  # refreshed twice this evaluation: a rule of the same scope
            if row.active and baseline_queries.stored(row) == old:
                row.active = False

    def extend(self, other: BaselineWrites) -> None:
        """Keep `other`'s writes too (a rule's, once it was judged without error)."""
        self.chunks += other.chunks
        self.chunks_before.update(other.chunks_before)
        self.replaced += other.replaced
        self.rows += other.rows

    def apply(self, session: Session) -> None:
        """Store the kept writes in `session`'s transaction."""
        for rule, before in self.chunks_before.items():
            series_queries.delete_chunks_before(session, rule, before)
        if self.chunks:
            series_queries.add_chunks(session, self.chunks)
        if self.replaced:
            session.execute(update(Baseline).where(Baseline.id.in_(self.replaced))
                            .values(active=False).execution_options(synchronize_session="fetch"))
        if self.rows:
            session.add_all(self.rows)
            session.flush()


def ensure_chunks(session: Session, rule: Rule, cache: RowCache, now: datetime,
                  backfill_hours: int = 6, rules: Sequence[Rule] = (),
                  writes: BaselineWrites | None = None) -> int:
    """Store finished hours of `rule`'s series not stored yet (at most `backfill_hours`,
    newest first); return how many hours were missing before this call.

    `rules`: every rule of the evaluation. The first call of an evaluation counts the
    hours chunked of all of them in one query and makes the chunks of every rule with
    hours missing in one pass (`_make_chunks`, kept on `cache`); each rule's call takes
    its own. `writes`: keep the chunks there instead (stored by its `apply`).
    """
    every = {r.name: r for r in (*rules, rule)}
    names = frozenset(every)  # the evaluation's rules: one plan and one pass for them all
    plan = cache.once(("chunk_plan", now, names), lambda: {
        r.name: _missing_hours(session, r, cache, now, backfill_hours, every.values())
        for r in every.values()})
    todo = plan[rule.name]
    if not todo.count:
        return 0
    made = cache.once(("chunks_made", now, names),
                      lambda: _make_chunks(cache, every.values(), plan))
    out = made[rule.name]
    if isinstance(out, Exception):
        raise out  # this rule's read failed: its savepoint, not the others'
    kept = BaselineWrites() if writes is None else writes
    kept.chunks_before[rule.name] = todo.start
    kept.chunks += out
    if writes is None:
        kept.apply(session)
    return todo.count


@dataclass(frozen=True)
class _Todo:
    """A rule's hours to chunk at one evaluation."""

    start: datetime  # the first hour of its baseline window
    count: int  # hours of the window not chunked yet
    hours: frozenset[datetime]  # those chunked now: the newest, at most backfill_hours


def _missing_hours(session: Session, rule: Rule, cache: RowCache, now: datetime,
                   backfill_hours: int, rules: Iterable[Rule]) -> _Todo:
    # An hour is chunked once its last cycle has settled (its traffic flushed): chunked
    # earlier, it lost its last minute for good.
    settled = settled_end(rule, cache, now)
    end = hour_start(settled)
    start = hour_start(settled - timedelta(seconds=rule.baseline_window_s))
    hour = timedelta(seconds=CHUNK_S)
    hours = round((end - start) / hour)
    # The rules whose window is this one's: their counts in one grouped read.
    names = tuple(sorted({r.name for r in rules if r.baseline_window_s == rule.baseline_window_s
                          and settled_end(r, cache, now) == settled} | {rule.name}))
    counts = cache.once(("chunk_counts", start, end, names),
                        lambda: series_queries.chunk_counts(session, names, start, end))
    if counts.get(rule.name, 0) >= hours:
        return _Todo(start, 0, frozenset())
    have = series_queries.chunk_starts(session, rule.name, start, end)
    todo = [h for h in (end - (i + 1) * hour for i in range(hours)) if h not in have]
    return _Todo(start, len(todo), frozenset(todo[:max(backfill_hours, 1)]))


def _make_chunks(cache: RowCache, rules: Iterable[Rule], plan: Mapping[str, _Todo]
                 ) -> dict[str, list[Chunk] | Exception]:
    """Return each rule's chunks of its hours in `plan` (or the error its read raised).

    The hours' raw rows are read `CHUNK_SLICE_S` at a time, each slice once for all the
    rules of one cycle length (one RowCache: a row kind loaded once, a cycle's sketch
    merged once for the rules that share it), and dropped before the next: read whole,
    an hour of raw rows was the worker's peak, and CPython keeps the arenas a peak takes.
    """
    groups: dict[float, list[Rule]] = {}
    for r in rules:
        if plan[r.name].hours:
            groups.setdefault(r.window_s, []).append(r)
    out: dict[str, list[Chunk] | Exception] = {}
    hour = timedelta(seconds=CHUNK_S)
    for window_s, group in groups.items():
        by_hour: dict[str, dict[tuple[str, Cohort, datetime], list[list[Any]]]] = {
            r.name: {} for r in group}
        failed: dict[str, Exception] = {}
        wanted = sorted({h for r in group for h in plan[r.name].hours})
        reach = max(reach_back(r) for r in group)
        for run_start, run_end in _runs(wanted, hour):
            for lo, hi, part in slice_caches(cache.session, run_start, run_end, window_s,
                                             CHUNK_SLICE_S, reach):
                for r in group:
                    mine = plan[r.name].hours
                    if r.name in failed or not any(lo < h + hour and h < hi for h in mine):
                        continue
                    try:
                        series = cohort_series(r, part, lo, hi)
                    except Exception as e:  # noqa: BLE001 - raised by that rule's own call
                        failed[r.name] = e
                        continue
                    for labels, cohort, p, value in _own(series):
                        at = hour_start(p.at)
                        if at in mine:
                            key = scope_key(rule_scope(r, dict(labels)))
                            by_hour[r.name].setdefault((key, cohort, at), []).append(
                                [p.at.timestamp(), value, p.samples, _median(p)])
                cache.rows_read += part.rows_read
        for r in group:
            made = [Chunk(r.name, k, c, h, v) for (k, c, h), v in by_hour[r.name].items()]
            # Each hour is marked done, data or not.
            made += [Chunk(r.name, "", NO_COHORT, h, []) for h in sorted(plan[r.name].hours)]
            out[r.name] = failed.get(r.name, made)
    return out


def _own(series: Mapping[Labels, Mapping[Cohort, Sequence[Point]]]
         ) -> Iterator[tuple[Labels, Cohort, Point, float]]:
    """Yield the cycles of `series` with a value of their cohort's own (and that value)."""
    for labels, per_cohort in series.items():
        for cohort, pts in per_cohort.items():
            for p in pts:
                # A value pooled partly from other cohorts is not this cohort's own.
                if p.value is not None and not p.borrowed:
                    yield labels, cohort, p, p.value


def _own_points(rule: Rule, cache: RowCache, start: datetime,
                end: datetime) -> Iterator[tuple[Labels, Cohort, Point, float]]:
    """Yield `rule`'s cycles in [start, end) with a value of their cohort's own (and that
    value), read `CHUNK_SLICE_S` at a time (each slice's rows dropped before the next;
    counted in `cache.rows_read`, the evaluation's cost)."""
    for part, rows in read_slices(rule, cache.session, start, end, CHUNK_SLICE_S):
        cache.rows_read += rows
        yield from _own(part)


def _median(p: Point) -> float | None:
    """Return the median of the cycle's own samples (a quantile's fresh ones), or None."""
    return p.fresh.quantile(0.5) if p.fresh is not None and p.fresh.count else None


def _runs(hours: list[datetime], step: timedelta) -> list[tuple[datetime, datetime]]:
    runs: list[tuple[datetime, datetime]] = []
    for h in hours:
        if runs and runs[-1][1] == h:
            runs[-1] = (runs[-1][0], h + step)
        else:
            runs.append((h, h + step))
    return runs


@dataclass
class _Need:
    labels: Labels
    cohort: Cohort
    scope: dict[str, str]
    key: str  # the stored row's key (seasonal rows carry their season)
    series_key: str  # the chunks' key
    start: datetime
    season: tuple[str, int] | None  # (HOUR_OF_WEEK or HOUR_OF_DAY, its value)
    old: StoredBaseline | None


def baselines_for_rule(
    session: Session,
    rule: Rule,
    rules: list[Rule],
    now: datetime,
    cache: RowCache,
    serving: Mapping[Labels, Iterable[Cohort]],
    config: BaselineConfig,
    writes: BaselineWrites | None = None,
) -> dict[Labels, dict[Cohort, CohortBaseline]]:
    """Return scope labels -> cohort -> its baseline, refreshing stale rolling baselines.

    `serving`: the cohorts with data per scope in the detector's window. `writes`: keep
    the refreshed chunks and rows there (stored by its `apply`; `session` is then only
    read); None: store them in `session` before returning.
    """
    kept = BaselineWrites() if writes is None else writes
    # While chunks are backfilled (more than the one hour that ends each hour), every
    # baseline rests on part of its window: refresh them until the window is complete.
    backfilling = ensure_chunks(session, rule, cache, now, config.backfill_hours, rules,
                                kept) > 1
    # Every rule's metrics in one read per evaluation, kept current below.
    metrics = tuple(sorted({r.metric for r in rules} | {rule.metric}))
    active = cache.once(("active_baselines", metrics),
                        lambda: baseline_queries.active_by_metric(session, metrics))[rule.metric]
    by_scope = dict(active)
    # Every rule's stored sensitivity (threshold in force) in one read per evaluation.
    sens = cache.once(("sensitivities",), lambda: sensitivity_queries.by_key(session))
    # Rule x scope where some cohort's estimate is made: the host's noise there is known,
    # so a new version's young series keeps paging through a rollout.
    known = cache.once(("sensitivities_known",), lambda: {
        (k[0], k[1]) for k, v in sens.items() if v.status != INSUFFICIENT_HISTORY})
    # The hour of the latest finished cycle (the one judged), not of `now`.
    judged = now - timedelta(seconds=rule.window_s)
    seasons: list[tuple[str, int]] = [(kind, season(judged))
                                      for kind, (_, season) in _SEASONS.items()] \
        if rule.seasonality == HOUR_OF_WEEK else []
    needs: list[_Need] = []
    plan: list[tuple[Labels, Cohort, str, list[str]]] = []
    for labels, cohorts in serving.items():
        scope = rule_scope(rule, dict(labels))
        key = scope_key(scope)
        scoped = [({**scope, "season": f"{_SEASONS[kind][0]}{v}"}, (kind, v))
                  for kind, v in seasons]
        skeys = [scope_key(sc) for sc, _ in scoped]
        for cohort in cohorts:
            since = cache.since(cohort, now)
            start = now - timedelta(seconds=rule.baseline_window_s)
            if since is not None:
                start = max(start, since + timedelta(seconds=config.warm_in_s))
            for k, (sc, s) in zip([key, *skeys], [(scope, None), *scoped], strict=True):
                old = decide_in_force(by_scope.get(k, []), cohort).rolling
                if start < now and (backfilling or _stale(old, rule, now, config, k)):
                    needs.append(_Need(labels, cohort, sc, k, key, start, s, old))
            plan.append((labels, cohort, key, skeys))
    if needs:
        fresh = _refresh(session, rule, rules, now, cache, needs, kept)
        for k, rows in fresh.items():
            by_scope[k] = by_scope.get(k, []) + rows
        # What the next rule of this metric would read: the replaced rows are inactive.
        # (Compared whole: a row refreshed earlier in this evaluation has no id yet.)
        gone = [n.old for n in needs if n.old is not None and any(
            (b.model_version, b.config_hash) == n.cohort for b in fresh.get(n.key, ()))]
        for k, rows in fresh.items():
            active[k] = [b for b in active.get(k, []) if b not in gone] + rows
    out: dict[Labels, dict[Cohort, CohortBaseline]] = {}
    for labels, cohort, key, skeys in plan:
        widen = _widening(rule, dict(labels), sens, config, known)
        out.setdefault(labels, {})[cohort] = _choose(rule, by_scope, cohort, key, skeys, widen)
    if writes is None:
        kept.apply(session)
    return out


def _choose(rule: Rule, by_scope: Mapping[str, list[StoredBaseline]], cohort: Cohort, key: str,
            skeys: Sequence[str], widen: _Widen = lambda b, st: st) -> CohortBaseline:
    n = rule.min_baseline_cycles
    force = decide_in_force(by_scope.get(key, []), cohort, min_cycles=n)
    rolling = force.rolling
    if force.pinned is not None:
        p = force.pinned
        # The spread measured when it was pinned; else today's rolling one.
        spread = p.spread if p.spread is not None else (
            rolling.spread if rolling is not None and rolling.spread is not None else 0.0)
        body = p.body if p.body is not None else (rolling.body if rolling is not None else None)
        return CohortBaseline(widen(p, BaselineStats(center=p.value, spread=spread,
                                                     cycles=max(p.samples, n), pinned=True,
                                                     body=body)), "pinned")
    fallback = ""
    # A season is used once it holds more cycles than one hour can: seen twice at least.
    per_hour = int(CHUNK_S // rule.window_s)
    need = max(n, per_hour + 1)
    why: list[str] = []
    ready: list[tuple[BaselineStats, str]] = []
    for kind, skey in zip(_SEASONS, skeys, strict=False):
        seasonal = decide_in_force(by_scope.get(skey, []), cohort, min_cycles=n).rolling
        if seasonal is not None and seasonal.samples >= need and seasonal.spread is not None:
            ready.append((widen(seasonal, _stats(seasonal, seasonal.spread)), kind))
            continue
        # Said, not silent: this season has too little history of its own yet.
        have = seasonal.samples if seasonal is not None else 0
        why.append(f"{kind}: {have} of {need} cycles")
    if ready:
        # The envelope: the hour of the week counts only where it is more lenient than the
        # hour of the day. A real weekly peak raises it and is used; an hour of the week
        # that reads quiet rests on two or three hours of pooled values, and its noise
        # alone paged a daily peak.
        stats, kind = max(ready, key=lambda sk: rule.direction * sk[0].center)
        young = all(st.cycles < YOUNG_SEASON_HOURS * per_hour for st, _ in ready)
        if (young and rolling is not None and rolling.spread is not None
                and rule.direction * rolling.value > rule.direction * stats.center):
            # A young season (each seen on fewer than a week of days) may only relax the
            # plain baseline: its centre rests on a few hours of pooled values, and an
            # hour that read low by their noise alone paged an ordinary hour against it.
            return CohortBaseline(widen(rolling, _stats(rolling, rolling.spread)),
                                  f"plain ({kind} young: {stats.cycles} cycles, reads "
                                  f"{(stats.center / rolling.value - 1) * 100:+.1f}%)")
        return CohortBaseline(stats, kind)
    if why:
        fallback = f"plain ({', '.join(why)})"
    b = force.inherited
    if b is not None and b.spread is not None:
        return CohortBaseline(widen(b, _stats(b, b.spread)),
                              f"inherited from {cohort_label((b.model_version, b.config_hash))}")
    if rolling is not None and rolling.spread is not None:
        return CohortBaseline(widen(rolling, _stats(rolling, rolling.spread)), fallback)
    return CohortBaseline(None)


_Widen = Callable[[StoredBaseline, BaselineStats], BaselineStats]


def _widening(rule: Rule, labels: Mapping[str, str],
              sens: Mapping[SensitivityKey, StoredSensitivity], config: BaselineConfig,
              known: Collection[tuple[str, str]] = frozenset()) -> _Widen:
    """Return what sets a chosen baseline's threshold in force from its stored estimate.

    The widened threshold applies while the budget is on for the rule and scope and the
    estimate was made for the configured threshold (a changed rule waits for the next one).
    Pages are held where the series is too young for its estimate and no other cohort of
    the scope has one (`known`).
    """
    on = config.false_page_budget and rule.budget_for(labels, 1.0) is not None

    def widen(b: StoredBaseline, stats: BaselineStats) -> BaselineStats:
        s = sens.get((rule.name, b.scope_key, b.model_version, b.config_hash))
        held = _held(b, s, config) if on and (rule.name, b.scope_key) not in known else ""
        if held:
            stats = replace(stats, held=held)
        if not on or s is None or s.budget_per_30d is None or s.threshold <= rule.threshold \
                or not math.isclose(s.configured_threshold, rule.threshold):
            return stats
        return replace(stats, threshold=s.threshold, widened=s.reason)
    return widen


def _held(b: StoredBaseline, s: StoredSensitivity | None, config: BaselineConfig) -> str:
    """Return why the series' pages are held (its history is too short for its false-page
    estimate), or "" where they page."""
    if not (config.hold_cycles or config.hold_s) or "season" in b.scope:
        return ""  # a season is in force only once seen on two days: never a young series
    # An estimate made before the series had a usable baseline says nothing about its
    # history now that it has one: judged as not estimated yet until the job runs again.
    if s is not None and NO_BASELINE not in s.reason:
        return s.reason.removesuffix(HELD_SUFFIX) if s.status == INSUFFICIENT_HISTORY else ""
    if b.kind != "rolling":
        return ""
    # Not estimated yet (the job runs on its own schedule): judged by the baseline's own
    # history, so a young series' first cycles after arming cannot page before it runs.
    span = (b.window_end - b.window_start).total_seconds() \
        if b.window_start is not None and b.window_end is not None else 0.0
    if b.samples >= config.hold_cycles and span >= config.hold_s:
        return ""
    return (f"{INSUFFICIENT_HISTORY}: {b.samples} of {config.hold_cycles} cycles, "
            f"{span / 3600:.1f} of {config.hold_s / 3600:g} h (not estimated yet)")


def _stats(b: StoredBaseline, spread: float) -> BaselineStats:
    """Return a stored rolling row (with its `spread`) as the detector's summary."""
    return BaselineStats(b.value, spread, b.samples, body=b.body)


def _stale(old: StoredBaseline | None, rule: Rule, now: datetime, config: BaselineConfig,
           key: str) -> bool:
    if old is None:
        return True
    if old.samples < rule.min_baseline_cycles:
        # Warming in: refresh once per cycle, when one has ended since the row was made.
        # Evaluations more frequent than the rule's cycles (a 1-minute traffic rule
        # evaluated every few seconds) would otherwise store the same row each time.
        return cycle_start(now, rule.window_s) > cycle_start(old.created_at, rule.window_s)
    age = (now - old.created_at).total_seconds()
    # Jitter (0.5-1 x refresh_s, fixed per scope): refreshes spread over the hour.
    if age >= config.refresh_s * (0.5 + (zlib.crc32(key.encode()) % 1000) / 2000.0):
        return True
    if old.window_start is not None and old.window_end is not None:
        span = (old.window_end - old.window_start).total_seconds()
        # Its window is still filling: refresh each time the data has doubled.
        if span < rule.baseline_window_s - 2 * rule.window_s and age >= max(span, rule.window_s):
            return True
    return False


def _refresh(session: Session, rule: Rule, rules: list[Rule], now: datetime, cache: RowCache,
             needs: list[_Need], writes: BaselineWrites) -> dict[str, list[StoredBaseline]]:
    """Recompute the rolling baselines in `needs` from chunks plus the current hour (the
    replaced and new rows kept in `writes`)."""
    # Chunks end where ensure_chunks stopped: the hour of the latest settled cycle.
    settled = settled_end(rule, cache, now)
    this_hour = hour_start(settled)
    first = min(n.start for n in needs)
    keys, cohorts = {n.series_key for n in needs}, {n.cohort for n in needs}
    # Stored chunks, then the hours chunked by this evaluation (not stored yet).
    values = _cycle_values(chain(
        series_queries.chunks(session, rule.name, keys, cohorts, hour_start(first), this_hour),
        writes.pending_chunks(rule.name, keys, cohorts, hour_start(first), this_hour)))
    # The current hour's cycles as plain numbers: its points (sketches) go with each slice.
    live: dict[tuple[Labels, Cohort], _CycleValues] = {}
    for labels, cohort, p, value in _own_points(rule, cache, max(this_hour, first), settled):
        live.setdefault((labels, cohort), _CycleValues()).append(
            p.at.timestamp(), value, p.samples, _median(p))
    same = [r.name for r in rules if r.metric == rule.metric and r.source == rule.source]
    periods = baseline_queries.alert_periods(session, same, first)
    out: dict[str, list[StoredBaseline]] = {}
    for need in needs:
        pts = _CycleValues()
        pts.extend(values.get((need.series_key, need.cohort), _CycleValues()))
        pts.extend(live.get((need.labels, need.cohort), _CycleValues()))
        excluded = alert_spans(periods, rule, need.labels, now)
        lo = need.start.timestamp()
        kept = _CycleValues()
        for t, v, n, m in pts:
            if t >= lo and n >= rule.min_samples \
                    and (need.season is None or _SEASONS[need.season[0]][1](
                        datetime.fromtimestamp(t, UTC)) == need.season[1]) \
                    and not any(a <= t < b for a, b in excluded):
                kept.append(t, v, n, m)
        # A body from a few cycles (hours chunked before 0008 have none) is no reference.
        stats = BaselineStats.of(kept.values, bodies=(m for *_, m in kept),
                                 min_bodies=rule.min_baseline_cycles)
        if stats is None:
            continue
        if need.old is not None:
            writes.replace(need.old)
        row = Baseline(metric=rule.metric, scope=need.scope, scope_key=need.key,
                       value=stats.center, samples=stats.cycles, window_start=need.start,
                       window_end=now, kind="rolling", model_version=need.cohort[0],
                       config_hash=need.cohort[1], created_at=now, spread=stats.spread,
                       body=stats.body, active=True)
        writes.rows.append(row)  # no id until stored
        out.setdefault(need.key, []).append(baseline_queries.stored(row))
    return out


class _CycleValues:
    """A series' stored cycles as columns of machine numbers (start, value, samples, body).

    A refresh reads every hour of the baseline window (7 days of cycles: 60,480 a scope at
    10-s cycles). As a tuple of Python objects per cycle they took several times the
    bytes, for the whole refresh, beside a copy per series refreshed; CPython keeps the
    arenas of that peak, so the worker's RSS stepped up with each hour of history.
    """

    def __init__(self) -> None:
        self.starts, self.values = array("d"), array("d")
        self.samples, self.bodies = array("q"), array("d")  # body: NaN when unknown

    def append(self, start: float, value: float, samples: int, body: float | None) -> None:
        self.starts.append(start)
        self.values.append(value)
        self.samples.append(samples)
        self.bodies.append(math.nan if body is None else body)

    def extend(self, other: _CycleValues) -> None:
        self.starts.extend(other.starts)
        self.values.extend(other.values)
        self.samples.extend(other.samples)
        self.bodies.extend(other.bodies)

    def __iter__(self) -> Iterator[tuple[float, float, int, float | None]]:
        for t, v, n, m in zip(self.starts, self.values, self.samples, self.bodies,
                              strict=True):
            yield t, v, n, None if math.isnan(m) else m


def _cycle_values(chunks: Iterable[Chunk]) -> dict[tuple[str, Cohort], _CycleValues]:
    """Return (scope key, cohort) -> the chunks' non-empty cycles (chunks before 0008 hold
    no body)."""
    out: dict[tuple[str, Cohort], _CycleValues] = {}
    for ch in chunks:
        col = out.get((ch.scope_key, ch.cohort))
        if col is None:
            col = out[(ch.scope_key, ch.cohort)] = _CycleValues()
        for c in ch.values:
            if c[1] is not None:
                col.append(float(c[0]), c[1], int(c[2]), c[3] if len(c) > 3 else None)
    return out


def alert_spans(periods: list[AlertPeriod], rule: Rule, labels: Labels,
                now: datetime) -> list[tuple[float, float]]:
    """Return the cycles (unix [start, end) spans) that `periods` of `labels`' scope
    leave out of its series: a regression is not the normal level, nor its noise."""
    key = scope_key(dict(labels))
    w = rule.window_s
    # An alert opens (pending) at the evaluation after its first breaching cycle: that
    # cycle is the one before; it resolves at the evaluation after the last cycle that
    # still counted, so the cycle in progress then is back in.
    return [(cycle_start(p.start, w).timestamp() - w, cycle_start(p.end or now, w).timestamp())
            for p in periods
            if scope_key({k: v for k, v in p.labels.items() if k in rule.per}) == key]


def parse_scope(scope: Mapping[str, Any] | str) -> dict[str, str]:
    """Return a validated scope from a mapping or "k=v,k=v"; source defaults to canary."""
    if isinstance(scope, str):
        items: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in scope.split(","))):
            k, sep, v = part.partition("=")
            if not sep or not k.strip() or not v.strip():
                raise BaselineError("scope", f"expected k=v pairs, got {part!r}", value=scope)
            items[k.strip()] = v.strip()
        scope = items
    if not isinstance(scope, Mapping):
        raise BaselineError("scope", "must be a mapping or k=v pairs", value=scope)
    out = {str(k): str(v) for k, v in scope.items()}
    bad = set(out) - set(_SCOPE_KEYS)
    if bad:
        raise BaselineError("scope", f"unknown label {sorted(bad)[0]!r} (allowed: "
                                     f"{', '.join(_SCOPE_KEYS)})", value=scope)
    out.setdefault("source", "canary")
    if out["source"] not in SOURCES:
        raise BaselineError("scope", f"source must be one of {', '.join(SOURCES)}", value=scope)
    return out


def _check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise BaselineError("metric", f"must be one of {', '.join(METRICS)}", value=metric)


def pin(session: Session, metric: str, scope: Mapping[str, Any] | str, actor: str, *,
        value: float | None = None, note: str | None = None,
        now: datetime | None = None) -> BaselineView:
    """Pin a baseline (the current rolling value unless `value` is given)."""
    _check_metric(metric)
    if not actor or not actor.strip():
        raise BaselineError("actor", "must not be empty", value=actor)
    sc = parse_scope(scope)
    key = scope_key(sc)
    # Any cohort: a person pins what the newest rolling baseline shows.
    rolling = baseline_queries.baseline_in_force(session, metric, key, None).rolling
    if value is None:
        if rolling is None:
            raise BaselineError("value", f"no rolling baseline for {metric} {key} yet: pass a value")
        value = rolling.value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BaselineError("value", "must be a number", value=value)
    spread = rolling.spread if rolling is not None else None
    body = rolling.body if rolling is not None else None
    _deactivate(session, metric, key, "pinned")
    kw = {"created_at": now} if now is not None else {}
    row = Baseline(metric=metric, scope=sc, scope_key=key, value=float(value),
                   samples=rolling.samples if rolling is not None else 0, kind="pinned",
                   model_version=rolling.model_version if rolling is not None else "",
                   config_hash=rolling.config_hash if rolling is not None else "",
                   pinned_by=actor, note=note or None, spread=spread, body=body, active=True,
                   **kw)
    session.add(row)
    session.flush()
    return baseline_queries.stored(row)


def unpin(session: Session, metric: str, scope: Mapping[str, Any] | str, actor: str) -> int:
    """Deactivate the pinned baseline of a metric and scope; return how many were active."""
    _check_metric(metric)
    if not actor or not actor.strip():
        raise BaselineError("actor", "must not be empty", value=actor)
    return _deactivate(session, metric, scope_key(parse_scope(scope)), "pinned")


def _deactivate(session: Session, metric: str, key: str, kind: str) -> int:
    result = session.execute(
        update(Baseline).where(Baseline.metric == metric, Baseline.scope_key == key,
                               Baseline.kind == kind, Baseline.active.is_(True))
        .values(active=False).execution_options(synchronize_session="fetch"))
    return int(result.rowcount or 0)  # type: ignore[attr-defined]


def list_baselines(session: Session, metric: str | None = None, *,
                   active_only: bool = True) -> list[BaselineView]:
    """Return stored baselines, newest first."""
    if metric is not None:
        _check_metric(metric)
    return baseline_queries.list_baselines(session, metric, active_only=active_only)
