"""The target's encoder on several inputs at once: CPU time per input, and is each row
bitwise what the served (compiled, batch-1) encoder gives that input alone?

    taskset -c 1 python -m bench.encoder_batch [--buckets 16,32,64,128] [--batches 1,4,8]

One process, the built-in target, one thread, inductor (the engine's options): the served
graph (`engine.t5.encode`, input length dynamic, as engine.runner compiles it) against
`engine.t5.encode_batch` compiled with the batch and the length dynamic. For each bucket,
B random inputs of random real lengths padded to it: the CPU milliseconds per input (the
calling thread's time: what a contended core still measures), and whether every row of the
batched call equals the served graph's output for that input alone, bit for bit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any


def _cpu_ms(fn: Callable[[], Any], calls: int = 10, rounds: int = 5) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        times.append((time.thread_time() - t0) / calls * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buckets", default="16,32,64,128")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--cache-dir", default="var/compile-cache")
    args = ap.parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(args.cache_dir))
    import torch

    from engine import EngineConfig, t5
    from engine.models import INDUCTOR_OPTIONS
    from engine.runtime import Runtime

    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        rt = Runtime(EngineConfig(compile_backend="eager", cache_dir=tmp, num_threads=1))
        r, m = rt.target, rt.target.m
        options = dict(INDUCTOR_OPTIONS)
        served = torch.compile(t5.encode, dynamic=False, backend="inductor", options=options)
        batched = torch.compile(t5.encode_batch, dynamic=False, backend="inductor",
                                options=options)
        served(*r._encode_example(16))
        ids = torch.full((2, 16), m.eos_id, dtype=torch.long)
        masks = m.mask_bias(torch.ones((1, 16), dtype=torch.long)).expand(2, 1, 1, 16)
        masks = masks.contiguous()
        for tensor in (ids, masks):  # the batch and the length dynamic
            torch._dynamo.mark_dynamic(tensor, 0)
            torch._dynamo.mark_dynamic(tensor, tensor.dim() - 1)
        batched(m, ids, masks, r._encode_example(16)[3])
        gen = torch.Generator().manual_seed(0)
        sizes = [int(b) for b in args.batches.split(",")]
        print(f"{'bucket':>6} {'served_ms':>10}"
              + "".join(f" {f'batch{b}_ms':>10}" for b in sizes) + "  rows bitwise served")
        for edge in (int(e) for e in args.buckets.split(",")):
            b = max(sizes)
            ids = torch.randint(3, m.vocab_size, (b, edge), generator=gen)
            mask = torch.zeros((b, edge), dtype=torch.long)
            for i, n in enumerate(torch.randint(2, edge + 1, (b,), generator=gen).tolist()):
                mask[i, :n] = 1
                ids[i, n:] = m.pad_id
            bias = torch.cat([m.mask_bias(mask[i:i + 1]) for i in range(b)])
            enc = r.encoder_bias(edge)
            alone = [served(m, ids[i:i + 1], bias[i:i + 1], enc).clone() for i in range(b)]
            same = all(torch.equal(batched(m, ids[:s], bias[:s], enc)[i], alone[i])
                       for s in sizes for i in range(s))
            base = _cpu_ms(partial(served, m, ids[:1], bias[:1], enc))
            per = [_cpu_ms(partial(batched, m, ids[:s], bias[:s], enc)) / s for s in sizes]
            print(f"{edge:>6} {base:>10.2f}" + "".join(f" {p:>10.2f}" for p in per)
                  + f"  {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
