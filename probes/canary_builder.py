"""Build canary suites from a user's own sample texts, for the engine's own tokenizer.

The shipped suites are byte-level word chains: with a subword tokenizer most of them fall
in the smallest buckets. `build_suites` cuts or joins sample texts so that every configured
bucket gets `per_bucket` canaries whose token counts spread over the bucket's range,
deduplicates them, holds out a share of the samples as a second suite, and records for
each canary its token count, bucket and reference output (the engine passed in is the
reference engine: eager, float32, no draft; each canary runs direct, exact shape).

Talks to the engine only through `engine.protocol.Engine`: `count_tokens`, `bucket_for`,
`generate`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.protocol import Engine, FlagOverride
from probes.canaries import Canary, CanarySuite

REFERENCE_PATH = "eager/float32/direct"
# The reference path: no compile, no speculation, the exact input shape.
REFERENCE_OVERRIDE = FlagOverride(compiled=False, speculative=False, bucketing=False)


@dataclass(frozen=True)
class BuildResult:
    """The built suites and, per bucket label, how many canaries each got."""

    suites: tuple[CanarySuite, ...]
    coverage: dict[str, dict[str, int]]  # suite name -> bucket label -> canaries
    missing: dict[str, tuple[str, ...]]  # suite name -> buckets left without a canary


def clean_samples(lines: Iterable[str]) -> list[str]:
    """Return the non-empty sample lines, whitespace-normalized and deduplicated, in order."""
    seen: set[str] = set()
    out: list[str] = []
    for line in lines:
        text = " ".join(line.split())
        if text and text not in seen:
            seen.add(text)
            out.append(text)
    return out


def split_holdout(samples: Sequence[str], share: float) -> tuple[list[str], list[str]]:
    """Split samples into (canary, held-out) by a stable hash of each text."""
    if not 0.0 <= share < 1.0:
        raise ValueError(f"holdout: must be in [0, 1), got {share}")
    keep: list[str] = []
    held: list[str] = []
    for text in samples:
        draw = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") / 2**32
        (held if draw < share else keep).append(text)
    if not keep and held:  # a tiny file must still give canaries
        keep, held = held, []
    return keep, held


def bucket_ranges(buckets: Sequence[int]) -> list[tuple[str, int, int]]:
    """Return (label, lowest, highest token count) of every bucket."""
    out = []
    low = 1
    for edge in buckets:
        out.append((str(edge), low, edge))
        low = edge + 1
    return out


def _targets(low: int, high: int, count: int) -> list[int]:
    """Return `count` token counts spread evenly over [low, high], highest first."""
    if count == 1:
        return [high]
    span = high - low
    return sorted({high - round(i * span / (count - 1)) for i in range(count)}, reverse=True)


class _Cutter:
    """Cut texts of a target token count out of a word stream (joining samples, wrapping)."""

    def __init__(self, samples: Sequence[str], count: Callable[[str], int]) -> None:
        self.words = " ".join(samples).split()
        self.count = count

    def cut(self, start: int, target: int) -> str | None:
        """Return the longest text from word `start` with at most `target` tokens."""
        words = self.words
        if not words:
            return None

        def text(n: int) -> str:
            return " ".join(words[(start + i) % len(words)] for i in range(n))

        lo, hi = 0, 1
        while self.count(text(hi)) <= target:  # grow until over the target
            lo, hi = hi, hi * 2
            if hi > 4 * target + 8:  # no word adds a token: give up
                return text(lo) if lo else None
        while hi - lo > 1:  # token counts grow with the word count: bisect
            mid = (lo + hi) // 2
            if self.count(text(mid)) <= target:
                lo = mid
            else:
                hi = mid
        return text(lo) if lo else None


def pick_canaries(samples: Sequence[str], engine: Engine, per_bucket: int
                  ) -> dict[str, list[tuple[str, int]]]:
    """Return, per bucket label, up to `per_bucket` distinct (text, tokens) landing in it.

    Whole samples that land in a bucket come first; the rest are cut from (or joined
    across) the samples at spread-out starting words to hit token counts spread over the
    bucket's range.
    """
    if per_bucket < 1:
        raise ValueError(f"per_bucket: must be >= 1, got {per_bucket}")
    ranges = bucket_ranges(engine.info.buckets)
    chosen: dict[str, list[tuple[str, int]]] = {label: [] for label, _, _ in ranges}
    seen: set[str] = set()

    def take(label: str, text: str, tokens: int) -> None:
        if text not in seen and len(chosen[label]) < per_bucket:
            seen.add(text)
            chosen[label].append((text, tokens))

    for text in samples:
        tokens = engine.count_tokens(text)
        label = engine.bucket_for(tokens)
        if label in chosen:
            take(label, text, tokens)
    cutter = _Cutter(samples, engine.count_tokens)
    n_words = max(1, len(cutter.words))
    # Starts spread over the stream (so canaries differ), shifted per bucket; +1 per try
    # so a stream shorter than the stride still yields distinct texts.
    stride = max(1, n_words // (2 * per_bucket))
    for b, (label, low, high) in enumerate(ranges):
        need = per_bucket - len(chosen[label])
        if need <= 0:
            continue
        targets = _targets(low, high, need)
        for attempt in range(8 * per_bucket):
            if len(chosen[label]) >= per_bucket:
                break
            target = targets[attempt % len(targets)]
            start = (attempt * stride + attempt + b * n_words // len(ranges)) % n_words
            cut = cutter.cut(start, target)
            if cut is None:
                continue
            tokens = engine.count_tokens(cut)
            if low <= tokens <= high and engine.bucket_for(tokens) == label:
                take(label, cut, tokens)
    return chosen


def build_suites(samples: Iterable[str], engine: Engine, *, name: str = "own",
                 per_bucket: int = 8, holdout: float = 0.2, max_new_tokens: int | None = None,
                 model_version: str | None = None) -> BuildResult:
    """Build the canary suite `name` (and `name`_heldout) with reference outputs."""
    cleaned = clean_samples(samples)
    if not cleaned:
        raise ValueError("samples: no non-empty line")
    keep, held = split_holdout(cleaned, holdout)
    suites: list[CanarySuite] = []
    coverage: dict[str, dict[str, int]] = {}
    missing: dict[str, tuple[str, ...]] = {}
    reference = {"model_version": model_version or engine.info.model_version,
                 "path": REFERENCE_PATH}
    parts = [(name, keep)] + ([(f"{name}_heldout", held)] if held else [])
    for suite_name, part in parts:
        picked = pick_canaries(part, engine, per_bucket)
        canaries: list[Canary] = []
        for label, items in picked.items():
            for text, tokens in items:
                result = engine.generate(text, max_new_tokens=max_new_tokens, canary=True,
                                         override=REFERENCE_OVERRIDE)
                canaries.append(Canary(text, tokens, label, tuple(result.output_ids),
                                       result.text))
        coverage[suite_name] = {label: len(items) for label, items in picked.items()}
        missing[suite_name] = tuple(label for label, items in picked.items() if not items)
        if canaries:
            suites.append(CanarySuite(suite_name, name, tuple(c.text for c in canaries),
                                      max_new_tokens, "", tuple(canaries), reference))
    return BuildResult(tuple(suites), coverage, missing)


def suites_yaml(suites: Iterable[CanarySuite], header: str = "") -> str:
    """Return a suites file for `suites` (the format probes.canaries.load_suites_file reads)."""
    import yaml

    class Dumper(yaml.SafeDumper):
        """Write token-id lists on one line."""

    class Ids(list):
        pass

    Dumper.add_representer(Ids, lambda d, v: d.represent_sequence(
        "tag:yaml.org,2002:seq", v, flow_style=True))
    data: list[dict[str, Any]] = []
    for suite in suites:
        entry: dict[str, Any] = {"name": suite.name, "domain": suite.domain}
        if suite.max_new_tokens is not None:
            entry["max_new_tokens"] = suite.max_new_tokens
        if suite.reference:
            entry["reference"] = dict(suite.reference)
        entry["prompts"] = [
            {"text": c.text, "tokens": c.tokens, "bucket": c.bucket,
             "reference_ids": Ids(c.reference_ids or ()), "reference_text": c.reference_text,
             **({"expected": c.expected} if c.expected is not None else {})}
            for c in suite.canaries]
        data.append(entry)
    body = yaml.dump({"suites": data}, Dumper=Dumper, sort_keys=False, allow_unicode=True,
                     width=100)
    lines = "".join(f"# {line}\n" for line in header.splitlines())
    return lines + body
