"""The batched C step's cost against its rows: is a step of B rows nearly a one-row step?

    taskset -c 1 python -m bench.batch_step [--rows 1,2,4,8,16,32] [--position 30]
        [--cross 64] [--filled 0.7] [--calls 50] [--rounds 5] [--verify 4]
        [--quantization int8] [--baseline FILE]

One process, the built-in target, one thread: `native.rows` on B rows at one position,
each row with its own self-attention cache and its own cross K/V of --cross keys, of which
the first --filled share is unmasked (the rest: bucket padding). Median over --rounds of
--calls calls; the C call's own time and the call with its Python (checks, pointer arrays),
and the call's CPU seconds (`cpu us`: the thread's own time, what a contended core still
measures). With --verify K, a batched verification as the batching loop runs it: each row
feeds K + 1 consecutive positions on its own cache in the same call (the `positions` column).
With --quantization int8, the int8 target's step (int8 weights, its products int8 x int8
summed in int32); its `GFLOP/s` counts the same products, and torch.mm runs them in float32.
`GFLOP/s`: the step's dense products (every decoder layer's linear weights and the LM
head, 2 flops per weight per position) over the C call's time; after the table, the same
products through `torch.mm` (MKL) at the largest row count, one call per weight: the
host's float32 product rate at these shapes, and (float32) the same products through the C
step's own kernel alone (`tw_gemm`), with no attention, norms or K/V around them. Where
the step's rate is near these, a step of more rows cannot cost less per row: the rows are
bound by arithmetic, not by reading weights (docs/benchmarks.md#benchbatch_step).
With --baseline FILE (another native_step.c, e.g. `git show REV:engine/native_step.c >
FILE`), both builds are bound to the same model and called on the same rows in alternating
rounds (the thread's CPU time, medians): columns `base us` and `x base`, and whether their
logits are bitwise equal (`same`).
Last line: `32 rows: Nx a one-row step, Mx its rows per second` (per position with --verify),
then `Nx the baseline` with --baseline.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any


def _median_s(fn: Callable[[], Any], calls: int, rounds: int,
              clock: Callable[[], float] = time.perf_counter) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(rounds):
        t0 = clock()
        for _ in range(calls):
            fn()
        times.append((clock() - t0) / calls)
    return statistics.median(times)


def _alternating(fns: list[Callable[[], Any]], calls: int, rounds: int) -> list[float]:
    """Return each fn's median CPU seconds a call, the fns timed in turn, order alternating."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        for i in (range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))):
            t0 = time.thread_time()
            for _ in range(calls):
                fns[i]()
            times[i].append((time.thread_time() - t0) / calls)
    return [statistics.median(t) for t in times]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--position", type=int, default=30)
    ap.add_argument("--cross", type=int, default=64)
    ap.add_argument("--filled", type=float, default=0.7)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--verify", type=int, default=0,
                    help="draft tokens each row verifies (0: a direct step, one position)")
    ap.add_argument("--quantization", choices=("none", "int8"), default="none",
                    help="int8: the int8 target's C step (int8 weights, activations "
                         "quantized per row)")
    ap.add_argument("--baseline", default=None, help="another native_step.c, timed against "
                    "this one on the same rows")
    args = ap.parse_args(argv)
    if args.baseline is not None and not Path(args.baseline).is_file():
        ap.error(f"--baseline: no such file: {args.baseline}")
    import torch

    from engine import EngineConfig, native
    from engine.quantize import is_int8
    from engine.runtime import Runtime

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        rt = Runtime(EngineConfig(compile_backend="eager", cache_dir=tmp, num_threads=1,
                                  quantization=args.quantization))
        r = rt.target_q if rt.target_q is not None else rt.target
        m = r.m
        step = r.native
        if step is None:
            raise SystemExit(f"no C step here ({rt.step_kind})")
        base = None
        if args.baseline is not None:
            built = native.load(Path(tmp) / "baseline", Path(args.baseline).resolve())
            if built is None:
                raise SystemExit(f"--baseline: {args.baseline} did not build (see the log)")
            base = built.bind(m)
        keep = torch.zeros((1, args.cross), dtype=torch.long)
        keep[0, : max(1, int(args.cross * args.filled))] = 1
        q = args.verify + 1
        print(f"position {args.position}, cross {args.cross} keys ({keep.sum()} unmasked), "
              f"{q} position(s) a row, one thread")
        weights = [w for layer in m.dec_layers
                   for w in (layer.qkv, layer.o, layer.cq, layer.co, layer.wi, layer.wo)]
        weights.append(m.lm_head)
        weights = [w.dequantized() if is_int8(w) else w for w in weights]
        flops = 2 * sum(w.numel() for w in weights)  # per position
        print(f"{'rows':>5} {'positions':>9} {'step us':>9} {'C us':>9} {'cpu us':>9} "
              f"{'x one row':>10} {'pos/s x':>8} {'GFLOP/s':>8}"
              + (f" {'base us':>9} {'x base':>7} {'same':>5}" if base else ""))
        first, last, against = 0.0, "", ""
        for b in [int(x) for x in args.rows.split(",")]:
            caches = [torch.randn(m.new_self_cache(r.slots, static=False).shape)
                      for _ in range(b)]
            crosses = [torch.randn((len(m.dec_layers), 2, m.n_heads, args.cross, m.d_kv))
                       for _ in range(b)]
            masks = [m.mask_bias(keep) for _ in range(b)]
            # Row i's q positions follow each other on its own cache (a verification).
            caches, crosses, masks = ([t for t in ts for _ in range(q)]
                                      for ts in (caches, crosses, masks))
            n = b * q
            tokens = torch.randint(2, m.embed.shape[0], (n,))
            positions = torch.tensor([args.position + j for _ in range(b) for j in range(q)])
            span = r.dec_bias.shape[-1]
            ptrs = ctypes.c_void_p * n
            lens = torch.full((n,), args.cross)
            out = torch.empty(n, dtype=torch.long)
            raw = (step._ref, tokens.data_ptr(), n, positions.data_ptr(),
                   ptrs(*[c.data_ptr() for c in caches]), caches[0].shape[-2],
                   ptrs(*[c.data_ptr() for c in crosses]), lens.data_ptr(),
                   ptrs(*[k.data_ptr() for k in masks]), r.dec_bias.data_ptr(), span,
                   step._scratch(step.scratch_floats(n, max(span, args.cross))),
                   out.data_ptr(), None)
            call = partial(step.rows, m, tokens, positions, caches, crosses, masks, r.dec_bias)
            with torch.no_grad():
                full = _median_s(call, args.calls, args.rounds)
                c_only = _median_s(partial(step._rows_fn, *raw), args.calls, args.rounds)
                cpu = _median_s(call, args.calls, args.rounds, time.thread_time)
            first = first or full
            last = (f"{b} rows: {full / first:.1f}x a one-row step, "
                    f"{n * first / (q * full):.1f}x its {'positions' if q > 1 else 'rows'} "
                    "per second")
            row = (f"{b:>5} {n:>9} {full * 1e6:>9.0f} {c_only * 1e6:>9.0f} {cpu * 1e6:>9.0f} "
                   f"{full / first:>9.1f}x {n * first / (q * full):>7.1f}x "
                   f"{flops * n / c_only / 1e9:>8.1f}")
            if base is not None:
                # Both builds on the same rows, alternating: CPU seconds, and their logits.
                mine, theirs = torch.zeros(n, step.vocab), torch.zeros(n, base.vocab)
                args_ = (m, tokens, positions, caches, crosses, masks, r.dec_bias)
                with torch.no_grad():
                    now_s, base_s = _alternating(
                        [partial(step.rows, *args_, logits=mine),
                         partial(base.rows, *args_, logits=theirs)], args.calls, args.rounds)
                same = "yes" if torch.equal(mine, theirs) else "NO"
                row += f" {base_s * 1e6:>9.0f} {now_s / base_s:>6.2f}x {same:>5}"
                against = f"{b} rows: {now_s / base_s:.2f}x the baseline, logits same: {same}"
            print(row)
        products = [(torch.randn(n, w.shape[1]), w) for w in weights]

        def mm() -> None:
            for x, w in products:
                torch.mm(x, w.t())

        with torch.no_grad():
            mkl = _median_s(mm, args.calls, args.rounds)
        print(f"the same products through torch.mm at {n} positions: "
              f"{flops * n / mkl / 1e9:.1f} GFLOP/s")
        if args.quantization == "none":
            lib = native.load(rt.cache_root)
            assert lib is not None  # the step above was bound from it

            def c_mm() -> None:
                for x, w in products:
                    lib.products(x, w)

            c_alone = _median_s(c_mm, args.calls, args.rounds)
            print(f"the same products through the C step's own (tw_gemm) at {n} positions: "
                  f"{flops * n / c_alone / 1e9:.1f} GFLOP/s")
        print(last)
        if against:
            print(against)


if __name__ == "__main__":
    main()
