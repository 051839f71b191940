"""Per-cycle series of a rule's metric, per scope, read from storage rows.

A cycle is `rule.window_s` long and aligned to the epoch; only finished cycles are
returned. Canary series read `ProbeResult` rows of kind "cycle" runs in the optimized
variant (A/B arms stay out), traffic series read `TrafficRollup` minutes, burst series
read "burst" runs; the batching metrics (BATCH_METRICS) read real traffic's
`BatchRollup` minutes, labelled with the batch-size class ("batch"). `recompiles_per_hour`, `compile_failures` and `memory_growth` are
sliding: each cycle reports the trailing hour, so one event stays visible for an hour.

Every row belongs to a cohort (model_version, config_hash): the one its instance ran at
that time (`storage.queries.series.cohort_map`). `series` merges cohorts; `cohort_series`
keeps them apart, so a new model version is judged on its own cycles.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar, cast

from sqlalchemy.orm import Session

from alerts import quality
from alerts.rules import Point, Rule, quantile_samples
from storage.queries import measurements as queries
from storage.queries.series import NO_COHORT, Cohort, CohortMap, cohort_map, cohort_since
from storage.sketches import PackedSketch, Sketch, merged, min_samples

Labels = tuple[tuple[str, str], ...]
_Key = tuple[Labels, Cohort]
_T = TypeVar("_T")
_HOUR = 3600.0


class Stored:
    """A sketch's stored JSON text, decoded the first time a rule reads it."""

    __slots__ = ("_text", "_data")

    def __init__(self, text: str | None) -> None:
        self._text = text
        self._data: PackedSketch | None = None

    @property
    def data(self) -> PackedSketch | None:
        """Return the decoded sketch, packed (None when stored as NULL)."""
        if self._data is None and self._text is not None:
            # Kept packed (one array of integers), and the text dropped: an evaluation
            # holds every row of its windows at once, and the worker's RSS keeps its peak
            # (CPython's arenas); decoded sketches (a dict and an int per bin) were its
            # largest part.
            self._data, self._text = PackedSketch.from_json(json.loads(self._text)), None
        return self._data


