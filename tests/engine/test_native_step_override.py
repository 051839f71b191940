"""The native_step flag and override: the compiled step serves one request, outputs equal."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from engine import native
from engine.protocol import FlagOverride, InMemoryFlagProvider, RuntimeFlags
from engine.runtime import Runtime
from tests.engine.conftest import random_texts, tiny_config

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="no C compiler")


def test_the_compiled_step_serves_per_request_with_identical_outputs(tmp_path, tiny_dirs):
    flags = InMemoryFlagProvider()
    rt = Runtime(tiny_config(tiny_dirs, compile_backend="eager",
                             cache_dir=str(tmp_path / "cache")), flags)
    try:
        rt.warm_up(background=False)
        assert rt.step_kind == "target native, draft native"
        texts = [t for t in random_texts(12, seed=3, overflow=False)]
        off = FlagOverride(native_step=False)

        def pair(text: str) -> tuple:
            c = rt.generate(text, max_new_tokens=12, override=off)
            n = rt.generate(text, max_new_tokens=12)
            return c, n

        # Concurrent requests, some on each step: each request's own choice holds.
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(pair, texts))
        for text, (c, n) in zip(texts, results, strict=True):
            assert (c.path, c.native_step, n.path, n.native_step) == (
                "compiled", False, "compiled", True), text
            assert c.output_ids == n.output_ids, text
        # The flag (the policy's per-instance fallback) does the same for every request.
        flags.set(RuntimeFlags(native_step=False))
        r = rt.generate(texts[0], max_new_tokens=12)
        assert r.native_step is False and r.output_ids == results[0][1].output_ids
        back = rt.generate(texts[0], max_new_tokens=12, override=FlagOverride(native_step=True))
        assert back.native_step is True and back.output_ids == r.output_ids
        # Eager requests never run the C step.
        eager = rt.generate(texts[0], max_new_tokens=12, override=FlagOverride(compiled=False))
        assert eager.native_step is False
    finally:
        rt.close()
