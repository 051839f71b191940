"""float32 vs int8 weights on the same C decode step: ms per request, speedup, agreement.

    taskset -c 1 python -m bench.quality [--buckets 16,32,64] [--inputs 3] [--repeats 3]
        [--new-tokens 32] [--small-inputs 2] [--small-new-tokens 32] [--ct2-dir var/ct2]
        [--float-encoder]

Built-in target: one engine with `engine.quantization: int8` serves both arms (flag override
per call), direct decoding, compiled bucketed encoder graphs, and both decode on the C step
(float32 weights and int8 weights in engine/native_step.c): the int8 arm is compared with
the float32 arm on the same implementation. Agreement (probes.quality) is against the
reference path (eager, float32, direct, exact shape); the float32 arm against the same
reference checks that the C step is exact (expected 1.0).

T5-small-shaped model (random weights, d_model 512, d_ff 2048, 8 heads, 6 + 6 layers,
vocab 32128: ~60 M parameters, weights far larger than the L3): encoder then the C step
for `--small-new-tokens` tokens (no EOS stop), float32 vs int8 weights, random inputs of
each bucket's length; agreement of int8 tokens against float32's (random weights give
near-flat logits, so one flipped argmax changes the rest of an output: a lower bound).

CTranslate2 (the `bench` extra, `make bench-deps`; --no-ct2 leaves it out): both models'
same weights converted once with its TransformersConverter into --ct2-dir (bench.ct2),
int8 timed in this process on one thread, alternating with the engine's arms, on the same
inputs and token count (the T5-small shape: no EOS stop either); on the built-in target its
time counts tokenizing and decoding with the engine's tokenizer, as the engine's does
(`ct2_request`). Columns: its ms, its token
agreement against the same reference as the engine's int8 (built-in: the eager float32
reference; T5-small: the engine's float32 tokens), engine int8 ms / its int8 ms, and the
share of inputs where its float32 gives the engine float32's tokens exactly (the conversion
checked). Second to last line: `engine int8 / CTranslate2 int8 time: built-in Nx (Nx without
the eager overflow rows), t5-small Nx` (median over buckets; below 1x the engine is faster).

The int8 arm's encoder multiplies int8 weights too (engine.int8_encoder set on, whatever
this host's measured products would decide; engine.encoder_int8, compiled), on both models
and in the resident memory;
`--float-encoder`: the int8 arm shares the float32 arm's encoder instead (compiled on the
built-in target, eager on the T5-small shape, for both arms).

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
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import ct2
from bench.engine import _canaries, by_bucket


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
            + (f" {'ct2_i8_ms':>9} {'ct2_i8_agree':>12} {'eng/ct2_i8':>10} {'ct2_f32_same':>12}"
               if ct2 else ""))


def _row(model: str, domain: str, bucket: str, n: int, f32: Arm, i8: Arm,
         ct2: Arm | None, ct2_f32: Arm | None) -> str:
    row = (f"{model:<9} {domain:<10} {bucket:>8} {n:>2} {f32.ms:>8.1f} {i8.ms:>8.1f} "
           f"{f32.ms / i8.ms:>6.2f}x {i8.agree():>10.4f} {i8.exact_share():>10.0%} "
           f"{f32.agree():>9.4f}")
    if ct2 is not None and ct2_f32 is not None:
        row += (f" {ct2.ms:>9.1f} {ct2.agree():>12.4f} {i8.ms / ct2.ms:>9.2f}x "
                f"{ct2_f32.exact_share():>12.0%}")
    return row


def ct2_request(model: ct2.Ct2, tokenizer: Any, text: str, new: int
                ) -> tuple[list[int], str]:
    """Return CTranslate2's output ids and text for `text`: tokenized, generated and
    decoded with the engine's tokenizer, as an engine request is (its total_s counts the
    three), so the two times differ by the model's implementation only."""
    out = model.generate([tokenizer(text).input_ids], new)[0]
    return out, tokenizer.decode(out, skip_special_tokens=True)


