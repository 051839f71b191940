"""Text far over the token cap is refused by its length in characters, before tokenizing."""

from __future__ import annotations

import pytest

from engine.errors import InputTooLong
from tests.engine.conftest import MAX_INPUT, tiny_config


def test_text_over_32_chars_per_token_is_refused_before_tokenizing(tiny_dirs):
    from engine import load_engine

    engine = load_engine(tiny_config(tiny_dirs, compile_mode="off"))
    tokenized: list[int] = []
    real = engine.tokenizer

    def counting(text, *args, **kwargs):
        tokenized.append(len(text))
        return real(text, *args, **kwargs)

    engine.models.tokenizer = counting  # observe the production path: is it reached?
    try:
        with pytest.raises(InputTooLong) as info:
            engine.generate("x" * (MAX_INPUT * 32 + 1), max_new_tokens=2)
        assert info.value.field == "text" and info.value.limit == MAX_INPUT * 32
        assert "characters" in str(info.value) and tokenized == []
        # Under the character bound the token cap still decides (after tokenizing).
        with pytest.raises(InputTooLong) as info:
            engine.generate("x" * MAX_INPUT, max_new_tokens=2)
        assert info.value.limit == MAX_INPUT and tokenized == [MAX_INPUT]
    finally:
        engine.close()
