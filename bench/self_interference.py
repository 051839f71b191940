"""Self-interference: does the monitor's own history change what it measures?

The real service (`bench.service`: `tailwatch serve` with its worker, built-in model,
shipped rules, policy and intervals, SQLite) runs in blocks of `--minutes` under the same
open-loop real traffic (Poisson, `--rate` per second), each block a fresh service on a
database of its own, of one of two arms:

    empty     an empty database
    history   7 days x 4 replicas of history (`storage.synthetic.simulate`, the generator
              `bench.evaluation` uses, ending when the block's service starts), so the
              worker's evaluation reads and backfills a week of rows while the serving
              process probes and serves

The arms alternate in rounds, E H then H E (`--rounds 2`: E H H E), so a drift of the
host over the run (a neighbour's load) falls on both arms alike instead of on whichever
ran second. Every canary cycle runs the A/B arms (`probes.ab_share: 1`) so that each
bucket gets its canaries' pairs every minute; halfway through each block a burst probe
(`POST /v1/probes/run`, kind burst) runs under the real traffic.

Compared between the arms, each over all its blocks:

    ratio         per bucket, the median over prompt pairs of optimized / direct latency:
                  one canary prompt's optimized request and its direct arm, run back to
                  back in a random order in one cycle, as the weekly report's speedups
                  pair them (`storage.queries.speedups`, its median and 95% interval);
                  the effect is the largest relative difference over buckets (target
                  <= 3%)
    traffic p99   client-side p99 of the real requests answered 200 (target <= 10%)
    stall         the largest extra wait of a real request: its latency minus its
                  bucket's median in its block (target <= 2x)

Each block is a fresh process, so blocks of one arm differ too (the process, the hour):
one line states the largest such spread of a bucket's ratio, and the next the history's
effect on each bucket's ratio with a 95% interval taken over blocks (each block's median
one observation of its arm: `effect_intervals`), and whether every interval lies within
3%. `--rounds 2` gives each arm two blocks; more rounds narrow the interval.

R counts the real requests answered 429 that were due while a burst ran (its window from
the service's `tailwatch_probe_*{kind="burst"}` gauges, plus 2 s; every block; a burst
must shed its own requests, never real ones; target 0). A saturated engine refuses real
requests on its own: each block's line also gives how many 429s the burst window would
hold at the rest of the block's rate. `--set KEY=VALUE` (repeatable; a JSON value, else text) changes
one setting of the service under test in every block, e.g. `--set worker.nice=0`. Last
line:

    history effect: ratio N%, traffic p99 M%, stall Kx; real requests shed by probes: R

    taskset -c 1 python -m bench.self_interference [--rounds 2] [--minutes 10] [--rate 3]
        [--quick] [--set worker.nice=0]
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, case, func, select

from bench.service import (
    Answer,
    PoissonTraffic,
    ServiceProcess,
    percentile,
    settings_for,
    stop_on_sigterm,
)
from bench.service_soak import SATURATED_SHARE, Window, answer_counts, burst_windows
from monitor.loopback import WebhookReceiver
from monitor.settings import Settings, check_keys
from storage.db import make_engine, make_sessionmaker
from storage.migrate import upgrade
from storage.models import ProbeResult, ProbeRun
from storage.queries.speedups import PairRecord, load_pairs, median_ci
from storage.synthetic import simulate
from vocab import Variant

INSTANCE = "bench"  # bench.service's instance_id
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
EMPTY, HISTORY = "empty", "history"


@dataclass(frozen=True)
class Block:
    """What one block (a fresh service on a database of its own) recorded."""

    arm: str  # EMPTY or HISTORY
    answers: tuple[Answer, ...]
    samples: dict[str, list[float]]  # bucket -> optimized/direct latency, one per prompt pair
    cycles: int  # canary cycles with both arms
    windows: tuple[Window, ...]  # the burst's window(s)
    burst: str  # the burst probe's outcome as the API answered it
    # bucket -> the optimized canaries' decoding: (speculative share of results, mean
    # draft length k): what the engine chose in this process, which moves its ratio.
    decoding: dict[str, tuple[float, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class RunResult:
    """What one arm measured over its blocks."""

    name: str
    blocks: int
    ratios: dict[str, float]  # bucket -> median optimized/direct latency over prompt pairs
    ci: dict[str, tuple[float | None, float | None]]  # bucket -> the median's 95% interval
    cycles: int  # canary cycles with both arms
    p99_s: float
    stall_s: float
    ok: int
    rejected_429: int
    rejected_in_burst: int  # 429s to real requests due during the burst windows
    expected_in_burst: float  # the same at the rest of each block's 429 rate
    errors: int
    burst: str  # the burst probes' outcomes, block by block


def block_order(rounds: int) -> list[str]:
    """Return the blocks' arms: rounds alternate E H and H E (2 rounds: E H H E)."""
    if rounds < 1:
        raise ValueError(f"rounds: must be >= 1, got {rounds}")
    return [arm for r in range(rounds)
            for arm in ((EMPTY, HISTORY) if r % 2 == 0 else (HISTORY, EMPTY))]


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


