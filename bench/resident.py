"""Resident memory of float32 vs int8 serving: tensor bytes by kind and the process's RSS.

    taskset -c 1 python -m bench.resident --model-dir DIR --quantization int8

One engine per process (RSS is the process's): load, warm up, serve `--requests` built-in
canaries the way the engine serves by default (int8 where `quantization: int8`), then
measure the tensors its runners hold (engine.memory.held_tensors: parameters, int8 weights
and scales, the C step's row sums, bias tables; KV caches and scratch not counted) and RSS.
With int8, the float target's decoder weights are released first, as the engine does
`engine.float_weights.HOLD_S` after the last float request (warm-up held them), and one
float32 request then measures what the float32 arm costs: its reload and what it holds
while resident. Prints one JSON line. `compare` runs both servings of a model, each in a
process of its own, for bench.quality.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

MiB = 2**20


def _kinds(held: dict[str, int]) -> dict[str, int]:
    """Return held bytes by kind: float weights, int8 weights and scales, tables, row sums."""
    out: dict[str, int] = {}
    for label, nbytes in held.items():
        name = label.split(".", 1)[1]
        if name == "tables":
            kind = "tables"
        elif name == "c_step":
            kind = "int8 row sums"
        elif name.endswith((".q", ".scale")) or name == "encoder_int8":
            kind = "int8 weights"
        else:
            kind = "float weights"
        out[kind] = out.get(kind, 0) + nbytes
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Serve with one engine in this process; return what it holds (see the module doc)."""
    import psutil

    from bench.engine import _canaries
    from engine import malloc
    from engine.config import EngineConfig
    from engine.memory import held_tensors
    from engine.protocol import FlagOverride
    from engine.runtime import Runtime

    proc = psutil.Process()
    engine = Runtime(EngineConfig(
        model_dir=args.model_dir, use_draft=False, quantization=args.quantization,
        int8_encoder=args.int8_encoder and args.quantization == "int8",
        buckets=tuple(int(b) for b in args.buckets.split(",")),
        compile_mode=args.compile_mode, flags_file=""))
    engine.warm_up(background=False)
    texts = [t for t in _canaries("in_domain")
             if engine.bucket_for(engine.count_tokens(t)) != "overflow"][: args.requests]
    for text in texts:
        engine.generate(text, max_new_tokens=args.new_tokens)
    weights = engine.target.weights

    def settled() -> tuple[int, int]:
        if weights is not None:
            weights.release_idle()  # what HOLD_S after the last float request does
        gc.collect()
        malloc.trim()
        return sum(held_tensors(engine.models.runners()).values()), proc.memory_info().rss

    tensors, rss = settled()
    out: dict[str, Any] = {
        "quantization": args.quantization, "step": engine.step_kind, "tensors": tensors,
        "rss": rss, "kinds": _kinds(held_tensors(engine.models.runners())),
    }
    if weights is not None:
        r = engine.generate(texts[0], max_new_tokens=args.new_tokens,
                            override=FlagOverride(quantized=False))
        out.update(arm_tensors=sum(held_tensors(engine.models.runners()).values()),
                   arm_rss=proc.memory_info().rss, arm_reload_s=weights.reload_s,
                   arm_native=r.native_step, arm_bytes=weights.nbytes)
        out["tensors_after_arm"], out["rss_after_arm"] = settled()
    engine.close()
    return out


def compare(model_dir: str | None, *, buckets: str, compile_mode: str, requests: int = 6,
            new_tokens: int = 16, int8_encoder: bool = False) -> dict[str, dict[str, Any]]:
    """Return `measure` for float32 and int8 serving of `model_dir` (None: built-in), each
    in a fresh process pinned like this one (`int8_encoder`: int8 serving's encoder too)."""
    out = {}
    for q in ("none", "int8"):
        cmd = [sys.executable, "-m", "bench.resident", "--quantization", q,
               "--buckets", buckets, "--compile-mode", compile_mode,
               "--requests", str(requests), "--new-tokens", str(new_tokens)]
        if model_dir is not None:
            cmd += ["--model-dir", model_dir]
        if int8_encoder:
            cmd.append("--int8-encoder")
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"bench.resident failed ({q}): {done.stderr.strip()[-2000:]}")
        out[q] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def save_checkpoint(cfg: Any, weights: dict[str, Any], path: Path) -> Path:
    """Save HF-named `weights` with `cfg` as a model directory the engine loads, with a
    character-level tokenizer as large as its vocabulary (random weights emit any id)."""
    import string

    from safetensors.torch import save_file
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for c in string.printable:
        if not c.isspace() or c == " ":
            vocab.setdefault(c, len(vocab))
    vocab.update({f"<t{i}>": i for i in range(len(vocab), cfg.vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>",
                                                       special_tokens=[("</s>", 1)])
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)
    return path


def report(name: str, both: dict[str, dict[str, Any]]) -> tuple[str, bool]:
    """Return the rows of one model's float32 vs int8 serving and whether int8 holds no more
    (tensor bytes and RSS) than float32 alone."""
    f, q = both["none"], both["int8"]
    lines = []
    for label, r in (("float32", f), ("int8", q)):
        kinds = ", ".join(f"{k} {v / MiB:.1f}" for k, v in sorted(r["kinds"].items()))
        lines.append(f"{name:<9} {label:<8} {r['tensors'] / MiB:>11.1f} {r['rss'] / MiB:>8.1f}"
                     f"  ({kinds})")
    if "arm_tensors" in q:
        lines.append(f"{name:<9} {'f32 arm':<8} {q['arm_tensors'] / MiB:>11.1f} "
                     f"{q['arm_rss'] / MiB:>8.1f}  (float32 arm while held: "
                     f"+{q['arm_bytes'] / MiB:.1f} MiB reloaded in {q['arm_reload_s']:.2f} s; "
                     f"released: {q['tensors_after_arm'] / MiB:.1f} MiB tensors, "
                     f"{q['rss_after_arm'] / MiB:.1f} MiB RSS)")
    met = q["tensors"] <= f["tensors"] and q["rss"] <= f["rss"]
    return "\n".join(lines), met


HEADER = f"{'model':<9} {'serving':<8} {'tensors_MiB':>11} {'rss_MiB':>8}  (by kind, MiB)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--quantization", default="int8", choices=("none", "int8"))
    parser.add_argument("--buckets", default="16,32,64")
    parser.add_argument("--compile-mode", default="default")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--int8-encoder", action="store_true",
                        help="int8 serving's encoder in int8 too (engine.int8_encoder)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path("var/compile-cache").resolve()))
    import torch

    torch.set_num_threads(1)
    print(json.dumps(measure(args)))


if __name__ == "__main__":
    main()
