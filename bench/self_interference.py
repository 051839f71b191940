"""Self-interference: does the monitor's own history change what it measures?

The real service (`bench.service`: `tailwatch serve` with its worker, built-in model,
shipped rules, policy and intervals, SQLite) runs twice under the same open-loop real
traffic (Poisson, `--rate` per second): once on an empty database, once on 7 days x 4
replicas of history (`storage.synthetic.simulate`, the generator `bench.evaluation`
uses, ending when the service starts), so the worker's evaluation reads and backfills
a week of rows while the serving process probes and serves. Every canary cycle runs
the A/B arms (`probes.ab_share: 1`) so that each bucket gets a paired sample a minute;
halfway through each run a burst probe (`POST /v1/probes/run`, kind burst) runs under
the real traffic.

Compared between the two runs:

    ratio         per bucket, the median over cycles of optimized p50 / direct p50 (the
                  same cycle's canaries, paired); the effect is the largest relative
                  difference over buckets (target <= 3%)
    traffic p99   client-side p99 of the real requests answered 200 (target <= 10%)
    stall         the largest extra wait of a real request: its latency minus its
                  bucket's median in that run (target <= 2x)

and R, the real requests answered 429 that were due while a burst ran (its window from
the service's `tailwatch_probe_*{kind="burst"}` gauges, plus 2 s; both runs; a burst
must shed its own requests, never real ones; target 0). A saturated engine refuses real
requests on its own: each run's line also gives how many 429s the burst window would
hold at the rest of the run's rate. Last line:

    history effect: ratio N%, traffic p99 M%, stall Kx; real requests shed by probes: R

    taskset -c 1 python -m bench.self_interference [--minutes 20] [--rate 3] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import Engine, select

from bench.service import Answer, PoissonTraffic, ServiceProcess, percentile, settings_for
from bench.service_soak import SATURATED_SHARE, Window, answer_counts, burst_windows
from monitor.loopback import WebhookReceiver
from storage.db import make_engine, make_sessionmaker
from storage.migrate import upgrade
from storage.models import ProbeResult, ProbeRun
from storage.synthetic import simulate
from vocab import Variant

INSTANCE = "bench"  # bench.service's instance_id


@dataclass(frozen=True)
class RunResult:
    """What one run of the service measured."""

    name: str
    ratios: dict[str, float]  # bucket -> median paired optimized/direct canary p50
    cycles: int  # canary cycles with both arms
    p99_s: float
    stall_s: float
    ok: int
    rejected_429: int
    rejected_in_burst: int  # 429s to real requests due during the burst window
    expected_in_burst: float  # the same at the rest of the run's 429 rate
    errors: int
    burst: str  # the burst probe's outcome as the API answered it


def fill_history(engine: Engine, end: datetime, *, days: float = 7.0,
                 replicas: int = 4) -> int:
    """Write `days` of synthetic history per replica ending at `end`; return the rows."""
    rows = 0
    for i in range(replicas):
        c = simulate(engine, end - timedelta(days=days), days, instance_id=f"sim-{i + 1}",
                     seed=i)
        rows += c.probe_runs + c.probe_results + c.traffic_rollups + c.memory_samples \
            + c.compile_events
    return rows


def paired_ratios(rows: Iterable[tuple[int, str, str, float | None]]) -> tuple[dict[str, float], int]:
    """Return bucket -> median over cycles of optimized p50 / direct p50, and the cycles.

    `rows` are (run id, bucket, variant, p50 s); a cycle counts for a bucket only when
    both its optimized canaries and its direct arm measured it.
    """
    p50: dict[tuple[int, str], dict[str, float]] = defaultdict(dict)
    for run_id, bucket, variant, value in rows:
        if value is not None and value > 0:
            p50[(run_id, bucket)][variant] = value
    per_bucket: dict[str, list[float]] = defaultdict(list)
    runs = set()
    for (run_id, bucket), arms in p50.items():
        if Variant.OPTIMIZED in arms and Variant.DIRECT in arms:
            per_bucket[bucket].append(arms[Variant.OPTIMIZED] / arms[Variant.DIRECT])
            runs.add(run_id)
    ratios = {b: statistics.median(v) for b, v in per_bucket.items()}
    return dict(sorted(ratios.items(), key=lambda kv: int(kv[0]))), len(runs)


def read_ratios(engine: Engine, instance_id: str = INSTANCE) -> tuple[dict[str, float], int]:
    """Return `paired_ratios` of the instance's stored canary cycles."""
    with make_sessionmaker(engine)() as s:
        rows = s.execute(
            select(ProbeResult.run_id, ProbeResult.bucket, ProbeResult.variant,
                   ProbeResult.p50_s)
            .join(ProbeRun, ProbeRun.id == ProbeResult.run_id)
            .where(ProbeRun.instance_id == instance_id, ProbeRun.kind == "cycle",
                   ProbeRun.status == "ok")).all()
    return paired_ratios(rows)


def largest_stall(answers: Sequence[Answer]) -> float:
    """Return the largest latency over its bucket's median among 200 answers (0 if none)."""
    by_bucket: dict[str, list[float]] = defaultdict(list)
    for a in answers:
        if a.status == 200:
            by_bucket[a.bucket].append(a.latency_s)
    worst = 0.0
    for lat in by_bucket.values():
        worst = max(worst, max(lat) - statistics.median(lat))
    return worst


