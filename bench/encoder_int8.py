"""The encoder in int8 against float32: its products, the whole encoder, and agreement.

    taskset -c 1 python -m bench.encoder_int8 [--rows 16,32,64] [--calls 15] [--no-small]
        [--no-agreement]

One thread; times are the calling thread's CPU time (`time.thread_time`, the least of
`--calls`): a call preempted by another process does not count the wait, so a busy core
shows the work itself (its caches still shared), not the queue.

1. Products: per model (the built-in target's widths, the T5-small shape's) and rows (one
   row per input token), the summed CPU microseconds of its five linear shapes (q/k/v, o,
   feed-forward in and out, cross K/V) for float32 `F.linear` (MKL; what the compiled
   float encoder calls) and engine.encoder_int8's product (rows quantized to int8,
   `torch._int_mm`, scaled back), eager and compiled, with its relative error against
   float32 (L2 norm of the difference over the reference's).
2. Encoder: `engine.t5.encode` on the built-in target and the T5-small-shaped model
   (random weights, bench.quality), float32 compiled (torch.compile, inductor, one graph
   per length: what the float arm serves), int8 compiled (what the int8 arm serves) and
   int8 eager (`engine.quantize.int8(encoder=True)`), CPU ms, with the int8 cross K/V's
   relative error. Random weights amplify any change through the layers: the T5-small
   error is no measure of quality.
3. Agreement (built-in target, direct decoding, the C step): the int8 arm with the float
   encoder (`engine.int8_encoder: false`) and with the int8 encoder (`true`), 3
   canaries per bucket and domain, 32 new tokens: mean token agreement against the eager
   float32 reference (probes.quality) and the int8 requests' median encoder ms (wall clock).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

SHAPES = {"built-in": [(576, 192), (192, 192), (512, 192), (192, 512), (384, 192)],
          "t5-small": [(1536, 512), (512, 512), (2048, 512), (512, 2048), (1024, 512)]}


def _cpu_ms(fn: Callable[[], object], calls: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return min(times) * 1e3


def _relerr(got: Any, ref: Any) -> float:
    return float((got - ref).norm() / ref.norm())


def products(rows_list: list[int], calls: int) -> None:
    """Print the summed CPU time of each model's linear shapes per implementation."""
    import torch
    from torch.nn import functional as F

    from engine.encoder_int8 import Int8EncoderWeight

    gen = torch.Generator().manual_seed(0)
    print(f"{'model':<9} {'rows':>5} {'f32_us':>8} {'int8_us':>8} {'int8_comp_us':>12} "
          f"{'int8_x':>7} {'int8_err':>8}")
    for model, shapes in SHAPES.items():
        for rows in rows_list:
            f32 = eager = comp = err = 0.0
            for out_f, in_f in shapes:
                w = torch.randn(out_f, in_f, generator=gen) / in_f ** 0.5
                x = torch.randn(1, rows, in_f, generator=gen)
                q = Int8EncoderWeight(w)
                compiled = torch.compile(q.linear, dynamic=False)
                ref = F.linear(x, w)
                f32 += _cpu_ms(partial(F.linear, x, w), calls)
                eager += _cpu_ms(partial(q.linear, x), calls)
                comp += _cpu_ms(partial(compiled, x), calls)
                err = max(err, _relerr(q.linear(x), ref))
            print(f"{model:<9} {rows:>5} {f32 * 1e3:>8.0f} {eager * 1e3:>8.0f} "
                  f"{comp * 1e3:>12.0f} {f32 / min(eager, comp):>6.2f}x {err:>8.4f}")


