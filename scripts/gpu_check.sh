#!/usr/bin/env bash
# Run tailwatch's GPU checks on a CUDA machine, in one go, and print one table.
#
#   scripts/gpu_check.sh [OUT_DIR]        (default: var/gpu-check-<UTC date>)
#
# 1. the gpu-marked tests (compiled vs eager greedy on CUDA in bfloat16 and float32,
#    exact speculative equality; see tests/engine/test_gpu.py for the tolerance rule);
# 2. per compile mode (default, reduce-overhead, max-autotune) on the built-in model:
#    time per output token per bucket, graphs compiled, compile seconds, CUDA graphs
#    captured and cudagraph-tree skip reasons (a skipped graph runs without CUDA graphs);
# 3. bench.engine and bench.speculative per compile mode (their own tables, logged).
#
# Everything is logged under OUT_DIR; the summary table is printed last and written to
# OUT_DIR/summary.md, ready for docs/benchmarks.md#gpu (add the date and the GPU model).
# Env: PYTHON (default .venv/bin/python), MODES, BUCKETS, STEP_TIMEOUT_S (per step).
set -u -o pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
MODES=${MODES:-"default reduce-overhead max-autotune"}
BUCKETS=${BUCKETS:-"16,32,64,128,256"}
STEP_TIMEOUT_S=${STEP_TIMEOUT_S:-900}
OUT=${1:-var/gpu-check-$(date -u +%Y%m%d-%H%M)}
mkdir -p "$OUT"
status=0

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: CUDA is not available to $PYTHON (torch $("$PYTHON" -c 'import torch; print(torch.__version__)'))" >&2
    exit 2
fi
"$PYTHON" - <<'EOF' | tee "$OUT/device.txt"
import torch
p = torch.cuda.get_device_properties(0)
print(f"device: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}")
EOF

echo "== gpu-marked tests"
timeout "$STEP_TIMEOUT_S" "$PYTHON" -m pytest -m gpu tests -q -p no:cacheprovider \
    2>&1 | tee "$OUT/pytest-gpu.txt" || status=1

for mode in $MODES; do
    echo "== engine per compile mode: $mode"
    TORCH_LOGS=cudagraphs timeout "$STEP_TIMEOUT_S" "$PYTHON" - "$mode" "$BUCKETS" <<'EOF' \
        2>&1 | tee "$OUT/modes-$mode.txt" || status=1
import statistics
import sys
import time

import torch
from torch._dynamo.utils import counters

from engine import load_engine
from engine.config import BUILTIN_DIR, EngineConfig
from engine.protocol import FlagOverride

mode, buckets = sys.argv[1], tuple(int(b) for b in sys.argv[2].split(","))
engine = load_engine(EngineConfig(device="cuda", buckets=buckets, compile_mode=mode))
start = time.perf_counter()
engine.warm_up(background=False)
warm_s = time.perf_counter() - start
texts = [t for t in (BUILTIN_DIR / "canaries" / "in_domain.txt").read_text().splitlines() if t]
per_bucket: dict[str, list[float]] = {}
for text in texts:
    label = engine.bucket_for(engine.count_tokens(text))
    if len(per_bucket.setdefault(label, [])) >= 12:
        continue
    for decoding in (False, True):
        r = engine.generate(text, max_new_tokens=64, override=FlagOverride(speculative=decoding))
        if decoding is False and r.output_tokens > 1:
            per_bucket[label].append((r.total_s - r.ttft_s) / (r.output_tokens - 1))
torch.cuda.synchronize()
snap = engine.compile_snapshot()
# cudagraph trees count every graph they decline to capture (the reasons are in this log:
# TORCH_LOGS=cudagraphs); 0 skips under reduce-overhead means every compiled graph is captured.
inductor = {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}
skips = inductor.get("cudagraph_skips", 0)
print(f"mode={mode} warm_up_s={warm_s:.1f} graphs={snap.graphs} recompiles={snap.recompiles} "
      f"compile_s={snap.compile_seconds:.1f} cudagraph counters={inductor}")
for label, values in per_bucket.items():
    if values:
        print(f"RESULT {mode} bucket={label} ms_per_token={statistics.median(values) * 1e3:.3f} "
              f"graphs={snap.graphs} compile_s={snap.compile_seconds:.1f} cudagraph_skips={skips}")
engine.close()
EOF
    echo "== bench.engine --compile-mode $mode"
    timeout "$STEP_TIMEOUT_S" "$PYTHON" -m bench.engine --compile-mode "$mode" \
        --buckets "$BUCKETS" --skip-restart 2>&1 | tee "$OUT/bench-engine-$mode.txt" || status=1
    echo "== bench.speculative --compile-mode $mode"
    timeout "$STEP_TIMEOUT_S" "$PYTHON" -m bench.speculative --compile-mode "$mode" \
        --buckets "$BUCKETS" 2>&1 | tee "$OUT/bench-speculative-$mode.txt" || status=1
done

{
    echo "GPU check $(date -u +%Y-%m-%d), $(head -1 "$OUT/device.txt")"
    echo
    echo "| mode | bucket | ms/token (direct, median) | graphs | compile s | cudagraph skips |"
    echo "|---|---|---|---|---|---|"
    grep -h '^RESULT' "$OUT"/modes-*.txt | while read -r _ mode bucket ms graphs comp skips; do
        echo "| $mode | ${bucket#bucket=} | ${ms#ms_per_token=} | ${graphs#graphs=} |" \
             "${comp#compile_s=} | ${skips#cudagraph_skips=} |"
    done
    echo
    for mode in $MODES; do
        echo "bench.engine $mode: $(tail -1 "$OUT/bench-engine-$mode.txt")"
        echo "bench.speculative $mode: $(tail -1 "$OUT/bench-speculative-$mode.txt")"
    done
    echo "gpu tests: $(tail -1 "$OUT/pytest-gpu.txt")"
} | tee "$OUT/summary.md"
exit $status
