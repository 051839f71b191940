"""Synthetic monitoring history in bulk (benchmarks, retention tests, demos).

`simulate(engine, start, days)` writes what one instance records: a canary cycle
every `cycle_minutes` on each bucket (plus an A/B arm every 4th cycle), one
traffic rollup per bucket per minute, one memory sample per cycle and one compile
event per hour. Values are deterministic (seeded) and plausible, not measured.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, func, select

from storage import sketches
from storage.db import compact_json
from storage.models import CompileEvent, MemorySample, ProbeResult, ProbeRun, TrafficRollup

DEFAULT_BUCKETS = (16, 32, 64, 128, 256)
_POOL = 64


@dataclass(frozen=True)
class SimulatedCounts:
    """Rows written per table."""

    probe_runs: int
    probe_results: int
    traffic_rollups: int
    memory_samples: int
    compile_events: int


def _chunks(rows: Iterator[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def simulate(
    engine: Engine,
    start: datetime,
    days: float,
    *,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    cycle_minutes: int = 1,
    instance_id: str = "sim-1",
    seed: int = 0,
    tables: Sequence[str] = ("probes", "rollups", "memory", "compile"),
    chunk_size: int = 5000,
) -> SimulatedCounts:
    """Bulk-insert `days` of history from `start` and return the rows written."""
    rng = random.Random(seed)
    minutes = int(days * 24 * 60)
    cycles = range(0, minutes, cycle_minutes)
    counts = dict.fromkeys(("probe_runs", "probe_results", "traffic_rollups",
                            "memory_samples", "compile_events"), 0)
    sqlite = engine.dialect.name == "sqlite"

    def when(minute: int) -> Any:
        return _driver_value(start + timedelta(minutes=minute), sqlite)

    with engine.begin() as conn:
        first_run = (conn.scalar(select(func.max(ProbeRun.id))) or 0) + 1
    if "probes" in tables:
        runs = ((first_run + i, when(m), when(m), "ok", instance_id, "t5-sim", "c0ffee", "cpu",
                 "in_domain", "cycle") for i, m in enumerate(cycles))
        counts["probe_runs"] = _insert(
            engine, ProbeRun, ("id", "started_at", "finished_at", "status", "instance_id",
                               "model_version", "config_hash", "device", "suite", "kind"),
            runs, chunk_size)
        # Pools of pre-converted rows keep generation cheaper than the inserts.
        plain = [_rows(_results(rng, 0, start, buckets, ab=False), sqlite) for _ in range(_POOL)]
        with_ab = [_rows(_results(rng, 0, start, buckets, ab=True), sqlite) for _ in range(_POOL)]
        cols = plain[0][0]
        results = ((first_run + i, at, *rest)
                   for i, m in enumerate(cycles) for at in (when(m),)
                   for rest in (with_ab if i % 4 == 0 else plain)[rng.randrange(_POOL)][1])
        counts["probe_results"] = _insert(engine, ProbeResult, cols, results, chunk_size)
    if "rollups" in tables:
        pool = {b: [_rows([_rollup(rng, start, instance_id, b)], sqlite) for _ in range(_POOL)]
                for b in buckets}
        cols = pool[buckets[0]][0][0]
        rollups = ((at, *pool[b][rng.randrange(_POOL)][1][0])
                   for m in range(minutes) for at in (when(m),) for b in buckets)
        counts["traffic_rollups"] = _insert(engine, TrafficRollup, cols, rollups, chunk_size)
    if "memory" in tables:
        memory = ((when(m), instance_id, "cpu", 900_000_000 + m * 1000 + rng.randrange(10**6),
                   50_000_000) for m in cycles)
        counts["memory_samples"] = _insert(
            engine, MemorySample, ("at", "instance_id", "device", "rss_bytes", "kv_cache_bytes"),
            memory, chunk_size)
    if "compile" in tables:
        events = ((when(h * 60), instance_id, 0, rng.choice((0, 0, 0, 1)), "{}", 0, "{}", 0.0,
                   0, 0) for h in range(minutes // 60))
        counts["compile_events"] = _insert(
            engine, CompileEvent, ("at", "instance_id", "graphs", "recompiles",
                                   "recompile_reasons", "graph_breaks", "graph_break_reasons",
                                   "compile_seconds", "limit_hits", "failures"),
            events, chunk_size)
    return SimulatedCounts(**counts)


def _rows(rows: Iterator[dict[str, Any]] | list[dict[str, Any]],
          sqlite: bool) -> tuple[tuple[str, ...], list[tuple[Any, ...]]]:
    """Return (columns, value tuples) with the leading time (and run) columns left out."""
    rows = list(rows)
    lead = ("run_id", "at") if "run_id" in rows[0] else ("minute",)
    cols = tuple(c for c in rows[0] if c not in lead)
    return lead + cols, [tuple(_driver_value(r[c], sqlite) for c in cols) for r in rows]


def _insert(engine: Engine, model: type, cols: Sequence[str],
            rows: Iterator[tuple[Any, ...]], size: int) -> int:
    """Insert driver-ready tuples: SQLAlchemy's per-value processing would dominate."""
    n = 0
    table = model.__table__  # type: ignore[attr-defined]
    mark = "?" if engine.dialect.name == "sqlite" else "%s"
    sql = (f"INSERT INTO {table.name} ({', '.join(cols)}) "
           f"VALUES ({', '.join([mark] * len(cols))})")
    for chunk in _chunks(rows, size):
        with engine.begin() as conn:
            conn.exec_driver_sql(sql, chunk)
        n += len(chunk)
    return n


