"""A baseline refresh holds its window's cycles as machine numbers, not objects per cycle.

The worker refreshes every rolling baseline from the hour chunks of its window (7 days);
its peak stays in the process's RSS after the refresh ends (issue 38: the worker's RSS
stepped up at each hour boundary as the window filled).
"""

from __future__ import annotations

import random
import tracemalloc
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from alerts.baselines import CHUNK_SLICE_S, _cycle_values, ensure_chunks
from alerts.rule_file import load_rules, parse_rule
from alerts.series import RowCache, cohort_series
from storage.models import SeriesChunk
from storage.queries import measurements
from storage.queries import series as series_queries
from storage.queries.series import Chunk
from tests.alerts.builders import add_cycle, add_traffic

T0 = datetime(2026, 11, 30, 0, 0, tzinfo=UTC)
HOURS, PER_HOUR = 24, 360  # a day of 10-s cycles
COHORT = ("m1", "c1")
# Four 8-byte columns a cycle, with room for the arrays' growth; a tuple of Python numbers
# per cycle (what the refresh held before) takes several times this.
BYTES_PER_CYCLE = 64


def _store(sm: sessionmaker[Session]) -> None:
    rng = random.Random(0)
    with sm.begin() as s:
        series_queries.add_chunks(s, [
            Chunk("p99", "bucket=64,source=canary", COHORT, T0 + timedelta(hours=h),
                  [[(T0 + timedelta(hours=h, seconds=10 * i)).timestamp(),
                    0.1 * (1 + rng.gauss(0, 0.02)), 4, 0.1] for i in range(PER_HOUR)])
            for h in range(HOURS)])


def test_a_days_chunks_are_read_into_columns(sessionmaker: sessionmaker[Session]) -> None:
    _store(sessionmaker)
    with sessionmaker() as s:
        chunks = series_queries.chunks(s, "p99", {"bucket=64,source=canary"}, {COHORT},
                                       T0, T0 + timedelta(hours=HOURS))
        tracemalloc.start()
        try:
            values = _cycle_values(chunks)
            held = tracemalloc.get_traced_memory()[0]  # what the refresh keeps reading on
        finally:
            tracemalloc.stop()
    col = values[("bucket=64,source=canary", COHORT)]
    assert len(col.values) == HOURS * PER_HOUR
    assert next(iter(col))[2:] == (4, 0.1)
    assert held < HOURS * PER_HOUR * BYTES_PER_CYCLE, held