def paired_samples(pairs: Iterable[PairRecord]) -> tuple[dict[str, list[float]], int]:
    """Return bucket -> optimized / direct latency per prompt pair, and the cycles.

    The pairs the weekly report's speedups read (`storage.queries.speedups`): one
    prompt's optimized request and its direct arm, back to back in one cycle. A pair
    counts only when both succeeded.
    """
    per_bucket: dict[str, list[float]] = defaultdict(list)
    runs = set()
    for p in pairs:
        opt, arm = p.latency_s.get(Variant.OPTIMIZED), p.latency_s.get(Variant.DIRECT)
        if isinstance(opt, int | float) and isinstance(arm, int | float) and opt > 0 and arm > 0:
            per_bucket[p.bucket].append(opt / arm)
            runs.add(p.run_id)
    return dict(per_bucket), len(runs)


def medians(samples: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Return bucket -> median of its ratios as the speedups take it, buckets ascending."""
    return {b: median_ci(v)[0]
            for b, v in sorted(samples.items(), key=lambda kv: int(kv[0])) if v}


def intervals(samples: Mapping[str, Sequence[float]]
              ) -> dict[str, tuple[float | None, float | None]]:
    """Return bucket -> the 95% confidence interval of its median (None: under 6 ratios)."""
    return {b: median_ci(v)[1:]
            for b, v in sorted(samples.items(), key=lambda kv: int(kv[0])) if v}


def read_decoding(engine: Engine, instance_id: str = INSTANCE
                  ) -> dict[str, tuple[float, float]]:
    """Return bucket -> (speculative share, mean draft length) of the optimized canaries."""
    r = ProbeResult
    stmt = (select(r.bucket, func.count(), func.sum(case((r.decoding == "speculative", 1),
                                                         else_=0)),
                   func.sum(r.drafts), func.sum(r.draft_tokens))
            .join(ProbeRun, ProbeRun.id == r.run_id)
            .where(ProbeRun.kind == "cycle", ProbeRun.instance_id == instance_id,
                   r.variant == Variant.OPTIMIZED)
            .group_by(r.bucket))
    with make_sessionmaker(engine)() as s:
        rows = s.execute(stmt).all()
    return {b: (spec / n if n else 0.0, tokens / drafts if drafts else 0.0)
            for b, n, spec, drafts, tokens in sorted(rows, key=lambda row: int(row[0]))}


def read_samples(engine: Engine, instance_id: str = INSTANCE
                 ) -> tuple[dict[str, list[float]], int]:
    """Return `paired_samples` of the instance's stored A/B cycles."""
    with make_sessionmaker(engine)() as s:
        pairs = load_pairs(s, EPOCH, datetime.now(UTC) + timedelta(days=1),
                           instance_id=instance_id)
    return paired_samples(pairs)


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


def expected_in_windows(answers: Sequence[Answer], windows: Sequence[Window],
                        rejected_outside: int) -> float:
    """Return the 429s the windows would hold at the rate of those outside them."""
    dues = [a.due for a in answers]
    span = max(dues) - min(dues) if dues else 0.0
    inside = sum(hi - lo for lo, hi in windows)
    return rejected_outside / (span - inside) * inside if span > inside else 0.0


def measure(name: str, blocks: Sequence[Block]) -> RunResult:
    """Return an arm's result over its blocks: answers pooled, stalls and 429s per block."""
    ok: list[float] = []
    samples: dict[str, list[float]] = defaultdict(list)
    totals = [0, 0, 0, 0]  # ok, 429, 429 in bursts, errors
    expected = stall = 0.0
    for b in blocks:
        counts = answer_counts(b.answers, b.windows)
        ok += [a.latency_s for a in b.answers if a.status == 200]
        for bucket, values in b.samples.items():
            samples[bucket] += values
        for i, v in enumerate((counts.ok, counts.rejected_429, counts.rejected_in_bursts,
                               counts.errors)):
            totals[i] += v
        expected += expected_in_windows(b.answers, b.windows,
                                        counts.rejected_429 - counts.rejected_in_bursts)
        stall = max(stall, largest_stall(b.answers))  # against its own block's medians
    return RunResult(name=name, blocks=len(blocks), ratios=medians(samples),
                     ci=intervals(samples),
                     cycles=sum(b.cycles for b in blocks), p99_s=percentile(ok, 0.99),
                     stall_s=stall, ok=totals[0], rejected_429=totals[1],
                     rejected_in_burst=totals[2], expected_in_burst=expected,
                     errors=totals[3], burst="; ".join(b.burst for b in blocks))


def block_spread(blocks: Mapping[str, Sequence[Block]]) -> tuple[float, str, str] | None:
    """Return the largest difference between two blocks of one arm, bucket by bucket
    (their median ratios, the larger over the smaller, minus 1), with its bucket and
    arm; None where no arm has two blocks.

    Each block is a fresh process: what differs between blocks of the same arm is the
    process and the hour, not the history, so a history effect below it is not resolved.
    """
    worst: tuple[float, str, str] | None = None
    for arm, arm_blocks in blocks.items():
        per_block = [medians(b.samples) for b in arm_blocks]
        for bucket in {b for m in per_block for b in m}:
            values = [m[bucket] for m in per_block if bucket in m]
            if len(values) < 2 or min(values) <= 0:
                continue
            spread = max(values) / min(values) - 1
            if worst is None or spread > worst[0]:
                worst = (spread, bucket, arm)
    return worst


def spread_line(spread: tuple[float, str, str] | None) -> str:
    """Return the line that states the blocks' own spread (the effect's resolution)."""
    if spread is None:
        return "between blocks of one arm: one block per arm, no spread to compare"
    value, bucket, arm = spread
    return (f"between blocks of one arm: up to {value * 100:.1f}% (bucket {bucket}, {arm}); "
            "a history effect on the ratio below this is not resolved")


# Two-sided 95% quantiles of Student's t by degrees of freedom (more: the normal's, widened).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228}


def effect_intervals(blocks: Mapping[str, Sequence[Block]]
                     ) -> dict[str, tuple[float, float, float]]:
    """Return bucket -> the history's effect on its ratio with a 95% interval, from the
    blocks: (history / empty - 1, low, high), for buckets with two blocks in an arm.

    Each block's median ratio is one observation of its arm (a fresh process: the
    process and the hour vary between blocks, so the pairs of one block are not
    independent draws of the arm). On their logs: the arms' mean difference, its standard
    error from the pooled spread of blocks within each arm, and t with nE + nH - 2
    degrees of freedom.
    """
    logs: dict[str, dict[str, list[float]]] = {}
    for arm in (EMPTY, HISTORY):
        for b in blocks.get(arm, ()):
            for bucket, m in medians(b.samples).items():
                if m > 0:
                    logs.setdefault(bucket, {EMPTY: [], HISTORY: []})[arm].append(math.log(m))
    out: dict[str, tuple[float, float, float]] = {}
    for bucket, by_arm in sorted(logs.items(), key=lambda kv: int(kv[0])):
        e, h = by_arm[EMPTY], by_arm[HISTORY]
        df = len(e) + len(h) - 2
        if not e or not h or df < 1:
            continue
        ss = sum((x - statistics.fmean(e)) ** 2 for x in e) \
            + sum((x - statistics.fmean(h)) ** 2 for x in h)
        se = math.sqrt(ss / df * (1 / len(e) + 1 / len(h)))
        d = statistics.fmean(h) - statistics.fmean(e)
        t = _T95.get(df, 1.96 + 2.5 / df)
        out[bucket] = (math.exp(d) - 1, math.exp(d - t * se) - 1, math.exp(d + t * se) - 1)
    return out


def effect_line(effects: Mapping[str, tuple[float, float, float]],
                target: float = 0.03) -> str:
    """Return the line that states the ratio's history effect with its interval, and
    whether every bucket's interval lies within +-target (the effect resolved there)."""
    if not effects:
        return "history effect on the ratio, 95% over blocks: needs two blocks in an arm"
    bucket, (v, lo, hi) = max(effects.items(), key=lambda kv: abs(kv[1][0]))
    widest = max(max(-lo, hi) for _, lo, hi in effects.values())
    verdict = (f"within {target * 100:.0f}% in every bucket" if widest <= target else
               f"not resolved at {target * 100:.0f}% (intervals reach {widest * 100:.1f}%)")
    return (f"history effect on the ratio, 95% over blocks: largest {v * 100:+.1f}% "
            f"[{lo * 100:+.1f}%, {hi * 100:+.1f}%] (bucket {bucket}); {verdict}")


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


@dataclass(frozen=True)
class Plan:
    """How every block runs: its length, traffic, history and settings overrides."""

    minutes: float
    rate: float
    days: float
    replicas: int
    overrides: Mapping[str, Any]  # settings sections merged over the bench's own


def _prepare(label: str, arm: str, folder: Path, plan: Plan) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / "service.db").exists():
        raise SystemExit(f"--folder: {folder / 'service.db'} exists; choose another folder")
    url = f"sqlite:///{folder / 'service.db'}"
    if arm == HISTORY:
        db = make_engine(url)
        upgrade(db)
        t0 = time.perf_counter()
        rows = fill_history(db, datetime.now(UTC), days=plan.days, replicas=plan.replicas)
        db.dispose()
        print(f"{label}: {rows} rows of history ({plan.days:g} days x {plan.replicas} "
              f"replicas) written in {time.perf_counter() - t0:.0f} s", flush=True)
    return url


