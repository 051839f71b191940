"""The compiled decode step is one fused kernel: no per-row MKL calls, no cache copies.

Two mistakes slow the CPU step several-fold without changing a single token: each 1-row
linear as an MKL call (a fixed per-call cost, dozens of calls per token), and the
KV-cache write through a view, which inductor turns into a copy of every layer's cache
and a write-back of the whole cache on each call. Both are visible in inductor's
generated code, which this test reads (docs/engine.md#torchcompile). It runs in
a subprocess: `run_and_get_code` resets dynamo, which would drop the process-wide
compile counters' callbacks (engine.compile_watch) for every later test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r'''
import json, re, sys
import torch
from torch._inductor.utils import run_and_get_code
from engine import t5
from engine.loader import load_model

loaded = load_model(sys.argv[1])
with torch.no_grad():
    m = t5.LeanT5(loaded.config, loaded.weights, dtype=torch.float32, device=torch.device("cpu"))
    slots = 32
    ids = torch.full((1, 16), m.eos_id, dtype=torch.long)
    mask = m.mask_bias(torch.ones((1, 16), dtype=torch.long))
    cross = t5.encode(m, ids, mask, m.encoder_bias(16))
    bias = m.decoder_bias(slots)
    start = torch.full((1, 1), m.decoder_start_id, dtype=torch.long)
    pos = torch.tensor([3])
    eager_kv = m.new_self_cache(slots)
    want = t5.decode_steps(m, start, pos, eager_kv, cross, mask, bias, 1)
    kv = m.new_self_cache(slots)
    step = torch.compile(t5.decode_steps, backend="inductor", dynamic=False)
    got, codes = run_and_get_code(step, m, start, pos, kv, cross, mask, bias, 1)
code = "\n".join(codes)
buffers = [int(torch.tensor(eval(shape)).prod())
           for shape in re.findall(r"empty_strided_cpu\((\([0-9, ]*\))", code)]
print(json.dumps({
    "same_token": bool(torch.equal(got, want)),
    # The cache agrees to float rounding (a fused reduction sums in another order than
    # MKL): greedy equality on 50 inputs per bucket is test_decode_step's.
    "cache_close": bool(torch.allclose(kv, eager_kv, rtol=1e-4, atol=1e-6)),
    "written": float(kv[:, :, :, 3].abs().sum()),
    "mm_calls": code.count("extern_kernels.mm") + code.count("extern_kernels.addmm"),
    "buffers": buffers, "layer": kv[0].numel()}))
'''


@pytest.mark.slow
def test_compiled_cpu_step_has_no_mm_calls_and_copies_no_cache(tiny_dirs, tmp_path):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", SCRIPT, str(tiny_dirs["target"])],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["same_token"] and got["cache_close"] and got["written"] > 0, got
    assert got["mm_calls"] == 0, got
    assert got["buffers"], "inductor's buffer allocations not found: the code format changed"
    assert max(got["buffers"]) < got["layer"], got  # no per-layer cache copy
