#!/usr/bin/env bash
# tailwatch's GPU check in one short run (under 8 minutes from an empty compile cache).
#
#   scripts/gpu_check.sh [OUT_DIR] [bench.gpu options...]   (OUT_DIR: var/gpu-check-<UTC time>)
#
# Runs `python -m bench.gpu` (see its docstring: per bucket, eager vs default vs
# reduce-overhead vs HF generate(), memory, recompiles, bf16 vs float32) with the machine's
# own python3 and torch (the GPU image: CPython 3.12, torch 2.11). The runtime packages that
# image lacks travel as wheels (`make gpu-wheels` -> var/gpu-wheels) and are installed here
# offline, into a folder of their own. The table is printed and written to OUT_DIR/summary.md.
# Exit: bench.gpu's (0 passed, 1 a check failed, 2 no CUDA); 3 the wheels did not install;
# 124 the time limit. Env: PYTHON (python3), WHEELS (var/gpu-wheels), TIME_LIMIT_S (480).
set -u -o pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-var/gpu-wheels}
TIME_LIMIT_S=${TIME_LIMIT_S:-480}
OUT=${1:-var/gpu-check-$(date -u +%Y%m%d-%H%M)}
shift $(( $# > 0 ? 1 : 0 ))
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)

if compgen -G "$WHEELS/*.whl" >/dev/null; then
    SITE=${SITE:-$(mktemp -d /tmp/tailwatch-site.XXXXXX)}
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$SITE" "$WHEELS"/*.whl || { echo "gpu_check: wheels did not install" >&2; exit 3; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# This tree's engine, not an installed copy; a compile cache of the check's own.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$OUT/inductor}
export PYTHONUNBUFFERED=1

"$PYTHON" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__}")'
timeout "$TIME_LIMIT_S" "$PYTHON" -m bench.gpu --out "$OUT" --budget-s $(( TIME_LIMIT_S * 7 / 8 )) "$@" \
    2>&1 | tee "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