def builtin(args: argparse.Namespace
            ) -> tuple[list[float], list[float], dict[tuple[str, str], float]]:
    """Run the built-in target's arms; return per-bucket speedups, every agreement and the
    engine int8 / CTranslate2 int8 time ratio by (domain, bucket) ({} without CTranslate2)."""
    from engine.config import BUILTIN_DIR, EngineConfig
    from engine.protocol import REFERENCE, FlagOverride
    from engine.runtime import Runtime
    from probes.quality import compare

    config = EngineConfig(model_dir=args.model_dir, use_draft=False, quantization="int8",
                          int8_encoder=not args.float_encoder,
                          buckets=tuple(int(b) for b in args.buckets.split(",")),
                          compile_mode=args.compile_mode, flags_file="")
    engine = Runtime(config)
    start = time.perf_counter()
    engine.warm_up(background=False)
    model_dir = args.model_dir or str(BUILTIN_DIR / "target")
    cts = {} if args.no_ct2 else ct2.load(model_dir, Path(args.ct2_dir))
    print(f"warm-up {time.perf_counter() - start:.1f} s; decode step: {engine.step_kind}; "
          f"ctranslate2={ct2.version() + ' (same process, one thread)' if cts else 'no'}")
    if engine.target.native is None or engine.target_q is None or engine.target_q.native is None:
        print("note: the arms do not both run the C step (see the decode step above)")
    f32, int8 = FlagOverride(quantized=False), FlagOverride(quantized=True)
    new = args.new_tokens
    print(_header(bool(cts)))
    ratios: list[float] = []
    agreements: list[float] = []
    vs_ct2: dict[tuple[str, str], float] = {}
    for domain in ("in_domain", "shifted"):
        for bucket, texts in by_bucket(engine, _canaries(domain), args.inputs).items():
            a32, a8, act2, act2_32 = Arm(), Arm(), Arm(), Arm()
            for text in texts:
                ref = engine.generate(text, max_new_tokens=new, override=REFERENCE).output_ids
                ids = engine.tokenizer(text).input_ids
                for _ in range(args.repeats):  # arms alternate: drift hits both alike
                    r32 = engine.generate(text, max_new_tokens=new, override=f32)
                    r8 = engine.generate(text, max_new_tokens=new, override=int8)
                    a32.seconds.append(r32.total_s)
                    a8.seconds.append(r8.total_s)
                    if cts:
                        t0 = time.perf_counter()
                        out_ct2, _ = ct2_request(cts["int8"], engine.tokenizer, text, new)
                        act2.seconds.append(time.perf_counter() - t0)
                for arm, ids_out in ((a32, r32.output_ids), (a8, r8.output_ids)):
                    c = compare(ids_out, ref)
                    arm.agreement.append(c.agreement)
                    arm.exact.append(c.exact)
                if cts:
                    act2.agreement.append(compare(out_ct2, ref).agreement)
                    # The conversion itself: CTranslate2 float32 against the engine's float32.
                    same = cts["float32"].generate([ids], new)[0] == list(r32.output_ids)
                    act2_32.exact.append(same)
            ratios.append(a32.ms / a8.ms)
            agreements += a8.agreement
            if cts:
                vs_ct2[(domain, bucket)] = a8.ms / act2.ms
            print(_row("built-in", domain, bucket, len(texts), a32, a8,
                       act2 if cts else None, act2_32 if cts else None))
    engine.close()
    return ratios, agreements, vs_ct2


def small_config(**changes: Any) -> Any:
    """Return the T5-small-shaped T5Config (`changes`: other sizes, for tests)."""
    from transformers import T5Config

    base: dict[str, Any] = dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048,
                                num_layers=6, num_heads=8, decoder_start_token_id=0,
                                pad_token_id=0, eos_token_id=1)
    return T5Config(**{**base, **changes})


