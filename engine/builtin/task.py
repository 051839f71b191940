"""The built-in models' synthetic text-to-text task (pure Python, deterministic).

Each domain is a "word chain": a fixed vocabulary laid out on one cycle, so every
word has exactly one successor. Some words carry the domain's terminator ('.' for
in_domain, ';' for shifted) and end a sentence. An input is the tail of a run of
consecutive chain words, cut from the left to exactly `input_bytes` bytes (so it may
start mid-word but always ends on a complete word); the expected output is the
continuation of the chain, from the next word up to and including the next
terminator word. Inputs are chosen so that outputs are 40-150 bytes long.

The decoder only needs the last word or two of context, so small models learn the
task quickly and generalize across input lengths; the draft model is trained on
in_domain only, so it disagrees with the target on shifted text.

Exceptions: `TaskError(ValueError)` for bad arguments or inputs not drawn from a chain.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

IN_DOMAIN = "in_domain"
SHIFTED = "shifted"
DOMAINS = (IN_DOMAIN, SHIFTED)

MIN_INPUT_BYTES = 8
MAX_INPUT_BYTES = 4096
MIN_OUTPUT_BYTES = 40
MAX_OUTPUT_BYTES = 150

BUILTIN_DIR = Path(__file__).parent
CANARY_DIR = BUILTIN_DIR / "canaries"
HELDOUT_PATH = BUILTIN_DIR / "heldout.jsonl"

# Buckets of input bytes (one token per byte plus EOS: 16/32/64/128/256 tokens).
BYTE_BUCKETS = ((8, 15), (16, 31), (32, 63), (64, 127), (128, 255))

_IN_DOMAIN_WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "river", "stone",
    "green", "field", "small", "house", "light", "water", "tree", "bird", "song", "early",
    "rain", "cloud", "warm", "wind", "north", "hill", "path", "gold", "bread", "milk",
    "honey", "apple", "garden", "road", "window", "door", "candle", "night", "star", "moon",
    "silver", "forest", "deer", "quiet", "snow", "winter", "spring", "summer", "autumn",
    "leaf", "branch", "root", "seed", "flower", "meadow", "valley", "lake", "boat", "sail",
    "shore", "sand", "shell", "wave", "salt",
)

_SHIFTED_TOKENS = (
    "ERR_42", "k8s_pod", "0x1f", "GET", "/api/v2", "id=7", "rc=-1", "NaN",
    "nil", "0xdead", "__init", "ptr->", "&&", "||", "x[i]", "!=",
    "<<", "i++", "int32", "u8", "fd=3", "PID:88", "SIGHUP", "EOF",
    "TODO:", "#def", "@v1", "$HOME", "~/tmp", "%d", "\\n", "0o755",
    "1e-9", "uuid4", "sha256", "-rwxr", "[OK]", "WARN", "FATAL", "tcp/80",
    "127.0.1", "::1", "{}", "()=>", "void*", "i<n", "len-1", "FF00",
    "q=0.9", "UTF-8", "HTTP/2", "503", "GC:12", "ms=17", "v3.11", "a_b_c",
    "ZZ_9", "<br/>", "x^2", "j+=4", "ret0", "mmap", "TTL:60", "CRC32",
)

_TERMINATOR = {IN_DOMAIN: ".", SHIFTED: ";"}
# Cycle indices (after shuffling) that carry the terminator: sentences of 20-23 words.
_TERMINATOR_AT = (20, 42, 63)


class TaskError(ValueError):
    """A bad argument or an input that is not drawn from a word chain."""


def _shuffled(words: tuple[str, ...], salt: str) -> list[str]:
    # A hash order instead of random.shuffle: identical on every Python version.
    return sorted(words, key=lambda w: hashlib.sha256((salt + w).encode()).hexdigest())


def _build_chain(words: tuple[str, ...], domain: str) -> tuple[str, ...]:
    order = _shuffled(words, f"tailwatch-{domain}")
    for i in _TERMINATOR_AT:
        order[i] = order[i] + _TERMINATOR[domain]
    return tuple(order)


CHAINS: dict[str, tuple[str, ...]] = {
    IN_DOMAIN: _build_chain(_IN_DOMAIN_WORDS, IN_DOMAIN),
    SHIFTED: _build_chain(_SHIFTED_TOKENS, SHIFTED),
}
_WHERE: dict[str, tuple[str, int]] = {
    w: (d, i) for d, chain in CHAINS.items() for i, w in enumerate(chain)
}
MAX_WORD_BYTES = max(len(w) for w in _WHERE)


def _check_domain(domain: str) -> tuple[str, ...]:
    if domain not in CHAINS:
        raise TaskError(f"domain: must be one of {DOMAINS}, got {domain!r}")
    return CHAINS[domain]


def _continuation(domain: str, last_index: int) -> str:
    chain = CHAINS[domain]
    term = _TERMINATOR[domain]
    out: list[str] = []
    i = last_index
    while True:
        i = (i + 1) % len(chain)
        out.append(chain[i])
        if chain[i].endswith(term):
            return " ".join(out)


def valid_end_indices(domain: str) -> tuple[int, ...]:
    """Return the chain indices an input may end on (outputs 40-150 bytes)."""
    chain = _check_domain(domain)
    return tuple(
        i for i in range(len(chain))
        if MIN_OUTPUT_BYTES <= len(_continuation(domain, i)) <= MAX_OUTPUT_BYTES
    )


def input_for(domain: str, end_index: int, input_bytes: int) -> str:
    """Return the `input_bytes` bytes of chain text ending with word `end_index`."""
    chain = _check_domain(domain)
    if not MIN_INPUT_BYTES <= input_bytes <= MAX_INPUT_BYTES:
        raise TaskError(
            f"input_bytes: must be in [{MIN_INPUT_BYTES}, {MAX_INPUT_BYTES}], got {input_bytes}")
    parts: list[str] = []
    size = -1
    i = end_index
    while size < input_bytes:
        parts.append(chain[i % len(chain)])
        size += len(parts[-1]) + 1
        i -= 1
    text = " ".join(reversed(parts))
    return text[-input_bytes:]


def make_input(domain: str, rng: random.Random, input_bytes: int) -> str:
    """Return a random ASCII input of exactly `input_bytes` bytes from `domain`."""
    ends = valid_end_indices(domain)
    return input_for(domain, rng.choice(ends), input_bytes)


def expected_output(input_text: str) -> str:
    """Return the chain continuation the target model must produce for `input_text`."""
    last = input_text.split(" ")[-1]
    if last not in _WHERE:
        raise TaskError(f"input_text: last word {last[-20:]!r} is not a chain word")
    domain, index = _WHERE[last]
    return _continuation(domain, index)


def domain_of(input_text: str) -> str:
    """Return the domain whose chain the last word of `input_text` belongs to."""
    last = input_text.split(" ")[-1]
    if last not in _WHERE:
        raise TaskError(f"input_text: last word {last[-20:]!r} is not a chain word")
    return _WHERE[last][0]


def make_example(domain: str, rng: random.Random, input_bytes: int) -> tuple[str, str]:
    """Return (input_text, expected_output) for a random input of `input_bytes` bytes."""
    text = make_input(domain, rng, input_bytes)
    return text, expected_output(text)


def random_input_bytes(rng: random.Random, weights: tuple[float, ...] | None = None) -> int:
    """Return an input length drawn bucket-first (mostly short inputs by default)."""
    weights = weights or (0.3, 0.25, 0.2, 0.15, 0.1)
    lo, hi = rng.choices(BYTE_BUCKETS, weights=weights)[0]
    return rng.randint(lo, hi)


def read_canaries(domain: str) -> list[str]:
    """Return the shipped canary inputs of `domain` (held out from training)."""
    _check_domain(domain)
    return (CANARY_DIR / f"{domain}.txt").read_text().splitlines()


def read_heldout() -> list[dict[str, str]]:
    """Return the shipped held-out examples: {"domain", "input", "expected"} dicts."""
    return [json.loads(line) for line in HELDOUT_PATH.read_text().splitlines() if line]
