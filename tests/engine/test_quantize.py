"""int8 weights: the weight-only int8 linear, and the runtime's quantized flag and arm."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from engine.protocol import REFERENCE, FlagOverride, InMemoryFlagProvider, RuntimeFlags
from engine.quantize import Int8Weight, weight_bytes
from engine.runtime import Runtime
from probes.quality import compare
from tests.engine.conftest import random_texts, tiny_config


def test_int8_weight_is_within_half_a_step_and_four_times_smaller() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=gen)
    q = Int8Weight(w)
    assert q.q.dtype == torch.int8
    step = q.scale[:, None]
    assert bool(((q.dequantized() - w).abs() <= step / 2 + 1e-6).all())
    x = torch.randn(1, 3, 32, generator=gen)
    assert torch.allclose(q.linear(x), F.linear(x, q.dequantized()), atol=1e-5)
    assert q.q.numel() * q.q.element_size() * 4 == w.numel() * w.element_size()


@pytest.mark.slow
def test_quantized_flag_serves_int8_and_the_reference_stays_float(
        tiny_dirs: dict[str, Path]) -> None:
    flags = InMemoryFlagProvider(RuntimeFlags(quantized_default=False, quantized={"16": True}))
    engine = Runtime(tiny_config(tiny_dirs, compile_mode="off", quantization="int8",
                                 use_draft=False, flags_file=""), flags)
    try:
        assert engine.info.quantization == "int8" and engine.target_q is not None
        # The int8 target shares the float model's other tensors: it adds its int8 ones only.
        assert (weight_bytes(engine.target_q.m, beyond=engine.target.m)
                < weight_bytes(engine.target.m) / 2)
        assert engine.info.config_hash != tiny_config(tiny_dirs, use_draft=False).config_hash()
        texts = random_texts(12, seed=3, overflow=False)
        served = {t: engine.generate(t) for t in texts}
        assert {r.bucket for r in served.values() if r.quantized} == {"16"}
        agreements = []
        for text, r in served.items():
            ref = engine.generate(text, override=REFERENCE)
            assert not ref.quantized and ref.path == "eager"
            on = engine.generate(text, override=FlagOverride(quantized=True))
            assert on.quantized
            agreements.append(compare(on.output_ids, ref.output_ids).agreement)
            if not r.quantized:  # float32 serving is the reference's output
                assert r.output_ids == ref.output_ids
        assert all(0.0 <= a <= 1.0 for a in agreements)
    finally:
        engine.close()
