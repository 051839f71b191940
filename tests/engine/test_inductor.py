"""Inductor end to end on a tiny model: compiled greedy equals eager, no recompiles."""

from __future__ import annotations

import pytest

from engine.protocol import PATH_COMPILED, FlagOverride
from tests.engine.conftest import random_texts, tiny_config


@pytest.mark.slow
# torch 2.13 inductor touches torch.jit.script_method, which warns; pytest makes warnings errors.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_inductor_bucket_matches_eager(tiny_dirs, tmp_path):
    from engine import load_engine

    # The compiled step and verification (what a GPU or a bfloat16 model runs): the C
    # step (engine.native, tests/engine/test_native_step.py) is off here.
    engine = load_engine(tiny_config(tiny_dirs, buckets=(16,), max_input_tokens=16,
                                     compile_backend="inductor", cache_dir=str(tmp_path),
                                     native_step=False))
    try:
        engine.warm_up(background=False)
        assert engine.warmup_status().warm_buckets == 1, engine.warmup_status()
        before = engine.compile_snapshot()
        texts = [t for t in random_texts(24, seed=9, overflow=False)
                 if engine.count_tokens(t) <= 16]
        for text in texts:
            for spec in (False, True):
                fast = engine.generate(text, max_new_tokens=12, override=FlagOverride(speculative=spec))
                slow = engine.generate(text, max_new_tokens=12,
                                       override=FlagOverride(speculative=spec, compiled=False))
                assert fast.path == PATH_COMPILED
                assert fast.output_ids == slow.output_ids
        delta = engine.compile_snapshot().diff(before)
        assert delta.recompiles == 0 and delta.graphs == 0
    finally:
        engine.close()
