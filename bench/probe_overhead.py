"""Overhead of tailwatch's per-request instrumentation, as a share of the request.

What a served request pays on top of `engine.generate()`: the traffic rollup
(`TrafficRecorder.record`) and the Prometheus observer (`MetricsSink.observe`).
Engine: a tiny random T5 (d_model 32, 2 layers, ByT5 tokens, no draft) on CPU in eager
mode: the fastest request here, so the largest overhead share; `--builtin` measures the
built-in models instead (eager, CPU).

Estimates, all against the same engine calls without instrumentation:
  direct: median instrumentation time (timed around its own calls) / median plain
          request time; medians, because on a shared 2-core machine preemption adds
          millisecond spikes to both that are not our overhead (means printed too);
  paired: median(instrumented request) / median(plain request) - 1, from interleaved
          pairs (noisy: machine jitter is larger than the effect).
The last line is the direct estimate in percent (targets: < 0.5% of a request and
< 20 us per request on the tiny model).

    python -m bench.probe_overhead [--requests 300] [--builtin]
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
from monitor.metrics import Metrics, MetricsSink
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
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--builtin", action="store_true", help="measure the built-in models")
    args = ap.parse_args()
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
            plain: list[float] = []
            instrumented: list[float] = []
            instr_only: list[float] = []
            rollup_only: list[float] = []
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
                instr_only.append(t2 - t1)
                rollup_only.append(t_mid - t1)
        finally:
            engine.close()
    mean_plain = statistics.fmean(plain)
    direct = statistics.median(instr_only) / statistics.median(plain)
    direct_mean = statistics.fmean(instr_only) / mean_plain
    paired = statistics.median(instrumented) / statistics.median(plain) - 1
    print(f"engine: {what}; {len(plain)} request pairs")
    print(f"plain request: mean {mean_plain * 1e3:.2f} ms, median "
          f"{statistics.median(plain) * 1e3:.2f} ms")
    print(f"instrumentation: median {statistics.median(instr_only) * 1e6:.1f} us, mean "
          f"{statistics.fmean(instr_only) * 1e6:.1f} us per request (rollup + Prometheus), p99 "
          f"{sorted(instr_only)[int(0.99 * (len(instr_only) - 1))] * 1e6:.1f} us")
    print(f"of which the traffic rollup: median {statistics.median(rollup_only) * 1e6:.1f} us"
          f" ({statistics.median(rollup_only) / statistics.median(plain) * 100:.3f}%)")
    print(f"mean-based share: {direct_mean * 100:.3f}%")
    print(f"paired median ratio (noisy cross-check): {paired * 100:+.2f}%")
    med_us = statistics.median(instr_only) * 1e6
    print(f"target < 20 us per request: {'met' if med_us < 20 else 'MISSED'} ({med_us:.1f} us)")
    print(f"target < 0.5%: {'met' if direct < 0.005 else 'MISSED'}")
    print(f"overhead: {direct * 100:.3f}%")


if __name__ == "__main__":
    main()
