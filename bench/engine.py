"""Engine vs HF generate(): median per-request latency per bucket, compile and restart cost.

    python -m bench.engine [--buckets 16,32,64,128,256] [--inputs 4] [--repeats 2]

Both run greedy on the same built-in canary inputs in this process after warm-up,
one intra-op thread. With `ctranslate2` installed (the `bench` extra, `make
bench-deps`; --no-ct2 leaves it out), CTranslate2 float32 and int8 run the same inputs
on the same weights (converted once with its TransformersConverter into --ct2-dir,
bench.ct2), one thread, in this process, and their outputs are compared token for token
with the engine's (identical outputs and token agreement per compute type). Run pinned to one core: `taskset -c 1 python -m bench.engine`. The warm
restart runs in a subprocess sharing TORCHINDUCTOR_CACHE_DIR. Last line:
`median speedup: N.Nx` (engine over HF generate).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import ct2


def _canaries(domain: str) -> list[str]:
    from engine.config import BUILTIN_DIR

    path = BUILTIN_DIR / "canaries" / f"{domain}.txt"
    return [line for line in path.read_text().splitlines() if line.strip()]


def by_bucket(engine, texts: list[str], per_bucket: int) -> dict[str, list[str]]:
    """Group texts by the engine's bucket label, at most `per_bucket` each."""
    out: dict[str, list[str]] = {}
    for text in texts:
        group = out.setdefault(engine.bucket_for(engine.count_tokens(text)), [])
        if len(group) < per_bucket:
            group.append(text)
    return out


def _config(args: argparse.Namespace, **changes):
    from engine.config import EngineConfig

    buckets = tuple(int(b) for b in args.buckets.split(","))
    base = dict(model_dir=args.model_dir, use_draft=False, buckets=buckets,
                compile_mode=args.compile_mode, compile_backend=args.backend)
    base.update(changes)
    return EngineConfig(**base)


