"""`tailwatch engine precompile` saves compiled functions a fresh process serves without tracing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from monitor.cli import main

# A fresh process: loads the saved functions (if any), warms every bucket, prints torch's own
# cache counters, the engine's warm-up status and the child processes inductor ran (on
# which thread): the vector-ISA probe and any precompiled-header preprocess; the modules
# the probe's thread imported itself (racing the main thread's imports); and any of HF's
# T5 modeling modules imported (seconds of a restart, for weights the engine reads itself).
_PROBE = """
import json, subprocess, sys, threading
children = []
probe_imports = []
class _Spy:
    def find_spec(self, name, path=None, target=None):
        if threading.current_thread().name == "inductor-isa-probe":
            probe_imports.append(name)
        return None
sys.meta_path.insert(0, _Spy())
_run = subprocess.run
def _recorded(cmd, *args, **kwargs):
    line = " ".join(map(str, cmd))
    if "LoadLibrary" in line or "header.hpp" in line:
        children.append(["isa" if "LoadLibrary" in line else "header",
                         threading.current_thread().name])
    return _run(cmd, *args, **kwargs)
subprocess.run = _recorded
from engine import load_engine
from engine.config import EngineConfig
from engine.protocol import FlagOverride
engine = load_engine(EngineConfig(**json.loads(sys.argv[1])))
engine.warm_up(background=False)
status = engine.warmup_status()
out = engine.generate("hello there", max_new_tokens=6, override=FlagOverride(speculative=False))
imported = {"dynamo": "torch._dynamo" in sys.modules, "inductor": "torch._inductor" in sys.modules}
from torch._dynamo.utils import counters
print(json.dumps({"fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
                  "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
                  "aot_miss": counters["aot_autograd"]["autograd_cache_miss"],
                  "graphs": counters["stats"]["unique_graphs"],
                  "saved": engine.saved_buckets, "saved_failures": engine.saved_failures,
                  "cache_hit": status.cache_hit, "warm": status.warm_buckets,
                  "ready_s": status.ready_seconds, "buckets": dict(status.bucket_seconds),
                  "children": children, "probe_imports": probe_imports,
                  "imported": imported, "output": list(out.output_ids),
                  "hf_modeling": sorted(m for m in sys.modules
                                        if m.endswith((".modeling_t5", ".modeling_mt5")))}))
