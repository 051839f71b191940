"""bench.quality's CTranslate2 request: timed as the engine's is, tokenizing and decoding."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import ct2, quality
from tests.engine.conftest import build_tiny_t5, random_texts

pytest.importorskip("ctranslate2")


def test_a_ct2_request_tokenizes_generates_and_decodes_as_the_engine(tmp_path: Path) -> None:
    from engine import load_engine
    from engine.config import EngineConfig

    model_dir = build_tiny_t5(tmp_path / "tiny", seed=0)
    model = ct2.load(model_dir, tmp_path / "ct2", ("float32",))["float32"]
    engine = load_engine(EngineConfig(model_dir=str(model_dir), use_draft=False,
                                      compile_mode="off", buckets=(8, 16, 32),
                                      max_input_tokens=48, flags_file=""))
    calls: list[str] = []
    real = engine.tokenizer

    class Counting:
        """The engine's tokenizer, counting what the request asks of it."""

        def __call__(self, text: str) -> object:
            calls.append("encode")
            return real(text)

        def decode(self, ids: list[int], **kwargs: object) -> str:
            calls.append("decode")
            return str(real.decode(ids, **kwargs))

    try:
        for text in random_texts(4, seed=2, overflow=False):
            calls.clear()
            ids, out = quality.ct2_request(model, Counting(), text, 12)
            assert calls == ["encode", "decode"]
            # float32 gives the engine's tokens, and the text is the engine's text of them.
            r = engine.generate(text, max_new_tokens=12)
            assert ids == list(r.output_ids) and out == r.text
    finally:
        engine.close()
