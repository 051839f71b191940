"""The C decode step vs the compiled one: target step, verification and draft step.

    taskset -c 1 python -m bench.decode_step [--calls 300] [--rounds 7]

One process, built-in models, one intra-op thread: a runtime with `native_step: false`
compiles the shared step graphs (inductor, a few minutes cold), then the C step
(`engine.native`, built with the machine's own vector width) is bound to the same
runners. Each arm is called on the runner's own example arguments (bucket 16, position
0; the verification: 9 positions), arms alternating, median of `rounds` x `calls`. Tokens
are checked equal between the arms. Last line: `C step over compiled: N.Nx` (target step).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any


def _time(fn: Callable[..., Any], args: tuple[Any, ...], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    import torch

    from engine import EngineConfig, native, t5
    from engine.runner import SHARED, STEP, VERIFY
    from engine.runtime import Runtime

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        rt = Runtime(EngineConfig(native_step=False, cache_dir=tmp, num_threads=1))
        rt.warm_up(background=False)
        print(f"compiled arm warm: {time.perf_counter() - t0:.1f} s ({rt.step_kind})")
        lib = native.load(tmp)
        if lib is None:
            raise SystemExit("no C compiler, or the C step failed to build")
        arms: dict[str, dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]] = {
            "compiled": {}, "C": {}}
        with torch.no_grad():
            for name in ("target", "draft"):
                r = getattr(rt, name)
                if r is None:
                    continue
                ex = r._examples(r.edges[0], t5.encode)
                fns, bound = r._compiled[SHARED], lib.bind(r.m)
                arms["compiled"][f"{name} step"] = (fns.step, ex[STEP])
                arms["C"][f"{name} step"] = (bound, ex[STEP])
                if name == "target":
                    arms["compiled"]["verify"] = (fns.verify, ex[VERIFY])
                    arms["C"]["verify"] = (bound.verify, ex[VERIFY])
            for what, (fn, call) in arms["compiled"].items():
                other, other_call = arms["C"][what]
                if fn(*call).tolist() != other(*other_call).tolist():
                    raise SystemExit(f"{what}: the arms chose different tokens")
            times: dict[tuple[str, str], list[float]] = {}
            for _ in range(args.rounds):
                for arm, fns_of in arms.items():
                    for what, (fn, call) in fns_of.items():
                        times.setdefault((arm, what), []).append(_time(fn, call, args.calls))
    print(f"{'':14} {'compiled us':>12} {'C us':>8} {'C over compiled':>16}")
    ratio = {}
    for what in arms["C"]:
        c = statistics.median(times["C", what]) * 1e6
        k = statistics.median(times["compiled", what]) * 1e6
        ratio[what] = k / c
        print(f"{what:14} {k:12.0f} {c:8.0f} {ratio[what]:15.2f}x")
    print(f"C step over compiled: {ratio['target step']:.1f}x")


if __name__ == "__main__":
    main()