def run_block(label: str, arm: str, folder: Path, plan: Plan) -> Block:
    """Run a fresh service of `arm` for `plan.minutes` under traffic; return what it recorded."""
    url = _prepare(label, arm, folder, plan)
    with WebhookReceiver() as rx:
        # Flags a block's policy flipped must not carry into the next block's engine.
        own = {"probes": {"ab_share": 1.0},
               "engine": {"flags_file": str(folder / "last-flags.json")}}
        extra = merged(own, plan.overrides)
        settings = settings_for(folder, rx.url, database_url=url, extra=extra)
        with ServiceProcess(folder, settings) as svc:
            print(f"{label}: ready; {plan.rate:g} requests/s for {plan.minutes:g} min",
                  flush=True)
            traffic = PoissonTraffic(svc.url, rate_per_s=plan.rate, token=svc.token)
            traffic.start()
            try:
                time.sleep(plan.minutes * 30)
                done = svc.post("/v1/probes/run", {"kind": "burst"})
                burst = f"{done.get('status')} in {done.get('duration_s', 0):.1f} s"
                windows = tuple(sorted(burst_windows(svc.metrics())))
                time.sleep(max(0.0, plan.minutes * 30 - float(done.get("duration_s") or 0)))
            finally:
                traffic.stop()
            answers = tuple(traffic.drain())
    db = make_engine(url)
    try:
        samples, cycles = read_samples(db)
        decoding = read_decoding(db)
    finally:
        db.dispose()
    block = Block(arm=arm, answers=answers, samples=samples, cycles=cycles, windows=windows,
                  burst=burst, decoding=decoding)
    report(label, measure(arm, [block]))
    print(f"{label}: optimized canaries' decoding, speculative share / mean k: "
          + ", ".join(f"{b} {share:.0%}/{k:.1f}" for b, (share, k) in decoding.items()),
          flush=True)
    return block


