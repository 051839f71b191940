"""Soak: 2,000 accelerated probe cycles; RSS must plateau and the DB stay within retention.

Engine: probes.fake.FakeEngine (computed latencies, no sleeping, no torch), so the
soak exercises tailwatch's own code: cycle threads, A/B arms, the SQL sink, traffic
rollups and retention. Simulated time advances 15 minutes per cycle (2,000 cycles =
20.8 days, past the 14 raw days of retention); each cycle also records 25 served
requests into the traffic recorder and flushes it, and once per simulated day the
retention job prunes. A/B share 0.25, 4 canaries per bucket, SQLite in a temp dir.

SQLite's page cache lives in the process and fills up to PRAGMA cache_size (storage
sets 16 MiB) while the database grows: bounded, but it would read as growth for the
whole soak. The soak pins it to 2 MiB (SQLite's default) so it fills during warm-up,
and prints SQLite's own heap (sqlite3_memory_used) next to RSS.

Checks: RSS after warm-up (cycle 200) to the end grows < 5%; probe runs kept equal
what 14 days of retention allows. Last line: RSS growth in percent.

    python -m bench.soak [--cycles 2000]
    python -m bench.soak --service [--minutes 120] ...   (the live soak: bench.service_soak)
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psutil
from sqlalchemy import event, func, select

from engine.builtin.task import BYTE_BUCKETS, make_input
from probes.canaries import CanarySuite
from probes.fake import FakeEngine
from probes.prober import Prober
from probes.traffic import TrafficRecorder
from storage import make_engine, make_sessionmaker
from storage.migrate import upgrade
from storage.models import MemorySample, ProbeResult, ProbeRun, TrafficRollup
from storage.retention import prune
from storage.writer import Writer

STEP = timedelta(minutes=15)
RAW_DAYS, ROLLUP_DAYS = 14, 90


class SimClock:
    """Simulated UTC time that the soak advances."""

    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


def suites() -> dict[str, CanarySuite]:
    """Return in-domain and shifted suites with 4 canaries per default bucket."""
    rng = random.Random(0)
    out = {}
    for domain in ("in_domain", "shifted"):
        prompts = tuple(make_input(domain, rng, rng.randint(lo, hi))
                        for lo, hi in BYTE_BUCKETS for _ in range(4))
        out[domain] = CanarySuite(domain, domain, prompts)
    return out


def sqlite_heap() -> int | None:
    """Return SQLite's heap bytes (page cache, statements), or None when unreadable."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("sqlite3")
    if name is None:
        return None
    lib = ctypes.CDLL(name)
    lib.sqlite3_memory_used.restype = ctypes.c_int64
    return int(lib.sqlite3_memory_used())


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:.1f} MiB"


def rss() -> int:
    """Return this process's resident set size in bytes."""
    gc.collect()
    return psutil.Process().memory_info().rss


def main() -> None:
    if "--service" in sys.argv[1:]:
        from bench import service_soak

        service_soak.main([a for a in sys.argv[1:] if a != "--service"])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    args = ap.parse_args()
    clock = SimClock()
    engine = FakeEngine()
    engine.warm_up()
    rng = random.Random(1)
    served_texts = [p for s in suites().values() for p in s.prompts]
    per_day = int(timedelta(days=1) / STEP)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "soak.db"
        db = make_engine(f"sqlite:///{path}")

        @event.listens_for(db, "connect")
        def _small_cache(dbapi_connection: object, _record: object) -> None:
            dbapi_connection.execute("PRAGMA cache_size=-2000")  # type: ignore[attr-defined]

        upgrade(db)
        sessions = make_sessionmaker(db)
        writer = Writer(sessions)  # the service's write path
        prober = Prober(engine, writer, suites(), instance_id="soak", suite="in_domain",
                        canaries_per_bucket=4, ab_share=0.25, rng=rng, clock=clock)
        recorder = TrafficRecorder("soak", clock=clock)
        t0 = time.perf_counter()
        rss_warm = None
        heap_warm = None
        for i in range(args.cycles):
            result = prober.run_cycle("shifted" if i % 2 else "in_domain")
            if result.status != "ok":
                raise SystemExit(f"cycle {i} failed: {result.error}")
            for _ in range(25):
                recorder.record(engine.generate(rng.choice(served_texts)))
            recorder.flush(writer)
            writer.flush(timeout=60)
            if i % per_day == per_day - 1:
                with sessions.begin() as s:
                    prune(s, clock.now, RAW_DAYS, ROLLUP_DAYS)
            clock.now += STEP
            if i + 1 == args.warmup:
                rss_warm = rss()
                heap_warm = sqlite_heap()
        elapsed = time.perf_counter() - t0
        writer.close()
        rss_end = rss()
        heap_end = sqlite_heap()
        with sessions() as s:
            runs = s.scalar(select(func.count()).select_from(ProbeRun)) or 0
            results = s.scalar(select(func.count()).select_from(ProbeResult))
            samples = s.scalar(select(func.count()).select_from(MemorySample))
            rollups = s.scalar(select(func.count()).select_from(TrafficRollup))
        db.dispose()
        size = path.stat().st_size + sum(p.stat().st_size for p in Path(tmp).glob("soak.db-*"))
    assert rss_warm is not None
    allowed = RAW_DAYS * per_day + per_day  # pruned daily: at most one day over
    growth = (rss_end - rss_warm) / rss_warm * 100
    print(f"engine: FakeEngine (computed latencies, no torch); {args.cycles} cycles in "
          f"{elapsed:.1f} s ({elapsed / args.cycles * 1e3:.1f} ms each), simulated "
          f"{args.cycles * STEP / timedelta(days=1):.1f} days")
    print(f"db: {size / 2**20:.1f} MiB; probe_runs {runs} (retention allows <= {allowed}), "
          f"probe_results {results}, memory_samples {samples}, traffic_rollups {rollups}")
    print(f"within retention: {'yes' if runs <= allowed else 'NO'}; "
          f"writes dropped {writer.stats.dropped}, rollups dropped {recorder.dropped}")
    print(f"rss: {rss_warm / 2**20:.1f} MiB after {args.warmup} cycles -> "
          f"{rss_end / 2**20:.1f} MiB at the end; SQLite heap {_mib(heap_warm)} -> "
          f"{_mib(heap_end)}")
    print(f"rss growth: {growth:.2f}%")


if __name__ == "__main__":
    main()
