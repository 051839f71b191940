"""Fold GenerateResults into per-(bucket, path, decoding, variant) group summaries."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any

from engine.protocol import GenerateResult
from probes.stats import Distribution
from storage.sketches import Sketch
from vocab import Variant

VARIANT_DEFAULT = Variant.OPTIMIZED.value  # the engine's current flags, no override


@dataclass(frozen=True)
class GroupResult:
    """What the canaries of one (bucket, path, decoding, variant) measured.

    latency: GenerateResult.own_s per request (total_s less any pause a real request
    preempted it for); ttft: ttft_s; per_token: each request's
    mean time per output token after the first; queue_wait: queue_wait_s.
    padded_length: the largest padded input; padding_waste: mean share of padding.
    Acceptance counters are summed over the group's requests. *_sketch: the same latency,
    ttft and per-token samples as storage.sketches' stored form (per_token weighted by each
    request's tokens after the first), so windows can pool cycles exactly.
    """

    bucket: str
    path: str
    decoding: str
    variant: str
    requests: int
    latency: Distribution
    ttft: Distribution
    per_token: Distribution
    queue_wait: Distribution
    input_tokens: Distribution
    padded_length: int
    padding_waste: float
    output_tokens: int
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
    target_forwards: int = 0
    latency_sketch: dict[str, Any] = field(default_factory=dict)
    ttft_sketch: dict[str, Any] = field(default_factory=dict)
    per_token_sketch: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str, str, str]:
        """Return (bucket, path, decoding, variant)."""
        return (self.bucket, self.path, self.decoding, self.variant)

    @property
    def acceptance_rate(self) -> float | None:
        """Return accepted / proposed tokens, or None when nothing was proposed."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None


def add_positions(*counters: Sequence[int]) -> tuple[int, ...]:
    """Return the element-wise sum of per-position counters of any lengths (one C pass)."""
    return tuple(map(sum, zip_longest(*counters, fillvalue=0)))


def summarize(variant: str, results: Sequence[GenerateResult]) -> GroupResult:
    """Summarize results that share bucket, path and decoding."""
    if not results:
        raise ValueError("results: must not be empty")
    first = results[0]
    positions = add_positions(*(r.spec.accepted_per_position for r in results))
    per_token = [r.per_token_s for r in results if r.per_token_s is not None]
    per_token_sketch = Sketch()
    for r in results:
        if r.decode_token_s:
            per_token_sketch.add(sum(r.decode_token_s) / len(r.decode_token_s),
                                 len(r.decode_token_s))
    return GroupResult(
        bucket=first.bucket,
        path=first.path,
        decoding=first.decoding,
        variant=variant,
        requests=len(results),
        latency=Distribution.of([r.own_s for r in results]),
        ttft=Distribution.of([r.ttft_s for r in results]),
        per_token=Distribution.of(per_token),
        queue_wait=Distribution.of([r.queue_wait_s for r in results]),
        input_tokens=Distribution.of([float(r.input_tokens) for r in results]),
        padded_length=max(r.padded_length for r in results),
        padding_waste=sum(r.padding_waste for r in results) / len(results),
        output_tokens=sum(r.output_tokens for r in results),
        drafts=sum(r.spec.drafts for r in results),
        draft_tokens=sum(r.spec.draft_tokens for r in results),
        accepted_tokens=sum(r.spec.accepted_tokens for r in results),
        accepted_per_position=positions,
        target_forwards=sum(r.spec.target_forwards for r in results),
        latency_sketch=Sketch.of([r.own_s for r in results]).to_json(),
        ttft_sketch=Sketch.of([r.ttft_s for r in results]).to_json(),
        per_token_sketch=per_token_sketch.to_json(),
    )


def group(pairs: Iterable[tuple[str, GenerateResult]]) -> tuple[GroupResult, ...]:
    """Group (variant, result) pairs by (bucket, path, decoding, variant), in first-seen order."""
    groups: dict[tuple[str, str, str, str], list[GenerateResult]] = {}
    for variant, r in pairs:
        groups.setdefault((r.bucket, r.path, r.decoding, variant), []).append(r)
    return tuple(summarize(k[3], rs) for k, rs in groups.items())
