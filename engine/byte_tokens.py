"""The byte-level (ByT5) tokenizer's plain encode and decode, without its per-byte Python loop.

A ByT5 tokenizer maps each UTF-8 byte `b` of the text to the id `b + offset` (the ids below
`offset` are pad, eos and unk; sentinel ids `<extra_id_N>` may follow the bytes) and appends
eos; decoding maps the ids back to bytes, drops the special ones when asked and decodes
UTF-8 ignoring invalid bytes. transformers does
this one token object per byte, which costs far more per request than the model's own
steps on a small target. `ByteTokenizer` does the same arithmetic on the whole text and
hands the tokenizer everything else: text that could hold a special token's spelling (a
`<`: `</s>` is encoded as eos, with the spaces around it stripped), text UTF-8 cannot
encode, decoding that keeps special tokens, ids outside the vocabulary, any keyword
argument, and every other attribute. Its ids and texts are the tokenizer's
(tests/engine/test_byte_tokens.py checks them against it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

BYTES = 256


@dataclass(frozen=True)
class Encoded:
    """What a tokenizer call returns that the engine reads: the input ids."""

    input_ids: list[int]
    attention_mask: list[int] = field(repr=False)


class ByteTokenizer:
    """A ByT5 tokenizer whose plain encode and decode skip its per-byte token objects.

    Example:
        tok = byte_tokens.fast(loaded.tokenizer)  # the tokenizer itself if not byte-level
        tok("héllo").input_ids  # [107, 198, 172, 111, 111, 114, 1], as the tokenizer's
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.offset = int(tokenizer.offset)
        self.eos = int(tokenizer.eos_token_id)
        self.size = len(tokenizer)
        self.specials = frozenset(int(i) for i in tokenizer.all_special_ids)

    def __call__(self, text: object, *args: Any, **kwargs: Any) -> Any:
        """Return the ids of `text` (an object with `input_ids`), as the tokenizer would."""
        if args or kwargs or not isinstance(text, str) or "<" in text:
            return self.tokenizer(text, *args, **kwargs)
        try:
            raw = text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: the tokenizer's own error or ids
            return self.tokenizer(text)
        off = self.offset
        ids = [b + off for b in raw]
        ids.append(self.eos)
        return Encoded(ids, [1] * len(ids))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False,
               **kwargs: Any) -> str:
        """Return the text of `ids`, as the tokenizer's `decode` would."""
        ids = list(ids)
        off, top = self.offset, self.offset + BYTES
        if kwargs or not skip_special_tokens:
            return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                             **kwargs))
        # Every id under the bytes is special (fast() checks): min and max, in C, clear a
        # sequence of bytes and specials; one with a sentinel above them is checked per id.
        if ids and (min(ids) < 0 or max(ids) >= top):
            if not all(off <= i < top or i in self.specials for i in ids):
                return str(self.tokenizer.decode(ids, skip_special_tokens=True))
            ids = [i for i in ids if i < top]
        return bytes([i - off for i in ids if i >= off]).decode("utf-8", errors="ignore")

    def __len__(self) -> int:
        return self.size

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


def fast(tokenizer: Any) -> Any:
    """Return a ByteTokenizer for a ByT5 tokenizer whose ids are its specials below the
    bytes and special tokens above them, else `tokenizer` itself."""
    cls = type(tokenizer)
    if not any(c.__name__ == "ByT5Tokenizer" for c in cls.__mro__):
        return tokenizer
    try:
        offset = int(tokenizer.offset)
        specials = {int(i) for i in tokenizer.all_special_ids}
        added = {int(i) for i in tokenizer.added_tokens_decoder}
        plain = list(tokenizer("ab").input_ids)
    except (AttributeError, TypeError, ValueError):
        return tokenizer
    # Only the layout this module assumes: every id under the bytes a special token, none
    # among them, and every id above them a special token (a sentinel).
    above = set(range(offset + BYTES, len(tokenizer)))
    if (not set(range(offset)) <= specials or added & set(range(offset, offset + BYTES))
            or not above <= specials
            or plain != [ord("a") + offset, ord("b") + offset, tokenizer.eos_token_id]):
        return tokenizer
    return ByteTokenizer(tokenizer)
