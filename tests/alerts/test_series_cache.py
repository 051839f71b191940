"""One read per row kind: a planned RowCache slices what per-window reads would return."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

from alerts.rule_file import load_rules
from alerts.rules import Point
from alerts.series import RowCache, cohort_series, plan_rules, reach_back, slice_caches
from tests.alerts.builders import add_cycle, add_traffic

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def _plain(out: Mapping[Any, Mapping[Any, list[Point]]]) -> dict[Any, Any]:
    """Return the series with each point's fresh sketch as (count, bins): comparable."""
    return {k: {c: [(p.at, p.value, p.samples,
                     None if p.fresh is None else (p.fresh.count, p.fresh.bins))
                    for p in pts] for c, pts in per.items()} for k, per in out.items()}


def _valued(out: Mapping[Any, Mapping[Any, list[Point]]]) -> dict[Any, Any]:
    """Return `_plain` without the cycles that have no value."""
    return {k: {c: [p for p in pts if p[1] is not None] for c, pts in per.items()}
            for k, per in _plain(out).items()}


def test_planned_reads_match_per_window_reads_in_one_query_per_kind(
        sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        for i in range(90):
            at = T0 + timedelta(minutes=i)
            add_cycle(s, at + timedelta(seconds=2), {"16": 0.05 + i / 1e4, "64": 0.1},
                      model_version="m1" if i < 75 else "m2")  # a rollout at minute 75
            add_traffic(s, at, "64", requests=3)  # short for a p99: pools reach back
    rules = load_rules()
    now = T0 + timedelta(minutes=90, seconds=30)
    windows = [(r, now - timedelta(seconds=r.window_s * r.lookback_cycles)) for r in rules]
    statements: list[str] = []
    with sessionmaker() as s:
        expected = {r.name: _plain(cohort_series(r, RowCache(s), start, now))
                    for r, start in windows}
        planned = RowCache(s)
        plan_rules(planned, rules, now)
        event.listen(s.get_bind(), "before_cursor_execute",
                     lambda *a: statements.append(a[2]))
        got = {r.name: _plain(cohort_series(r, planned, start, now)) for r, start in windows}
        # A read planned after the first one of its kind still sees every row.
        late = dataclasses.replace(rules[0], lookback_cycles=80)
        planned.plan("canary", now - timedelta(minutes=80), now)
        late_got = _plain(cohort_series(late, planned, now - timedelta(minutes=80), now))
    assert got == expected
    with sessionmaker() as s:
        assert late_got == _plain(cohort_series(late, RowCache(s), now - timedelta(minutes=80),
                                                now))
    assert any(len(v) == 2 for per in got.values() for v in per.values())  # both cohorts
    canary = [q for q in statements if "FROM probe_results" in q]
    traffic = [q for q in statements if "FROM traffic_rollups" in q]
    # The window, then once the older cycles pooled quantiles reach back for; canary: also
    # the late read.
    assert len(traffic) == 2 and len(canary) == 3, (len(traffic), len(canary))


def test_rows_held_share_their_labels_and_keep_sketches_decoded_not_as_text(
        sessionmaker: sessionmaker[Session]) -> None:
    """An evaluation holds every row of its windows at once, and the worker keeps its peak:
    a row's labels are one mapping per distinct label set, its values one tuple, and a
    sketch, once read, is held packed, its stored JSON text let go."""
    import json

    from alerts.series import Stored, Values, _sketch
    from storage.sketches import PackedSketch, Sketch, merged

    with sessionmaker.begin() as s:
        for i in range(6):
            at = T0 + timedelta(minutes=i)
            add_cycle(s, at + timedelta(seconds=2), {"16": 0.05 + i / 1e3, "64": 0.1})
            add_traffic(s, at, "64", requests=3)
    with sessionmaker() as s:
        cache = RowCache(s)
        canary = cache.rows("canary", T0, T0 + timedelta(minutes=6))
        traffic = cache.rows("traffic", T0, T0 + timedelta(minutes=6))
        for rows in (canary, traffic):
            by_labels: dict[tuple[tuple[str, str], ...], set[int]] = {}
            for r in rows:
                by_labels.setdefault(tuple(sorted(r.labels.items())), set()).add(id(r.labels))
            assert len(rows) > len(by_labels)
            assert all(len(ids) == 1 for ids in by_labels.values())
        row = next(r for r in canary if r.labels["bucket"] == "16")
        assert all(isinstance(r.values, Values) for r in (*canary, *traffic))
        assert row.values["count"] == 100 and row.values.get("failed_runs") is None
        stored = row.values["lat_sketch"]
        assert isinstance(stored, Stored)
        text = stored._text
        assert text is not None
        got = _sketch(row, "lat_sketch")
        assert isinstance(got, PackedSketch) and stored._text is None
        want = Sketch.from_json(json.loads(text))
        one = merged([got])
        assert (one.count, one.zeros, one.bins) == (want.count, want.zeros, want.bins)
        # Merged as the JSON form merges, and the held sketch is left as it was.
        both = merged([got, json.loads(text)])
        assert both.count == 2 * want.count and list(got) == list(PackedSketch.of(want))


def test_sliced_reads_carry_the_pooled_reach_back_instead_of_reading_it_again(
        sessionmaker: sessionmaker[Session]) -> None:
    # 4 canaries a cycle: a p99 pools 25 cycles, so every 10-minute slice reaches back 29
    # minutes; a rollout at minute 75 puts a cohort's first cycles inside a slice.
    with sessionmaker.begin() as s:
        for i in range(120):
            add_cycle(s, T0 + timedelta(minutes=i, seconds=2), {"16": 0.05 + i / 1e4, "64": 0.1},
                      model_version="m1" if i < 75 else "m2", count=4)
    rule = {r.name: r for r in load_rules()}["p99_latency_regression"]
    start, end = T0 + timedelta(minutes=40), T0 + timedelta(minutes=120)

    def read(reach: timedelta) -> tuple[dict[Any, dict[Any, list[Point]]], int]:
        out: dict[Any, dict[Any, list[Point]]] = {}
        rows = 0
        with sessionmaker() as s:
            for lo, hi, cache in slice_caches(s, start, end, rule.window_s, 600.0, reach):
                for labels, per in cohort_series(rule, cache, lo, hi).items():
                    for cohort, pts in per.items():
                        out.setdefault(labels, {}).setdefault(cohort, []).extend(pts)
                rows += cache.rows_read
        return out, rows

    assert reach_back(rule) == timedelta(minutes=29)
    carried, carried_rows = read(reach_back(rule))
    again, again_rows = read(timedelta(0))  # each slice reads its reach-back itself
    assert _plain(carried) == _plain(again)
    assert any(p.samples > 4 for per in carried.values() for pts in per.values() for p in pts)
    # 8 slices each read 29 minutes again (two buckets a minute); carried, the window and
    # one reach-back are read once.
    assert again_rows - carried_rows >= 7 * 2 * 20
    assert carried_rows < 2 * (80 + 29) + 50  # plus the cohort maps' spans


def test_a_slice_that_did_not_reach_back_carries_nothing(
        sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        for i in range(-10, 10):
            add_traffic(s, T0 + timedelta(minutes=i), "16")
    lo, hi = T0, T0 + timedelta(minutes=10)
    with sessionmaker() as s:
        cache = RowCache(s)
        window = cache.rows("traffic", lo, hi)
        # No cycle was short: the next slice most likely reads no reach-back either.
        assert cache.carry(hi - timedelta(minutes=12), hi, reached=lo) == {}
        before = cache.rows("traffic", lo - timedelta(minutes=5), lo)
        carried = cache.carry(hi - timedelta(minutes=12), hi, reached=lo)["traffic"]
        kept = [r for r in before if r.at >= hi - timedelta(minutes=12)] + window
        assert len(kept) > len(window) and all(
            a is b for a, b in zip(carried.rows, kept, strict=True))  # the rows read, not copies
        # A stretch the cache did not read whole is read by the next slice itself.
        assert cache.carry(hi - timedelta(minutes=16), hi, reached=lo) == {}


def test_the_row_kinds_of_one_slice_share_its_cohort_map(
        sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        for i in range(10):
            add_cycle(s, T0 + timedelta(minutes=i, seconds=2), {"16": 0.05})
            add_traffic(s, T0 + timedelta(minutes=i), "16")
    lo, hi = T0, T0 + timedelta(minutes=10)
    statements: list[str] = []
    with sessionmaker() as s:
        cache = RowCache(s)
        event.listen(s.get_bind(), "before_cursor_execute", lambda *a: statements.append(a[2]))
        canary, traffic = cache.rows("canary", lo, hi), cache.rows("traffic", lo, hi)
        cache.rows("traffic", lo - timedelta(minutes=5), lo)  # another window: its own map
    assert canary and traffic and {r.cohort for r in canary + traffic} == {("m1", "c1")}
    maps = [q for q in statements if "FROM probe_runs" in q and "GROUP BY" in q]
    assert len(maps) == 2, statements
