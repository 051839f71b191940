"""Saved compiled functions: a fresh process serves from them without dynamo tracing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.engine.conftest import BUCKETS, CAP, MAX_INPUT

pytestmark = pytest.mark.slow

# A fresh process: warms up (loading saved functions when there are any), then serves
# texts compiled (direct and speculative) and eager, and prints torch's own counters
# from before the eager run (the compiled runs must not have traced anything).
_PROBE = """
import json, sys
from engine import load_engine
from engine.config import EngineConfig
from engine.protocol import FlagOverride
from tests.engine.conftest import random_texts
from torch._dynamo.utils import counters
engine = load_engine(EngineConfig(**json.loads(sys.argv[1])))
engine.warm_up(background=False)
texts = random_texts(24, seed=5, overflow=False)
runs = {}
overrides = [("direct", FlagOverride(speculative=False)),
             ("spec", FlagOverride(speculative=True))]
if engine.config.quantization == "int8":
    overrides.append(("int8", FlagOverride(speculative=False, quantized=True)))
for name, over in overrides:
    runs[name] = [engine.generate(t, max_new_tokens=16, override=over) for t in texts]
frames = dict(counters["frames"])
graphs = counters["stats"]["unique_graphs"]
eager = [engine.generate(t, max_new_tokens=16, override=FlagOverride(compiled=False,
         speculative=False)).output_ids for t in texts]
if "int8" in runs:
    eager_int8 = [engine.generate(t, max_new_tokens=16, override=FlagOverride(
        compiled=False, speculative=False, quantized=True)).output_ids for t in texts]
status = engine.warmup_status()
print(json.dumps({
    "frames": frames, "graphs": graphs, "warm": status.warm_buckets,
    "saved_buckets": engine.saved_buckets, "saved_failures": engine.saved_failures,
    "paths": sorted({r.path for rs in runs.values() for r in rs}),
    "quantized": sorted({(k, r.quantized) for k, rs in runs.items() for r in rs}),
    "same": {k: [list(r.output_ids) for r in rs] == [list(e) for e in (
        eager_int8 if k == "int8" else eager)] for k, rs in runs.items()}}))
"""


def _engine(tiny_dirs: dict[str, Path], cache: Path) -> dict:
    return {"model_dir": str(tiny_dirs["target"]), "draft_dir": str(tiny_dirs["draft"]),
            "buckets": list(BUCKETS), "max_input_tokens": MAX_INPUT, "max_new_tokens": 16,
            "max_new_tokens_cap": CAP, "kv_headroom": 4, "speculative_k": 3,
            "speculative_fallback": False, "compile_backend": "aot_eager",
            "cache_dir": str(cache)}


def _run(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=900, cwd=Path(__file__).resolve().parents[2])


def _fresh(engine: dict, cache: Path) -> dict:
    out = _run(["-c", _PROBE, json.dumps(engine)], cache)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _precompile(engine: dict, tmp_path: Path) -> str:
    config = tmp_path / "tailwatch.yaml"
    config.write_text(yaml.safe_dump({"engine": engine}))
    out = _run(["-c", "import sys; from monitor.cli import main; sys.exit(main(sys.argv[1:]))",
                "--config", str(config), "engine", "precompile"], Path(engine["cache_dir"]))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_saved_functions_serve_a_fresh_process_without_tracing(tiny_dirs, tmp_path):
    cache = tmp_path / "cache"
    engine = _engine(tiny_dirs, cache)
    said = _precompile(engine, tmp_path)
    # The target's encode, shared by every bucket (the steps and the verification run in
    # C, engine.native; the draft's encoder is eager).
    # Compiled once: the AOT compile is what serves (no second torch.compile warm-up).
    assert "(1 graph, 1 saved function; decode step: target native, draft native)" in said, \
        said
    saved = list(cache.glob("precompiled/*/*.aot"))
    assert len(saved) == 1

    warm = _fresh(engine, cache)
    assert warm["saved_buckets"] == len(BUCKETS) and warm["saved_failures"] == 0, warm
    assert warm["warm"] == len(BUCKETS)
    # Nothing traced: no frame compiled, no graph made, for warm-up and 48 compiled requests.
    assert warm["graphs"] == 0 and warm["frames"].get("ok", 0) == 0, warm
    assert warm["paths"] == ["compiled"], warm
    assert warm["same"] == {"direct": True, "spec": True}, warm

    # Without the saved functions the same start traces every function (the test can fail).
    for path in saved:
        path.unlink()
    cold = _fresh(engine, cache)
    assert cold["saved_buckets"] == 0 and cold["graphs"] >= 1, cold
    assert cold["frames"]["ok"] >= 1, cold
    assert cold["same"] == {"direct": True, "spec": True}, cold


def test_a_saved_function_that_does_not_fit_falls_back_to_compiling(tiny_dirs, tmp_path):
    cache = tmp_path / "cache"
    engine = {**_engine(tiny_dirs, cache), "buckets": [8], "use_draft": False}
    _precompile(engine, tmp_path)
    saved = sorted(cache.glob("precompiled/*/*.aot"))
    assert len(saved) == 1  # the target's encode (its step runs in C)
    saved[0].write_bytes(b"not a compiled function")

    warm = _fresh(engine, cache)
    assert warm["saved_failures"] == 1 and warm["saved_buckets"] == 0, warm
    assert warm["warm"] == 1 and warm["graphs"] >= 1, warm  # compiled, as without them
    assert warm["same"]["direct"] is True, warm


def test_an_int8_target_is_saved_and_served_without_tracing(tiny_dirs, tmp_path):
    cache = tmp_path / "cache"
    engine = {**_engine(tiny_dirs, cache), "quantization": "int8", "int8_encoder": True}
    said = _precompile(engine, tmp_path)
    # Both targets decode in C (engine.native; int8 weights too); each has its encoder (the
    # int8 target's multiplies int8 weights, engine.int8_encoder): two encodes are saved.
    assert "(2 graphs, 2 saved functions;" in said, said
    assert len(list(cache.glob("precompiled/*/target-int8_*"))) == 1

    warm = _fresh(engine, cache)
    assert warm["saved_buckets"] == len(BUCKETS) and warm["saved_failures"] == 0, warm
    assert warm["graphs"] == 0 and warm["frames"].get("ok", 0) == 0, warm
    assert ["int8", True] in warm["quantized"], warm
    # Not compared with int8 eager: the C step also quantizes activations, the eager
    # forward dequantizes the weights (tests/engine/test_int8_step.py bounds the difference).
