"""float32 vs int8 weights: latency ratio and output agreement per bucket and domain.

    python -m bench.quality [--buckets 16,32,64,128,256] [--inputs 4] [--repeats 3]

One engine with `engine.quantization: int8` serves both arms (flag override per call),
direct decoding, compiled bucketed graphs. Agreement (probes.quality) is against the
reference path (eager, float32, direct, exact shape); the compiled float32 arm against the
same reference checks that compilation is exact (expected 1.0). With `ctranslate2`
installed (the `bench` extra), its int8 on the same converted model is compared too.
Run pinned: `taskset -c 1 python -m bench.quality`.
Last line: `int8 speedup: N.NNx, agreement: A.AAAA` (geometric-mean speedup over
buckets and domains; mean token agreement over every canary).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path

from bench.engine import _canaries, by_bucket, ct2_generate, ct2_translators


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buckets", default="16,32,64,128,256")
    parser.add_argument("--inputs", type=int, default=4, help="inputs per bucket and domain")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--compile-mode", default="default")
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path("var/compile-cache").resolve()))

    from engine.config import BUILTIN_DIR, EngineConfig
    from engine.protocol import REFERENCE, FlagOverride
    from engine.runtime import Runtime
    from probes.quality import compare

    config = EngineConfig(model_dir=args.model_dir, use_draft=False, quantization="int8",
                          buckets=tuple(int(b) for b in args.buckets.split(",")),
                          compile_mode=args.compile_mode, flags_file="")
    engine = Runtime(config)
    start = time.perf_counter()
    engine.warm_up(background=False)
    model_dir = args.model_dir or str(BUILTIN_DIR / "target")
    ct2 = ct2_translators(model_dir, Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]))
    print(f"warm-up {time.perf_counter() - start:.1f} s (float32 and int8 graphs), "
          f"ctranslate2={'yes' if ct2 else 'not installed'}")
    f32, int8 = FlagOverride(quantized=False), FlagOverride(quantized=True)
    new = args.new_tokens
    print(f"{'domain':<10} {'bucket':>6} {'n':>2} {'f32_ms':>8} {'int8_ms':>8} {'speedup':>7} "
          f"{'int8_agree':>10} {'int8_exact':>10} {'compiled_agree':>14}"
          + (f" {'ct2_i8_agree':>12}" if ct2 else ""))
    ratios: list[float] = []
    agreements: list[float] = []
    for domain in ("in_domain", "shifted"):
        for bucket, texts in by_bucket(engine, _canaries(domain), args.inputs).items():
            t32: list[float] = []
            t8: list[float] = []
            a8: list[float] = []
            e8: list[bool] = []
            a32: list[float] = []
            act2: list[float] = []
            for text in texts:
                ref = engine.generate(text, max_new_tokens=new, override=REFERENCE).output_ids
                for _ in range(args.repeats):
                    r32 = engine.generate(text, max_new_tokens=new, override=f32)
                    r8 = engine.generate(text, max_new_tokens=new, override=int8)
                    t32.append(r32.total_s)
                    t8.append(r8.total_s)
                c8 = compare(r8.output_ids, ref)
                a8.append(c8.agreement)
                e8.append(c8.exact)
                a32.append(compare(r32.output_ids, ref).agreement)
                if ct2:
                    ids = ct2_generate(ct2["int8"], engine.tokenizer, text, new)
                    act2.append(compare(ids, ref).agreement)
            ratio = statistics.median(t32) / statistics.median(t8)
            ratios.append(ratio)
            agreements += a8
            print(f"{domain:<10} {bucket:>6} {len(texts):>2} {statistics.median(t32) * 1e3:>8.1f} "
                  f"{statistics.median(t8) * 1e3:>8.1f} {ratio:>6.2f}x "
                  f"{statistics.fmean(a8):>10.4f} {sum(e8) / len(e8):>10.0%} "
                  f"{statistics.fmean(a32):>14.4f}"
                  + (f" {statistics.fmean(act2):>12.4f}" if ct2 else ""))
    engine.close()
    speedup = math.exp(statistics.fmean(math.log(r) for r in ratios))
    print(f"int8 speedup: {speedup:.2f}x, agreement: {statistics.fmean(agreements):.4f}")


if __name__ == "__main__":
    main()
