"""A full garbage collection in the serving process's heap, before and after the freeze.

    taskset -c 1 python -m bench.gc_heap [--repeats 5] [--requests 24]

The serving process's heap as it is once warm: the app's modules imported (FastAPI,
SQLAlchemy, pandas, APScheduler, the monitor), the engine on the built-in target (or
--model-dir) loaded, warmed and serving --requests in-domain canaries. Then a full
collection (`gc.collect()`, generation 2: what the collector runs on its own once enough
objects outlive the younger generations) is timed --repeats times as the heap is, and
--repeats times after `monitor.gc_heap.freeze()`, the call the serving process makes once
its engine is warm (monitor.engine_holder). Each such collection holds the GIL: every
request in flight waits for it. Prints the objects the collector tracks, the median
pause of each and their ratio; last line `full collection after the freeze: Nx before`.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from pathlib import Path


def pause_s(repeats: int) -> list[float]:
    """Return the seconds of `repeats` full collections, one after another."""
    out = []
    for _ in range(repeats):
        started = time.perf_counter()
        gc.collect()
        out.append(time.perf_counter() - started)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--cache-dir", default="var/compile-cache")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.requests < 0:
        parser.error("--repeats must be >= 1 and --requests >= 0")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(args.cache_dir).resolve()))

    import monitor.app  # noqa: F401 - the serving process's modules, as `tailwatch serve` has them
    import monitor.lifespan  # noqa: F401
    import monitor.report  # noqa: F401
    from bench.engine import _canaries
    from engine.config import EngineConfig
    from engine.runtime import Runtime
    from monitor import gc_heap

    engine = Runtime(EngineConfig(model_dir=args.model_dir, cache_dir=args.cache_dir,
                                  flags_file=""))
    try:
        engine.warm_up(background=False)
        texts = _canaries("in_domain")
        for i in range(args.requests):
            engine.generate(texts[i % len(texts)])
        tracked = len(gc.get_objects())
        before = pause_s(args.repeats)
        frozen = gc_heap.freeze()
        after = pause_s(args.repeats)
    finally:
        engine.close()
    b, a = statistics.median(before), statistics.median(after)
    print(f"objects tracked once warm: {tracked}; frozen: {frozen}")
    print(f"full collection, median of {args.repeats}: before the freeze {b * 1e3:.1f} ms "
          f"(max {max(before) * 1e3:.1f}), after {a * 1e6:.1f} µs "
          f"(max {max(after) * 1e6:.1f})")
    print(f"full collection after the freeze: {a / b:.2g}x before")


if __name__ == "__main__":
    main()