def report(label: str, r: RunResult) -> None:
    """Print one block's or one arm's line (and say so when the engine was saturated)."""
    print(f"{label}: {r.ok} ok, {r.rejected_429} answered 429 ({r.rejected_in_burst} due "
          f"during the burst, {r.expected_in_burst:.1f} expected there at the other 429s' "
          f"rate), {r.errors} errors; traffic p99 {r.p99_s * 1e3:.0f} ms, largest stall "
          f"{r.stall_s * 1e3:.0f} ms; burst {r.burst}; paired cycles {r.cycles}; "
          "optimized/direct per prompt pair, median [95% interval]: "
          + ", ".join(f"{b} {v:.3f}{_interval(r.ci.get(b))}" for b, v in r.ratios.items()),
          flush=True)
    total = r.ok + r.rejected_429 + r.errors
    if total and r.rejected_429 / total > SATURATED_SHARE:
        print(f"{label}: saturated: {r.rejected_429 / total:.0%} of the real requests were "
              "answered 429; latencies measure the queue, not the monitor", flush=True)


def _interval(ci: tuple[float | None, float | None] | None) -> str:
    if ci is None or ci[0] is None or ci[1] is None:
        return ""
    return f" [{ci[0]:.3f}, {ci[1]:.3f}]"


def merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Return `base` with `over` merged into it, nested mappings key by key."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def _value(text: str) -> Any:
    # JSON where it parses (0, false, [16, 32]), else the text: YAML would read "off" as false.
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_sets(items: Sequence[str]) -> dict[str, Any]:
    """Return `--set section.key=value` items as nested settings; SystemExit names a bad one."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--set: expected KEY=VALUE, got {item!r}")
        value: Any = _value(text)
        for part in reversed(key.strip().split(".")):
            value = {part: value}
        out = merged(out, value)
    try:
        check_keys(out, Settings)
    except ValueError as exc:
        raise SystemExit(f"--set: {exc}") from None
    return out


def run_blocks(root: Path, rounds: int, plan: Plan
               ) -> tuple[RunResult, RunResult, dict[str, list[Block]]]:
    """Run the blocks in their alternating order; return each arm's result and the
    blocks by arm."""
    blocks: dict[str, list[Block]] = {EMPTY: [], HISTORY: []}
    order = block_order(rounds)
    for i, arm in enumerate(order, 1):
        label = f"block {i}/{len(order)} {arm}"
        blocks[arm].append(run_block(label, arm, root / f"{i}-{arm}", plan))
    empty, history = measure(EMPTY, blocks[EMPTY]), measure(HISTORY, blocks[HISTORY])
    for r in (empty, history):
        report(f"{r.name} ({r.blocks} blocks)", r)
    return empty, history, blocks


def main(argv: Sequence[str] | None = None) -> None:
    """Run empty and history blocks alternately; print the history's effect."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds of two blocks, E H then H E (2: E H H E)")
    ap.add_argument("--minutes", type=float, default=10.0, help="traffic per block")
    ap.add_argument("--rate", type=float, default=3.0, help="real requests per second")
    ap.add_argument("--days", type=float, default=7.0)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--quick", action="store_true",
                    help="2.5 minutes per block on 1 day x 2 replicas of history")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting of the service under test, e.g. worker.nice=0")
    ap.add_argument("--folder", type=Path, default=None,
                    help="keep databases and logs here (default: a temporary folder)")
    args = ap.parse_args(argv)
    if args.quick:
        args.minutes, args.days, args.replicas = 2.5, 1.0, 2
    if args.minutes <= 0 or args.rate <= 0 or args.days <= 0 or args.replicas < 1 \
            or args.rounds < 1:
        raise SystemExit("--minutes, --rate and --days must be > 0, --replicas and "
                         "--rounds >= 1")
    plan = Plan(minutes=args.minutes, rate=args.rate, days=args.days,
                replicas=args.replicas, overrides=parse_sets(args.sets))
    signal.signal(signal.SIGTERM, stop_on_sigterm)  # a stopped bench stops its service
    with tempfile.TemporaryDirectory(prefix="self-interference-") as tmp:
        empty, history, blocks = run_blocks(args.folder or Path(tmp), args.rounds, plan)
    print(spread_line(block_spread(blocks)))
    print(effect_line(effect_intervals(blocks)))
    print(headline(empty, history))


if __name__ == "__main__":
    main(sys.argv[1:])
