"""The C step's boundary checks against the step they guard (engine.native_checks).

    taskset -c 1 python -m bench.boundary [--calls 2000] [--tokens 32] [--rows 8]

On the built-in target and draft, as they are called when serving (the target one token per
C call, the draft a round of speculative_k tokens per call): the median time of one call (at
a mid-answer position), of the full tensor checks a request's first call makes, of the
identity check every later call makes, and the checks' share of a call and of a request of
`--tokens` tokens; and the target's batched step of `--rows` rows (engine.native `rows`), whose
rows are checked by identity per step. Last line: `boundary cost: N% of a step` (the largest
share).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable


def _median_s(fn: Callable[[], object], calls: int) -> float:
    for _ in range(min(calls, 50)):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure(runner, steps: int, tokens: int, calls: int) -> float:
    """Print one model's row; return the checks' larger share (of a call, of a request)."""
    import torch

    from engine.native_checks import INTEGER, check_request, check_tokens

    m, fn = runner.m, runner.native
    cache = m.new_self_cache(runner.slots, static=False)
    cross = torch.randn((len(m.dec_layers), 2, m.n_heads, 32, m.d_kv))
    mask = m.mask_bias(torch.ones((1, 32), dtype=torch.long))
    pos = tokens // 2
    token, at, bias = torch.tensor([[5]]), runner.positions[pos], runner.bias_for(pos + steps)
    with torch.no_grad():
        call = _median_s(lambda: fn(m, token, at, cache, cross, mask, bias, steps), calls)
    dims = fn.boundary.dims

    def full() -> None:  # a request's first call: its cross K/V and mask (the slot's cache
        # and the bias corners are checked once per thread, not per request)
        check_request(dims, cache, cross, mask, cache_checked=True)

    def memo() -> None:  # what BoundStep.__call__ checks on a request's later calls
        fn.boundary.tensors(cache, cross, mask, bias)
        if token.dtype not in INTEGER:
            check_tokens("token", token, 1)

    full_s, memo_s = _median_s(full, calls), _median_s(memo, calls)
    n = max(1, tokens // steps)  # calls per request
    request = (full_s + (n - 1) * memo_s) / (n * call)
    print(f"{runner.name:>7} {steps:8d} {call * 1e6:8.1f} {full_s * 1e6:8.2f} "
          f"{memo_s * 1e6:8.2f} {memo_s / call:8.2%} {request:7.2%}")
    return max(request, memo_s / call)


def _measure_rows(runner, rows: int, tokens: int, calls: int) -> float:
    """Print the batched step's row; return the per-step checks' share of a step."""
    import torch

    m, fn = runner.m, runner.native
    caches = [m.new_self_cache(runner.slots, static=False) for _ in range(rows)]
    crosses = [torch.randn((len(m.dec_layers), 2, m.n_heads, 16 + 4 * (r % 4), m.d_kv))
               for r in range(rows)]
    masks = [m.mask_bias(torch.ones((1, c.shape[-2]), dtype=torch.long)) for c in crosses]
    toks = torch.full((rows,), 5, dtype=torch.long)
    pos = torch.tensor([tokens // 2 + r % 3 for r in range(rows)], dtype=torch.long)
    bias = runner.dec_bias
    with torch.no_grad():
        call = _median_s(lambda: fn.rows(m, toks, pos, caches, crosses, masks, bias), calls)
    memo_s = _median_s(lambda: fn.boundary.rows(toks, pos, caches, crosses, masks, bias), calls)
    print(f"{runner.name + ' B=' + str(rows):>12} {call * 1e6:8.1f} {memo_s * 1e6:8.2f} "
          f"{memo_s / call:9.2%}")
    return memo_s / call


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=32, help="steps per request")
    parser.add_argument("--rows", type=int, default=8, help="rows of the batched step")
    args = parser.parse_args(argv)

    import torch

    from engine.config import EngineConfig
    from engine.runtime import Runtime

    torch.set_num_threads(1)
    rt = Runtime(EngineConfig(device="cpu", dtype="float32"))
    worst = 0.0
    print(f"torch {torch.__version__}, one thread; calls={args.calls}, "
          f"tokens/request={args.tokens}")
    # The target steps one token per call; the draft proposes a round (k tokens) per call.
    print(f"{'model':>7} {'tok/call':>8} {'call_us':>8} {'full_us':>8} {'memo_us':>8} "
          f"{'memo/call':>9} {'request':>8}")
    for runner, steps in ((rt.target, 1), (rt.draft, rt.config.speculative_k)):
        if runner is None or runner.native is None:
            print(f"{getattr(runner, 'name', 'draft')}: no C step ({rt.step_kind})")
            continue
        worst = max(worst, _measure(runner, steps, args.tokens, args.calls))
    if rt.target.native is not None and args.rows > 0:
        print(f"{'batched':>12} {'call_us':>8} {'memo_us':>8} {'memo/call':>9}")
        worst = max(worst, _measure_rows(rt.target, args.rows, args.tokens, args.calls))
    rt.close()
    print(f"boundary cost: {worst:.2%} of a step")


if __name__ == "__main__":
    main()
