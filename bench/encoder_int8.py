"""The encoder's linear products: float32 against the int8 paths torch has on this CPU.

    taskset -c 1 python -m bench.encoder_int8 [--rows 16,64,256] [--calls 20]

Per model (the built-in target's widths, the T5-small shape's) and rows (an encoder
product has one row per input token), the summed median microseconds of its four linear
shapes (q/k/v, o, feed-forward in and out) for: float32 `F.linear` (what the encoder runs),
`F.linear(x, q.to(float)) * scale` (dequantizing per call) and
`torch.ops.quantized.linear_dynamic` (the quantized engine's int8 product with activations
quantized per call, per tensor), with its relative error against float32 (L2 norm of the
difference over the reference's). One thread.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

SHAPES = {"built-in": [(576, 192), (192, 192), (512, 192), (192, 512)],
          "t5-small": [(1536, 512), (512, 512), (2048, 512), (512, 2048)]}


def _us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="16,64,256")
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args(argv)
    import torch
    from torch.nn import functional as F

    torch.set_num_threads(1)
    warnings.simplefilter("ignore", UserWarning)  # torch's deprecation of qint8 tensors
    gen = torch.Generator().manual_seed(0)
    print(f"quantized engine: {torch.backends.quantized.engine}")
    print(f"{'model':<9} {'rows':>5} {'f32_us':>9} {'dequant_us':>10} {'dynamic_us':>10} "
          f"{'dynamic_x':>9} {'dyn_relerr':>10}")
    for model, shapes in SHAPES.items():
        for rows in (int(r) for r in args.rows.split(",")):
            f32 = deq = dyn = 0.0
            errs = []
            for out_f, in_f in shapes:
                w = torch.randn(out_f, in_f, generator=gen) / in_f ** 0.5
                x = torch.randn(1, rows, in_f, generator=gen)
                scale = w.abs().amax(1) / 127
                q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
                packed = torch.ops.quantized.linear_prepack(torch.quantize_per_channel(
                    w, scale.double(), torch.zeros(out_f, dtype=torch.long), 0, torch.qint8),
                    None)
                f32 += _us(lambda x=x, w=w: F.linear(x, w), args.calls)
                deq += _us(lambda x=x, q=q, s=scale: F.linear(x, q.float()) * s, args.calls)
                dyn += _us(lambda x=x, p=packed: torch.ops.quantized.linear_dynamic(x, p, True),
                           args.calls)
                ref = F.linear(x, w)
                got = torch.ops.quantized.linear_dynamic(x, packed, True)
                errs.append(float((got - ref).norm() / ref.norm()))
            print(f"{model:<9} {rows:>5} {f32:>9.0f} {deq:>10.0f} {dyn:>10.0f} "
                  f"{f32 / dyn:>8.2f}x {max(errs):>10.4f}")


if __name__ == "__main__":
    main()
