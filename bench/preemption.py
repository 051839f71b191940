"""Real requests under synthetic load, preemption on vs off: latency and queue wait.

    taskset -c 1 python -m bench.preemption [--rate 3] [--seconds 30] [--rounds 4]
        [--max-batch 1] [--quick]

Two engines on the built-in target (or --model-dir), default flags, in this process,
alike but for `engine.preempt_synthetic`. Unbatched by default (`engine.max_batch` 1,
one decode stream: the defaults):
  on: a real request that finds a synthetic one holding the slot takes the extra decode
      row at once, and the synthetic one pauses at its next step boundary
      (engine.admission);
  off: the real request waits until the synthetic one has finished (the rule before
      preemption).
--max-batch N (> 1): both engines batched (`engine.max_batch` N, `batch_window_max_s` 0:
no step waits for arrivals), the scheduler's preemption (engine.scheduler):
  on: a real request that finds synthetic ones holding every row takes the extra row at
      once and joins the running batch at the next step, while one synthetic row pauses
      (its row and state kept) so that a step stays at N rows;
  off: the real request waits until a synthetic row has finished.
Each round runs one engine for --seconds under two loads at once, through the engine's
own interface (`generate(canary=...)`):
  synthetic: one thread per row (max_batch of them; one unbatched), each sending
      `canary=True` requests back to back, cycling over the shipped in-domain canary
      prompts (every bucket; thread k starts k/max_batch of the way round), as a probe
      cycle sends them, together as concurrent as a burst; here without a pause between
      cycles, so synthetic requests hold every row nearly all the time: the case
      preemption is for. One refused (a real request waits) is sent again
      REFUSED_PAUSE_S later, counted as refused.
  real: open loop, Poisson arrivals at --rate per second, in-domain inputs
      (engine.builtin.task.make_input) of sizes drawn uniformly over the buckets, each
      sent by its own thread at its scheduled time; its latency runs from that time, so
      a late send counts (no coordinated omission).
Rounds alternate the arms on, off, off, on, on, off, ... (ABBA), so a drift of the host
over the run falls on both arms; the two rounds of each pair offer the same arrivals and
inputs. The engine of the other arm sits idle meanwhile (memory, no work). Before the
rounds, each engine warms up (batched: every batch-size class of the fixed-row compiled
step, 2 to N rows, and the grouped encoder: engine.warmers; a step never holds more than
N rows, preempting or not), decodes every canary and a few real inputs once, then runs an
untimed round of WARM_ROUND_S at most under the same loads (the extra row's first use;
batched, real rows joining full batches of synthetic ones); the heap is frozen after the
warm passes, as the serving process freezes it once warm (monitor.gc_heap). A compile in a
timed round (the engine's compile counters moved) is said on stderr: that round's
latencies include it.

Printed: a header (max_batch included); per round, then per arm (its rounds pooled; the
arm lines with a max_batch column where N > 1): real requests' p50, p99 and max latency,
their queue wait (GenerateResult.queue_wait_s: arrival to slot) p99 and max, real
requests refused or failed; synthetic requests done, refused, their preempted_s total;
the engine's preemptions (admission_stats: batched, the scheduler's included). Last
line, the on arm's figure over the off arm's (below 1: preemption shortens it), with
` at max_batch N` where N > 1:

    preemption: real p99 Nx, max wait Mx (on / off)

--quick: 2 rounds of 5 s (directions, not results).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bench.throughput import percentile
from engine.builtin.task import MIN_INPUT_BYTES, make_input, read_canaries
from engine.config import MAX_BATCH
from engine.errors import Overloaded
from monitor import gc_heap
from probes import burst

if TYPE_CHECKING:
    from engine.protocol import CompileSnapshot, Engine

ARMS = ("on", "off")
# A refused synthetic request sent again at once would spin beside the real requests (the
# GIL, the core): a probe cycle moves on to its next prompt, a burst to its next arrival.
REFUSED_PAUSE_S = 0.01
# The synthetic threads start this long before the first arrival, so they hold the rows.
LEAD_S = 0.1
# An untimed round of each engine first: the on arm's first preemptions use the extra row
# (its first use), the off arm's first real requests the queue; batched, real rows join
# full batches of synthetic ones.
WARM_ROUND_S = 2.0


@dataclass
class Round:
    """One round of one arm: what its real and synthetic requests measured."""

    arm: str
    latencies: list[float] = field(default_factory=list)  # real, from the scheduled send
    waits: list[float] = field(default_factory=list)  # real, queue_wait_s
    real_failed: int = 0
    synthetic_done: int = 0
    synthetic_refused: int = 0
    preempted_s: float = 0.0  # synthetic requests' pauses, summed
    preemptions: int = 0


@dataclass(frozen=True)
class Summary:
    """One arm's rounds pooled (latencies in seconds; nan: no real request answered)."""

    arm: str
    real: int
    real_failed: int
    p50_s: float
    p99_s: float
    max_s: float
    wait_p99_s: float
    wait_max_s: float
    synthetic_done: int
    synthetic_refused: int
    preempted_s: float
    preemptions: int


