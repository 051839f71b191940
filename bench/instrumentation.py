"""What recording costs a request at batch 32: the batched closed loop, recording on vs off.

    taskset -c 1 python -m bench.instrumentation [--callers 32] [--requests 256] [--rounds 4]

One batched engine (engine.max_batch = --callers) on the built-in target (or --model-dir),
default flags, in this process; closed loop: --callers callers at once, each sending its
next request when the last returned (bench.throughput.closed_loop). Rounds alternate off
and on, --rounds of each, after one warm pass of each:
  on: what a served request runs. The batching loop's StepRecorder (every step's seconds
      by phase, every request's step count and batch sizes: engine.scheduler_recorder)
      and, after each request, the app's two recording calls (monitor.api.generate):
      the traffic rollups with their batching rollups (TrafficRecorder.record) and the
      Prometheus sink (MetricsSink.observe), their folds included (the route's optional
      quality sampler is a probe, not recording: left out); what a round leaves
      queued is folded at its end and counted.
  off: the loop's NullRecorder and neither call.

Two figures, both in CPU time, which on a shared core still measures this process's
work where wall-clock time also holds other processes' (bench.throughput's `*_cpu_ms`):
  timed: the CPU seconds the recording calls take, each call's own thread's
      (time.thread_time around it, its two reads counted too), over the process's CPU
      seconds in the on rounds. In a closed loop a request's share is the process's
      CPU / requests, so this is recording's share of a request at this batch size: a
      step's recording delays every row in it, and the callers' recording takes the
      loop's core (one core, the GIL). Thread time, not wall time, around each call: a
      wall-clock interval would also hold whatever other thread got the GIL meanwhile
      (up to the 5 ms switch interval) and other processes' slices.
  on/off: the on rounds' median process CPU over the off rounds' - 1: the same cost
      with its indirect effects (caches, thread switches), but only as sharp as the
      run-to-run spread, printed beside it: the cross-check, not the figure.
Last line: `instrumentation: X% of a request at batch N` (X: timed).

Not switched off, so in neither figure: the per-token timestamps a row keeps
(GenerateResult.decode_token_s: one clock read per step, shared by the rows), a request's
own timestamps, and what the loop's decisions read (each request's largest batch, the
step cost fits). Off the request path and not per request: the database flush of the
rollups and the batching-loop sample (a job every traffic_flush_interval_s), Prometheus
scrapes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from bench.engine import _canaries
from bench.throughput import closed_loop
from engine.scheduler_recorder import NullRecorder, Recorded, StepRecorder
from monitor.metrics import Metrics, MetricsSink
from probes.traffic import TrafficRecorder


class TimedRecorder(StepRecorder):
    """The production StepRecorder, its calls timed in the loop thread's CPU time."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []

    def joined(self, job: Recorded, encode_s: float) -> None:
        """Record an arrival (StepRecorder) and time it."""
        t0 = time.thread_time()
        super().joined(job, encode_s)
        self.seconds.append(time.thread_time() - t0)

    def stepped(self, phase: str, seconds: float, jobs: Sequence[Recorded]) -> None:
        """Record one step (StepRecorder) and time it."""
        t0 = time.thread_time()
        super().stepped(phase, seconds, jobs)
        self.seconds.append(time.thread_time() - t0)


@dataclass(frozen=True)
class Overhead:
    """Rounds of the closed loop, recording on and off, and the recording timed."""

    callers: int
    requests: int  # per round
    on_s: tuple[float, ...]  # process CPU seconds of each on round
    off_s: tuple[float, ...]
    loop_s: float  # CPU inside the loop's recorder, summed over the on rounds
    app_s: float  # CPU inside the app's recording calls (and the rounds' last folds)
    steps: int  # steps the on rounds recorded
    on_wall_s: float = 0.0  # wall seconds of the on rounds, summed (for the rates)
    off_wall_s: float = 0.0

    @property
    def timed(self) -> float:
        """Return the recording CPU seconds over the on rounds' process CPU seconds."""
        return (self.loop_s + self.app_s) / sum(self.on_s)

    @property
    def on_off(self) -> float:
        """Return the median on round over the median off round (CPU), minus 1."""
        return statistics.median(self.on_s) / statistics.median(self.off_s) - 1

    @property
    def spread(self) -> float:
        """Return the off rounds' range over their median (the noise the on/off is in)."""
        return (max(self.off_s) - min(self.off_s)) / statistics.median(self.off_s)