def _driver_value(value: Any, sqlite: bool) -> Any:
    if isinstance(value, datetime):
        # The text format storage.models.UTCDateTime stores on SQLite (naive UTC).
        utc = value.astimezone(UTC)
        return utc.strftime("%Y-%m-%d %H:%M:%S.%f") if sqlite else utc
    if isinstance(value, list | dict):
        return compact_json(value)
    return value


def _results(rng: random.Random, run_id: int, at: datetime, buckets: Sequence[int],
             ab: bool) -> Iterator[dict[str, Any]]:
    for b in buckets:
        variants = ("optimized", "eager") if ab else ("optimized",)
        for variant in variants:
            base = 0.004 * b ** 0.5 * (1.5 if variant == "eager" else 1.0)
            p50 = base * rng.uniform(0.9, 1.1)
            drafts = rng.randint(6, 10)
            accepted = [rng.randint(0, drafts) for _ in range(4)]
            accepted.sort(reverse=True)
            lat = sketches.Sketch.of(p50 * f for f in (0.9, 1.0, 1.1, 1.5))  # the 4 canaries
            yield {
                "latency_sketch": lat.to_json(), "samples": 4,
                "ttft_sketch": sketches.Sketch.of(p50 / 4 * f for f in (0.9, 1.0, 1.1, 1.2))
                .to_json(),
                "per_token_sketch": sketches.Sketch.of([p50 / 32] * 4).to_json(),
                "run_id": run_id, "at": at, "bucket": str(b),
                "path": "compiled" if variant == "optimized" else "eager",
                "decoding": "speculative", "variant": variant, "count": 4, "errors": 0,
                "p50_s": p50, "p95_s": p50 * 1.3, "p99_s": p50 * 1.5, "max_s": p50 * 1.6,
                "ttft_p50_s": p50 / 5, "ttft_p95_s": p50 / 4, "per_token_p50_s": p50 / 32,
                "input_tokens_min": b // 2, "input_tokens_mean": b * 0.7, "input_tokens_max": b,
                "padded_length": b, "padding_waste": 0.3, "output_tokens": 128,
                "drafts": drafts, "draft_tokens": drafts * 4,
                "accepted_tokens": sum(accepted), "accepted_per_position": accepted,
            }


def _rollup(rng: random.Random, minute: datetime, instance_id: str, bucket: int) -> dict[str, Any]:
    requests = rng.randint(5, 30)
    lat = sketches.Sketch()
    inp: list[int] = []
    out: list[int] = []
    lat_sum = 0.0
    in_sum = 0
    for _ in range(requests):
        latency = 0.05 * bucket ** 0.5 * rng.uniform(0.7, 1.6)
        tokens = rng.randint(bucket // 2 + 1, bucket)
        lat.add(latency)
        inp.append(tokens)
        out.append(rng.randint(8, 64))
        lat_sum += latency
        in_sum += tokens
    drafts = requests * 8
    accepted = [int(drafts * p * rng.uniform(0.9, 1.0)) for p in (0.8, 0.6, 0.45, 0.3)]
    return {
        "minute": minute, "instance_id": instance_id, "bucket": str(bucket), "path": "compiled",
        "decoding": "speculative", "requests": requests, "errors": 0, "rejections": 0,
        "overflow": 0, "latency_sum_s": lat_sum, "latency_sketch": lat.to_json(), "ttft_sum_s": lat_sum / 5,
        "input_tokens_sum": in_sum, "padded_tokens_sum": requests * bucket,
        "output_tokens_sum": requests * 32, "input_lens": sketches.lengths_of(inp),
        "output_lens": sketches.lengths_of(out),
        "drafts": drafts, "draft_tokens": drafts * 4, "accepted_tokens": sum(accepted),
        "accepted_per_position": accepted, "probation_requests": 0,
        "probation_draft_tokens": 0, "probation_accepted": 0,
    }