class _Sizes:
    """Record how many rows each read of `loader` (in storage.queries.measurements)
    returned."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, loader: str) -> None:
        self.sizes: list[int] = []
        real = getattr(measurements, loader)

        def read(session: Session, start: datetime, end: datetime) -> list[Any]:
            rows = real(session, start, end)
            self.sizes.append(len(rows))
            return rows

        monkeypatch.setattr(measurements, loader, read)


def _stored_chunks(s: Session, rule: str) -> dict[tuple[str, datetime], list[list[Any]]]:
    return {(c.scope_key, c.start): c.values for c in s.scalars(
        select(SeriesChunk).where(SeriesChunk.rule == rule, SeriesChunk.scope_key != ""))}


def test_a_finished_hour_is_chunked_a_slice_at_a_time(
        sessionmaker: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch) -> None:
    """The hour's rows are read 10 minutes at a time (issue 38: read whole, a full hour of
    raw rows was the worker's peak, and its RSS kept the arenas of that peak); the chunks
    hold the values one read of the hour gives."""
    rule = parse_rule({"name": "p99", "metric": "p99_latency", "change": "+15%", "for": 3,
                       "min_samples": 2, "lookback": 10, "baseline_window": "2h"})
    rng = random.Random(1)
    with sessionmaker.begin() as s:
        for i in range(60):  # the hour's cycles, and the hour before it is empty
            add_cycle(s, T0 + timedelta(minutes=i, seconds=2),
                      {"16": 0.05 * (1 + rng.gauss(0, 0.05)),
                       "64": 0.1 * (1 + rng.gauss(0, 0.05))}, count=rng.choice([4, 150]))
    now = T0 + timedelta(hours=1, seconds=30)
    with sessionmaker() as s:
        whole = cohort_series(rule, RowCache(s), T0, T0 + timedelta(hours=1))
    reads = _Sizes(monkeypatch, "canary_cycle_results")
    with sessionmaker.begin() as s:
        assert ensure_chunks(s, rule, RowCache(s), now) == 2
    # Two buckets' rows in a slice's cycles, and in those a short cycle's p99 pools.
    held = 2 * (CHUNK_SLICE_S / 60 + rule.pool_cycles)
    assert reads.sizes and max(reads.sizes) <= held < 2 * 60, (reads.sizes, held)
    with sessionmaker() as s:
        stored = _stored_chunks(s, "p99")
    want = {(f"bucket={dict(labels)['bucket']},source=canary", T0): [
        [p.at.timestamp(), p.value, p.samples] for p in pts if p.value is not None]
        for labels, per_cohort in whole.items() for pts in per_cohort.values()}
    assert {k: [v[:3] for v in vals] for k, vals in stored.items()} == want
    assert len(want) == 2 and all(len(v) == 60 for v in want.values())


def test_a_traffic_hour_is_chunked_once_its_last_minute_has_settled(
        sessionmaker: sessionmaker[Session]) -> None:
    """Chunked before its last rollups were flushed, an hour lost its last minute for good
    (the settle held that cycle back, and the hour was never read again)."""
    rule = {r.name: r for r in load_rules()}["traffic_p99_regression"]
    with sessionmaker.begin() as s:
        for i in range(60):
            add_traffic(s, T0 + timedelta(minutes=i), "64", requests=150)
    settle = {"traffic": 25.0}
    end = T0 + timedelta(hours=1)
    with sessionmaker.begin() as s:
        ensure_chunks(s, rule, RowCache(s, settle), end + timedelta(seconds=10))
    with sessionmaker() as s:
        assert _stored_chunks(s, rule.name) == {}  # its last minute may not be flushed yet
    with sessionmaker.begin() as s:
        ensure_chunks(s, rule, RowCache(s, settle), end + timedelta(seconds=30))
    with sessionmaker() as s:
        (values,) = _stored_chunks(s, rule.name).values()
    assert len(values) == 60 and values[-1][0] == (end - timedelta(minutes=1)).timestamp()


def test_the_rules_of_one_kind_share_each_slices_read(
        sessionmaker: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch) -> None:
    """The first call of an evaluation chunks every rule's missing hours in one pass: a
    slice of canary rows is read once for the p99 and p50 rules (as the detector windows
    are, one read per kind); a rule whose read fails gets its error, the others their
    chunks."""
    import alerts.baselines as baselines

    p99, p50 = (parse_rule({"name": n, "metric": m, "change": "+15%", "for": 3,
                            "min_samples": 2, "lookback": 10, "baseline_window": "2h"})
                for n, m in (("p99", "p99_latency"), ("p50", "p50_latency")))
    with sessionmaker.begin() as s:
        for i in range(60):
            add_cycle(s, T0 + timedelta(minutes=i, seconds=2), {"16": 0.05, "64": 0.1})
    now = T0 + timedelta(hours=1, seconds=30)
    reads = _Sizes(monkeypatch, "canary_cycle_results")
    with sessionmaker() as s:
        cache = RowCache(s)
        one = baselines.BaselineWrites()
        assert ensure_chunks(s, p99, cache, now, rules=[p99], writes=one) == 2
    alone = len(reads.sizes)
    assert alone == 12  # the window's two hours, six slices of 10 minutes each
    reads.sizes.clear()
    with sessionmaker() as s:
        cache = RowCache(s)
        both = {r.name: baselines.BaselineWrites() for r in (p99, p50)}
        for r in (p99, p50):
            assert ensure_chunks(s, r, cache, now, rules=[p99, p50], writes=both[r.name]) == 2
    assert len(reads.sizes) == alone
    assert [c.values for c in both["p99"].chunks] == [c.values for c in one.chunks]
    assert {c.rule for c in both["p50"].chunks} == {"p50"} and len(both["p50"].chunks) == 4

    real = baselines.cohort_series

    def failing(rule: Any, *args: Any) -> Any:
        if rule.name == "p50":
            raise RuntimeError("p50's read failed")
        return real(rule, *args)

    monkeypatch.setattr(baselines, "cohort_series", failing)
    with sessionmaker() as s:
        cache = RowCache(s)
        assert ensure_chunks(s, p99, cache, now, rules=[p99, p50],
                             writes=baselines.BaselineWrites()) == 2
        with pytest.raises(RuntimeError, match="p50's read failed"):
            ensure_chunks(s, p50, cache, now, rules=[p99, p50], writes=baselines.BaselineWrites())
