"""Fakes for probe tests: the protocol-level fake engine and placeholder canary suites."""

from __future__ import annotations

import random

from probes.canaries import CanarySuite
from probes.fake import FakeEngine, FakeTimings

__all__ = ["FakeEngine", "FakeTimings", "placeholder_suites", "prompt_of"]

_WORDS = ("river", "stone", "green", "field", "small", "house", "light", "water")
_SHIFTED = ("ERR_42", "k8s_pod", "0x1f", "GET", "/api/v2", "rc=-1", "NaN", "nil")


def prompt_of(n_bytes: int, words: tuple[str, ...] = _WORDS, seed: int = 0) -> str:
    """Return a text of exactly `n_bytes` bytes built from `words`."""
    rng = random.Random(seed)
    text = ""
    while len(text) < n_bytes:
        text += rng.choice(words) + " "
    return text[:n_bytes].rstrip().ljust(n_bytes, "a")


def placeholder_suites(per_bucket: int = 2) -> dict[str, CanarySuite]:
    """Return in_domain and shifted suites with `per_bucket` prompts in every default bucket."""
    sizes = (10, 25, 50, 100, 200)  # bytes; +1 EOS token lands in 16/32/64/128/256
    out = {}
    for name, words in (("in_domain", _WORDS), ("shifted", _SHIFTED)):
        prompts = tuple(prompt_of(n - i, words, seed=i) for n in sizes for i in range(per_bucket))
        out[name] = CanarySuite(name, name, prompts, 16, "placeholder")
    return out