def restart_only(args: argparse.Namespace) -> None:
    """Print the warm-up seconds of a fresh process (the inductor cache is warm)."""
    from engine import load_engine

    engine = load_engine(_config(args))
    start = time.perf_counter()
    engine.warm_up(background=False)
    print(f"restart_warmup_s {time.perf_counter() - start:.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buckets", default="16,32,64,128,256")
    parser.add_argument("--inputs", type=int, default=4, help="inputs per bucket")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--new-tokens", default="32,128")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--compile-mode", default="default")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--skip-restart", action="store_true")
    parser.add_argument("--ct2-dir", default=str(ct2.DEFAULT_DIR),
                        help="where CTranslate2's conversions are kept (converted once)")
    parser.add_argument("--no-ct2", action="store_true", help="leave CTranslate2 out")
    parser.add_argument("--restart-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", default=None,
                        help="inductor cache to start from (default: a new empty one, "
                             "so the first warm-up is really cold)")
    args = parser.parse_args(argv)
    if args.restart_only:
        restart_only(args)  # the parent set TORCHINDUCTOR_CACHE_DIR to the cache it filled
        return
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="tailwatch-bench-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(cache_dir).resolve())

    import torch
    from transformers import T5ForConditionalGeneration

    from engine.config import BUILTIN_DIR
    from engine.protocol import FlagOverride
    from engine.runtime import Runtime  # the concrete runtime: tokenizer, bucket_compile_s

    engine = Runtime(_config(args))
    start = time.perf_counter()
    engine.warm_up(background=False)
    cold = time.perf_counter() - start
    model_dir = args.model_dir or str(BUILTIN_DIR / "target")
    hf = T5ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    groups = by_bucket(engine, _canaries("in_domain"), args.inputs)
    direct = FlagOverride(speculative=False)
    cts = {} if args.no_ct2 else ct2.load(model_dir, Path(args.ct2_dir))
    print(f"threads={torch.get_num_threads()} compile={args.compile_mode}/{args.backend} "
          f"inputs/bucket={args.inputs} repeats={args.repeats} "
          f"ctranslate2={ct2.version() + ' (same process, one thread)' if cts else 'no'}")
    print(f"{'bucket':>8} {'new':>4} {'hf_ms':>8} {'engine_ms':>10} {'speedup':>8} "
          f"{'path':>9} {'compile_s':>9}"
          + (f" {'ct2_f32_ms':>10} {'ct2_i8_ms':>9} {'eng/f32':>7} {'eng/i8':>7}" if cts else ""))
    speedups, vs_f32, vs_i8 = [], [], []
    # Engine and CTranslate2 outputs per compute type, input by input (every repeat).
    pairs: dict[str, tuple[list[list[int]], list[list[int]]]] = {c: ([], []) for c in cts}
    for label in [str(b) for b in engine.config.buckets]:
        texts = groups.get(label, [])
        if not texts:
            continue
        for new in (int(n) for n in args.new_tokens.split(",")):
            hf_times, our_times, paths = [], [], set()
            ct2_times: dict[str, list[float]] = {name: [] for name in cts}
            for text in texts:
                ids = torch.tensor([engine.tokenizer(text).input_ids])
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        ref = hf.generate(ids, max_new_tokens=new, do_sample=False)
                    hf_times.append(time.perf_counter() - t0)
                    result = engine.generate(text, max_new_tokens=new, override=direct)
                    our_times.append(result.total_s)
                    paths.add(result.path)
                    if list(result.output_ids) != ref[0].tolist()[1:]:
                        print(f"  warning: output differs from HF on {text!r}")
                    for name, model in cts.items():
                        t0 = time.perf_counter()
                        ids_ct2 = model.generate(ids.tolist(), new)[0]
                        ct2_times[name].append(time.perf_counter() - t0)
                        pairs[name][0].append(list(result.output_ids))
                        pairs[name][1].append(ids_ct2)
            h, o = statistics.median(hf_times), statistics.median(our_times)
            speedups.append(h / o)
            compile_s = engine.bucket_compile_s.get(int(label), 0.0)
            row = (f"{label:>8} {new:>4} {h * 1e3:8.1f} {o * 1e3:10.1f} {h / o:7.2f}x "
                   f"{','.join(sorted(paths)):>9} {compile_s:9.1f}")
            if cts:
                f32 = statistics.median(ct2_times["float32"])
                i8 = statistics.median(ct2_times["int8"])
                vs_f32.append(o / f32)
                vs_i8.append(o / i8)
                row += f" {f32 * 1e3:10.1f} {i8 * 1e3:9.1f} {o / f32:6.2f}x {o / i8:6.2f}x"
            print(row)
    snap = engine.compile_snapshot()
    print(f"cold warm-up: {cold:.1f} s ({snap.graphs} graphs, {snap.recompiles} recompiles)")
    if not args.skip_restart and args.compile_mode != "off":
        cmd = [sys.executable, "-m", "bench.engine", "--restart-only", "--buckets", args.buckets,
               "--compile-mode", args.compile_mode, "--backend", args.backend]
        if args.model_dir:
            cmd += ["--model-dir", args.model_dir]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=os.environ)
        line = [x for x in out.stdout.splitlines() if x.startswith("restart_warmup_s")][-1]
        warm = float(line.split()[1])
        print(f"warm restart (inductor cache reused): {warm:.1f} s vs cold {cold:.1f} s "
              f"({cold / max(warm, 1e-9):.1f}x faster)")
    engine.close()
    for name, (ours, theirs) in pairs.items():
        print(f"CTranslate2 {name} outputs against the engine's: {ct2.compare(ours, theirs)}")
    if vs_f32:
        print(f"engine time / CTranslate2 float32: {statistics.median(vs_f32):.2f}x, "
              f"/ int8: {statistics.median(vs_i8):.2f}x (median over rows; < 1 is faster)")
    print(f"median speedup: {statistics.median(speedups):.1f}x")


if __name__ == "__main__":
    main()