def encoders(rows_list: list[int], calls: int, small: bool) -> None:
    """Print the whole encoder's CPU time: float32 compiled, int8 compiled and eager."""
    import torch

    from bench import quality
    from engine import loader, quantize, t5
    from engine.config import BUILTIN_DIR

    loaded = loader.load_model(BUILTIN_DIR / "target")
    assert loaded.weights is not None
    models = {"built-in": t5.LeanT5(loaded.config, loaded.weights, dtype=torch.float32,
                                    device=torch.device("cpu"))}
    if small:
        models["t5-small"] = quality.small_model()
    gen = torch.Generator().manual_seed(0)
    print(f"{'model':<9} {'rows':>5} {'f32_compiled_ms':>15} {'int8_compiled_ms':>16} "
          f"{'int8_eager_ms':>13} {'int8_x_f32':>10} {'int8_relerr':>11}")
    for name, m in models.items():
        q = quantize.int8(m, encoder=True)
        # One compiled function per model: each traces its own weights' shapes.
        float_enc = torch.compile(t5.encode, dynamic=False)
        int8_enc = torch.compile(t5.encode, dynamic=False)
        for rows in rows_list:
            ids = torch.randint(3, m.vocab_size, (1, rows), generator=gen)
            args = (ids, m.mask_bias(torch.ones_like(ids)), m.encoder_bias(rows))
            with torch.no_grad():
                err = _relerr(int8_enc(q, *args), t5.encode(m, *args))
                fc = _cpu_ms(partial(float_enc, m, *args), calls)
                ic = _cpu_ms(partial(int8_enc, q, *args), calls)
                ie = _cpu_ms(partial(t5.encode, q, *args), calls)
            print(f"{name:<9} {rows:>5} {fc:>15.2f} {ic:>16.2f} {ie:>13.2f} "
                  f"{fc / ic:>9.2f}x {err:>11.4f}")


def agreement(buckets: str) -> None:
    """Print the built-in int8 arm's agreement with the float and with the int8 encoder."""
    from bench.engine import _canaries, by_bucket
    from engine.config import EngineConfig
    from engine.protocol import REFERENCE, FlagOverride
    from engine.runtime import Runtime
    from probes.quality import compare

    int8 = FlagOverride(quantized=True)
    print(f"{'encoder':<7} {'domain':<10} {'bucket':>8} {'n':>2} {'agreement':>9} "
          f"{'exact':>6} {'enc_ms':>7} {'total_ms':>8}")
    means = {}
    for label, int8_encoder in (("float", False), ("int8", True)):
        engine = Runtime(EngineConfig(use_draft=False, quantization="int8", flags_file="",
                                      int8_encoder=int8_encoder,
                                      buckets=tuple(int(b) for b in buckets.split(","))))
        engine.warm_up(background=False)
        every = []
        for domain in ("in_domain", "shifted"):
            for bucket, texts in by_bucket(engine, _canaries(domain), 3).items():
                agree, exact, enc, total = [], [], [], []
                for text in texts:
                    ref = engine.generate(text, max_new_tokens=32, override=REFERENCE)
                    for _ in range(3):
                        r = engine.generate(text, max_new_tokens=32, override=int8)
                        enc.append(r.encoder_s)
                        total.append(r.total_s)
                    c = compare(r.output_ids, ref.output_ids)
                    agree.append(c.agreement)
                    exact.append(c.exact)
                every += agree
                print(f"{label:<7} {domain:<10} {bucket:>8} {len(texts):>2} "
                      f"{statistics.fmean(agree):>9.4f} {sum(exact) / len(exact):>6.0%} "
                      f"{statistics.median(enc) * 1e3:>7.1f} "
                      f"{statistics.median(total) * 1e3:>8.1f}", flush=True)
        engine.close()
        means[label] = statistics.fmean(every)
    print(f"int8 agreement: float encoder {means['float']:.4f}, "
          f"int8 encoder {means['int8']:.4f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="16,32,64")
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--buckets", default="16,32,64")
    parser.add_argument("--no-small", action="store_true",
                        help="leave the T5-small-shaped model out of the encoder table")
    parser.add_argument("--no-agreement", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path("var/compile-cache").resolve()))
    import torch

    torch.set_num_threads(1)
    # Every product's and model's compiled function shares one code object: past the
    # default limit dynamo would run the rest eager and the compiled columns would lie.
    torch._dynamo.config.recompile_limit = 256
    rows = [int(r) for r in args.rows.split(",")]
    products(rows, args.calls)
    encoders(rows, args.calls, not args.no_small)
    if not args.no_agreement:
        agreement(args.buckets)


if __name__ == "__main__":
    main()