def measure(name: str, answers: Sequence[Answer], ratios: Mapping[str, float], cycles: int,
            burst: str, windows: Sequence[Window] = ()) -> RunResult:
    """Return a run's result from its real requests' answers and its stored canary ratios."""
    counts = answer_counts(answers, windows)
    ok = [a.latency_s for a in answers if a.status == 200]
    dues = [a.due for a in answers]
    span = max(dues) - min(dues) if dues else 0.0
    inside = sum(hi - lo for lo, hi in windows)
    rest = counts.rejected_429 - counts.rejected_in_bursts
    expected = rest / (span - inside) * inside if span > inside else 0.0
    return RunResult(name=name, ratios=dict(ratios), cycles=cycles,
                     p99_s=percentile(ok, 0.99), stall_s=largest_stall(answers),
                     ok=counts.ok, rejected_429=counts.rejected_429,
                     rejected_in_burst=counts.rejected_in_bursts, expected_in_burst=expected,
                     errors=counts.errors, burst=burst)


def headline(empty: RunResult, history: RunResult) -> str:
    """Return the last line: the history's effect on ratio, p99 and stall; real 429s."""
    common = sorted(set(empty.ratios) & set(history.ratios), key=int)
    ratio = max((abs(history.ratios[b] / empty.ratios[b] - 1) for b in common),
                default=float("nan"))
    p99 = history.p99_s / empty.p99_s - 1 if empty.p99_s > 0 else float("nan")
    stall = history.stall_s / empty.stall_s if empty.stall_s > 0 else float("nan")
    shed = empty.rejected_in_burst + history.rejected_in_burst
    return (f"history effect: ratio {ratio * 100:.1f}%, traffic p99 {p99 * 100:+.1f}%, "
            f"stall {stall:.2f}x; real requests shed by probes: {shed}")


def run_once(name: str, folder: Path, *, minutes: float, rate: float,
             history_days: float, replicas: int) -> RunResult:
    """Run the service once for `minutes` under traffic; return what it measured."""
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / "service.db").exists():
        raise SystemExit(f"--folder: {folder / 'service.db'} exists; choose another folder")
    url = f"sqlite:///{folder / 'service.db'}"
    if history_days > 0:
        db = make_engine(url)
        upgrade(db)
        t0 = time.perf_counter()
        rows = fill_history(db, datetime.now(UTC), days=history_days, replicas=replicas)
        db.dispose()
        print(f"{name}: {rows} rows of history ({history_days:g} days x {replicas} replicas) "
              f"written in {time.perf_counter() - t0:.0f} s", flush=True)
    with WebhookReceiver() as rx:
        settings = settings_for(folder, rx.url, database_url=url,
                                extra={"probes": {"ab_share": 1.0}})
        with ServiceProcess(folder, settings) as svc:
            print(f"{name}: ready; {rate:g} requests/s for {minutes:g} min", flush=True)
            traffic = PoissonTraffic(svc.url, rate_per_s=rate, token=svc.token)
            traffic.start()
            try:
                time.sleep(minutes * 30)
                done = svc.post("/v1/probes/run", {"kind": "burst"})
                burst = f"{done.get('status')} in {done.get('duration_s', 0):.1f} s"
                windows = sorted(burst_windows(svc.metrics()))
                time.sleep(max(0.0, minutes * 30 - float(done.get("duration_s") or 0)))
            finally:
                traffic.stop()
            answers = traffic.drain()
    db = make_engine(url)
    try:
        ratios, cycles = read_ratios(db)
    finally:
        db.dispose()
    result = measure(name, answers, ratios, cycles, burst, windows)
    print(f"{name}: {result.ok} ok, {result.rejected_429} answered 429 ("
          f"{result.rejected_in_burst} due during the burst, {result.expected_in_burst:.1f} "
          f"expected there at the other 429s' rate), {result.errors} "
          f"errors; traffic p99 {result.p99_s * 1e3:.0f} ms, largest stall "
          f"{result.stall_s * 1e3:.0f} ms; burst {burst}; paired cycles {cycles}; "
          "optimized/direct p50: "
          + ", ".join(f"{b} {r:.3f}" for b, r in result.ratios.items()), flush=True)
    total = result.ok + result.rejected_429 + result.errors
    if total and result.rejected_429 / total > SATURATED_SHARE:
        print(f"{name}: saturated: {result.rejected_429 / total:.0%} of the real requests "
              "were answered 429; latencies measure the queue, not the monitor", flush=True)
    return result


def main(argv: Sequence[str] | None = None) -> None:
    """Run the service on an empty database and on a week of history; print the effect."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=20.0, help="traffic per run")
    ap.add_argument("--rate", type=float, default=3.0, help="real requests per second")
    ap.add_argument("--days", type=float, default=7.0)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--quick", action="store_true",
                    help="5 minutes per run on 1 day x 2 replicas of history")
    ap.add_argument("--folder", type=Path, default=None,
                    help="keep databases and logs here (default: a temporary folder)")
    args = ap.parse_args(argv)
    if args.quick:
        args.minutes, args.days, args.replicas = 5.0, 1.0, 2
    if args.minutes <= 0 or args.rate <= 0 or args.days <= 0 or args.replicas < 1:
        raise SystemExit("--minutes, --rate and --days must be > 0, --replicas >= 1")
    with tempfile.TemporaryDirectory(prefix="self-interference-") as tmp:
        root = args.folder or Path(tmp)
        empty = run_once("empty", root / "empty", minutes=args.minutes, rate=args.rate,
                         history_days=0, replicas=0)
        history = run_once("history", root / "history", minutes=args.minutes,
                           rate=args.rate, history_days=args.days, replicas=args.replicas)
    print(headline(empty, history))


if __name__ == "__main__":
    main(sys.argv[1:])
