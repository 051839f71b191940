"""Overhead of tailwatch's per-request instrumentation, as a share of the request.

What a served request pays on top of `engine.generate()`: the traffic rollup
(`TrafficRecorder.record`) and the Prometheus observer (`MetricsSink.observe`).
Engine: a tiny random T5 (d_model 32, 2 layers, ByT5 tokens, no draft) on CPU in eager
mode: the fastest request here, so the largest overhead share; `--builtin` measures the
built-in models instead (eager, CPU).

A request only queues its result (both record() and observe() append to a deque); every
FOLD_AT requests the recording thread folds the queue into the rollups and the Prometheus
series in bulk (and a scrape or flush folds whatever waits). So two costs are reported:
  on the request path: median time of the two calls on a request that does not fold
          (what nearly every request waits for);
  amortized: everything the instrumentation spends, folds included, per request: the
          instrumentation time summed over each window of FOLD_AT consecutive requests
          (exactly one fold each) divided by FOLD_AT, median over the windows (medians,
          because on a shared 2-core machine preemption adds millisecond spikes to both
          that are not our overhead; means printed too).
Both against the median plain request (the same engine calls without instrumentation),
plus a noisy cross-check: median(instrumented request) / median(plain request) - 1, from
interleaved pairs. The last line is the amortized estimate in percent (targets: < 0.5%
of a request and < 20 us per request on the tiny model).

    python -m bench.probe_overhead [--requests 640] [--builtin]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from engine.protocol import Engine
from monitor.metrics import FOLD_AT, Metrics, MetricsSink
from probes import traffic
from probes.traffic import TrafficRecorder


def load(tmp: Path, builtin: bool = False) -> tuple[Engine, str]:
    """Return the engine to measure and its description."""
    from engine import EngineConfig, load_engine

    if builtin:
        return (load_engine(EngineConfig(device="cpu", compile_mode="off")),
                "built-in models, eager, CPU")
    from tests.engine.conftest import build_tiny_t5

    target = build_tiny_t5(tmp / "target", seed=0)
    config = EngineConfig(model_dir=str(target), use_draft=False, device="cpu",
                          compile_mode="off", max_new_tokens=16)
    return load_engine(config), "tiny random T5 (d32, 2 layers, no draft), eager, CPU"


def prompts(n: int) -> list[str]:
    """Return inputs of every default bucket's length."""
    from engine.builtin.task import make_input, random_input_bytes

    rng = random.Random(0)
    return [make_input("in_domain", rng, random_input_bytes(rng)) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10 * FOLD_AT)
    ap.add_argument("--builtin", action="store_true", help="measure the built-in models")
    args = ap.parse_args()
    if traffic.FOLD_AT != FOLD_AT:
        raise SystemExit("bench assumes the rollup and the sink fold at the same count")
    with tempfile.TemporaryDirectory() as tmp:
        engine, what = load(Path(tmp), args.builtin)
        try:
            recorder = TrafficRecorder("bench")
            sink = MetricsSink(Metrics(CollectorRegistry()))
            texts = prompts(args.requests)
            for t in texts[:10]:  # warm caches, allocator, label children
                r = engine.generate(t)
                recorder.record(r)
                sink.observe(r)
            recorder.drain()  # empty queues: every FOLD_AT-th request below folds
            sink.fold()
            plain: list[float] = []
            instrumented: list[float] = []
            instr: list[float] = []
            rollup: list[float] = []
            for t in texts:
                t0 = time.perf_counter()
                engine.generate(t)
                plain.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                r = engine.generate(t)
                t1 = time.perf_counter()
                recorder.record(r)
                t_mid = time.perf_counter()
                sink.observe(r)
                t2 = time.perf_counter()
                instrumented.append(t2 - t0)
                instr.append(t2 - t1)
                rollup.append(t_mid - t1)
            t0 = time.perf_counter()
            recorder.drain()  # what the last, partial window left for the flush / scrape
            sink.fold()
            tail = time.perf_counter() - t0
        finally:
            engine.close()
    plain_med = statistics.median(plain)
    folds = {i for i in range(FOLD_AT - 1, len(instr), FOLD_AT)}
    on_path = statistics.median(v for i, v in enumerate(instr) if i not in folds)
    on_path_rollup = statistics.median(v for i, v in enumerate(rollup) if i not in folds)
    windows = [sum(instr[i:i + FOLD_AT]) / FOLD_AT
               for i in range(0, len(instr) - FOLD_AT + 1, FOLD_AT)]
    amortized = statistics.median(windows)
    fold_times = [instr[i] for i in sorted(folds)]
    mean_all = (sum(instr) + tail) / len(instr)
    paired = statistics.median(instrumented) / plain_med - 1
    print(f"engine: {what}; {len(plain)} request pairs, fold every {FOLD_AT} requests")
    print(f"plain request: mean {statistics.fmean(plain) * 1e3:.2f} ms, median "
          f"{plain_med * 1e3:.2f} ms")
    print(f"on the request path: median {on_path * 1e6:.1f} us per request "
          f"({on_path / plain_med * 100:.4f}%), of which the rollup {on_path_rollup * 1e6:.1f} us")
    print(f"a folding request: median {statistics.median(fold_times) * 1e6:.0f} us "
          f"({len(fold_times)} folds of {FOLD_AT} requests)")
    print(f"amortized (folds included): median over {len(windows)} windows "
          f"{amortized * 1e6:.1f} us per request; mean {mean_all * 1e6:.1f} us (spikes included)")
    print(f"paired median ratio (noisy cross-check): {paired * 100:+.2f}%")
    print(f"target < 20 us per request: {'met' if amortized < 20e-6 else 'MISSED'} "
          f"({amortized * 1e6:.1f} us amortized, {on_path * 1e6:.1f} us on the request path)")
    print(f"target < 0.5%: {'met' if amortized / plain_med < 0.005 else 'MISSED'}")
    print(f"overhead: {amortized / plain_med * 100:.3f}%")


if __name__ == "__main__":
    main()
