"""float32 vs int8 weights on the same C decode step: ms per request, speedup, agreement.

    taskset -c 1 python -m bench.quality [--buckets 16,32,64] [--inputs 3] [--repeats 3]
        [--new-tokens 32] [--small-inputs 2] [--small-new-tokens 32]

Built-in target: one engine with `engine.quantization: int8` serves both arms (flag override
per call), direct decoding, compiled bucketed encoder graphs, and both decode on the C step
(float32 weights and int8 weights in engine/native_step.c): the int8 arm is compared with
the float32 arm on the same implementation. Agreement (probes.quality) is against the
reference path (eager, float32, direct, exact shape); the float32 arm against the same
reference checks that the C step is exact (expected 1.0). With `ctranslate2` installed (the
`bench` extra), its int8 on the same converted model is timed and compared too.

T5-small-shaped model (random weights, d_model 512, d_ff 2048, 8 heads, 6 + 6 layers,
vocab 32128: ~60 M parameters, weights far larger than the L3): encoder then the C step
for `--small-new-tokens` tokens (no EOS stop), float32 vs int8 weights, random inputs of
each bucket's length; agreement of int8 tokens against float32's (random weights give
near-flat logits, so one flipped argmax changes the rest of the output: a lower bound).

Resident memory first (`resident_memory`, bench.resident; `--no-memory` skips it): float32
and int8 serving of each model, one engine per process, tensor bytes by kind and RSS, and
whether int8 holds no more than float32 alone.

Last line: `int8 speedup: N.NNx, agreement: A.AAAA` (built-in target: geometric-mean
speedup over buckets and domains; mean token agreement over every canary).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.engine import _canaries, by_bucket, ct2_generate, ct2_translators


@dataclass
class Arm:
    """Per-request seconds and comparisons of one arm in one bucket."""

    seconds: list[float] = field(default_factory=list)
    agreement: list[float] = field(default_factory=list)
    exact: list[bool] = field(default_factory=list)

    @property
    def ms(self) -> float:
        return statistics.median(self.seconds) * 1e3

    def agree(self) -> float:
        return statistics.fmean(self.agreement) if self.agreement else float("nan")

    def exact_share(self) -> float:
        return sum(self.exact) / len(self.exact) if self.exact else float("nan")


def _header(ct2: bool) -> str:
    return (f"{'model':<9} {'domain':<10} {'bucket':>8} {'n':>2} {'f32_ms':>8} {'int8_ms':>8} "
            f"{'speedup':>7} {'int8_agree':>10} {'int8_exact':>10} {'f32_agree':>9}"
            + (f" {'ct2_i8_ms':>9} {'ct2_i8_agree':>12}" if ct2 else ""))


def _row(model: str, domain: str, bucket: str, n: int, f32: Arm, i8: Arm,
         ct2: Arm | None) -> str:
    return (f"{model:<9} {domain:<10} {bucket:>8} {n:>2} {f32.ms:>8.1f} {i8.ms:>8.1f} "
            f"{f32.ms / i8.ms:>6.2f}x {i8.agree():>10.4f} {i8.exact_share():>10.0%} "
            f"{f32.agree():>9.4f}"
            + (f" {ct2.ms:>9.1f} {ct2.agree():>12.4f}" if ct2 is not None else ""))


def builtin(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Run the built-in target's arms; return per-bucket speedups and every agreement."""
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
    print(f"warm-up {time.perf_counter() - start:.1f} s; decode step: {engine.step_kind}; "
          f"ctranslate2={'yes' if ct2 else 'not installed'}")
    if engine.target.native is None or engine.target_q is None or engine.target_q.native is None:
        print("note: the arms do not both run the C step (see the decode step above)")
    f32, int8 = FlagOverride(quantized=False), FlagOverride(quantized=True)
    new = args.new_tokens
    print(_header(bool(ct2)))
    ratios: list[float] = []
    agreements: list[float] = []
    for domain in ("in_domain", "shifted"):
        for bucket, texts in by_bucket(engine, _canaries(domain), args.inputs).items():
            a32, a8, act2 = Arm(), Arm(), Arm()
            for text in texts:
                ref = engine.generate(text, max_new_tokens=new, override=REFERENCE).output_ids
                for _ in range(args.repeats):  # arms alternate: drift hits both alike
                    r32 = engine.generate(text, max_new_tokens=new, override=f32)
                    r8 = engine.generate(text, max_new_tokens=new, override=int8)
                    a32.seconds.append(r32.total_s)
                    a8.seconds.append(r8.total_s)
                    if ct2:
                        t0 = time.perf_counter()
                        ids = ct2_generate(ct2["int8"], engine.tokenizer, text, new)
                        act2.seconds.append(time.perf_counter() - t0)
                for arm, ids_out in ((a32, r32.output_ids), (a8, r8.output_ids)):
                    c = compare(ids_out, ref)
                    arm.agreement.append(c.agreement)
                    arm.exact.append(c.exact)
                if ct2:
                    act2.agreement.append(compare(ids, ref).agreement)
            ratios.append(a32.ms / a8.ms)
            agreements += a8.agreement
            print(_row("built-in", domain, bucket, len(texts), a32, a8, act2 if ct2 else None))
    engine.close()
    return ratios, agreements