"""


def _fresh_process(engine: dict, inductor_dir: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir)}
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(engine)], env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_precompiled_functions_load_with_zero_new_compiles(tiny_dirs, tmp_path, monkeypatch):
    # The compiled step (what a GPU or a bfloat16 model runs): the C step is off here.
    engine = {"model_dir": str(tiny_dirs["target"]), "use_draft": False, "buckets": [8],
              "max_input_tokens": 16, "max_new_tokens": 4, "max_new_tokens_cap": 8,
              "kv_headroom": 4, "compile_backend": "inductor", "native_step": False}
    built = tmp_path / "built"
    config = tmp_path / "tailwatch.yaml"
    config.write_text(yaml.safe_dump({"engine": {**engine, "cache_dir": str(built)}}))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(built))
    # The CLI runs the compile in a child so this test process stays compile-free.
    cli = [sys.executable, "-c", "import sys; from monitor.cli import main; "
           "sys.exit(main(sys.argv[1:]))", "--config", str(config), "engine", "precompile"]
    first = subprocess.run(cli, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "precompiled 1 buckets" in first.stdout
    # The step as a saved function, the encoder as an AOTInductor package for this CPU.
    saved = sorted((built / "precompiled").glob("*/*_enc_*.pt2")) + sorted(
        (built / "precompiled").glob("*/*.aot"))
    assert [p.suffix for p in saved] == [".pt2", ".aot"], saved
    assert all(p.stat().st_size > 0 for p in saved)
    again = subprocess.run(cli, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "compiled functions up to date" in again.stdout, again.stdout

    # A restart on this machine serves from the saved functions: nothing traced or compiled.
    restart = _fresh_process({**engine, "cache_dir": str(built)}, built)
    assert restart["saved"] == 1 and restart["saved_failures"] == 0, restart
    assert restart["graphs"] == 0 and restart["fxgraph_miss"] == 0, restart
    assert restart["warm"] == 1 and restart["cache_hit"] is True, restart
    # The ISA probe ran on its own thread while the weights loaded (one child per candidate
    # ISA: one on an AVX2-only CPU, ten on an AVX-512 one with AMX), and loading the saved
    # kernels did not preprocess a precompiled header (it only speeds a rebuild).
    assert restart["children"], restart
    assert all(c == ["isa", "inductor-isa-probe"] for c in restart["children"]), restart
    # Its thread imports nothing: every module it needs was imported before it started.
    assert restart["probe_imports"] == [], restart
    assert restart["hf_modeling"] == [], restart

    # Another machine: an empty inductor cache, only the precompiled directory copied over.
    # The saved functions still serve without tracing (their C++ kernels are rebuilt).
    fresh = tmp_path / "fresh"
    shutil.copytree(built / "precompiled", fresh / "precompiled")
    warm = _fresh_process({**engine, "cache_dir": str(fresh)}, fresh)
    assert warm["cache_hit"] is True and warm["warm"] == 1, warm
    assert warm["saved"] == 1 and warm["saved_failures"] == 0, warm
    assert warm["graphs"] == 0 and warm["fxgraph_miss"] == 0 and warm["aot_miss"] == 0, warm
    assert warm["ready_s"] is not None and set(warm["buckets"]) == {"8"}

    # Without the saved functions the same fresh start compiles (the test can fail).
    cold = tmp_path / "cold"
    none = _fresh_process({**engine, "cache_dir": str(cold)}, cold)
    assert none["cache_hit"] is False and none["fxgraph_miss"] >= 2, none


@pytest.mark.slow
def test_a_warm_cpu_restart_imports_neither_dynamo_nor_inductor(tiny_dirs, tmp_path):
    """The C step and the encoder's package: a restart serves without torch.compile's
    machinery (importing torch._dynamo and inductor cost ~2.5 s of every restart)."""
    engine = {"model_dir": str(tiny_dirs["target"]), "use_draft": False, "buckets": [8],
              "max_input_tokens": 16, "max_new_tokens": 6, "max_new_tokens_cap": 8,
              "kv_headroom": 4, "compile_backend": "inductor", "cache_dir": str(tmp_path)}
    config = tmp_path / "tailwatch.yaml"
    config.write_text(yaml.safe_dump({"engine": engine}))
    cli = [sys.executable, "-c", "import sys; from monitor.cli import main; "
           "sys.exit(main(sys.argv[1:]))", "--config", str(config), "engine", "precompile"]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(list((tmp_path / "precompiled").glob("*/*_enc_*.pt2"))) == 1

    restart = _fresh_process(engine, tmp_path)
    assert restart["imported"] == {"dynamo": False, "inductor": False}, restart
    assert restart["saved"] == 1 and restart["saved_failures"] == 0, restart
    assert restart["cache_hit"] is True and restart["warm"] == 1, restart
    assert restart["children"] == [], restart  # no ISA probe: nothing of inductor's loads
    assert restart["graphs"] == 0 and restart["fxgraph_miss"] == 0, restart

    # The same tokens as the eager path.
    from engine import load_engine
    from engine.config import EngineConfig
    from engine.protocol import FlagOverride

    eager = load_engine(EngineConfig(**{**engine, "compile_mode": "off"}))
    try:
        want = eager.generate("hello there", max_new_tokens=6,
                              override=FlagOverride(speculative=False))
    finally:
        eager.close()
    assert restart["output"] == list(want.output_ids)


def test_an_unreadable_package_is_a_load_error_not_a_crash(tmp_path):
    from engine import aot

    bad = tmp_path / f"target_buckets_enc_s8q5n1_{aot.cpu_key()}{aot.PACKAGE_SUFFIX}"
    bad.write_bytes(b"not a package")
    with pytest.raises(aot.AOTLoadError, match=bad.name):
        aot.load_package(bad)


def test_precompile_with_compile_off_says_so(tmp_path):
    config = tmp_path / "tailwatch.yaml"
    config.write_text(yaml.safe_dump({"engine": {"compile_mode": "off"}}))
    assert main(["--config", str(config), "engine", "precompile"]) == 0


def test_warm_up_starts_with_the_busiest_bucket(tiny_dirs, tmp_path):
    from engine import load_engine
    from tests.engine.conftest import tiny_config

    config = tiny_config(tiny_dirs, use_draft=False, compile_backend="eager",
                         cache_dir=str(tmp_path))
    first = load_engine(config)
    assert first.warm_order() == [8, 16, 32]  # nothing known yet: ascending
    for _ in range(3):
        first.generate("x" * 20, max_new_tokens=1)  # bucket 32
    first.generate("x" * 10, max_new_tokens=1)  # bucket 16
    first.close()
    second = load_engine(config)
    try:
        assert second.warm_order() == [32, 16, 8]
    finally:
        second.close()
