"""The batched C step's cost against its rows: is a step of B rows nearly a one-row step?

    taskset -c 1 python -m bench.batch_step [--rows 1,2,4,8,16,32] [--position 30]
        [--cross 64] [--filled 0.7] [--calls 50] [--rounds 5]

One process, the built-in target, one thread: `native.rows` on B rows at one position,
each row with its own self-attention cache and its own cross K/V of --cross keys, of which
the first --filled share is unmasked (the rest: bucket padding). Median over --rounds of
--calls calls; the C call's own time and the call with its Python (checks, pointer arrays).
Last line: `32 rows: Nx a one-row step, Mx its rows per second`.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any


def _median_s(fn: Callable[[], Any], calls: int, rounds: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--position", type=int, default=30)
    ap.add_argument("--cross", type=int, default=64)
    ap.add_argument("--filled", type=float, default=0.7)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    import torch

    from engine import EngineConfig
    from engine.runtime import Runtime

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        rt = Runtime(EngineConfig(compile_backend="eager", cache_dir=tmp, num_threads=1))
        r, m = rt.target, rt.target.m
        step = r.native
        if step is None:
            raise SystemExit(f"no C step here ({rt.step_kind})")
        keep = torch.zeros((1, args.cross), dtype=torch.long)
        keep[0, : max(1, int(args.cross * args.filled))] = 1
        print(f"position {args.position}, cross {args.cross} keys ({keep.sum()} unmasked), "
              f"one thread")
        print(f"{'rows':>5} {'step us':>9} {'C us':>9} {'x one row':>10} {'rows/s x':>9}")
        first, last = 0.0, ""
        for b in [int(x) for x in args.rows.split(",")]:
            caches = [torch.randn(m.new_self_cache(r.slots, static=False).shape)
                      for _ in range(b)]
            crosses = [torch.randn((len(m.dec_layers), 2, m.n_heads, args.cross, m.d_kv))
                       for _ in range(b)]
            masks = [m.mask_bias(keep) for _ in range(b)]
            tokens = torch.randint(2, m.embed.shape[0], (b,))
            positions = torch.full((b,), args.position)
            span = r.dec_bias.shape[-1]
            ptrs = ctypes.c_void_p * b
            lens = torch.full((b,), args.cross)
            out = torch.empty(b, dtype=torch.long)
            raw = (step._ref, tokens.data_ptr(), b, positions.data_ptr(),
                   ptrs(*[c.data_ptr() for c in caches]), caches[0].shape[-2],
                   ptrs(*[c.data_ptr() for c in crosses]), lens.data_ptr(),
                   ptrs(*[k.data_ptr() for k in masks]), r.dec_bias.data_ptr(), span,
                   step._scratch(step.scratch_floats(b, max(span, args.cross))),
                   out.data_ptr(), None)
            with torch.no_grad():
                full = _median_s(partial(step.rows, m, tokens, positions, caches, crosses,
                                         masks, r.dec_bias), args.calls, args.rounds)
                c_only = _median_s(partial(step._rows_fn, *raw), args.calls, args.rounds)
            first = first or full
            last = (f"{b} rows: {full / first:.1f}x a one-row step, "
                    f"{b * first / full:.1f}x its rows per second")
            print(f"{b:>5} {full * 1e6:>9.0f} {c_only * 1e6:>9.0f} {full / first:>9.1f}x "
                  f"{b * first / full:>8.1f}x")
        print(last)


if __name__ == "__main__":
    main()