class Values(Mapping[str, Any]):
    """A row's numbers: one tuple, the names shared by every row of its kind."""

    __slots__ = ("_names", "_items")

    def __init__(self, names: Mapping[str, int], items: tuple[Any, ...]) -> None:
        self._names = names
        self._items = items

    def __getitem__(self, key: str) -> Any:
        return self._items[self._names[key]]

    def get(self, key: str, default: Any = None) -> Any:
        """Return the value of `key`, or `default` when the row has none."""
        i = self._names.get(key)
        return default if i is None else self._items[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _names(*names: str) -> dict[str, int]:
    """Return the index of each of a row kind's value names (see `Values`)."""
    return {name: i for i, name in enumerate(names)}


def _sketch(row: Row, field: str) -> PackedSketch | Sketch | Mapping[str, Any] | None:
    """Return the stored sketch of `field` in `row` (rows read lazily hold `Stored`)."""
    v = row.values.get(field)
    return v.data if isinstance(v, Stored) else v


# Slots: an evaluation holds thousands of rows at once (see Stored).
@dataclass(frozen=True, slots=True)
class Row:
    """One measurement row, flattened: when, its labels and its numbers."""

    at: datetime
    labels: Mapping[str, str]
    values: Mapping[str, Any]
    cohort: Cohort = NO_COHORT


def cycle_start(t: datetime, window_s: float) -> datetime:
    """Return the start of the epoch-aligned cycle holding `t`."""
    ts = t.timestamp()
    return datetime.fromtimestamp(ts - ts % window_s, UTC)


def cycle_starts(start: datetime, end: datetime, window_s: float) -> list[datetime]:
    """Return starts of the finished cycles within [start, end)."""
    out: list[datetime] = []
    t = cycle_start(start, window_s)
    if t < start:
        t += timedelta(seconds=window_s)
    step = timedelta(seconds=window_s)
    while t + step <= end:
        out.append(t)
        t += step
    return out


@dataclass
class _Span:
    """The rows of one kind loaded for [lo, hi), sorted by time (slices are bisected)."""

    lo: datetime
    hi: datetime
    rows: list[Row]
    times: list[datetime]

    def slice(self, start: datetime, end: datetime) -> list[Row]:
        return self.rows[bisect_left(self.times, start):bisect_left(self.times, end)]


class RowCache:
    """Rows read during one evaluation, tagged with their cohort: one read per kind.

    The evaluator first `plan`s what every rule will read (`plan_rules`): the first read
    of a kind then loads the union of the planned windows in one query and every later
    read inside it is an in-memory slice, so the statements an evaluation issues do not
    grow with its rules or scopes. `optional` windows (the older cycles a pooled quantile
    reaches back for only when a cycle is short) are loaded, all at once, in one more
    query the first time some read needs them. Reads outside the plan (hour chunks
    backfilled in the past) are loaded as asked and kept by window.

    settle: row kind -> seconds after a cycle's end before it counts as finished. Real
    traffic reaches the database in rollup flushes (every `traffic_flush_interval_s`, per
    replica), so a minute read just after it ended lacks its last requests: judged then, a
    shift that began late in the minute read as a mild dip and went into the baseline.

    carried: row kind -> rows the previous slice of a sliced read already loaded (`carry`),
    handed out instead of read again.
    """

    def __init__(self, session: Session, settle: Mapping[str, float] | None = None,
                 carried: Mapping[str, _Span] | None = None) -> None:
        self.session = session
        self.settle = dict(settle or {})
        self._carried = dict(carried or {})
        self.rows_read = 0  # rows loaded from the database: evaluation cost, for tests and bench
        self._cache: dict[tuple[str, datetime, datetime], list[Row]] = {}
        self._since: dict[Cohort, datetime] | None = None
        self._planned: dict[str, tuple[datetime, datetime]] = {}
        self._optional: dict[str, datetime] = {}
        self._spans: dict[str, _Span] = {}
        self._map: tuple[datetime, datetime, CohortMap] | None = None  # see _cohorts
        self._maps: dict[tuple[datetime, datetime], CohortMap] = {}  # see _map_of
        self._grouped: dict[tuple[Any, ...], dict[_Key, dict[datetime, list[Row]]]] = {}
        self._sketches: dict[tuple[Any, ...], dict[datetime, Sketch]] = {}
        self._once: dict[Hashable, object] = {}

    def plan(self, kind: str, start: datetime, end: datetime, *, optional: bool = False) -> None:
        """Announce a read of `kind` in [start, end) (before the first read of `kind`)."""
        if start >= end:
            return
        old = self._planned.get(kind)
        if optional:
            self._optional[kind] = min(start, self._optional.get(kind, start))
            start = old[0] if old is not None else end
        if old is not None:
            start, end = min(start, old[0]), max(end, old[1])
        self._planned[kind] = (start, end)

    def rows(self, kind: str, start: datetime, end: datetime) -> list[Row]:
        """Return rows of `kind` ("canary", "traffic", "burst", "compile", "memory") in range."""
        planned = self._planned.get(kind)
        if planned is not None and end <= planned[1] and start < end:
            lo = min(planned[0], self._optional.get(kind, planned[0]))
            if start >= lo:
                return self._planned_rows(kind, start, end, planned)
        key = (kind, start, end)
        if key not in self._cache:
            self._cache[key] = self._load(kind, start, end, self._map_of)
        return self._cache[key]

    def _map_of(self, start: datetime, end: datetime) -> CohortMap:
        # An instance's cohort is that of its latest run: look an hour further back. The
        # row kinds of one window share its map (a slice reads each kind of one window).
        m = self._maps.get((start, end))
        if m is None:
            m = self._maps[start, end] = cohort_map(
                self.session, start - timedelta(seconds=_HOUR), end)
            self.rows_read += len(m.spans)
        return m

    def carry(self, since: datetime, end: datetime, reached: datetime) -> dict[str, _Span]:
        """Return, per row kind, the rows held for [since, end) where this cache holds all
        of that stretch and read back before `reached` (its slice's start): the pooled
        reach-back of the next slice, which starts at `end`, reads them again otherwise.

        Kinds that did not reach back (no cycle was short) are not carried: the next slice
        would most likely not read them, and holding them would raise the slices' peak.
        """
        pieces: dict[str, list[tuple[datetime, datetime, list[Row]]]] = {}
        for (kind, lo, hi), rows in self._cache.items():
            pieces.setdefault(kind, []).append((lo, hi, rows))
        for kind, span in self._spans.items():
            pieces.setdefault(kind, []).append((span.lo, span.hi, span.rows))
        out: dict[str, _Span] = {}
        for kind, held in pieces.items():
            if not any(lo < reached for lo, _, _ in held):
                continue
            lo, parts = end, []
            while lo > since:  # back over contiguous reads, the one reaching furthest first
                covering = [p for p in held if p[0] < lo <= p[1]]
                if not covering:
                    break
                first, _, rows = min(covering, key=lambda p: p[0])
                parts.append([r for r in rows if since <= r.at < lo])
                lo = first
            if lo > since:  # a gap: the next slice reads the stretch itself
                continue
            rows = [r for part in reversed(parts) for r in part]
            out[kind] = _Span(since, end, rows, [r.at for r in rows])
        return out

    def _planned_rows(self, kind: str, start: datetime, end: datetime,
                      planned: tuple[datetime, datetime]) -> list[Row]:
        span = self._spans.get(kind)
        if span is None:
            lo = planned[0] if start >= planned[0] else min(start, self._optional[kind])
            rows = self._load(kind, lo, planned[1], self._cohorts)
            span = self._spans[kind] = _Span(lo, planned[1], rows, [r.at for r in rows])
        elif start < span.lo:  # the optional stretch, all of it at once
            lo = min(start, self._optional.get(kind, start))
            rows = self._load(kind, lo, span.lo, self._cohorts) + span.rows
            span = self._spans[kind] = _Span(lo, span.hi, rows, [r.at for r in rows])
        if end > span.hi:  # planned after the first read: load the rest
            rows = span.rows + self._load(kind, span.hi, planned[1], self._cohorts)
            span = self._spans[kind] = _Span(span.lo, planned[1], rows, [r.at for r in rows])
        return span.slice(start, end)

    def _cohorts(self, start: datetime, end: datetime) -> CohortMap:
        """Return the cohort map for rows in [start, end): the planned windows' one, read
        once, when it covers them (an instance's cohort is that of its latest run: an hour
        further back is read)."""
        hour = timedelta(seconds=_HOUR)
        if self._map is None:
            lo = min([*(s for s, _ in self._planned.values()), *self._optional.values()])
            hi = max(e for _, e in self._planned.values())
            self._map = (lo, hi, cohort_map(self.session, lo - hour, hi))
            self.rows_read += len(self._map[2].spans)
        lo, hi, m = self._map
        if lo <= start and end <= hi:
            return m
        m = cohort_map(self.session, start - hour, end)  # planned after the first read
        self.rows_read += len(m.spans)
        return m

    def _load(self, kind: str, start: datetime, end: datetime,
              cohorts: Callable[[datetime, datetime], CohortMap]) -> list[Row]:
        """Return the rows of `kind` in [start, end): those carried from the previous
        slice as they are, the rest read (tagged from `cohorts(start, end)`'s map)."""
        span = self._carried.get(kind)
        if span is None or end <= span.lo or start >= span.hi:
            return self._read(kind, start, end, cohorts(start, end))
        head = self._read(kind, start, span.lo, cohorts(start, span.lo)) \
            if start < span.lo else []
        tail = self._read(kind, span.hi, end, cohorts(span.hi, end)) if end > span.hi else []
        return head + span.slice(max(start, span.lo), min(end, span.hi)) + tail

    def _read(self, kind: str, start: datetime, end: datetime, m: CohortMap) -> list[Row]:
        rows = _LOADERS[kind](self.session, start, end)
        self.rows_read += len(rows)
        out = [Row(r.at, r.labels, r.values, m.cohort_of(r.labels["instance"], r.at))
               for r in rows]
        out.sort(key=lambda r: r.at)  # stable: rows of one time keep the database's order
        return out

    def grouped(self, rule: Rule, kind: str, split: bool, start: datetime,
                end: datetime) -> dict[_Key, dict[datetime, list[Row]]]:
        """Return scope (and cohort) -> cycle start -> rows of [start, end), for `rule`'s
        scopes (kept for the rules that group the same rows alike; read-only)."""
        spec = (kind, rule.window_s, rule.per, tuple(sorted(rule.match.items())), split,
                start, end)
        out = self._grouped.get(spec)
        if out is None:
            out = {}
            for row in self.rows(kind, start, end):
                key = _key(rule, row.labels)
                if key is not None:
                    out.setdefault((key, row.cohort if split else NO_COHORT), {}).setdefault(
                        cycle_start(row.at, rule.window_s), []).append(row)
            self._grouped[spec] = out
        return out

    def cycle_sketches(self, rule: Rule, kind: str, split: bool, field: str, key: _Key,
                       lo: datetime) -> dict[datetime, Sketch]:
        """Return the memo of merged per-cycle sketches of one scope whose rows were read
        from `lo` on (shared by the rules grouping alike this evaluation)."""
        spec = (kind, rule.window_s, rule.per, tuple(sorted(rule.match.items())), split,
                field, key, lo)
        return self._sketches.setdefault(spec, {})

    def once(self, key: Hashable, load: Callable[[], _T]) -> _T:
        """Return `load()` the first time `key` is asked this evaluation, then that value.

        For reads every rule needs (stored baselines, chunked hours): one statement per
        evaluation instead of one per rule. The caller keeps a mutable value current.
        """
        if key not in self._once:
            self._once[key] = load()
        return cast(_T, self._once[key])

    def forget(self) -> None:
        """Drop the `once` values (a rule's savepoint rolled back what they reflected)."""
        self._once.clear()

    def release(self) -> None:
        """Drop the rows read and all built from them (a later read loads its rows again)."""
        # The evaluation's write phase reads more after its last series (incidents, the
        # policy's A/B pairs): held until then, the rows' peak and those reads' added up,
        # and the worker's RSS keeps a peak (CPython's arenas stay where survivors pin them).
        self._cache.clear()
        self._spans.clear()
        self._carried.clear()
        self._grouped.clear()
        self._sketches.clear()
        self._once.clear()

    def since(self, cohort: Cohort, now: datetime) -> datetime | None:
        """Return when `cohort` first probed (read once per evaluation)."""
        if self._since is None:
            self._since = cohort_since(self.session, now)
        return self._since.get(cohort)


def plan_rules(cache: RowCache, rules: Iterable[Rule], now: datetime) -> None:
    """Plan the reads of every rule's detector window at `now` (see RowCache)."""
    for rule in rules:
        start = now - timedelta(seconds=rule.window_s * rule.lookback_cycles)
        starts = cycle_starts(start, now, rule.window_s)
        if not starts:
            continue
        step = timedelta(seconds=rule.window_s)
        first, end = starts[0], starts[-1] + step
        if rule.metric in _SLIDING:
            cache.plan(_SLIDING[rule.metric], first + step - timedelta(seconds=_HOUR), end)
            if _SLIDING[rule.metric] == "compile":
                cache.plan("canary", first, end)
            continue
        kind = series_kind(rule)
        cache.plan(kind, first, end)
        if rule.metric in _SKETCH_METRICS and rule.pool_cycles > 1 \
                and kind in ("canary", "traffic", "burst"):
            cache.plan(kind, first - (rule.pool_cycles - 1) * step, first, optional=True)


def _shared_labels() -> Callable[..., Mapping[str, str]]:
    """Return a maker of label mappings that hands out one mapping per distinct labels:
    a window's thousands of rows carry a few dozen label sets (never mutated)."""
    made: dict[tuple[str, ...], Mapping[str, str]] = {}

    def labels(bucket: str, path: str, decoding: str, instance: str) -> Mapping[str, str]:
        key = (bucket, path, decoding, instance)
        out = made.get(key)
        if out is None:
            out = made[key] = {"bucket": bucket, "path": path, "decoding": decoding,
                               "instance": instance}
        return out
    return labels


# The values each row kind holds (what `aggregate` and the sketch metrics read).
_CANARY = _names("count", "errors", "lat_sketch", "ttft_sketch", "pt_sketch", "padding_waste",
                 "draft_tokens", "accepted", "overflow")
_FAILED_RUN = _names("count", "errors", "failed_runs")
_TRAFFIC = _names("requests", "errors", "rejections", "overflow", "latency_sum", "lat_sketch",
                  "ttft_sketch", "pt_sketch", "ttft_sum", "input_sum", "padded_sum",
                  "output_sum", "draft_tokens", "accepted", "spec_requests")
_BATCH = _names("requests", "latency_sum", "wait_sum", "row_tokens", "decode_s", "lat_sketch")
_COMPILE = _names("recompiles", "failures")
_MEMORY = _names("bytes")


def _canary_rows(session: Session, start: datetime, end: datetime) -> list[Row]:
    labels = _shared_labels()
    out = [
        Row(r.at, labels(r.bucket, r.path, r.decoding, r.instance_id),
            Values(_CANARY, (r.count, r.errors, Stored(r.latency_sketch), Stored(r.ttft_sketch),
                             Stored(r.per_token_sketch), r.padding_waste, r.draft_tokens,
                             r.accepted_tokens, r.count if r.path == "overflow" else 0)))
        for r in queries.canary_cycle_results(session, start, end)
    ]
    # Runs that failed as a whole count as one failed probe each.
    out += [Row(at, labels("", "", "", inst), Values(_FAILED_RUN, (0, 0, 1)))
            for at, inst in queries.failed_cycle_runs(session, start, end)]
    return out


def _traffic_rows(session: Session, start: datetime, end: datetime) -> list[Row]:
    labels = _shared_labels()
    return [
        Row(r.minute, labels(r.bucket, r.path, r.decoding, r.instance_id),
            Values(_TRAFFIC, (r.requests, r.errors, r.rejections, r.overflow, r.latency_sum_s,
                              Stored(r.latency_sketch), Stored(r.ttft_sketch),
                              Stored(r.per_token_sketch), r.ttft_sum_s, r.input_tokens_sum,
                              r.padded_tokens_sum, r.output_tokens_sum, r.draft_tokens,
                              r.accepted_tokens,
                              r.requests if r.decoding == "speculative" else 0)))
        for r in queries.traffic_rollups(session, start, end)
    ]


def _burst_rows(session: Session, start: datetime, end: datetime) -> list[Row]:
    out = []
    for r in queries.burst_runs(session, start, end):
        d = r.details or {}
        if d.get("variant", "optimized") != "optimized":
            continue  # an A/B arm (unbatched) is no regression of the burst itself
        out.append(Row(r.started_at, {"bucket": "", "path": "", "decoding": "", "instance": r.instance_id},
                       {"p99": d.get("latency_p99_s"), "lat_sketch": d.get("latency_sketch"),
                        "requests": r.requests or 0,
                        "rejections": r.rejections or 0, "ok": r.status == "ok"}))
    return out


def _batch_rows(session: Session, start: datetime, end: datetime) -> list[Row]:
    made: dict[tuple[str, str, str, str], Mapping[str, str]] = {}

    def labels(bucket: str, decoding: str, instance: str, batch: str) -> Mapping[str, str]:
        key = (bucket, decoding, instance, batch)
        out = made.get(key)
        if out is None:
            out = made[key] = {"bucket": bucket, "path": "", "decoding": decoding,
                               "instance": instance, "batch": batch}
        return out
    return [
        Row(r.minute, labels(r.bucket, r.decoding, r.instance_id, r.batch),
            Values(_BATCH, (r.requests, r.latency_sum_s, r.queue_wait_sum_s + r.batch_wait_sum_s,
                            r.row_tokens_sum, r.decode_sum_s, Stored(r.latency_sketch))))
        for r in queries.batch_minutes(session, start, end)
    ]


def _compile_rows(session: Session, start: datetime, end: datetime) -> list[Row]:
    labels = _shared_labels()
    return [Row(e.at, labels("", "", "", e.instance_id),
                Values(_COMPILE, (e.recompiles, e.limit_hits + e.failures)))
            for e in queries.compile_events(session, start, end)]


def _memory_rows(session: Session, start: datetime, end: datetime) -> list[Row]:
    labels = _shared_labels()
    return [Row(m.at, labels("", "", "", m.instance_id),
                Values(_MEMORY, (m.cuda_allocated_bytes if m.cuda_allocated_bytes is not None
                                 else m.rss_bytes,)))
            for m in queries.memory_samples(session, start, end)]


def _agreement_loader(source: str) -> Callable[[Session, datetime, datetime], list[Row]]:
    def load(session: Session, start: datetime, end: datetime) -> list[Row]:
        return [Row(*t) for t in quality.agreement_rows(session, start, end, source)]
    return load


_LOADERS = {"canary": _canary_rows, "traffic": _traffic_rows, "burst": _burst_rows,
            "batch": _batch_rows,
            "compile": _compile_rows, "memory": _memory_rows,
            **{kind: _agreement_loader(src) for src, kind in quality.KINDS.items()}}
_SLIDING = {"recompiles_per_hour": "compile", "compile_failures": "compile",
            "memory_growth": "memory"}


# Metrics read from the batch rollups (kind "batch"): see batch_aggregate.
BATCH_METRICS = ("batch_p99_ratio", "queue_wait_share", "step_throughput")


def series_kind(rule: Rule) -> str:
    """Return the RowCache kind `rule`'s series reads."""
    if rule.metric in BATCH_METRICS:
        return "batch"
    return quality.series_kind(rule.metric, rule.source)


def _key(rule: Rule, labels: Mapping[str, str]) -> Labels | None:
    for k, v in rule.match.items():
        if labels.get(k) != v:
            return None
    if any(not labels.get(k) for k in rule.per):
        return None  # run-level rows (failed runs) carry no bucket
    return tuple((k, labels[k]) for k in rule.per)


def series(rule: Rule, cache: RowCache, start: datetime, end: datetime) -> dict[Labels, list[Point]]:
    """Return scope labels -> the per-cycle points of `rule` in [start, end), oldest first."""
    return {labels: pts for (labels, _), pts in _series(rule, cache, start, end, False).items()}


def cohort_series(rule: Rule, cache: RowCache, start: datetime,
                  end: datetime) -> dict[Labels, dict[Cohort, list[Point]]]:
    """Return scope labels -> cohort -> that cohort's per-cycle points in [start, end)."""
    out: dict[Labels, dict[Cohort, list[Point]]] = {}
    for (labels, cohort), pts in _series(rule, cache, start, end, True).items():
        out.setdefault(labels, {})[cohort] = pts
    return out




def read_slices(rule: Rule, session: Session, start: datetime, end: datetime,
                slice_s: float = _HOUR) -> Iterator[tuple[
                    dict[Labels, dict[Cohort, list[Point]]], int]]:
    """Yield `cohort_series` of [start, end) one slice of `slice_s` at a time, with the
    rows that slice read.

    For windows much longer than a detector's (a day of raw cycles, a finished hour): the
    rows held at once stay one slice's however long the window, where one read held all
    of them. The slices are cycle-aligned and each reaches back for pooled cycles as the
    whole window would, so a scope's non-empty points are those of one read; a scope's
    empty cycles appear only in the slices where it has rows, and a cohort new to a scope
    borrows only from cohorts with rows in the same slice. No cycle is held back to
    settle: `end` is the caller's to choose (see `settled_end`).
    """
    for lo, hi, cache in slice_caches(session, start, end, rule.window_s, slice_s,
                                      reach_back(rule)):
        yield cohort_series(rule, cache, lo, hi), cache.rows_read


def reach_back(rule: Rule) -> timedelta:
    """Return how far before a window's first cycle `rule` may read (a pooled quantile's
    older cycles)."""
    if rule.metric not in _SKETCH_METRICS or rule.pool_cycles <= 1:
        return timedelta(0)
    return timedelta(seconds=rule.window_s) * (rule.pool_cycles - 1)


def slice_caches(session: Session, start: datetime, end: datetime, window_s: float,
                 slice_s: float, reach: timedelta) -> Iterator[tuple[datetime, datetime, RowCache]]:
    """Yield each slice of [start, end) (`slice_bounds`) with a RowCache of its own, dropped
    with the slice (its rows, groups and sketches); the rows a slice read within `reach`
    of its end are carried into the next one's cache, whose pooled reach-back needs them.
    """
    carried: dict[str, _Span] | None = None
    for lo, hi in slice_bounds(start, end, window_s, slice_s):
        cache = RowCache(session, carried=carried)
        carried = None
        yield lo, hi, cache
        if reach:
            carried = cache.carry(hi - reach, hi, reached=lo)


def slice_bounds(start: datetime, end: datetime, window_s: float,
                 slice_s: float) -> Iterator[tuple[datetime, datetime]]:
    """Yield [lo, hi) slices of [start, end), each the most whole cycles of `window_s` that
    fit in `slice_s` (at least one), cut at cycle boundaries."""
    width = timedelta(seconds=window_s) * max(1, math.floor(slice_s / window_s))
    lo, hi = start, cycle_start(start, window_s) + width
    while lo < end:
        hi = min(hi, end)
        yield lo, hi
        lo, hi = hi, hi + width


def sliced_cohort_series(rule: Rule, session: Session, start: datetime, end: datetime,
                         slice_s: float = _HOUR) -> tuple[
                             dict[Labels, dict[Cohort, list[Point]]], int]:
    """Return `cohort_series` of [start, end) read `slice_s` at a time (`read_slices`), and
    the most rows one slice read."""
    out: dict[Labels, dict[Cohort, list[Point]]] = {}
    held = 0
    for part, rows in read_slices(rule, session, start, end, slice_s):
        for labels, per_cohort in part.items():
            for cohort, pts in per_cohort.items():
                out.setdefault(labels, {}).setdefault(cohort, []).extend(pts)
        held = max(held, rows)
    return out, held


def row_kind(rule: Rule) -> str:
    """Return the RowCache kind whose rows `rule`'s cycles read (a sliding metric's events)."""
    return _SLIDING.get(rule.metric) or series_kind(rule)


def settled_end(rule: Rule, cache: RowCache, now: datetime) -> datetime:
    """Return the end of the cycles of `rule` that have settled by `now` (`RowCache.settle`)."""
    return settled_by(rule, cache.settle, now)


def settled_by(rule: Rule, settle: Mapping[str, float], now: datetime) -> datetime:
    """Return the end of the cycles of `rule` settled by `now`; `settle`: row kind ->
    seconds, as the evaluation passes it (`RowCache.settle`)."""
    return now - timedelta(seconds=settle.get(row_kind(rule), 0.0))


def judged_cycle(rule: Rule, settle: Mapping[str, float], now: datetime) -> datetime:
    """Return the start of the latest cycle of `rule` an evaluation at `now` judges.

    The last cycle of its series (`_series`: the cycles finished by `settled_by`), the
    one whose breach makes an alert pending (alerts.rules.RuleResult.breaching); a pooled
    quantile's point sits on the same grid.
    """
    return cycle_start(settled_by(rule, settle, now), rule.window_s) \
        - timedelta(seconds=rule.window_s)


def _series(rule: Rule, cache: RowCache, start: datetime, end: datetime,
            split: bool) -> dict[_Key, list[Point]]:
    kind = row_kind(rule)
    # A cycle counts once its rows have all arrived (RowCache.settle).
    starts = cycle_starts(start, settled_end(rule, cache, end), rule.window_s)
    if not starts:
        return {}
    step = timedelta(seconds=rule.window_s)
    if rule.metric in _SLIDING:
        return _sliding(rule, cache, starts, step, split)
    quantile = _SKETCH_METRICS.get(rule.metric) if kind in ("canary", "traffic", "burst") \
        else None
    end = starts[-1] + step
    grouped = cache.grouped(rule, kind, split, starts[0], end)
    lo = starts[0]
    if quantile is not None and rule.pool_cycles > 1 and _short(
            cache, rule, kind, split, grouped, lo, quantile[0], quantile_samples(rule.metric)):
        # A quantile pools the scope's latest cycles (at most rule.pool_cycles) until it
        # rests on the samples it needs (p99: 100): reach back for the oldest cycles, but
        # only when some cycle is short (large cycles read no more than the window).
        lo = starts[0] - (rule.pool_cycles - 1) * step
        older = cache.grouped(rule, kind, split, lo, starts[0])
        # No series starts from older rows: only scopes of the window reach back.
        grouped = {k: {**older.get(k, {}), **by_cycle} for k, by_cycle in grouped.items()}
    out: dict[_Key, list[Point]] = {}
    for full_key, by_cycle in grouped.items():
        pts = []
        # Each cycle's merged sketch, shared by the rules reading the same rows this
        # evaluation (a p50 and a p99 rule, the rollout check): merged once, never mutated.
        parsed = cache.cycle_sketches(rule, kind, split, quantile[0], full_key, lo) \
            if quantile is not None else {}
        others = [(grouped[k], cache.cycle_sketches(rule, kind, split, quantile[0], k, lo))
                  for k in grouped if k[0] == full_key[0] and k != full_key] \
            if quantile is not None and split and rule.pool_cycles > 1 else []
        for s in starts:
            borrowed = 0
            if quantile is not None:
                value, n, borrowed = pooled_quantile(rule, by_cycle, s, step, parsed, others)
            else:
                value, n = aggregate(rule.metric, kind, by_cycle.get(s, []))
            # The cycle's own samples: the detector scores only these (alerts.detection).
            pts.append(Point(at=s, value=value, samples=n,
                             fresh=parsed.get(s) if quantile is not None else None,
                             borrowed=borrowed))
        out[full_key] = pts
    return out


# metric -> (the row's sketch field, quantile) for quantiles read from sketches.
_SKETCH_METRICS: dict[str, tuple[str, float]] = {
    "p50_latency": ("lat_sketch", 0.50), "p95_latency": ("lat_sketch", 0.95),
    "p99_latency": ("lat_sketch", 0.99), "ttft": ("ttft_sketch", 0.95),
    "per_token": ("pt_sketch", 0.50), "burst_p99": ("lat_sketch", 0.99),
}


def _short(cache: RowCache, rule: Rule, kind: str, split: bool,
           grouped: Mapping[_Key, Mapping[datetime, list[Row]]], lo: datetime, field: str,
           need: int) -> bool:
    """Return whether some cycle's rows hold fewer than `need` samples in `field`."""
    for key, by_cycle in grouped.items():
        parsed = cache.cycle_sketches(rule, kind, split, field, key, lo)
        for t in by_cycle:
            if _cycle(parsed, by_cycle, t, field).count < need:
                return True
    return False


def _cycle(parsed: dict[datetime, Sketch], by_cycle: Mapping[datetime, list[Row]],
           t: datetime, field: str) -> Sketch:
    """Return cycle `t`'s merged sketch of `field`, memoized in `parsed`."""
    one = parsed.get(t)
    if one is None:
        one = parsed[t] = merged(_sketch(r, field) for r in by_cycle.get(t, ()))
    return one


_Other = tuple[Mapping[datetime, list[Row]], dict[datetime, Sketch]]


def pooled_quantile(rule: Rule, by_cycle: Mapping[datetime, list[Row]], s: datetime,
                    step: timedelta, parsed: dict[datetime, Sketch] | None = None,
                    others: Sequence[_Other] = ()) -> tuple[float | None, int, int]:
    """Return (quantile, samples, borrowed) of cycle `s` pooled with the scope's previous
    cycles.

    Cycles are merged newest first until the merged sketch holds the samples the
    quantile needs (storage.sketches.min_samples: 100 for a p99) or rule.pool_cycles are
    in; the caller's rule reads `samples` and says insufficient_samples when short.
    `parsed`: the cycles' merged sketches, kept across the calls of one series (each
    cycle's stored sketches are then read once, not once per cycle pooling it).
    `others`: the same scope's other cohorts (their cycles and memos). A cohort new to
    the scope (a rollout) has too few cycles of its own: its pool is topped up with their
    latest samples, newest first, as the merged series would pool them, so a regression
    of the new version is confirmed after as many cycles as any other; its detector still
    scores only its own fresh samples. `borrowed` counts the samples so taken.
    """
    field, q = _SKETCH_METRICS[rule.metric]
    need = quantile_samples(rule.metric)
    if not by_cycle.get(s):
        return None, 0, 0
    cache = {} if parsed is None else parsed
    pool = Sketch()
    for i in range(rule.pool_cycles):
        pool.merge(_cycle(cache, by_cycle, s - i * step, field))
        if pool.count >= need:
            break
    own = pool.count
    if own < need and others:
        for i in range(rule.pool_cycles):
            for other, memo in others:
                pool.merge(_cycle(memo, other, s - i * step, field))
            if pool.count >= need:
                break
    return pool.quantile(q), pool.count, pool.count - own


def _sketch_quantile(metric: str, rows: list[Row]) -> tuple[float | None, int]:
    field, q = _SKETCH_METRICS[metric]
    pool = merged(_sketch(r, field) for r in rows)
    return pool.quantile(q), pool.count


def _sliding(rule: Rule, cache: RowCache, starts: list[datetime], step: timedelta,
             split: bool) -> dict[_Key, list[Point]]:
    kind = _SLIDING[rule.metric]
    hour = timedelta(seconds=_HOUR)
    rows = cache.rows(kind, starts[0] + step - hour, starts[-1] + step)
    grouped: dict[_Key, list[Row]] = defaultdict(list)
    if kind == "compile":
        # No compile event is a count of zero for an instance that is alive (probing).
        for row in cache.rows("canary", starts[0], starts[-1] + step):
            key = _key(rule, row.labels)
            if key is not None:
                grouped.setdefault((key, row.cohort if split else NO_COHORT), [])
    for row in rows:
        key = _key(rule, row.labels)
        if key is not None:
            grouped[key, row.cohort if split else NO_COHORT].append(row)
    out: dict[_Key, list[Point]] = {}
    for full_key, items in grouped.items():
        items.sort(key=lambda r: r.at)
        times = [r.at for r in items]
        pts = []
        for s in starts:
            end = s + step
            inside = items[bisect_left(times, end - hour):bisect_left(times, end)]
            pts.append(Point(s, *_sliding_value(rule.metric, inside)))
        out[full_key] = pts
    return out


def _sliding_value(metric: str, rows: list[Row]) -> tuple[float | None, int]:
    if metric == "recompiles_per_hour":
        return float(sum(r.values["recompiles"] for r in rows)), max(len(rows), 1)
    if metric == "compile_failures":
        return float(sum(r.values["failures"] for r in rows)), max(len(rows), 1)
    # memory_growth: bytes per hour between the first and last sample of the hour.
    if len(rows) < 2:
        return None, len(rows)
    span_h = (rows[-1].at - rows[0].at).total_seconds() / _HOUR
    if span_h <= 0:
        return None, len(rows)
    return (rows[-1].values["bytes"] - rows[0].values["bytes"]) / span_h, len(rows)


def _sum(rows: Iterable[Row], field: str) -> float:
    return float(sum(r.values.get(field) or 0 for r in rows))


def _weighted(rows: list[Row], field: str, weight: str) -> float | None:
    pairs: list[tuple[float, float]] = []
    for r in rows:
        v, w = r.values.get(field), r.values.get(weight) or 0
        if v is not None and w > 0:
            pairs.append((v, w))
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else None


def aggregate(metric: str, kind: str, rows: list[Row]) -> tuple[float | None, int]:
    """Return (value, samples) of one cycle's rows; value None when the cycle is empty."""
    if kind in quality.KINDS.values():
        return quality.aggregate(metric, [dict(r.values) for r in rows])
    if kind == "canary":
        ok = [r for r in rows if r.values.get("count")]
        n = int(sum(r.values["count"] - r.values["errors"] for r in ok))
        if metric == "probe_failures":
            failed = _sum(rows, "errors") + _sum(rows, "failed_runs")
            total = _sum(rows, "count") + _sum(rows, "failed_runs")
            return (failed / total if total else None), int(total)
        if metric in _SKETCH_METRICS:
            # Quantiles of the union: the merged sketch, never a max or mean of parts.
            return _sketch_quantile(metric, ok)
        if metric == "padding_waste":
            return _weighted(ok, "padding_waste", "count"), n
        if metric == "acceptance_rate":
            drafted = _sum(rows, "draft_tokens")
            spec = int(sum(r.values["count"] for r in ok if r.values.get("draft_tokens")))
            return (_sum(rows, "accepted") / drafted if drafted else None), spec
        if metric == "overflow_share":
            total = _sum(ok, "count")
            return (_sum(ok, "overflow") / total if total else None), int(total)
        raise ValueError(f"metric: {metric!r} has no canary series")
    if kind == "traffic":
        n = int(_sum(rows, "requests"))
        if metric in _SKETCH_METRICS:
            return _sketch_quantile(metric, rows)
        if metric == "acceptance_rate":
            drafted = _sum(rows, "draft_tokens")
            return (_sum(rows, "accepted") / drafted if drafted else None), int(
                _sum(rows, "spec_requests"))
        if metric == "overflow_share":
            return (_sum(rows, "overflow") / n if n else None), n
        if metric == "padding_waste":
            padded = _sum(rows, "padded_sum")
            return (1.0 - _sum(rows, "input_sum") / padded if padded else None), n
        if metric == "rejections":
            total = n + _sum(rows, "rejections")
            return (_sum(rows, "rejections") / total if total else None), int(total)
        raise ValueError(f"metric: {metric!r} has no traffic series")
    if kind == "batch":
        return batch_aggregate(metric, rows)
    if kind == "burst":
        if metric == "burst_p99":
            return _sketch_quantile(metric, rows)
        if metric == "rejections":
            total = _sum(rows, "requests")
            return (_sum(rows, "rejections") / total if total else None), int(total)
    raise ValueError(f"metric: {metric!r} has no {kind} series")


def batch_aggregate(metric: str, rows: list[Row]) -> tuple[float | None, int]:
    """Return (value, samples) of one cycle's batch rollup rows.

    batch_p99_ratio: the p99 latency of the largest batch-size class over that of the
        smallest, among the classes whose p99 rests on enough requests (a p99's 100):
        over-batching is the tail rising with the batch size. Samples: the fewer of the two.
    queue_wait_share: (queue wait + wait for the loop) / latency, summed over requests.
    step_throughput: tokens per second of the steps the requests took part in (all rows);
        judged per batch-size class, it falls when a step of the same size got slower.
    """
    n = int(_sum(rows, "requests"))
    if metric == "queue_wait_share":
        latency = _sum(rows, "latency_sum")
        return (_sum(rows, "wait_sum") / latency if latency else None), n
    if metric == "step_throughput":
        seconds = _sum(rows, "decode_s")
        return (_sum(rows, "row_tokens") / seconds if seconds else None), n
    if metric == "batch_p99_ratio":
        need = min_samples(0.99)
        by_class: dict[str, list[Row]] = defaultdict(list)
        for r in rows:
            by_class[r.labels["batch"]].append(r)
        sketches = sorted(((int(c), merged(_sketch(r, "lat_sketch") for r in rs))
                           for c, rs in by_class.items()), key=lambda cs: cs[0])
        enough = [s for _, s in sketches if s.count >= need]
        if len(enough) < 2:
            return None, min((s.count for s in enough), default=0)
        low, high = enough[0].quantile(0.99), enough[-1].quantile(0.99)
        if not low or high is None:
            return None, 0
        return high / low, min(enough[0].count, enough[-1].count)
    raise ValueError(f"metric: {metric!r} has no batch series")