def small_model() -> Any:
    """Return a T5-small-shaped LeanT5 with random weights (float32, CPU)."""
    import torch

    from engine import t5

    cfg, weights = small_weights()
    return t5.LeanT5(cfg, weights, dtype=torch.float32, device=torch.device("cpu"))


def small_weights() -> tuple[Any, dict[str, Any]]:
    """Return a T5-small-shaped config and random weights by Hugging Face name."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    from engine import t5

    cfg = T5Config(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6,
                   num_heads=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    with torch.device("meta"):  # shapes only: no 60 M-parameter init
        shapes = {k: v.shape for k, v in T5ForConditionalGeneration(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for name in t5.required_weights(cfg):
        shape = shapes[name]
        if len(shape) == 1:  # layer norms
            weights[name] = torch.ones(shape)
        else:  # wide enough that greedy outputs vary
            std = 1.0 if "shared" in name or "relative" in name else 1.5 / shape[-1] ** 0.5
            weights[name] = torch.randn(shape, generator=gen) * std
    return cfg, weights


def small(args: argparse.Namespace, cache_dir: Path) -> None:
    """Run the T5-small-shaped model's arms (encoder + C step, random inputs)."""
    import torch

    from engine import native, quantize, t5
    from probes.quality import compare

    lib = native.load(cache_dir)
    if lib is None:
        print("t5-small: no C compiler, or the C step failed to build: skipped")
        return
    torch.manual_seed(0)
    m = small_model()
    q = quantize.int8(m)
    params = sum({p.data_ptr(): p.numel() for p in m.parameters()}.values())  # tied: once
    print(f"t5-small: {params / 1e6:.1f} M parameters; int8 adds "
          f"{quantize.weight_bytes(q, beyond=m) / 2**20:.1f} MiB beyond the float model")
    steps = {"f32": lib.bind(m), "int8": lib.bind(q)}
    print(_header(False))
    new = args.small_new_tokens
    slots = new + 1
    gen = torch.Generator().manual_seed(1)
    for bucket in (int(b) for b in args.buckets.split(",")):
        arms = {"f32": Arm(), "int8": Arm()}
        for _ in range(args.small_inputs):
            ids = torch.randint(2, 32128, (1, bucket), generator=gen)
            mask = torch.ones((1, bucket), dtype=torch.long)
            out: dict[str, list[int]] = {}
            for _ in range(args.repeats):
                for name, model in (("f32", m), ("int8", q)):
                    with torch.no_grad():
                        t0 = time.perf_counter()
                        bias = model.mask_bias(mask)
                        cross = t5.encode(model, ids, bias, model.encoder_bias(bucket))
                        cache = model.new_self_cache(slots, static=False)
                        dec_bias = model.decoder_bias(slots)
                        toks = steps[name](model, torch.tensor([[model.decoder_start_id]]),
                                           torch.tensor([0]), cache, cross, bias,
                                           dec_bias, new)
                        arms[name].seconds.append(time.perf_counter() - t0)
                    out[name] = toks.tolist()
            c = compare(out["int8"], out["f32"])
            arms["int8"].agreement.append(c.agreement)
            arms["int8"].exact.append(c.exact)
            arms["f32"].agreement.append(1.0)
            arms["f32"].exact.append(True)
        print(_row("t5-small", "random", str(bucket), args.small_inputs, arms["f32"],
                   arms["int8"], None))


def resident_memory(args: argparse.Namespace) -> None:
    """Print float32 vs int8 serving's resident memory (bench.resident) on both models."""
    import tempfile

    from bench import resident

    models: list[tuple[str, str | None]] = [("built-in", args.model_dir)]
    with tempfile.TemporaryDirectory(prefix="t5-small-") as tmp:
        if args.small_inputs > 0:
            cfg, weights = small_weights()
            models.append(("t5-small", str(resident.save_checkpoint(cfg, weights, Path(tmp)))))
            del weights
        print("resident memory (one engine per process, after warm-up and serving; int8: "
              "float decoder weights released)")
        print(resident.HEADER)
        verdicts = []
        for name, model_dir in models:
            rows, met = resident.report(name, resident.compare(
                model_dir, buckets=args.buckets, compile_mode=args.compile_mode))
            print(rows)
            verdicts.append(f"{name} {'met' if met else 'MISSED'}")
    print(f"resident memory int8 <= float32 (tensors and RSS): {', '.join(verdicts)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buckets", default="16,32,64")
    parser.add_argument("--inputs", type=int, default=3, help="inputs per bucket and domain")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--compile-mode", default="default")
    parser.add_argument("--small-inputs", type=int, default=2,
                        help="random inputs per bucket for the T5-small-shaped model (0: skip)")
    parser.add_argument("--small-new-tokens", type=int, default=32)
    parser.add_argument("--no-memory", action="store_true",
                        help="skip resident memory (bench.resident, a process per serving)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path("var/compile-cache").resolve()))
    import torch

    torch.set_num_threads(1)
    if not args.no_memory:
        resident_memory(args)
    if args.small_inputs > 0:
        small(args, Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]))
    ratios, agreements = builtin(args)
    speedup = math.exp(statistics.fmean(math.log(r) for r in ratios))
    print(f"int8 speedup: {speedup:.2f}x, agreement: {statistics.fmean(agreements):.4f}")


if __name__ == "__main__":
    main()
