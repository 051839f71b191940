"""The correctness checks on CUDA (run where a GPU exists)."""

from __future__ import annotations

import pytest
import torch

from engine.protocol import FlagOverride
from tests.engine.conftest import random_texts, tiny_config

# Inductor's advice on CUDA (TF32 left off keeps float32 exact; its softmax choice) and
# cudagraph trees' own empty capture (a new tree manager captures nothing to claim its
# memory pool) are not errors of the engine's.
pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning"),
              pytest.mark.filterwarnings("ignore:\\nOnline softmax is disabled:UserWarning"),
              pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_greedy_and_speculative_match(tiny_dirs, dtype):
    from engine import load_engine

    cpu = load_engine(tiny_config(tiny_dirs, compile_mode="off", device="cpu"))
    gpu = load_engine(tiny_config(tiny_dirs, device="cuda", dtype=dtype,
                                  compile_backend="inductor", buckets=(8, 16, 32)))
    try:
        gpu.warm_up(background=False)
        assert gpu.info.device.startswith("cuda") and gpu.info.dtype == dtype
        agree = 0
        texts = random_texts(30, seed=11)
        for text in texts:
            direct = gpu.generate(text, max_new_tokens=16, override=FlagOverride(speculative=False))
            spec = gpu.generate(text, max_new_tokens=16, override=FlagOverride(speculative=True))
            assert spec.output_ids == direct.output_ids
            ref = cpu.generate(text, max_new_tokens=16, override=FlagOverride(speculative=False))
            agree += ref.output_ids == direct.output_ids
        # fp32 on GPU equals CPU; bf16 rounds differently, so only most outputs match.
        assert agree == len(texts) if dtype == "float32" else agree >= len(texts) // 2
        mem = gpu.memory_snapshot()
        assert mem.cuda_allocated_bytes and mem.cuda_peak_bytes >= mem.cuda_allocated_bytes
        assert mem.cuda_ooms == 0
    finally:
        cpu.close()
        gpu.close()


def test_reduce_overhead_captures_the_decode_step(tiny_dirs):
    """With cudagraph trees, no graph is skipped (the mutated KV cache is a static input)."""
    from torch._dynamo.utils import counters

    from engine import load_engine

    gpu = load_engine(tiny_config(tiny_dirs, device="cuda", dtype="float32",
                                  compile_backend="inductor", compile_mode="reduce-overhead",
                                  buckets=(8,), max_input_tokens=8))
    try:
        skips = sum(counters["inductor"].get(k, 0) for k in ("cudagraph_skips",))
        gpu.warm_up(background=False)
        status = gpu.warmup_status()
        assert status.error is None, status.error  # no bucket fell back to eager
        assert all(g.startswith("recorded") for g in status.bucket_graphs.values()), status
        texts = [t for t in random_texts(12, seed=12, overflow=False) if gpu.count_tokens(t) <= 8]
        compiled = gpu.compile_snapshot()
        for text in texts:
            for spec in (False, True):
                gpu.generate(text, max_new_tokens=8, override=FlagOverride(speculative=spec))
        assert counters["inductor"].get("cudagraph_skips", 0) == skips, dict(counters["inductor"])
        graphs = gpu.graph_snapshot()
        assert graphs.replayed > 0 and graphs.recorded_after_warmup == 0, graphs
        # torch's own count: no recording on a request's path (every call a tree root).
        now = gpu.compile_snapshot()
        assert now.cudagraph_recordings == compiled.cudagraph_recordings, (compiled, now)
        assert now.recompiles == compiled.recompiles, now.recompile_reasons
    finally:
        gpu.close()
