"""Reported percentiles against the exact ones, through the real recording and read paths.

Two sources are replayed into a fresh SQLite database exactly as production writes them:
  traffic: a week of requests, lognormal per bucket (median 10 / 30 / 80 ms, sigma 0.25)
      with 1% stalls x5..x20, 1 request per minute per bucket on each of 2 replicas,
      recorded by probes.traffic.TrafficRecorder and flushed through storage.writer.Writer;
  canary: a week of canary cycles every 5 minutes, 4 canaries per bucket, latencies
      resampled from the built-in model's recorded cycles (bench/data/canary_noise.json),
      grouped by probes.measure and stored by probes.sink.add_cycle through the Writer.
Reported quantiles are read back by storage.queries.latency (the merged sketches) and
compared with the exact order statistic of the same requests (rank floor(q (n - 1))):
p50/p95/p99 over the last hour, day and week, per bucket and replica, per bucket across
replicas, and across everything. Then known shifts (+5/+10/+20/+30%) are applied to a
copy of one replica's last day (recorded as its own instance) and the reported relative
change of each quantile is printed next to the true one.

The last line is `max relative error: X%` (target <= 1%).

    python -m bench.percentiles [--per-minute 1] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path

import numpy as np

from engine.protocol import GenerateResult
from probes.cycle import CycleResult
from probes.measure import VARIANT_DEFAULT, group
from probes.sink import add_cycle
from probes.traffic import TrafficRecorder
from storage import migrate
from storage.db import make_engine, make_sessionmaker
from storage.queries import latency
from storage.sketches import RELATIVE_ACCURACY
from storage.writer import Writer

NOISE_FILE = Path(__file__).parent / "data" / "canary_noise.json"
T0 = datetime(2026, 11, 2, tzinfo=UTC)
DAYS = 7
MEDIANS = {"16": 0.010, "64": 0.030, "256": 0.080}
REPLICAS = ("r1", "r2")
QS = (0.50, 0.95, 0.99)
SHIFTS = (0.05, 0.10, 0.20, 0.30)
WINDOWS = {"1h": timedelta(hours=1), "1d": timedelta(days=1), "7d": timedelta(days=DAYS)}
END = T0 + timedelta(days=DAYS)


class Clock:
    """The recorder's minute, set by the replay."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


def result(total_s: float, bucket: str, *, canary: bool = False) -> GenerateResult:
    """Return a served request of `total_s` seconds (16 output tokens)."""
    return GenerateResult(
        text="", output_ids=(), input_tokens=int(bucket) // 2, bucket=bucket,
        padded_length=int(bucket), output_tokens=16, path="compiled", decoding="direct",
        queue_wait_s=0.0, encoder_s=0.0, ttft_s=total_s / 8,
        decode_token_s=(total_s / 20,) * 15, total_s=total_s, canary=canary)


def traffic_latency(rng: random.Random, bucket: str) -> float:
    """Return one request's latency: lognormal around the bucket's median, 1% stalled."""
    x = MEDIANS[bucket] * rng.lognormvariate(0.0, 0.25)
    return x * rng.uniform(5.0, 20.0) if rng.random() < 0.01 else x


Exact = dict[tuple[str, str], list[tuple[float, float]]]  # (instance, bucket) -> (t, latency)


def replay_traffic(sessions: Callable, per_minute: int, rng: random.Random) -> Exact:
    """Record a week of traffic (plus the shifted copies) through the production path."""
    exact: Exact = {}
    writer = Writer(sessions, max_pending=100_000)
    clocks = {inst: Clock() for inst in (*REPLICAS, *(f"shift{int(s * 100)}" for s in SHIFTS))}
    recorders = {inst: TrafficRecorder(inst, buffer_max=100_000, clock=clock)
                 for inst, clock in clocks.items()}
    last_day = END - timedelta(days=1)
    try:
        for m in range(DAYS * 24 * 60):
            minute = T0 + timedelta(minutes=m)
            t = (minute - T0).total_seconds()
            for inst in REPLICAS:
                clocks[inst].now = minute
                for bucket in MEDIANS:
                    for _ in range(per_minute):
                        x = traffic_latency(rng, bucket)
                        recorders[inst].record(result(x, bucket))
                        exact.setdefault((inst, bucket), []).append((t, x))
                        if inst == REPLICAS[0] and minute >= last_day:
                            for s in SHIFTS:
                                name = f"shift{int(s * 100)}"
                                clocks[name].now = minute
                                recorders[name].record(result(x * (1 + s), bucket))
            if m % 60 == 59:
                for rec in recorders.values():
                    rec.flush(writer)
        assert writer.flush(timeout=600), "writer did not drain"
        assert writer.stats.failed == 0 and writer.stats.dropped == 0, writer.stats
    finally:
        writer.close()
    return exact


