"""The byte-level tokenizer's fast path (engine.byte_tokens) against the tokenizer itself."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import pytest

from engine import byte_tokens, loader
from engine.config import BUILTIN_DIR
from tests.engine.conftest import tiny_config


@pytest.fixture(scope="module")
def hf():
    return loader.load_tokenizer(BUILTIN_DIR / "target")


def _texts() -> list[str]:
    rng = random.Random(0)
    alphabet = ("abc XYZ 019 .,;:!?'\"\t\n\r\x00\x7f é ß ñ ø 漢字 かな 한국 "
                "Ж ж ع א 🙂 👍🏽 \u200b \u0301 \ufeff")
    texts = ["", " ", "hello", " lead and trail ", "a . b ,c", "é漢字🙂", "\n\n",
             "x" * 300, "naïve café", "e\u0301", "<", ">", "</", "a<b", "<s>", "</S>",
             "</s>", "a</s>b", "a </s> b", "x<pad>y <unk>", "<extra_id_0>", "1 < 2 and 3 > 2"]
    for _ in range(300):
        texts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))))
    for _ in range(100):  # any code point but the surrogates
        texts.append("".join(chr(rng.choice([rng.randint(1, 0xD7FF),
                                             rng.randint(0xE000, 0x10FFFF)]))
                             for _ in range(rng.randint(1, 20))))
    return texts


def _ids(hf, text: str) -> list[int]:
    with warnings.catch_warnings():
        # Text ending in "</s>": the tokenizer warns that it adds no second eos.
        warnings.simplefilter("ignore", UserWarning)
        return list(hf(text).input_ids)


def test_the_builtin_tokenizer_is_byte_level_and_gets_the_fast_path(hf) -> None:
    tok = byte_tokens.fast(hf)
    assert isinstance(tok, byte_tokens.ByteTokenizer) and tok.tokenizer is hf
    # What it does not do itself it hands on.
    assert len(tok) == len(hf) and tok.eos_token_id == hf.eos_token_id == 1
    assert tok.pad_token_id == hf.pad_token_id


def test_encoded_ids_are_the_tokenizers(hf) -> None:
    tok = byte_tokens.fast(hf)
    for text in _texts():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # see _ids
            got = list(tok(text).input_ids)
        assert got == _ids(hf, text), repr(text)
    # Keyword arguments and non-text go to the tokenizer.
    assert tok("ab", add_special_tokens=False).input_ids == hf("ab", add_special_tokens=False
                                                               ).input_ids == [100, 101]
    assert list(tok(["ab", "c"]).input_ids) == list(hf(["ab", "c"]).input_ids)


def test_a_lone_surrogate_is_the_tokenizers_business(hf) -> None:
    tok = byte_tokens.fast(hf)
    try:
        expected: object = list(hf("a\ud800").input_ids)
    except UnicodeEncodeError as exc:
        expected = type(exc)
    try:
        got: object = list(tok("a\ud800").input_ids)
    except UnicodeEncodeError as exc:
        got = type(exc)
    assert got == expected


def test_decoded_texts_are_the_tokenizers(hf) -> None:
    tok = byte_tokens.fast(hf)
    rng = random.Random(1)
    sequences = [_ids(hf, text) for text in _texts()]
    # Any ids in the vocabulary: specials anywhere, bytes that are not valid UTF-8.
    sequences += [[rng.randrange(len(hf)) for _ in range(rng.randint(0, 40))]
                  for _ in range(400)]
    sequences += [[], [0, 1, 2], [107, 0, 200, 1, 258], [0xC3 + 3, 1, 0xA9 + 3]]
    for ids in sequences:
        for skip in (True, False):
            assert (tok.decode(ids, skip_special_tokens=skip)
                    == hf.decode(ids, skip_special_tokens=skip)), (ids, skip)


def test_ids_outside_the_vocabulary_fail_as_the_tokenizers_do(hf) -> None:
    tok = byte_tokens.fast(hf)
    for ids in ([300, 104], [104, -1]):
        with pytest.raises(Exception) as ref:
            hf.decode(ids, skip_special_tokens=True)
        with pytest.raises(type(ref.value)):
            tok.decode(ids, skip_special_tokens=True)


def test_sentinel_ids_above_the_bytes_decode_as_the_tokenizers() -> None:
    from transformers import ByT5Tokenizer

    hf = ByT5Tokenizer()  # 125 <extra_id_N> above the bytes, as the tiny test models have
    tok = byte_tokens.fast(hf)
    assert isinstance(tok, byte_tokens.ByteTokenizer)
    rng = random.Random(2)
    for _ in range(200):
        ids = [rng.randrange(len(hf)) for _ in range(rng.randint(0, 30))]
        for skip in (True, False):
            assert (tok.decode(ids, skip_special_tokens=skip)
                    == hf.decode(ids, skip_special_tokens=skip)), (ids, skip)
    for text in ("plain", "a<extra_id_3>b", "héllo"):
        assert list(tok(text).input_ids) == _ids(hf, text)


def test_other_tokenizers_are_left_as_they_are(hf) -> None:
    from transformers import ByT5Tokenizer

    plain = object()
    assert byte_tokens.fast(plain) is plain
    added = ByT5Tokenizer(extra_ids=0)
    added.add_tokens(["hello"])  # a token that is not special above the bytes
    assert byte_tokens.fast(added) is added


def test_the_engine_serves_through_the_fast_path(tiny_dirs: dict[str, Path]) -> None:
    from engine import load_engine

    engine = load_engine(tiny_config(tiny_dirs, compile_mode="off"))
    try:
        assert isinstance(engine.tokenizer, byte_tokens.ByteTokenizer)
        hf = engine.tokenizer.tokenizer
        r = engine.generate("héllo wörld", max_new_tokens=4)
        assert r.input_tokens == len(hf("héllo wörld").input_ids)
        assert r.text == hf.decode(list(r.output_ids), skip_special_tokens=True)
    finally:
        engine.close()
