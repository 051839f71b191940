"""Batched vs unbatched throughput: closed loop and open loop (Poisson), one process.

    taskset -c 1 python -m bench.throughput [--requests 64] [--new-tokens 64]

Two engines on the built-in target (or --model-dir), default flags (speculation where
the engine chooses it): `engine.max_batch` --max-batch (batched) and 1 (unbatched, one
decode stream). Both serve the same in-domain canaries; every output of the batched
engine is compared with the unbatched one's (`output differences` must be 0): once each
input alone, and then every request of every measurement under load (a column per closed
loop, and a line for the open loops), against the unbatched engine's alone.
--quantization int8: both engines load the int8 target (its encoder int8 too) and serve
every request with it, as `engine.quantization: int8` does by default.

(1) Closed loop: C callers at once for C in --callers, each sending its next request when
the last returned: requests per second per engine and the ratio. Each C is measured in
--rounds rounds (default 3), every engine once a round, their order reversed each round:
a rate is its median over the rounds, and a ratio (batched against unbatched, against
CTranslate2) is the median of the rounds' own ratios with their range in brackets, so a
host whose speed drifts between two engines' runs shows as a wide range, not as a
result. With CTranslate2
installed (the `bench` extra, `make bench-deps`; --no-ct2 leaves it out): the same
weights converted once into --ct2-dir (bench.ct2), float32 and int8, one thread, in this
process, the same requests in one `translate_batch` with `max_batch_size` C (greedy, the
same max new tokens): requests per second, and its outputs compared token for token with
the unbatched engine's; then the batched engine at the most callers against CTranslate2
float32 at that batch size and int8 at its best.
(2) Open loop: Poisson arrivals at a sweep of offered rates, multiples of the unbatched
engine's measured closed-loop one-caller throughput (its capacity with one decode stream),
from well below it upward (--rates); each request is sent by its own thread at its
scheduled time and its latency runs from that scheduled time (no coordinated omission).
A request's slowdown is its latency over the same input's unloaded latency on the same
engine: the median of --unloaded-repeats requests each sent to an idle engine, --idle-s
after the one before finished. Unloaded means no other load, and an engine with none is
idle between requests: on these hosts a request that finds the engine idle takes 10-40%
longer than one sent back to back (its weights left the caches the core shares), and the
open loop's low rates are made of such requests. Requests sent back to back are a closed
loop at full use of one decode stream, not an unloaded engine; their latencies are printed
beside (`back to back`). The p99 slowdown of --requests more sent the same way (an idle
pause before each) is printed as the floor the host's own jitter sets (where it is near 2,
no rate can be within the limit). Each p99 slowdown comes with its 95% interval (two
order statistics; distribution-free), and a rate is `within` the limit (the interval at or
under 2, no errors), `past` it (the interval above 2, or errors) or `unresolved` (the
interval spans 2: more requests would tell; below about 370 requests no value bounds a p99
from above, so no rate is shown within). The p99 limit of an engine, sweeping upward to
the first rate shown past it: at least the highest rate below that shown within, and below
that one (where no rate is shown within, half the lowest, down to an eighth); p50 / p99
latency and p99 slowdown at 50% and 80% of its lower bound. Each rate's line also gives
the share of its requests sent while another was in flight (`busy at arrival`: they
waited for it or shared its steps) and the p99 slowdown of the rest, which found the
engine idle: once that share passes 1%, the p99 is made of requests that met another.
Where requests stepped with others (the batched engine), a line splits them by the most
rows they stepped with (1, 2, 3-4, ... : GenerateResult.batch_size_max) with each bin's
p50 slowdown: where a step over B rows costs what the rows cost one at a time, a request
beside B - 1 others takes about B times as long (the core shared), which is what batching
costs the tail at low load.
Last line: `batched throughput at the p99 limit: Nx unbatched (the bounds allow ...)`, the
ratio of the two lower bounds and the range the bounds allow, or `unresolved`.

The closed loop also prints each engine's CPU milliseconds per request (this process's CPU
time over the run, `*_cpu_ms`): on a core shared with other work, wall-clock rates follow
the other work's load, and the CPU time per request is the direction that still holds.
For each batched engine it then splits the loop's seconds a request by phase (its
recorder's: encoders, direct steps, verifications, with how many ran), what bounds the
gain: batching shares the decode steps, never the encoders of arrivals apart.
Without --quantization, it then prints the arithmetic floor (bench.floor): the requests
per second this core could serve doing nothing but the model's dense products for these
requests (each input at its own length, each decoded token one decoder position) at the
best rate torch.mm reaches on the model's weight shapes, the batched closed loops as shares
of it, and the issue's targets as multiples of it: past 1, no schedule reaches them here.
The heap is frozen once the engines are warm, as the serving process freezes it
(monitor.gc_heap), and each engine prints the full garbage collections its floor and sweep met.
--quick: 32 requests, one round, a short rate sweep and one unloaded repeat (directions only).
--without-turns: a third engine, batched as the first but whose rows never take turns
(every row steps every step: engine.scheduler's `turns` off), measured beside the others
with its outputs compared the same way: what taking turns changes, in one run.
--bucket EDGE: only the canaries of that length bucket (the mix's 16- to 256-token inputs
make a short request that meets a long one take several times its own latency; one bucket
takes the length mix out of the queueing, which is what the open loop's limit is about).

Why slowdown and not the issue's "p99 within 2x the unloaded p50": the canaries mix input
lengths from one bucket to the largest, so the unloaded latencies of the mix already spread
past 2x their median (the longest inputs' encoders alone take several times a short
request), and that rule fails at any load, an idle engine included. Each request measured
against its own unloaded latency keeps the issue's intent (the tail at most doubles under
load) for a mixed workload.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench import ct2
from bench.engine import _canaries, by_bucket
from bench.floor import Floor, Products, gemm_rate
from engine.protocol import Engine
from engine.scheduler_recorder import Totals
from monitor import gc_heap
from storage.queries.speedups import order_rank

# From well below the unbatched engine's capacity (1x) to far past it: the batched engine's
# limit is expected at several times it.
RATES = "0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1,1.2,1.4,1.7,2,2.4,2.8,3.3,4,5,6,8"


# A rate's verdict against the limit: its p99 slowdown's interval below it, above it, or
# across it (more requests would tell).
WITHIN, PAST, UNRESOLVED = "within", "past", "unresolved"
# The confidence of a p99's interval (two-sided).
CONFIDENCE = 0.95


# The most rows a request stepped with, binned: (label, fewest, most).
ROW_BINS = (("1", 1, 1), ("2", 2, 2), ("3-4", 3, 4), ("5-8", 5, 8), ("9-16", 9, 16),
            ("17+", 17, math.inf))


def row_bins(rows_and_slowdowns: Sequence[tuple[int, float]]
             ) -> tuple[tuple[str, int, float], ...]:
    """Return (label, requests, p50 slowdown) for each non-empty ROW_BINS bin."""
    out = []
    for label, low, high in ROW_BINS:
        got = [s for rows, s in rows_and_slowdowns if low <= rows <= high]
        if got:
            out.append((label, len(got), statistics.median(got)))
    return tuple(out)


@dataclass(frozen=True)
class OpenLoop:
    """One offered rate: latencies from the scheduled send time, and what failed."""

    rate: float
    p50_s: float
    p99_s: float
    errors: int
    p99_slowdown: float = math.nan  # latency over the input's unloaded latency (nan: unknown)
    # The p99 slowdown's CONFIDENCE interval (-inf / inf: too few requests to bound a side).
    slowdown_low: float = -math.inf
    slowdown_high: float = math.inf
    # Why the tail is what it is: the share of requests sent while another was in flight
    # (they waited for it or shared its steps), and the p99 slowdown of the others, which
    # found the engine idle (the host's jitter, no queueing).
    busy_share: float = math.nan
    idle_p99_slowdown: float = math.nan
    # Requests by the most rows they stepped with (the result's batch_size_max, ROW_BINS):
    # (bin's label, requests, their p50 slowdown). Where batching gains a request nothing,
    # its latency grows with the rows beside it: the core shared, as processor sharing.
    by_rows: tuple[tuple[str, int, float], ...] = ()

    @property
    def verdict(self) -> str:
        """Return WITHIN, PAST or UNRESOLVED against SLOWDOWN_LIMIT (an error is past)."""
        if self.errors or self.slowdown_low > SLOWDOWN_LIMIT:
            return PAST
        return WITHIN if self.slowdown_high <= SLOWDOWN_LIMIT else UNRESOLVED


@dataclass(frozen=True)
class Limit:
    """An engine's p99 limit as the sweep bounds it: at least `within` (the highest rate
    shown within, below the first shown past it; 0: none) and below `past` (inf: none)."""

    within: float
    past: float
    runs: tuple[OpenLoop, ...]

    def describe(self) -> str:
        """Return the bounds as words."""
        if self.within == 0 and math.isinf(self.past):
            return "unresolved (no rate shown within or past it)"
        if self.within == 0:
            return f"below {self.past:.1f} req/s (no rate shown within it)"
        if math.isinf(self.past):
            return f"at least {self.within:.1f} req/s (no rate shown past it)"
        return f"at least {self.within:.1f}, below {self.past:.1f} req/s"


def in_bucket(engine: Engine, texts: Sequence[str], bucket: str) -> list[str]:
    """Return the texts whose length bucket on `engine` is `bucket` (its label, e.g. "32")."""
    groups = by_bucket(engine, list(texts), per_bucket=len(texts))
    if bucket not in groups:
        labels = sorted(groups, key=lambda b: (len(b), b))
        raise ValueError(f"--bucket {bucket}: no canary in that bucket (buckets with "
                         f"canaries: {', '.join(labels)})")
    return groups[bucket]


def percentile(values: Sequence[float], q: float) -> float:
    """Return the q-quantile (0..1) of `values`, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def quantile_interval(values: Sequence[float], q: float = 0.99,
                      confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Return a distribution-free `confidence` interval for the q-quantile that `values`
    were drawn from, two order statistics (-inf / inf where too few values bound a side).

    How many values fall below the true q-quantile is binomial(n, q), as for the speedup
    median's interval (storage.queries.speedups.order_rank). A p99 needs hundreds of
    values: below about 370 no value bounds it from above at 95%."""
    ordered, n = sorted(values), len(values)
    tail = (1.0 - confidence) / 2
    lower, upper = order_rank(n, tail, q), order_rank(n, tail, 1.0 - q)
    return (ordered[lower - 1] if lower >= 1 else -math.inf,
            ordered[n - upper] if upper >= 1 else math.inf)


def round_order(names: Sequence[str], round_index: int) -> list[str]:
    """Return the order the engines run in round `round_index`: as given, then reversed,
    alternating (an engine that always ran first or last would carry the host's drift)."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


@dataclass(frozen=True)
class Ratio:
    """A ratio measured in each round (its two rates from the same round): the median of
    the rounds' ratios and their range."""

    values: tuple[float, ...]

    @classmethod
    def paired(cls, numerators: Sequence[float], denominators: Sequence[float]) -> Ratio:
        """Return the ratio of each round's numerator to the same round's denominator."""
        return cls(tuple(n / d for n, d in zip(numerators, denominators, strict=True)))

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def spread(self) -> str:
        """Return the rounds' range as `1.21-1.40` (`-` for one round)."""
        if len(self.values) == 1:
            return "-"
        return f"{min(self.values):.2f}-{max(self.values):.2f}"

    def describe(self) -> str:
        """Return `1.33x`, or with several rounds `1.33x [1.21, 1.40]` (their range)."""
        if len(self.values) == 1:
            return f"{self.median:.2f}x"
        return f"{self.median:.2f}x [{self.spread().replace('-', ', ')}]"


def closed_loop(call: Callable[[str], object], texts: Sequence[str], callers: int,
                requests: int) -> float:
    """Return requests per second with `callers` callers, `requests` requests in all."""
    lock = threading.Lock()
    next_index = [0]

    def caller() -> None:
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= requests:
                return
            call(texts[i % len(texts)])

    start = time.perf_counter()
    with ThreadPoolExecutor(callers) as pool:
        for f in [pool.submit(caller) for _ in range(callers)]:
            f.result()
    return requests / (time.perf_counter() - start)


@dataclass(frozen=True)
class PhaseSplit:
    """Where a batched engine's loop spent a closed loop's seconds, per request: its
    recorder's phases (engine.scheduler_recorder), each phase's seconds summed over the
    run, and how many arrivals were encoded (alone or together) or steps ran in it."""

    requests: int
    seconds: dict[str, float]
    counts: dict[str, int]

    def describe(self) -> str:
        """Return the split as words: milliseconds a request and share, by phase."""
        total = sum(self.seconds.values())
        parts = []
        for phase, seconds in self.seconds.items():
            n = self.counts[phase]
            what = "arrival" if phase == "encode" else "step"
            parts.append(f"{phase} {seconds * 1e3 / self.requests:.2f} ms "
                         f"({seconds / total if total else 0.0:.0%}, {n} {what}"
                         f"{'' if n == 1 else 's'})")
        return ", ".join(parts)


def phase_split(before: Totals, after: Totals, requests: int) -> PhaseSplit:
    """Return the phases' seconds and counts between two recorder totals, over `requests`."""
    _steps0, counts0, seconds0, _b0 = before
    _steps1, counts1, seconds1, _b1 = after
    return PhaseSplit(requests, {p: seconds1[p] - seconds0[p] for p in seconds1},
                      {p: counts1[p] - counts0[p] for p in counts1})


def describe_floor(limit: Floor, batched: dict[int, float], ct2_float32: dict[int, float]
                   ) -> str:
    """Return the arithmetic floor's lines: the floor, the batched engine's closed loops as
    shares of it, and the issue's targets (3x the one-caller rate; 2x CTranslate2 float32
    at the most callers, where it ran) as multiples of it (past 1: out of reach here)."""
    callers = sorted(batched)
    lines = [f"arithmetic floor: {limit.flops_per_request / 1e9:.3f} GFLOP a request (dense "
             f"products only, each input at its own length, each decoded token one position) "
             f"at {limit.rate / 1e9:.1f} GFLOP/s (float32 torch.mm on the model's weight "
             f"shapes): at most {limit.requests_per_s:.1f} requests/s on this core",
             "  batched at " + " / ".join(map(str, callers)) + " callers: "
             + " / ".join(f"{limit.share(batched[c]):.2f}" for c in callers) + " of it"]
    targets = [f"3x the one-caller rate is {3 * limit.share(batched[callers[0]]):.2f}x it"]
    if ct2_float32:
        top = max(ct2_float32)
        targets.append(f"2x CTranslate2 float32 at batch {top} is "
                       f"{2 * limit.share(ct2_float32[top]):.2f}x it")
    lines.append("  " + ", ".join(targets))
    return "\n".join(lines)


def unloaded_latencies(call: Callable[[str], object], texts: Sequence[str],
                       repeats: int = 3, idle_s: float = 0.0) -> list[float]:
    """Return each input's median latency over `repeats` requests sent one at a time,
    each `idle_s` after the one before finished (0: back to back)."""
    times: list[list[float]] = [[] for _ in texts]
    for _ in range(repeats):
        for i, text in enumerate(texts):
            times[i].append(_latency(call, text, idle_s))
    return [statistics.median(t) for t in times]


def _latency(call: Callable[[str], object], text: str, idle_s: float = 0.0) -> float:
    if idle_s > 0:
        time.sleep(idle_s)
    t0 = time.perf_counter()
    call(text)
    return time.perf_counter() - t0


def sequential_slowdowns(call: Callable[[str], object], texts: Sequence[str], requests: int,
                         unloaded: Sequence[float], idle_s: float = 0.0) -> list[float]:
    """Return the slowdowns of `requests` requests sent one at a time, each `idle_s` after
    the one before, no load at all (request i sends texts[i % len(texts)], as the open loop
    does): their p99 is the floor that the host's own jitter puts under every open-loop p99
    slowdown."""
    return [_latency(call, texts[i % len(texts)], idle_s) / unloaded[i % len(texts)]
            for i in range(requests)]


def open_loop(call: Callable[[str], object], texts: Sequence[str], rate: float,
              requests: int, seed: int = 0, unloaded: Sequence[float] | None = None
              ) -> OpenLoop:
    """Offer `requests` Poisson arrivals at `rate` per second; measure from the schedule
    (request i sends texts[i % len(texts)]; `unloaded`: their unloaded latencies, for the
    p99 slowdown)."""
    rng = random.Random(seed)
    at, schedule = 0.0, []
    for _ in range(requests):
        at += rng.expovariate(rate)
        schedule.append(at)
    latencies: list[float] = []
    slowdowns: list[float] = []
    idle_slowdowns: list[float] = []
    rows: list[tuple[int, float]] = []
    errors, in_flight, busy = [0], [0], [0]
    lock = threading.Lock()
    start = time.perf_counter() + 0.05

    def send(i: int) -> None:
        due = start + schedule[i]
        with lock:
            found_busy = in_flight[0] > 0
            busy[0] += found_busy
            in_flight[0] += 1
        try:
            result = call(texts[i % len(texts)])
        except Exception:  # noqa: BLE001 - an overloaded engine's 429 counts, not stops
            with lock:
                errors[0] += 1
            return
        finally:
            with lock:
                in_flight[0] -= 1
        latency = time.perf_counter() - due
        with lock:
            latencies.append(latency)
            if unloaded is not None:
                slowdowns.append(latency / unloaded[i % len(texts)])
                if not found_busy:
                    idle_slowdowns.append(slowdowns[-1])
                most = getattr(result, "batch_size_max", None)
                if isinstance(most, int):
                    rows.append((most, slowdowns[-1]))

    threads = []
    for i, offset in enumerate(schedule):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=send, args=(i,))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    if not latencies:
        return OpenLoop(rate, math.inf, math.inf, errors[0], math.inf)
    if not slowdowns:
        return OpenLoop(rate, percentile(latencies, 0.5), percentile(latencies, 0.99),
                        errors[0])
    low, high = quantile_interval(slowdowns)
    return OpenLoop(rate, percentile(latencies, 0.5), percentile(latencies, 0.99), errors[0],
                    percentile(slowdowns, 0.99), low, high, busy[0] / requests,
                    percentile(idle_slowdowns, 0.99) if idle_slowdowns else math.nan,
                    row_bins(rows))


class OutputCheck:
    """Count outputs that differ from each input's reference (the unbatched engine's,
    decoded one request at a time before any load), by engine: batching must never change
    a token, at any load."""

    def __init__(self, engines: Sequence[str]) -> None:
        self.reference: dict[str, tuple[int, ...]] = {}
        self.differing = dict.fromkeys(engines, 0)
        self._lock = threading.Lock()

    def seen(self, name: str, text: str, output: tuple[int, ...]) -> None:
        """Compare one output of engine `name` (before the reference is set: nothing)."""
        expected = self.reference.get(text)
        if expected is not None and output != expected:
            with self._lock:
                self.differing[name] += 1


QUICK_RATES = "0.5,1,1.5,2,3,4,6"
# A request may take at most this many times its own unloaded latency at the p99.
SLOWDOWN_LIMIT = 2.0
# An unloaded request's pause before it: about the mean gap of the sweep's lowest rates,
# long enough for an idle engine's working set to leave the shared caches.
IDLE_S = 0.5


def p99_limit(call: Callable[[str], object], texts: Sequence[str], rates: Sequence[float],
              requests: int, unloaded: Sequence[float], halvings: int = 3) -> Limit:
    """Sweep `rates` upward to the first shown PAST the limit (p99 slowdown over
    SLOWDOWN_LIMIT: its interval above it, or errors) and return the bounds: the highest
    rate below it shown WITHIN (its interval at or under the limit) and that first one.

    Where no rate of the sweep is shown within, half the lowest is offered, up to
    `halvings` times, until one is, so that the last line compares two limits rather than
    none. A rate whose interval spans the limit (UNRESOLVED) bounds nothing: the sweep
    goes on past it."""
    runs: list[OpenLoop] = []

    def offer(rate: float) -> str:
        run = open_loop(call, texts, rate, requests, unloaded=unloaded)
        runs.append(run)
        return run.verdict

    within, past = 0.0, math.inf
    for rate in sorted(rates):
        verdict = offer(rate)
        if verdict == PAST:
            past = rate
            break  # past the limit the queue only grows
        if verdict == WITHIN:
            within = rate
    lowest = min(rates, default=0.0)
    for _ in range(halvings if within == 0.0 and lowest > 0 else 0):
        lowest /= 2
        verdict = offer(lowest)
        if verdict == WITHIN:
            within = lowest
            break
        if verdict == PAST:
            past = min(past, lowest)
    return Limit(within, past, tuple(runs))


def limit_ratio(batched: Limit, unbatched: Limit) -> str:
    """Return the last line's comparison: the ratio of the highest rates shown within, and
    the range the bounds allow."""
    if unbatched.within == 0 or batched.within == 0:
        return ("unresolved (no offered rate shown within the limit for "
                + " or ".join(name for name, limit in (("batched", batched),
                                                       ("unbatched", unbatched))
                              if limit.within == 0) + ")")
    low = batched.within / unbatched.past
    high = batched.past / unbatched.within
    allowed = f"at least {low:.2f}x" if math.isinf(high) else f"{low:.2f}x to {high:.2f}x"
    return f"{batched.within / unbatched.within:.2f}x unbatched (the bounds allow {allowed})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64, help="requests per measurement")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--callers", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=3, help="closed-loop rounds, every "
                        "engine once a round, the order reversed each round")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--rates", default=RATES, help="offered rates, multiples of the "
                        "unbatched engine's closed-loop one-caller throughput")
    parser.add_argument("--unloaded-repeats", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=IDLE_S, help="the pause before "
                        "each unloaded request (the engine idle, as at a low offered rate)")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--quantization", choices=("none", "int8"), default="none",
                        help="both engines' engine.quantization (int8: the int8 target "
                        "serves every request, its encoder int8 too)")
    parser.add_argument("--cache-dir", default="var/compile-cache")
    parser.add_argument("--ct2-dir", default=str(ct2.DEFAULT_DIR),
                        help="where CTranslate2's conversions are kept (converted once)")
    parser.add_argument("--no-ct2", action="store_true", help="leave CTranslate2 out")
    parser.add_argument("--quick", action="store_true", help="32 requests, rates "
                        f"{QUICK_RATES}, one unloaded repeat: directions, not results")
    parser.add_argument("--bucket", default=None, help="only the canaries of this length "
                        "bucket (its edge in tokens): one length, no length mix in the queue")
    parser.add_argument("--without-turns", action="store_true", help="also a batched engine "
                        "whose rows never take turns (every row steps every step)")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.rates, args.unloaded_repeats, args.rounds = 32, QUICK_RATES, 1, 1
    if args.rounds < 1:
        parser.error(f"--rounds: must be at least 1, got {args.rounds}")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(args.cache_dir).resolve()))

    from engine.config import BUILTIN_DIR, EngineConfig
    from engine.runtime import Runtime  # the concrete runtime: its tokenizer feeds CTranslate2

    callers = [int(c) for c in args.callers.split(",")]
    # flags_file "": the engines' own defaults (quantized_default on), not a flags file's.
    base = dict(model_dir=args.model_dir, max_queue=4 * max(callers) + 1024,
                max_new_tokens=args.new_tokens, cache_dir=args.cache_dir,
                quantization=args.quantization, flags_file="")
    engines = {"batched": Runtime(EngineConfig(**base, max_batch=args.max_batch)),  # type: ignore[arg-type]
               "unbatched": Runtime(EngineConfig(**base, max_batch=1))}  # type: ignore[arg-type]
    if args.without_turns:
        shared = Runtime(EngineConfig(**base, max_batch=args.max_batch))  # type: ignore[arg-type]
        assert shared.batch_scheduler is not None
        shared.batch_scheduler.turns = False
        engines["batched_without_turns"] = shared
    texts = _canaries("in_domain")
    if args.bucket is not None:  # before warm-up: a wrong bucket is said at once
        try:
            texts = in_bucket(engines["unbatched"], texts, args.bucket)
        except ValueError as exc:
            for engine in engines.values():
                engine.close()
            parser.error(str(exc))
    texts = texts[: args.requests]
    for engine in engines.values():
        engine.warm_up(background=False)
    outputs: dict[str, dict[str, tuple[int, ...]]] = {name: {} for name in engines}
    check = OutputCheck(list(engines))

    def caller(name: str) -> Callable[[str], object]:
        engine = engines[name]

        def call(text: str) -> object:
            result = engine.generate(text, max_new_tokens=args.new_tokens)
            outputs[name][text] = result.output_ids
            check.seen(name, text, result.output_ids)
            return result

        return call

    calls = {name: caller(name) for name in engines}
    for call in calls.values():  # one pass each: every output known, caches warm
        for text in texts:
            call(text)
    # As the serving process does once its engine is warm (monitor.engine_holder): a full
    # collection walking the warm heap would stall whichever requests are in flight.
    frozen = gc_heap.freeze()
    gc_heap.PAUSES.install()
    others = [name for name in engines if name != "unbatched"]
    diffs = {name: sum(outputs[name][t] != outputs["unbatched"][t] for t in texts)
             for name in others}
    check.reference.update(outputs["unbatched"])
    cts = {} if args.no_ct2 else ct2.load(args.model_dir or BUILTIN_DIR / "target",
                                          Path(args.ct2_dir))
    print(f"inputs={len(texts)} bucket={args.bucket or 'all'} new_tokens={args.new_tokens} "
          f"max_batch={args.max_batch} "
          f"quantization={args.quantization} "
          f"requests/measurement={args.requests} rounds={args.rounds} ctranslate2="
          f"{ct2.version() + ' (same process, one thread)' if cts else 'not compared'} "
          f"heap_frozen={frozen}")
    print("output differences (against unbatched, every input): "
          + ", ".join(f"{name} {n}" for name, n in diffs.items()))

    # CTranslate2: the closed loop's requests in one translate_batch, max_batch_size C.
    sent = [texts[i % len(texts)] for i in range(args.requests)]
    tokenizer = engines["unbatched"].tokenizer
    inputs = [tokenizer(t).input_ids for t in sent]
    expected = [list(outputs["unbatched"][t]) for t in sent]
    compared: dict[str, list[str]] = {name: [] for name in cts}
    print(f"{'callers':>8} {'batched_rps':>12} {'unbatched_rps':>14} {'ratio':>6}"
          f" {'ratio_rounds':>13} {'batched_cpu_ms':>15} {'unbatched_cpu_ms':>17}"
          f" {'batched_diffs':>13}"
          + "".join(f" {'ct2_' + name + '_rps':>16}" for name in cts)
          + "".join(f" {name + '_rps':>26} {'cpu_ms':>7} {'diffs':>5}" for name in others[1:]))
    # Each measurement's value in every round, then its median: the rates a ratio pairs
    # come from the same round.
    rounds: dict[tuple[str, int], list[float]] = {}
    cpu_rounds: dict[tuple[str, int], list[float]] = {}
    splits: list[str] = []
    for c in callers:
        differing = dict(check.differing)
        loops = {name: engine.batch_scheduler for name, engine in engines.items()
                 if engine.batch_scheduler is not None}
        before = {name: sched.recorder.totals() for name, sched in loops.items()}
        for r in range(args.rounds):
            for name in round_order(list(calls), r):
                cpu0 = time.process_time()
                rounds.setdefault((name, c), []).append(
                    closed_loop(calls[name], texts, c, args.requests))
                cpu_rounds.setdefault((name, c), []).append(
                    (time.process_time() - cpu0) * 1e3 / args.requests)
            for name, model in cts.items():
                start = time.perf_counter()
                got = model.generate(inputs, args.new_tokens, max_batch_size=c)
                rounds.setdefault((name, c), []).append(
                    args.requests / (time.perf_counter() - start))
                if r == 0:  # the same inputs every round: one comparison says it
                    compared[name].append(f"batch {c}: {ct2.compare(expected, got)}")
        for name, sched in loops.items():
            split = phase_split(before[name], sched.recorder.totals(),
                                args.requests * args.rounds)
            splits.append(f"{name} at {c} caller{'' if c == 1 else 's'}: {split.describe()}")
        rps = {key: statistics.median(values) for key, values in rounds.items()}
        cpu_ms = {key: statistics.median(values) for key, values in cpu_rounds.items()}
        row = "".join(f" {rps[(name, c)]:>16.1f}" for name in cts)
        for name in others[1:]:
            row += (f" {rps[(name, c)]:>26.1f} {cpu_ms[(name, c)]:>7.1f}"
                    f" {check.differing[name] - differing[name]:>5}")
        ratio = Ratio.paired(rounds[("batched", c)], rounds[("unbatched", c)])
        print(f"{c:>8} {rps[('batched', c)]:>12.1f} {rps[('unbatched', c)]:>14.1f}"
              f" {ratio.median:>5.2f}x {ratio.spread():>13}"
              f" {cpu_ms[('batched', c)]:>15.1f} {cpu_ms[('unbatched', c)]:>17.1f}"
              f" {check.differing['batched'] - differing['batched']:>13}" + row)
    # What no schedule can pass on this core: the dense products every request runs.
    if args.quantization == "none":
        unbatched = engines["unbatched"]
        products = Products.of(unbatched.target.m)
        bound = Floor.of(products, [(unbatched.count_tokens(t), len(outputs["unbatched"][t]))
                                    for t in sent], gemm_rate(products))
        print(describe_floor(bound, {c: rps[("batched", c)] for c in callers},
                             {c: rps[("float32", c)] for c in callers if "float32" in cts}))
    # Where a request's time goes in the loop: what bounds what batching can gain here.
    print("the loop's seconds a request, by phase:")
    for line in splits:
        print(f"  {line}")
    for name, lines in compared.items():
        print(f"CTranslate2 {name} outputs against the engine's: {'; '.join(lines)}")
    if cts:
        top = max(callers)
        best = max(callers, key=lambda c: rps[("int8", c)])
        batched = rounds[("batched", top)]
        print(f"closed loop at {top} callers: batched engine "
              f"{Ratio.paired(batched, rounds[('float32', top)]).describe()} CTranslate2 "
              f"float32 at batch {top}, "
              f"{Ratio.paired(batched, rounds[('int8', best)]).describe()} CTranslate2 "
              f"int8's best (batch {best})")

    unloaded = {name: unloaded_latencies(call, texts, args.unloaded_repeats, args.idle_s)
                for name, call in calls.items()}
    back_to_back = {name: unloaded_latencies(call, texts, 1) for name, call in calls.items()}
    unit = rps[("unbatched", 1)] if ("unbatched", 1) in rps else closed_loop(
        calls["unbatched"], texts, 1, args.requests)
    rates = [float(r) * unit for r in args.rates.split(",")]
    print(f"open loop: rates x {unit:.1f}/s (unbatched closed-loop one-caller throughput); "
          f"limit: p99 slowdown <= {SLOWDOWN_LIMIT:g}x the input's unloaded latency "
          f"(each sent {args.idle_s:g} s after the one before)")
    limits: dict[str, Limit] = {}
    for name, call in calls.items():
        loop = engines[name].batch_scheduler
        turns_before = (loop.turn_steps, loop.recorder.totals()[0]) if loop else (0, 0)
        gc_before = gc_heap.PAUSES.snapshot()
        floor = sequential_slowdowns(call, texts, args.requests, unloaded[name], args.idle_s)
        limit = limits[name] = p99_limit(call, texts, rates, args.requests, unloaded[name])
        print(f"{name}: unloaded p50 {statistics.median(unloaded[name]) * 1e3:.1f} ms, p99 "
              f"{percentile(unloaded[name], 0.99) * 1e3:.1f} ms (back to back: p50 "
              f"{statistics.median(back_to_back[name]) * 1e3:.1f} ms); p99 slowdown one at a "
              f"time {percentile(floor, 0.99):.2f}x {_interval(quantile_interval(floor))} "
              f"(no load: the host's own jitter); p99 limit {limit.describe()}")
        for run in limit.runs:
            print(f"  offered {run.rate:7.1f}/s  p50 {run.p50_s * 1e3:8.1f} ms  "
                  f"p99 {run.p99_s * 1e3:8.1f} ms  p99 slowdown {run.p99_slowdown:5.2f}x "
                  f"{_interval((run.slowdown_low, run.slowdown_high))} {run.verdict}  "
                  f"errors {run.errors}  busy at arrival {run.busy_share:.1%}, idle "
                  f"arrivals' p99 slowdown {run.idle_p99_slowdown:.2f}x")
            if len(run.by_rows) > 1:
                print("    p50 slowdown by the most rows a request stepped with: " + ", ".join(
                    f"{label}: {s:.2f}x ({n})" for label, n, s in run.by_rows))
        gc_after = gc_heap.PAUSES.snapshot()
        print(f"  full garbage collections during its floor and sweep: "
              f"{gc_after.count[2] - gc_before.count[2]}, "
              f"{(gc_after.seconds[2] - gc_before.seconds[2]) * 1e3:.1f} ms in all")
        if loop is not None:
            print(f"  steps in which rows waited their turn: "
                  f"{loop.turn_steps - turns_before[0]} of "
                  f"{loop.recorder.totals()[0] - turns_before[1]}")
        for share in (0.5, 0.8):
            if limit.within > 0:
                run = open_loop(call, texts, share * limit.within, args.requests, seed=1,
                                unloaded=unloaded[name])
                print(f"  at {share:.0%} of the limit ({run.rate:.1f}/s): p50 "
                      f"{run.p50_s * 1e3:.1f} ms, p99 {run.p99_s * 1e3:.1f} ms, p99 slowdown "
                      f"{run.p99_slowdown:.2f}x "
                      f"{_interval((run.slowdown_low, run.slowdown_high))} {run.verdict}")
    for engine in engines.values():
        engine.close()
    print("output differences under load (every request of every measurement against the "
          "unbatched engine's alone): "
          + ", ".join(f"{name} {n}" for name, n in check.differing.items()))
    print(f"batched throughput at the p99 limit: "
          f"{limit_ratio(limits['batched'], limits['unbatched'])}")


def _interval(bounds: tuple[float, float]) -> str:
    """Return a p99's interval as `[low, high]` (`-` for a side too few values bound)."""
    low, high = (f"{b:.2f}" if math.isfinite(b) else "-" for b in bounds)
    return f"[{low}, {high}]"


if __name__ == "__main__":
    main()