def replay_canaries(sessions: Callable, rng: random.Random) -> Exact:
    """Store a week of canary cycles (recorded latencies, resampled) as the prober does."""
    sample = json.loads(NOISE_FILE.read_text())
    cycles: dict[str, list[list[float]]] = sample["latency_s"]
    exact: Exact = {}
    writer = Writer(sessions, max_pending=100_000)
    try:
        for c in range(DAYS * 24 * 12):
            at = T0 + timedelta(minutes=5 * c, seconds=3)
            t = (at - T0).total_seconds()
            pairs = []
            for bucket, recorded in cycles.items():
                for x in recorded[rng.randrange(len(recorded))]:
                    pairs.append((VARIANT_DEFAULT, result(x, bucket, canary=True)))
                    exact.setdefault(("canary", bucket), []).append((t, x))
            cyc = CycleResult(suite="in_domain", instance_id="canary", started_at=at,
                              finished_at=at + timedelta(seconds=2), status="ok",
                              groups=group(pairs))
            writer.submit(partial(add_cycle, c=cyc))
        assert writer.flush(timeout=600), "writer did not drain"
        assert writer.stats.failed == 0, writer.stats
    finally:
        writer.close()
    return exact


def exact_quantile(xs: np.ndarray, q: float) -> float:
    """Return the order statistic of rank floor(q (n - 1)) (what the sketch estimates)."""
    k = math.floor(q * (len(xs) - 1))
    return float(np.partition(xs, k)[k])


def values(exact: Exact, keys: list[tuple[str, str]], start: datetime) -> np.ndarray:
    """Return the latencies of `keys` at or after `start`."""
    t0 = (start - T0).total_seconds()
    return np.array([x for k in keys for t, x in exact[k] if t >= t0])


def compare(sessions: Callable, exact: Exact, source: str) -> float:
    """Print reported vs exact quantiles per window and scope; return the worst error."""
    worst = 0.0
    instances = sorted({k[0] for k in exact if not k[0].startswith("shift")})
    buckets = sorted({k[1] for k in exact}, key=int)
    scopes: list[tuple[str, list[str] | None, list[str] | None]] = []
    for b in buckets:
        if source == "traffic":
            scopes += [(f"bucket {b} {inst}", [b], [inst]) for inst in instances]
        scopes.append((f"bucket {b}" + (" (replicas merged)" if source == "traffic" else ""),
                       [b], instances))
    scopes.append(("all buckets" + (" and replicas" if source == "traffic" else ""), None,
                   instances))
    print(f"\n{source}: reported (merged sketches) vs exact, relative error per quantile")
    print(f"  {'window':6} {'scope':34} {'n':>7}  " + "  ".join(f"p{int(q * 100):<2} err"
                                                             for q in QS))
    with sessions() as s:
        for wname, span in WINDOWS.items():
            start = END - span
            for name, bs, insts in scopes:
                keys = [k for k in exact if (insts is None or k[0] in insts)
                        and (bs is None or k[1] in bs)]
                xs = values(exact, keys, start)
                got = latency.quantiles(s, start, END, QS, source=source, buckets=bs,
                                        instances=insts)
                assert got.samples == len(xs), (name, got.samples, len(xs))
                errs = []
                for q in QS:
                    want = exact_quantile(xs, q)
                    err = abs(got.values[q] - want) / want  # type: ignore[operator]
                    worst = max(worst, err)
                    errs.append(f"{err:6.3%}")
                print(f"  {wname:6} {name:34} {len(xs):7d}  " + "  ".join(errs))
    return worst


def shifts(sessions: Callable, exact: Exact) -> float:
    """Print reported vs true relative change under known shifts; return the worst gap."""
    start = END - timedelta(days=1)
    worst = 0.0
    print("\nshifts (last day, replica r1 vs the same requests scaled): reported change vs true")
    with sessions() as s:
        for b in sorted(MEDIANS, key=int):
            base = latency.quantiles(s, start, END, QS, buckets=[b], instances=[REPLICAS[0]])
            xs = values(exact, [(REPLICAS[0], b)], start)
            for shift in SHIFTS:
                inst = f"shift{int(shift * 100)}"
                got = latency.quantiles(s, start, END, QS, buckets=[b], instances=[inst])
                cells = []
                for q in QS:
                    true = exact_quantile(xs * (1 + shift), q) / exact_quantile(xs, q) - 1
                    rep = got.values[q] / base.values[q] - 1  # type: ignore[operator]
                    worst = max(worst, abs(rep - true))
                    cells.append(f"p{int(q * 100)} {rep:+.2%} (true {true:+.2%})")
                print(f"  bucket {b:>3} {shift:+.0%}: " + ", ".join(cells))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-minute", type=int, default=1,
                    help="requests per minute per bucket and replica")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/bench.db"
        migrate.upgrade(url)
        engine = make_engine(url)
        try:
            sessions = make_sessionmaker(engine)
            rng = random.Random(args.seed)
            traffic = replay_traffic(sessions, args.per_minute, rng)
            canary = replay_canaries(sessions, rng)
            recorded = time.perf_counter() - t_start
            worst_traffic = compare(sessions, traffic, "traffic")
            worst_canary = compare(sessions, canary, "canary")
            worst_shift = shifts(sessions, traffic)
        finally:
            engine.dispose()
    print(f"\n(recorded in {recorded:.0f} s, ran in {time.perf_counter() - t_start:.0f} s)")
    print(f"worst shift gap: {worst_shift * 100:.2f} points (target <= 1)")
    print(f"sketch relative accuracy: {RELATIVE_ACCURACY:.2%}")
    print(f"max relative error: {max(worst_traffic, worst_canary):.2%}")


if __name__ == "__main__":
    main()
