"""Direct vs speculative greedy decoding per bucket, on in-domain and shifted canaries.

    python -m bench.speculative [--buckets 16,32,64,128,256] [--inputs 4] [--repeats 1]

Same engine, same inputs, same process; the output is identical by construction and
checked. The draft length k is the engine's own per-bucket choice from measured
acceptance and costs (an untimed pass per bucket and domain lets it measure first).
Speculative arms: `forced` asks for speculation explicitly (it still picks k);
`auto` follows the flags, so the engine's fallback to direct decoding applies when
speculation cannot pay. Run pinned: `taskset -c 1 python -m bench.speculative`.
Last line: `in-domain speedup: N.Nx` (median over buckets, auto arm).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from bench.engine import _canaries, by_bucket


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buckets", default="16,32,64,128,256")
    parser.add_argument("--inputs", type=int, default=4, help="inputs per bucket and domain")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--draft-dir", default=None)
    parser.add_argument("--compile-mode", default="default")
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path("var/compile-cache").resolve()))

    from engine.config import EngineConfig
    from engine.protocol import FlagOverride
    from engine.runtime import Runtime  # the concrete runtime: k_max is not the protocol's

    config = EngineConfig(model_dir=args.model_dir, draft_dir=args.draft_dir,
                          buckets=tuple(int(b) for b in args.buckets.split(",")),
                          compile_mode=args.compile_mode, compile_backend=args.backend)
    engine = Runtime(config)
    if not engine.info.speculative_available:
        raise SystemExit("no draft model: nothing to compare")
    start = time.perf_counter()
    engine.warm_up(background=False)
    print(f"warm-up {time.perf_counter() - start:.1f} s, initial k={config.speculative_k} "
          f"(adaptive 1..{engine.k_max}), "
          f"compile={args.compile_mode}/{args.backend}, new tokens={args.new_tokens}")
    print(f"{'domain':>9} {'bucket':>7} {'direct_ms':>10} {'forced_ms':>9} {'forced':>7} "
          f"{'auto_ms':>8} {'auto':>7} {'k':>2} {'accept':>7} {'mean_len':>8}")
    ratios: dict[str, list[float]] = {}
    forced_ratios: dict[str, list[float]] = {}
    direct_arm, forced_arm = FlagOverride(speculative=False), FlagOverride(speculative=True)
    for domain in ("in_domain", "shifted"):
        groups = by_bucket(engine, _canaries(domain), args.inputs)
        for label in [str(b) for b in config.buckets]:
            texts = groups.get(label, [])
            if not texts:
                continue
            for text in texts:  # untimed: the engine measures acceptance and costs here
                for arm in (direct_arm, forced_arm, None):
                    engine.generate(text, max_new_tokens=args.new_tokens, override=arm)
            d_times, f_times, a_times = [], [], []
            drafts = proposed = accepted = 0
            for text in texts:
                for _ in range(args.repeats):
                    d = engine.generate(text, max_new_tokens=args.new_tokens, override=direct_arm)
                    f = engine.generate(text, max_new_tokens=args.new_tokens, override=forced_arm)
                    a = engine.generate(text, max_new_tokens=args.new_tokens)
                    if not d.output_ids == f.output_ids == a.output_ids:
                        raise SystemExit(f"speculative output differs on {text!r}")
                    d_times.append(d.total_s)
                    f_times.append(f.total_s)
                    a_times.append(a.total_s)
                    drafts += f.spec.drafts
                    proposed += f.spec.draft_tokens
                    accepted += f.spec.accepted_tokens
            dm, fm, am = (statistics.median(t) for t in (d_times, f_times, a_times))
            ratios.setdefault(domain, []).append(dm / am)
            forced_ratios.setdefault(domain, []).append(dm / fm)
            rate = accepted / proposed if proposed else 0.0
            mean_len = 1 + accepted / drafts if drafts else 0.0
            k = engine.draft_length_snapshot().k.get(label, config.speculative_k)
            print(f"{domain:>9} {label:>7} {dm * 1e3:10.1f} {fm * 1e3:9.1f} {dm / fm:6.2f}x "
                  f"{am * 1e3:8.1f} {dm / am:6.2f}x {k:>2} {rate:7.2f} {mean_len:8.2f}")
    engine.close()
    if "shifted" in ratios:
        print(f"shifted: forced speculation runs at "
              f"{statistics.median(forced_ratios['shifted']):.2f}x direct speed, with the "
              f"fallback on at {statistics.median(ratios['shifted']):.2f}x")
    if "in_domain" in forced_ratios:
        print(f"in-domain forced speculation: "
              f"{statistics.median(forced_ratios['in_domain']):.1f}x direct")
    print(f"in-domain speedup: {statistics.median(ratios.get('in_domain', [0.0])):.1f}x")


if __name__ == "__main__":
    main()