def arm_order(rounds: int) -> list[str]:
    """Return the arms of `rounds` rounds in ABBA order: on, off, off, on, on, off, ..."""
    return [ARMS[(i + i // 2) % 2] for i in range(rounds)]


def arrivals(rate: float, seconds: float, seed: int) -> list[float]:
    """Return Poisson arrival offsets in seconds at `rate` per second within `seconds`
    (the burst probe's draw, seeded)."""
    return burst.arrivals(random.Random(seed), rate, seconds)


def real_texts(buckets: Sequence[int], count: int, seed: int) -> list[str]:
    """Return `count` in-domain inputs: a bucket drawn uniformly, a size uniform within it
    (one token a byte, plus EOS)."""
    rng = random.Random(seed)
    sizes, low = [], MIN_INPUT_BYTES
    for edge in buckets:
        sizes.append((low, edge - 1))
        low = edge
    return [make_input("in_domain", rng, rng.randint(*rng.choice(sizes)))
            for _ in range(count)]


def run_round(engine: Engine, arm: str, canaries: Sequence[str], schedule: Sequence[float],
              texts: Sequence[str], new_tokens: int, senders: int = 1) -> Round:
    """Run one round: `senders` threads each sending synthetic requests back to back (one
    per batch row: together they can hold every row) while real request i is sent with
    texts[i] at offset schedule[i]; return what they measured."""
    out = Round(arm)
    lock = threading.Lock()
    stop = threading.Event()
    before = engine.admission_stats().preemptions

    def synthetic(k: int) -> None:
        i = k * len(canaries) // senders  # each sender starts elsewhere in the cycle
        while not stop.is_set():
            try:
                r = engine.generate(canaries[i % len(canaries)], max_new_tokens=new_tokens,
                                    canary=True)
            except Overloaded:
                with lock:
                    out.synthetic_refused += 1
                stop.wait(REFUSED_PAUSE_S)
            else:
                with lock:
                    out.synthetic_done += 1
                    out.preempted_s += r.preempted_s
            i += 1

    def send(i: int, due: float) -> None:
        try:
            r = engine.generate(texts[i], max_new_tokens=new_tokens)
        except Exception:  # noqa: BLE001 - a refused or failed real request counts, not stops
            with lock:
                out.real_failed += 1
            return
        latency = time.perf_counter() - due
        with lock:
            out.latencies.append(latency)
            out.waits.append(r.queue_wait_s)

    background = [threading.Thread(target=synthetic, args=(k,), name=f"bench-synthetic-{k}")
                  for k in range(senders)]
    for thread in background:
        thread.start()
    start = time.perf_counter() + LEAD_S
    threads = []
    for i, offset in enumerate(schedule):
        due = start + offset
        delay = due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        thread = threading.Thread(target=send, args=(i, due), name="bench-real")
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    stop.set()
    for thread in background:
        thread.join()
    out.preemptions = engine.admission_stats().preemptions - before
    return out


def summarize(arm: str, rounds: Sequence[Round]) -> Summary:
    """Return the arm's rounds pooled."""
    mine = [r for r in rounds if r.arm == arm]
    latencies = [x for r in mine for x in r.latencies]
    waits = [x for r in mine for x in r.waits]

    def q(values: list[float], quantile: float) -> float:
        return percentile(values, quantile) if values else math.nan

    return Summary(
        arm=arm, real=len(latencies), real_failed=sum(r.real_failed for r in mine),
        p50_s=q(latencies, 0.5), p99_s=q(latencies, 0.99), max_s=q(latencies, 1.0),
        wait_p99_s=q(waits, 0.99), wait_max_s=q(waits, 1.0),
        synthetic_done=sum(r.synthetic_done for r in mine),
        synthetic_refused=sum(r.synthetic_refused for r in mine),
        preempted_s=sum(r.preempted_s for r in mine),
        preemptions=sum(r.preemptions for r in mine))


def ratio(on: float, off: float) -> float:
    """Return on / off (nan where off is 0 or either is unknown)."""
    return on / off if off > 0 and not math.isnan(on) else math.nan


def report(summaries: dict[str, Summary], max_batch: int = 1) -> list[str]:
    """Return the per-arm table's lines and the last line (batched, max_batch > 1: a
    max_batch column after the arm, and ` at max_batch N` at the end)."""
    batched = max_batch > 1
    column = f" {'max_batch':>9}" if batched else ""
    lines = [f"{'arm':>4}{column} {'real':>5} {'failed':>6} {'p50_ms':>8} {'p99_ms':>8} "
             f"{'max_ms':>8} {'wait_p99_ms':>11} {'wait_max_ms':>11} {'synth_done':>10} "
             f"{'synth_refused':>13} {'preempted_s':>11} {'preemptions':>11}"]
    value = f" {max_batch:>9}" if batched else ""
    for s in summaries.values():
        lines.append(f"{s.arm:>4}{value} {s.real:>5} {s.real_failed:>6} "
                     f"{s.p50_s * 1e3:>8.1f} "
                     f"{s.p99_s * 1e3:>8.1f} {s.max_s * 1e3:>8.1f} "
                     f"{s.wait_p99_s * 1e3:>11.1f} {s.wait_max_s * 1e3:>11.1f} "
                     f"{s.synthetic_done:>10} {s.synthetic_refused:>13} "
                     f"{s.preempted_s:>11.2f} {s.preemptions:>11}")
    on, off = summaries["on"], summaries["off"]
    lines.append(f"preemption: real p99 {ratio(on.p99_s, off.p99_s):.2f}x, max wait "
                 f"{ratio(on.wait_max_s, off.wait_max_s):.2f}x (on / off)"
                 + (f" at max_batch {max_batch}" if batched else ""))
    return lines


def compiles(after: CompileSnapshot, before: CompileSnapshot) -> int:
    """Return the graphs compiled, recompiles and CUDA graphs recorded between two of the
    engine's compile snapshots (0: the round ran warm)."""
    return (after.graphs - before.graphs + after.recompiles - before.recompiles
            + after.cudagraph_recordings - before.cudagraph_recordings)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=3.0, help="real requests per second")
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds a round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds in all (ABBA order)")
    parser.add_argument("--max-batch", type=int, default=1,
                        help="engine.max_batch of both engines (> 1: batched, as many "
                             "synthetic senders)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--compile-mode", default="default", choices=("default", "off"),
                        help="the CUDA-graph modes never preempt: not offered")
    parser.add_argument("--cache-dir", default="var/compile-cache")
    parser.add_argument("--quick", action="store_true",
                        help="2 rounds of 5 s: directions, not results")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds = 2, 5.0
    if args.rate <= 0 or args.seconds <= 0:
        parser.error("--rate and --seconds: must be > 0")
    if args.rounds < 2 or args.new_tokens < 1:
        parser.error("--rounds: must be >= 2 (both arms); --new-tokens: >= 1")
    if not 1 <= args.max_batch <= MAX_BATCH:
        parser.error(f"--max-batch: must be between 1 and {MAX_BATCH}")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(args.cache_dir).resolve()))

    from engine import load_engine
    from engine.config import EngineConfig

    # flags_file "": the engines' own default flags, not a flags file's. Batched, no
    # window: a step never waits for arrivals (the synthetic rows fill it anyway).
    senders = args.max_batch
    configs = {arm: EngineConfig(model_dir=args.model_dir, max_new_tokens=args.new_tokens,
                                 compile_mode=args.compile_mode, cache_dir=args.cache_dir,
                                 flags_file="", preempt_synthetic=arm == "on",
                                 max_batch=args.max_batch, batch_window_max_s=0.0)
               for arm in ARMS}
    engines = {arm: load_engine(config) for arm, config in configs.items()}
    try:
        canaries = [t for t in read_canaries("in_domain") if t.strip()]
        buckets = configs["on"].buckets
        for engine in engines.values():
            engine.warm_up(background=False)
            for text in canaries + real_texts(buckets, 2 * len(buckets), args.seed):
                engine.generate(text, max_new_tokens=args.new_tokens)  # untimed warm pass
        # As the serving process does once its engine is warm (monitor.engine_holder): a full
        # collection of the warm heap would stall whichever requests are in flight.
        gc_heap.freeze()
        for arm, engine in engines.items():
            # At least a few arrivals, whatever --rate: the extra row must be used.
            schedule = arrivals(max(args.rate, 3.0), min(args.seconds, WARM_ROUND_S),
                                args.seed)
            run_round(engine, arm, canaries, schedule,
                      real_texts(buckets, len(schedule), args.seed), args.new_tokens,
                      senders)
        order = arm_order(args.rounds)
        shape = f"{senders} senders " if senders > 1 else ""
        print(f"model {args.model_dir or 'built-in'}, compile {args.compile_mode}, "
              f"max_batch {args.max_batch}, new tokens {args.new_tokens}; real "
              f"{args.rate:g}/s open loop, synthetic {shape}back to back over "
              f"{len(canaries)} canaries; {args.rounds} rounds of {args.seconds:g} s: "
              f"{' '.join(order)}")
        rounds = []
        for i, arm in enumerate(order):
            seed = args.seed + 1 + i // 2  # a pair's two rounds: the same arrivals
            schedule = arrivals(args.rate, args.seconds, seed)
            texts = real_texts(buckets, len(schedule), seed)
            before = engines[arm].compile_snapshot()
            r = run_round(engines[arm], arm, canaries, schedule, texts, args.new_tokens,
                          senders)
            compiled = compiles(engines[arm].compile_snapshot(), before)
            if compiled:
                print(f"round {i + 1} {arm}: {compiled} compile(s) or CUDA graph recording(s) "
                      "in the timed round: its latencies include them", file=sys.stderr)
            rounds.append(r)
            s = summarize(arm, [r])
            print(f"round {i + 1} {arm:>3}: real {s.real} (failed {s.real_failed}), p99 "
                  f"{s.p99_s * 1e3:.1f} ms, max {s.max_s * 1e3:.1f} ms, max wait "
                  f"{s.wait_max_s * 1e3:.1f} ms; synthetic {s.synthetic_done} done, "
                  f"{s.synthetic_refused} refused, preempted {s.preempted_s:.2f} s")
    finally:
        for engine in engines.values():
            engine.close()
    for line in report({arm: summarize(arm, rounds) for arm in ARMS}, args.max_batch):
        print(line)


if __name__ == "__main__":
    main()