def small_weights(cfg: Any, seed: int = 0) -> dict[str, Any]:
    """Return random weights by HF name for `cfg` (what LeanT5 reads; lm_head tied)."""
    import torch
    from transformers import T5ForConditionalGeneration

    from engine import t5

    with torch.device("meta"):  # shapes only: no 60 M-parameter init
        shapes = {k: v.shape for k, v in T5ForConditionalGeneration(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name in t5.required_weights(cfg):
        shape = shapes[name]
        if len(shape) == 1:  # layer norms
            weights[name] = torch.ones(shape)
        else:  # wide enough that greedy outputs vary
            std = 1.0 if "shared" in name or "relative" in name else 1.5 / shape[-1] ** 0.5
            weights[name] = torch.randn(shape, generator=gen) * std
    return weights


def small_model(cfg: Any = None, weights: dict[str, Any] | None = None) -> Any:
    """Return a T5-small-shaped LeanT5 with random weights (float32, CPU)."""
    import torch

    from engine import t5

    cfg = cfg if cfg is not None else small_config()
    weights = weights if weights is not None else small_weights(cfg)
    return t5.LeanT5(cfg, weights, dtype=torch.float32, device=torch.device("cpu"))


def small_hf(cfg: Any, weights: dict[str, Any], source_dir: Path) -> Any:
    """Return the transformers model of the same weights, and write what CTranslate2's
    converter reads besides them into `source_dir` (config, the byte tokenizer)."""
    import torch
    from transformers import T5ForConditionalGeneration

    from engine.config import BUILTIN_DIR

    with torch.device("meta"):
        hf = T5ForConditionalGeneration(cfg)
    # Copies: the converter may rewrite its model's tensors in place, and the engine's
    # LeanT5 holds these same tensors.
    copies = {name: w.detach().clone() for name, w in weights.items()}
    missing, unexpected = hf.load_state_dict(copies, strict=False, assign=True)
    hf.tie_weights()  # embed_tokens and lm_head are the shared embedding
    left = [n for n, p in hf.named_parameters() if p.is_meta]
    if left or unexpected:
        raise ValueError(f"weights do not fill the model: missing {left}, unexpected "
                         f"{unexpected}")
    source_dir.mkdir(parents=True, exist_ok=True)
    hf.config.save_pretrained(source_dir)
    # Byte tokens (ids 3-258); the converter names the ids above them <extra_id_N>.
    shutil.copy(BUILTIN_DIR / "target" / "tokenizer_config.json", source_dir)
    return hf.eval()


def small_decode(step: Any, model: Any, ids: Any, new: int) -> list[int]:
    """Return `new` greedy tokens (no EOS stop) of `model` for input ids [1, n]: the
    encoder, then the C step `step` (engine.native) for every token."""
    import torch

    from engine import t5

    with torch.no_grad():
        mask = torch.ones_like(ids)
        bias = model.mask_bias(mask)
        cross = t5.encode(model, ids, bias, model.encoder_bias(ids.shape[1]))
        slots = new + 1
        cache = model.new_self_cache(slots, static=False)
        toks = step(model, torch.tensor([[model.decoder_start_id]]), torch.tensor([0]),
                    cache, cross, bias, model.decoder_bias(slots), new)
    return [int(t) for t in toks.tolist()]


def small(args: argparse.Namespace, cache_dir: Path) -> list[float]:
    """Run the T5-small-shaped model's arms (encoder + C step, random inputs); return the
    per-bucket engine int8 / CTranslate2 int8 time ratios ([] without CTranslate2)."""
    import torch

    from engine import native, quantize
    from probes.quality import compare

    lib = native.load(cache_dir)
    if lib is None:
        print("t5-small: no C compiler, or the C step failed to build: skipped")
        return []
    torch.manual_seed(0)
    cfg = small_config()
    weights = small_weights(cfg)
    m = small_model(cfg, weights)
    q = quantize.int8(m, encoder=not args.float_encoder)
    params = sum({p.data_ptr(): p.numel() for p in m.parameters()}.values())  # tied: once
    print(f"t5-small: {params / 1e6:.1f} M parameters; int8 adds "
          f"{quantize.weight_bytes(q, beyond=m) / 2**20:.1f} MiB beyond the float model")
    cts: dict[str, ct2.Ct2] = {}
    if not args.no_ct2 and ct2.available():
        source = Path(args.ct2_dir) / "t5-small-random"
        cts = ct2.load(source, Path(args.ct2_dir), model=small_hf(cfg, weights, source))
    steps = {"f32": lib.bind(m), "int8": lib.bind(q)}
    print(_header(bool(cts)))
    new = args.small_new_tokens
    gen = torch.Generator().manual_seed(1)
    vs_ct2: list[float] = []
    for bucket in (int(b) for b in args.buckets.split(",")):
        arms = {"f32": Arm(), "int8": Arm(), "ct2": Arm(), "ct2_f32": Arm()}
        for _ in range(args.small_inputs):
            ids = torch.randint(2, 32128, (1, bucket), generator=gen)
            out: dict[str, list[int]] = {}
            for _ in range(args.repeats):
                for name, model in (("f32", m), ("int8", q)):
                    t0 = time.perf_counter()
                    out[name] = small_decode(steps[name], model, ids, new)
                    arms[name].seconds.append(time.perf_counter() - t0)
                if cts:  # no EOS stop either: the same `new` tokens as the C step
                    t0 = time.perf_counter()
                    out["ct2"] = cts["int8"].generate(ids.tolist(), new, stop_at_eos=False)[0]
                    arms["ct2"].seconds.append(time.perf_counter() - t0)
            c = compare(out["int8"], out["f32"])
            arms["int8"].agreement.append(c.agreement)
            arms["int8"].exact.append(c.exact)
            arms["f32"].agreement.append(1.0)
            arms["f32"].exact.append(True)
            if cts:
                arms["ct2"].agreement.append(compare(out["ct2"], out["f32"]).agreement)
                f32_ct2 = cts["float32"].generate(ids.tolist(), new, stop_at_eos=False)[0]
                arms["ct2_f32"].exact.append(f32_ct2 == out["f32"])
        if cts:
            vs_ct2.append(arms["int8"].ms / arms["ct2"].ms)
        print(_row("t5-small", "random", str(bucket), args.small_inputs, arms["f32"],
                   arms["int8"], arms["ct2"] if cts else None,
                   arms["ct2_f32"] if cts else None))
    return vs_ct2


def _median(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f}x" if ratios else "not measured"


def resident_memory(args: argparse.Namespace) -> None:
    """Print float32 vs int8 serving's resident memory (bench.resident) on both models."""
    import tempfile

    from bench import resident

    models: list[tuple[str, str | None]] = [("built-in", args.model_dir)]
    with tempfile.TemporaryDirectory(prefix="t5-small-") as tmp:
        if args.small_inputs > 0:
            cfg = small_config()
            weights = small_weights(cfg)
            models.append(("t5-small", str(resident.save_checkpoint(cfg, weights, Path(tmp)))))
            del weights
        print("resident memory (one engine per process, after warm-up and serving; int8: "
              "float decoder weights released)")
        print(resident.HEADER)
        verdicts = []
        for name, model_dir in models:
            rows, met = resident.report(name, resident.compare(
                model_dir, buckets=args.buckets, compile_mode=args.compile_mode,
                int8_encoder=not args.float_encoder))
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
    parser.add_argument("--ct2-dir", default=str(ct2.DEFAULT_DIR),
                        help="where CTranslate2's conversions are kept (converted once)")
    parser.add_argument("--no-ct2", action="store_true", help="leave CTranslate2 out")
    parser.add_argument("--float-encoder", action="store_true",
                        help="the int8 arm shares the float encoder (engine.int8_encoder off)")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip resident memory (bench.resident, a process per serving)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path("var/compile-cache").resolve()))
    import torch

    torch.set_num_threads(1)
    if not args.no_memory:
        resident_memory(args)
    small_vs_ct2 = small(args, Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])) \
        if args.small_inputs > 0 else []
    ratios, agreements, builtin_vs_ct2 = builtin(args)
    if builtin_vs_ct2 or small_vs_ct2:
        # The eager overflow rows: int8 buys the eager path nothing (engine/quantize.py).
        compiled = [r for (_, b), r in builtin_vs_ct2.items() if not b.startswith("overflow")]
        print(f"engine int8 / CTranslate2 int8 time: built-in "
              f"{_median(list(builtin_vs_ct2.values()))} ({_median(compiled)} without the "
              f"eager overflow rows), t5-small {_median(small_vs_ct2)} (median over buckets; "
              f"below 1x the engine is faster)")
    speedup = math.exp(statistics.fmean(math.log(r) for r in ratios))
    print(f"int8 speedup: {speedup:.2f}x, agreement: {statistics.fmean(agreements):.4f}")


if __name__ == "__main__":
    main()
