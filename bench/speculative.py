"""Direct vs speculative greedy decoding per bucket, on in-domain and shifted canaries.

    python -m bench.speculative [--buckets 16,32,64,128,256] [--inputs 4] [--repeats 1]

Same engine, same inputs, same process; the output is identical by construction and
checked. Last line: `in-domain speedup: N.Nx` (median over buckets).
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

    from engine import load_engine
    from engine.config import EngineConfig
    from engine.protocol import FlagOverride

    config = EngineConfig(model_dir=args.model_dir, draft_dir=args.draft_dir,
                          buckets=tuple(int(b) for b in args.buckets.split(",")),
                          compile_mode=args.compile_mode, compile_backend=args.backend)
    engine = load_engine(config)
    if not engine.info.speculative_available:
        raise SystemExit("no draft model: nothing to compare")
    start = time.perf_counter()
    engine.warm_up(background=False)
    print(f"warm-up {time.perf_counter() - start:.1f} s, k={config.speculative_k}, "
          f"compile={args.compile_mode}/{args.backend}, new tokens={args.new_tokens}")
    print(f"{'domain':>9} {'bucket':>7} {'direct_ms':>10} {'spec_ms':>9} {'speedup':>8} "
          f"{'accept':>7} {'mean_len':>8}")
    ratios: dict[str, list[float]] = {}
    for domain in ("in_domain", "shifted"):
        groups = by_bucket(engine, _canaries(domain), args.inputs)
        for label in [str(b) for b in config.buckets]:
            texts = groups.get(label, [])
            if not texts:
                continue
            d_times, s_times = [], []
            drafts = proposed = accepted = 0
            for text in texts:
                for _ in range(args.repeats):
                    d = engine.generate(text, max_new_tokens=args.new_tokens,
                                        override=FlagOverride(speculative=False))
                    s = engine.generate(text, max_new_tokens=args.new_tokens,
                                        override=FlagOverride(speculative=True))
                    if d.output_ids != s.output_ids:
                        raise SystemExit(f"speculative output differs on {text!r}")
                    d_times.append(d.total_s)
                    s_times.append(s.total_s)
                    drafts += s.spec.drafts
                    proposed += s.spec.draft_tokens
                    accepted += s.spec.accepted_tokens
            dm, sm = statistics.median(d_times), statistics.median(s_times)
            ratios.setdefault(domain, []).append(dm / sm)
            rate = accepted / proposed if proposed else 0.0
            mean_len = 1 + accepted / drafts if drafts else 0.0
            print(f"{domain:>9} {label:>7} {dm * 1e3:10.1f} {sm * 1e3:9.1f} {dm / sm:7.2f}x "
                  f"{rate:7.2f} {mean_len:8.2f}")
    engine.close()
    if "shifted" in ratios:
        slow = statistics.median(ratios["shifted"])
        print(f"shifted: speculative runs at {slow:.2f}x direct speed "
              f"({1 / slow:.2f}x the latency)")
    print(f"in-domain speedup: {statistics.median(ratios.get('in_domain', [0.0])):.1f}x")


if __name__ == "__main__":
    main()