def measure(engine, texts: Sequence[str], *, callers: int, requests: int, rounds: int,
            new_tokens: int) -> Overhead:
    """Run `rounds` off and on rounds of `requests` requests with `callers` callers on a
    batched engine (engine.runtime.Runtime); return what recording cost."""
    loop = engine.batch_scheduler
    if loop is None:
        raise ValueError("engine: not batched (max_batch 1): no batching loop to record")
    traffic = TrafficRecorder("bench")
    sink = MetricsSink(Metrics(CollectorRegistry()))
    app_s: list[float] = []

    def off(text: str) -> object:
        return engine.generate(text, max_new_tokens=new_tokens)

    def on(text: str) -> object:
        result = engine.generate(text, max_new_tokens=new_tokens)
        t0 = time.thread_time()
        sink.observe(result)  # the route's calls, in its order (monitor.api.generate)
        traffic.record(result)
        app_s.append(time.thread_time() - t0)
        return result

    def folded() -> None:
        t0 = time.thread_time()
        traffic.drain()
        sink.fold()
        app_s.append(time.thread_time() - t0)

    def run(recorder: StepRecorder, call: Callable[[str], object]) -> tuple[float, float]:
        """Return the wall and process CPU seconds of one round (its last fold counted)."""
        loop.recorder = recorder
        wall0, cpu0 = time.perf_counter(), time.process_time()
        closed_loop(call, texts, callers, requests)
        if call is on:
            folded()
        return time.perf_counter() - wall0, time.process_time() - cpu0

    run(NullRecorder(), off)  # warm: allocator, caches, label children, the cost fits
    run(TimedRecorder(), on)
    app_s.clear()
    rounds_on: list[tuple[float, float]] = []
    rounds_off: list[tuple[float, float]] = []
    timed: list[TimedRecorder] = []
    for _ in range(rounds):
        rounds_off.append(run(NullRecorder(), off))
        timed.append(TimedRecorder())
        rounds_on.append(run(timed[-1], on))
    loop.recorder = StepRecorder()
    return Overhead(callers=callers, requests=requests,
                    on_s=tuple(cpu for _w, cpu in rounds_on),
                    off_s=tuple(cpu for _w, cpu in rounds_off),
                    loop_s=sum(sum(r.seconds) for r in timed), app_s=sum(app_s),
                    steps=sum(r.totals()[0] for r in timed),
                    on_wall_s=sum(w for w, _cpu in rounds_on),
                    off_wall_s=sum(w for w, _cpu in rounds_off))


def report(o: Overhead) -> list[str]:
    """Return the printed lines, the figure last."""
    n = o.requests * len(o.on_s)
    rates = (f"off {n / o.off_wall_s:.1f} req/s, on {n / o.on_wall_s:.1f} req/s; "
             if o.on_wall_s and o.off_wall_s else "")
    return [
        f"closed loop, {o.callers} callers, {len(o.on_s)} rounds of {o.requests} requests "
        f"each way: {rates}process CPU per request off {sum(o.off_s) / n * 1e3:.2f} ms, "
        f"on {sum(o.on_s) / n * 1e3:.2f} ms",
        f"recording CPU per request: loop {o.loop_s / n * 1e6:.1f} us ({o.steps} steps "
        f"recorded), app {o.app_s / n * 1e6:.1f} us",
        f"on/off process CPU (cross-check): {o.on_off * 100:+.2f}% "
        f"(off rounds' spread {o.spread * 100:.2f}%)",
        f"instrumentation: {o.timed * 100:.3f}% of a request at batch {o.callers}",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--callers", type=int, default=32, help="callers and max_batch")
    parser.add_argument("--requests", type=int, default=256, help="requests per round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each arm")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--compile-mode", default="default")
    parser.add_argument("--cache-dir", default="var/compile-cache")
    args = parser.parse_args(argv)
    for name in ("callers", "requests", "rounds", "new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(args.cache_dir).resolve()))

    from engine.config import EngineConfig
    from engine.runtime import Runtime  # the concrete runtime: its batching loop is recorded

    engine = Runtime(EngineConfig(
        model_dir=args.model_dir, max_batch=args.callers, max_queue=4 * args.callers,
        max_new_tokens=args.new_tokens, compile_mode=args.compile_mode,
        cache_dir=args.cache_dir, flags_file=""))
    try:
        engine.warm_up(background=False)
        print(f"model {args.model_dir or 'built-in'}, compile {args.compile_mode}, "
              f"max_batch {args.callers}, new tokens {args.new_tokens}")
        overhead = measure(engine, _canaries("in_domain"), callers=args.callers,
                           requests=args.requests, rounds=args.rounds,
                           new_tokens=args.new_tokens)
    finally:
        engine.close()
    for line in report(overhead):
        print(line)


if __name__ == "__main__":
    main()
