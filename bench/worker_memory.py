"""Memory of the worker's jobs over simulated hours of 10-s cycles, in one process.

What the soak's worker does, accelerated: a fake engine's canary cycles (every 10 s) and
real traffic rollups (every 15 s) are stored as the serving process stores them, and the
worker's jobs (evaluation every 10 s, delivery, sensitivity, retention, the heap trim
every 60 s) run on the same simulated clock over a fresh SQLite database. Every `--every`
simulated minutes it prints RSS, the heaps in it (glibc malloc, SQLite, CPython's arenas)
and the Python heap (tracemalloc); the end prints the growth per simulated hour from
hour `--since` and the allocation sites that grew most since then.

    taskset -c 0 python -m bench.worker_memory [--hours 4] [--since 1] [--every 30] [--top 15]
        [--no-trace] [--no-trim] [--trace-jobs evaluate,sensitivity] [--jitter 0.2]
        [--fault-at HOURS --fault-minutes M --fault-factor F]

The canaries' latencies are jittered (lognormal, seeded, `--jitter` its sigma; 0: the fake
engine's deterministic latencies), as the soak's noisy engine gives sketches with spread; a
fault window multiplies the optimized canaries' latencies so latency rules fire, an
incident opens, its cause is computed and its notifications go to a loopback webhook
receiver over real HTTP, as in the soak.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import random
import sys
import tempfile
import threading
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from prometheus_client import CollectorRegistry

from engine import malloc
from engine.protocol import CancelSignal, FlagOverride, GenerateResult, InMemoryFlagProvider
from monitor.alerting import load_alerts, make_deliverer
from monitor.hub import Seams
from monitor.jobs import AnalysisParts, analysis_jobs, process_jobs
from monitor.loopback import WebhookReceiver
from monitor.metrics import Metrics, MetricsSink
from monitor.settings import Settings
from probes.fake import FakeEngine
from probes.prober import prober_from_settings
from probes.traffic import TrafficRecorder
from storage import migrate
from storage.db import make_engine, make_sessionmaker, sqlite_memory_bytes
from storage.writer import Writer

START = datetime(2026, 1, 12, 9, 30, tzinfo=UTC)  # half an hour before an hour boundary
CYCLE_S = 10
# Real requests' input lengths in words, one per bucket in turn (the soak draws its
# buckets uniformly): every bucket's traffic series fills, as in the service.
TRAFFIC_WORDS = (3, 6, 12, 24, 48)
PHRASE = "the river runs past the house and the hill behind it "
INTERVALS_S = {"evaluate": 10, "delivery": 10, "sensitivity": 300, "retention": 3600,
               "memory_trim": 60}


def rss_mb() -> float:
    """Return this process's resident set size in MB (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pymalloc_arenas() -> int:
    """Return the arenas pymalloc holds now (each 1 MiB on 64-bit CPython 3.10+)."""
    import os

    with tempfile.TemporaryFile() as out:
        saved = os.dup(2)
        os.dup2(out.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        for line in out.read().decode().splitlines():
            if line.startswith("# arenas allocated current"):
                return int(line.split("=")[1].replace(",", "").strip())
    return -1


def sqlite_mb() -> float:
    """Return the memory SQLite's library holds in this process in MB (nan: unknown)."""
    used = sqlite_memory_bytes()
    return float("nan") if used is None else used / 1e6


def malloc_mb() -> tuple[float, float]:
    """Return glibc malloc's (bytes in use, bytes free but kept) in MB (nan: not glibc)."""
    usage = malloc.usage()
    if usage is None:
        return float("nan"), float("nan")
    return usage[0] / 1e6, usage[1] / 1e6


class Clock:
    """A settable clock the jobs and the prober read."""

    def __init__(self, at: datetime) -> None:
        self.at = at

    def __call__(self) -> datetime:
        return self.at


@dataclasses.dataclass(frozen=True)
class Fault:
    """A window of simulated time in which the optimized canaries are `factor` times slower."""

    at: datetime
    minutes: float
    factor: float

    def covers(self, now: datetime) -> bool:
        """Return whether `now` falls inside the window."""
        return self.at <= now < self.at + timedelta(minutes=self.minutes)


class NoisyEngine(FakeEngine):
    """The fake engine with seeded lognormal jitter on canary latencies, and a fault window.

    Each canary call's timings are multiplied by exp(N(0, sigma)) (real traffic is left as
    the fake computes it); inside the fault window an optimized canary (no override: the
    service's flags as they are) is also multiplied by the fault's factor.
    """

    def __init__(self, clock: Clock, *, sigma: float = 0.0, fault: Fault | None = None,
                 seed: int = 38) -> None:
        super().__init__()
        self.clock = clock
        self.sigma = sigma
        self.fault = fault
        self.faulted = 0  # optimized canary calls slowed by the fault
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()

    def generate(self, text: str, *, max_new_tokens: int | None = None, canary: bool = False,
                 override: FlagOverride | None = None, timeout_s: float | None = None,
                 cancel: CancelSignal | None = None) -> GenerateResult:
        result = super().generate(text, max_new_tokens=max_new_tokens, canary=canary,
                                  override=override, timeout_s=timeout_s,
                                  cancel=cancel)
        if not canary:
            return result
        factor = 1.0
        if self.sigma > 0:
            with self._rng_lock:
                factor = math.exp(self._rng.gauss(0.0, self.sigma))
        if override is None and self.fault is not None and self.fault.covers(self.clock()):
            factor *= self.fault.factor
            self.faulted += 1
        if factor == 1.0:
            return result
        return dataclasses.replace(
            result, encoder_s=result.encoder_s * factor, ttft_s=result.ttft_s * factor,
            decode_token_s=tuple(x * factor for x in result.decode_token_s),
            total_s=result.total_s * factor)


class Replay:
    """The serving side's writes and the worker's jobs on one simulated clock."""

    def __init__(self, folder: Path, *, trim: bool = True, rate: float = 10.0,
                 ab_share: float | None = None, jitter: float = 0.0,
                 fault: Fault | None = None) -> None:
        url = f"sqlite:///{folder / 'replay.db'}"
        migrate.upgrade(url)
        # One generic webhook to a loopback receiver over real HTTP, as in the soak.
        self.receiver = WebhookReceiver()
        self.receiver.start()
        self.settings = Settings(database_url=url, instance_id="replay",
                                 probes={} if ab_share is None else {"ab_share": ab_share},
                                 alerts={"webhooks": [{"name": "r", "url": self.receiver.url,
                                                       "format": "generic"}]})
        self.clock = Clock(START)
        self.db = make_engine(url)
        self.sessions = make_sessionmaker(self.db)
        self.writer = Writer(self.sessions)
        self.engine = NoisyEngine(self.clock, sigma=jitter, fault=fault)
        self.prober = prober_from_settings(self.settings.probes, self.engine, self.writer,
                                           instance_id="replay", clock=self.clock)
        self.traffic = TrafficRecorder("replay", clock=self.clock)
        self.closers: list[Callable[[], object]] = []
        alerts = load_alerts(self.settings)
        deliverer = make_deliverer(self.sessions, alerts,
                                   Seams(clock=self.clock, transport=None),
                                   self.closers)
        parts = AnalysisParts(settings=self.settings, sessions=self.sessions, clock=self.clock,
                              alerts=alerts, deliverer=deliverer, flags=InMemoryFlagProvider(),
                              sink=MetricsSink(Metrics(CollectorRegistry())))
        # The worker's jobs: the analysis and its heap trim (`--no-trim` replays without).
        self.jobs = {**analysis_jobs(parts),
                     **process_jobs(malloc.trim if trim else lambda: False)}
        self.step = 0
        self.requests_per_cycle = round(rate * CYCLE_S)
        words = PHRASE.split()
        self.texts = [" ".join(words[i % len(words)] for i in range(n)) for n in TRAFFIC_WORDS]
        self.trace_jobs: set[str] = set()  # jobs traced on their own (evaluate: on the hour)
        self.trace_every_s = 3600  # how often a traced evaluate is traced
        self.peaks: dict[str, float] = {}  # job -> its largest Python heap rise (MB), traced

    def serve_cycle(self) -> None:
        """Store one probe cycle and a cycle's real requests (the serving process's writes)."""
        self.prober.run_cycle()
        for i in range(self.requests_per_cycle):
            self.traffic.record(self.engine.generate(self.texts[i % len(self.texts)]))
        if self.step % 2 == 0:  # every 20 s: close to the shipped 15 s flush
            # As the serving process's flush job does: its compile bookkeeping too (the
            # prober holds the cycles' compile deltas until this claims them).
            self.traffic.flush(self.writer)
            self.prober.record_unprobed_compiles()
        self.writer.flush(timeout=30.0)

    def tick(self) -> None:
        """Advance one cycle: the serving side's writes, then the worker's jobs due."""
        self.clock.at = START + timedelta(seconds=CYCLE_S * self.step)
        self.serve_cycle()
        elapsed = CYCLE_S * self.step
        for name, every in INTERVALS_S.items():
            if elapsed % every == 0:
                self._run(name)
        self.step += 1

    def _run(self, name: str) -> None:
        if name in self.trace_jobs and not tracemalloc.is_tracing() and (
                name != "evaluate" or self.clock.at.timestamp() % self.trace_every_s == 0):
            self._traced(name)
            return
        if not tracemalloc.is_tracing():
            self.jobs[name]()
            return
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        self.jobs[name]()
        rise = (tracemalloc.get_traced_memory()[1] - before) / 1e6
        self.peaks[name] = max(self.peaks.get(name, 0.0), rise)

    def _traced(self, name: str) -> None:
        """Run one job traced: its peak, and what it allocated that is still alive after."""
        tracemalloc.start(10)
        try:
            self.jobs[name]()
            gc.collect()
            peak = tracemalloc.get_traced_memory()[1] / 1e6
            kept = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        self.peaks[name] = max(self.peaks.get(name, 0.0), peak)
        top = kept.statistics("traceback")[:3]
        left = sum(st.size for st in kept.statistics("filename")) / 1e6
        print(f"  {self.clock.at:%H:%M} {name}: peak {peak:.1f} MB, {left:.2f} MB still held after",
              flush=True)
        for st in top:
            if st.size > 100_000:
                print(f"    {st.size / 1e3:.0f} kB in {st.count} blocks at")
                for line in st.traceback.format()[-6:]:
                    print("      " + line)

    def close(self) -> None:
        """Close the deliverer, the writer, the database and the receiver."""
        for close in reversed(self.closers):
            close()
        self.writer.close()
        self.db.dispose()
        self.receiver.stop()

    def outcome(self) -> str:
        """Return the alerts, incidents and notifications so far, in one line."""
        from sqlalchemy import func, select

        from storage.models import Alert, Incident

        with self.sessions() as s:
            alerts = s.execute(select(Alert.rule, Alert.state)).all()
            incidents = s.scalar(select(func.count()).select_from(Incident))
        bodies = [d.body for d in self.receiver.deliveries()]
        statuses = Counter(str(b.get("status")) if isinstance(b, dict) else "?" for b in bodies)
        rules = Counter(f"{r} {state}" for r, state in alerts)
        return (f"alerts {len(alerts)} ({', '.join(f'{k} {v}' for k, v in rules.items())}), "
                f"incidents {incidents}, notifications received {len(bodies)} "
                f"({', '.join(f'{k} {v}' for k, v in statuses.items())}), "
                f"optimized canaries slowed by the fault {self.engine.faulted}")


def _types() -> Counter[str]:
    return Counter(type(o).__name__ for o in gc.get_objects())


def main() -> None:
    """Replay `--hours` of cycles; print RSS and the Python heap per hour, then the growth."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=4.0)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--no-trace", action="store_true")
    parser.add_argument("--rate", type=float, default=10.0,
                        help="real requests per second recorded (the soak's 10)")
    parser.add_argument("--since", type=float, default=1.0,
                        help="simulated hour from which growth is measured")
    parser.add_argument("--every", type=float, default=30.0,
                        help="simulated minutes between printed rows")
    parser.add_argument("--ab-share", type=float, default=None,
                        help="share of cycles that run the A/B arms (default: probes.ab_share; "
                             "a service's on-demand arms raise it while its canaries are noisy)")
    parser.add_argument("--no-trim", action="store_true",
                        help="leave out the worker's memory_trim job (every 60 s)")
    parser.add_argument("--trace-every", type=float, default=60.0,
                        help="simulated minutes between traced evaluations (--trace-jobs)")
    parser.add_argument("--jitter", type=float, default=0.2,
                        help="sigma of the canaries' lognormal latency jitter (0: none)")
    parser.add_argument("--fault-at", type=float, default=None,
                        help="simulated hour at which the optimized canaries slow down")
    parser.add_argument("--fault-minutes", type=float, default=8.0,
                        help="the fault window's length in simulated minutes")
    parser.add_argument("--fault-factor", type=float, default=2.0,
                        help="the optimized canaries' latency factor inside the window")
    parser.add_argument("--trace-jobs", default="",
                        help="comma-separated jobs to trace one run at a time (implies --no-trace)")
    args = parser.parse_args()
    trace = not args.no_trace and not args.trace_jobs
    if trace:
        tracemalloc.start(8)
    per_hour = 3600 // CYCLE_S
    with tempfile.TemporaryDirectory() as tmp:
        fault = None if args.fault_at is None else Fault(
            START + timedelta(hours=args.fault_at), args.fault_minutes, args.fault_factor)
        replay = Replay(Path(tmp), trim=not args.no_trim, rate=args.rate,
                        ab_share=args.ab_share, jitter=args.jitter, fault=fault)
        replay.trace_jobs = {j for j in args.trace_jobs.split(",") if j}
        replay.trace_every_s = round(args.trace_every * 60)
        rows: list[tuple[float, float, float, float]] = []  # hours, RSS, Python heap, SQLite
        first: tracemalloc.Snapshot | None = None
        types0: Counter[str] | None = None
        t0 = time.perf_counter()
        for step in range(int(args.hours * per_hour) + 1):
            replay.tick()
            if step % max(1, int(args.every * 60 // CYCLE_S)) == 0:
                gc.collect()
                heap = tracemalloc.get_traced_memory()[0] / 1e6 if trace else float("nan")
                hours = step / per_hour
                rows.append((hours, rss_mb(), heap, sqlite_mb()))
                peaks = " ".join(f"{k} {v:.1f}" for k, v in sorted(replay.peaks.items()))
                used, free = malloc_mb()
                print(f"hour {hours:4.1f}  rss {rows[-1][1]:7.1f} MB  malloc in use {used:6.1f} MB"
                      f" free {free:6.1f} MB  sqlite {rows[-1][3]:5.1f} MB  python blocks {sys.getallocatedblocks()}"
                      f" in {pymalloc_arenas()} arenas  python heap {heap:7.1f} MB"
                      f"  ({time.perf_counter() - t0:.0f} s)  job peaks (MB): {peaks}", flush=True)
                replay.peaks.clear()
                if step == int(args.since * per_hour):
                    first = tracemalloc.take_snapshot() if trace else None
                    types0 = _types()
        last = tracemalloc.take_snapshot() if trace else None
        types1 = _types()
        print(replay.outcome(), flush=True)
        replay.close()
    after = [r for r in rows if r[0] >= args.since]
    span = after[-1][0] - after[0][0] if after else 0.0
    if span > 0:
        # The serving side's writes run in this process: SQLite's heap grows with them here
        # (the soak's worker holds 1-2 MB there), so the RSS less it is printed too.
        rest = (after[-1][1] - after[-1][3]) - (after[0][1] - after[0][3])
        print(f"growth after hour {args.since:g}: rss {(after[-1][1] - after[0][1]) / span:+.1f} MB/h"
              f" (less SQLite's heap {rest / span:+.1f} MB/h), "
              f"python heap {(after[-1][2] - after[0][2]) / span:+.2f} MB/h (simulated hours)")
    if types0 is not None:
        grown = (types1 - types0).most_common(10)
        print(f"objects grown since hour {args.since:g}:", ", ".join(f"{k} +{v}" for k, v in grown))
    if first is not None and last is not None:
        for stat in last.compare_to(first, "traceback")[:args.top]:
            print(f"{stat.size_diff / 1e3:+9.1f} kB {stat.count_diff:+7d} blocks")
            for line in stat.traceback.format()[-8:]:
                print("    " + line)


if __name__ == "__main__":
    main()
