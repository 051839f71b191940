"""The compiled decode step is one fused kernel: no per-row MKL calls, no cache copies.

Two regressions made the CPU step 4x slower without changing a single token: each
1-row linear as an MKL call (~40 us each, 37 per token on the built-in model), and the
KV-cache write through a view, which inductor turned into a copy of every layer's cache
and a write-back of the whole cache on each call. Both are visible in inductor's
generated code, which this test reads (README, Benchmarks: the decode step).
"""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

from engine import t5  # noqa: E402
from engine.loader import load_model  # noqa: E402
from tests.engine.conftest import tiny_config  # noqa: E402


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_compiled_cpu_step_has_no_mm_calls_and_copies_no_cache(tiny_dirs, tmp_path, monkeypatch):
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    config = tiny_config(tiny_dirs)
    loaded = load_model(config.model_dir)
    with torch.no_grad():
        m = t5.LeanT5(loaded.model, dtype=torch.float32, device=torch.device("cpu"))
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
    # The same token; the cache agrees to float rounding (a fused reduction sums in another
    # order than MKL: greedy equality on 50 inputs per bucket is test_decode_step's).
    assert torch.equal(got, want)
    assert torch.allclose(kv, eager_kv, rtol=1e-4, atol=1e-6) and kv[:, :, :, 3].abs().sum() > 0
    code = "\n".join(codes)
    assert "extern_kernels.mm" not in code and "extern_kernels.addmm" not in code
    layer = kv[0].numel()
    buffers = [int(torch.tensor(eval(shape)).prod())  # noqa: S307 - inductor's own literal
               for shape in re.findall(r"empty_strided_cpu\((\([0-9, ]*\))", code)]
    assert buffers, "inductor's buffer allocations not found: the code format changed"
    assert max(buffers) < layer, (max(buffers), layer)  # no per-layer cache copy
