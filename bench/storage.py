"""Storage benchmark: SQLite and PostgreSQL side by side.

Measures the insert rate of probe results (ORM, one cycle per transaction) and of
traffic rollups (storage.rollups.add_rollups, one minute per transaction, new rows
then adds to existing ones), then the time of the weekly report's reads (storage.queries,
7-day windows, and `collect_week` as a whole) and of two 30-day reads over `--days` of
synthetic history (storage.synthetic). Each query is timed best of three. PostgreSQL runs in a temporary database that is dropped afterwards.

    python -m bench.storage [--days 30] [--no-postgres]

The last line reads `slowest weekly-report query: 0.123 s` (target < 1 s).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from monitor.report.collect import CollectOptions, collect_week
from monitor.report.week import week_of
from storage import migrate, queries
from storage.db import make_engine, make_sessionmaker
from storage.models import ProbeResult, ProbeRun
from storage.queries import week as week_queries
from storage.queries.export import table_frame
from storage.rollups import RollupDelta, RollupKey, add_rollups
from storage.synthetic import DEFAULT_BUCKETS, simulate

PG_ADMIN_URL = os.environ.get(
    "TAILWATCH_TEST_PG_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
START = datetime(2026, 1, 5, tzinfo=UTC)  # a Monday


@contextmanager
def _sqlite() -> Iterator[Engine]:
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'bench.db'}"
        migrate.upgrade(url)
        engine = make_engine(url)
        try:
            yield engine
        finally:
            engine.dispose()


@contextmanager
def _postgres() -> Iterator[Engine]:
    name = f"tailwatch_bench_{uuid.uuid4().hex[:8]}"
    admin = make_engine(PG_ADMIN_URL, connect_timeout_s=5)
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(PG_ADMIN_URL).set(database=name)
    engine = make_engine(url)
    try:
        migrate.upgrade(engine)
        yield engine
    finally:
        engine.dispose()
        with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _insert_probe_results(maker: sessionmaker[Session], cycles: int) -> float:
    """Return probe results inserted per second (one cycle per transaction)."""
    t0 = time.perf_counter()
    for i in range(cycles):
        at = START - timedelta(days=400) + timedelta(minutes=i)
        run = ProbeRun(started_at=at, finished_at=at, instance_id="bench", kind="cycle")
        for b in DEFAULT_BUCKETS:
            run.results.append(ProbeResult(
                at=at, bucket=str(b), path="compiled", decoding="speculative", count=4,
                p50_s=0.01, p95_s=0.02, p99_s=0.03, max_s=0.04, drafts=8, draft_tokens=32,
                accepted_tokens=20, accepted_per_position=[7, 6, 4, 3],
            ))
        with maker.begin() as s:
            s.add(run)
    return cycles * len(DEFAULT_BUCKETS) / (time.perf_counter() - t0)


def _insert_rollups(maker: sessionmaker[Session], minutes: int) -> tuple[float, float]:
    """Return rollup rows per second: created, then added to (one minute per transaction)."""
    delta = RollupDelta.for_request(latency_s=0.2, ttft_s=0.05, input_tokens=40, padded_length=64,
                                    output_tokens=20, drafts=5, draft_tokens=20,
                                    accepted_tokens=12, accepted_per_position=(5, 4, 2, 1))
    rates = []
    for _ in range(2):
        t0 = time.perf_counter()
        for m in range(minutes):
            minute = START - timedelta(days=400) + timedelta(minutes=m)
            items = [(RollupKey(minute, "bench", str(b), "compiled", "speculative"), delta)
                     for b in DEFAULT_BUCKETS]
            with maker.begin() as s:
                add_rollups(s, items)
        rates.append(minutes * len(DEFAULT_BUCKETS) / (time.perf_counter() - t0))
    return rates[0], rates[1]


def report_queries(end: datetime) -> dict[str, Callable[[Session], object]]:
    """Return the reads a weekly report runs (storage.queries), and the whole collection."""
    week = end - timedelta(days=7)
    options = CollectOptions(buckets=tuple(DEFAULT_BUCKETS))
    return {
        "canary p99 frame 7d": lambda s: week_queries.canary_results_frame(
            s, week, end, kind="cycle", variant="optimized"),
        "traffic sums frame 7d": lambda s: week_queries.traffic_sums_frame(s, week, end),
        "input lengths 7d": lambda s: week_queries.input_lengths(s, week, end),
        "memory frame 7d": lambda s: week_queries.memory_frame(s, week, end),
        "compile frame 7d": lambda s: week_queries.compile_frame(s, week, end),
        "collect_week (all reads + pandas)": lambda s: collect_week(
            s, week_of(week), options),
    }


def trend_queries(end: datetime) -> dict[str, Callable[[Session], object]]:
    """Return month-long reads (dashboards, notebooks), timed for reference."""
    month = end - timedelta(days=30)
    return {
        "[30d] acceptance traffic/day": lambda s: queries.acceptance(
            s, month, end, source="traffic", by_day=True),
        "[30d] export traffic_rollups": lambda s: table_frame(s, "traffic_rollups", month),
    }


def _time_queries(maker: sessionmaker[Session],
                  named: dict[str, Callable[[Session], object]]) -> dict[str, float]:
    out = {}
    for name, query in named.items():
        best = float("inf")
        for _ in range(3):
            with maker() as s:
                t0 = time.perf_counter()
                query(s)
                best = min(best, time.perf_counter() - t0)
        out[name] = best
    return out


def run_one(engine: Engine, days: float) -> dict[str, float]:
    """Run every measurement on one database and return name -> value."""
    maker = make_sessionmaker(engine)
    results: dict[str, float] = {}
    results["probe results inserted /s"] = _insert_probe_results(maker, 400)
    created, added = _insert_rollups(maker, 300)
    results["rollup rows created /s"] = created
    results["rollup rows added to /s"] = added
    t0 = time.perf_counter()
    simulate(engine, START, days)
    results[f"bulk-load {days:g} days (s)"] = time.perf_counter() - t0
    if engine.dialect.name == "postgresql":
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("VACUUM ANALYZE"))
    else:
        with engine.begin() as conn:
            conn.exec_driver_sql("ANALYZE")
    end = START + timedelta(days=days)
    for name, seconds in _time_queries(maker, report_queries(end)).items():
        results[f"{name} (s)"] = seconds
    for name, seconds in _time_queries(maker, trend_queries(end)).items():
        results[f"{name} (s)"] = seconds
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a table; return an exit code."""
    parser = argparse.ArgumentParser(prog="python -m bench.storage", description=__doc__)
    parser.add_argument("--days", type=float, default=30.0, help="days of history (30)")
    parser.add_argument("--no-postgres", action="store_true", help="SQLite only")
    args = parser.parse_args(argv)
    columns: dict[str, dict[str, float]] = {}
    with _sqlite() as engine:
        columns["sqlite"] = run_one(engine, args.days)
    if not args.no_postgres:
        with _postgres() as engine:
            columns["postgres"] = run_one(engine, args.days)
    names = list(columns["sqlite"])
    header = f"{'measurement':<40}" + "".join(f"{k:>12}" for k in columns)
    if "postgres" in columns:
        header += f"{'pg/sqlite':>11}"
    print(header)
    for name in names:
        line = f"{name:<40}" + "".join(f"{columns[k][name]:>12.4g}" for k in columns)
        if "postgres" in columns:
            line += f"{columns['postgres'][name] / columns['sqlite'][name]:>11.2f}"
        print(line)
    report = {f"{name} (s)" for name in report_queries(START)}
    slowest = max(v for col in columns.values() for k, v in col.items() if k in report)
    print(f"slowest weekly-report query: {slowest:.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
