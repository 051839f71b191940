"""Compare outputs with their reference outputs: pure functions, no engine, no SQL.

The reference output of a prompt is what the reference path (engine.protocol.REFERENCE:
eager, direct decoding, exact input shape, float32 weights) generates for it in one
cohort (model_version, config_hash). Every arm's output is compared with it:

    exact: the token ids are equal.
    agreement: the share of positions equal up to the shorter length (1.0 when both
        are empty, 0.0 when only one is); `length_diff` says what it leaves out.
    length_diff: len(output) - len(reference).
    first_divergence: the first position where the two differ (a position past the
        shorter one when one is a prefix of the other), None when exact.

`summarize` sums them per (bucket, path, decoding, variant) into the AgreementGroup the
SQL sink stores and storage.queries.quality reads back (one view for both).

A canary may also carry a golden answer (`expected` in a suites file, probes.canaries):
its output text is then checked against it too (golden_match), and each group counts
the outputs that had one (golden_count) and those equal to it (golden_exact).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from storage.queries.quality import AgreementGroup

WORST_KEPT = 3  # worst outputs kept per group (for the report)


@dataclass(frozen=True)
class Comparison:
    """One output compared with its reference (see the module docstring)."""

    exact: bool
    agreement: float
    length_diff: int
    first_divergence: int | None


def compare(output: Sequence[int], reference: Sequence[int]) -> Comparison:
    """Return how `output` agrees with `reference`."""
    out, ref = list(output), list(reference)
    shorter = min(len(out), len(ref))
    equal = sum(1 for a, b in zip(out, ref, strict=False) if a == b)
    # Two empty outputs agree; an empty one against a non-empty one does not.
    agreement = equal / shorter if shorter else float(len(out) == len(ref))
    first = next((i for i, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b), None)
    if first is None and len(out) != len(ref):
        first = shorter
    return Comparison(exact=out == ref, agreement=agreement, length_diff=len(out) - len(ref),
                      first_divergence=first)


def golden_match(output_text: str, expected: str) -> bool:
    """Return whether an output equals its golden answer, surrounding whitespace aside."""
    return output_text.strip() == expected.strip()


def prompt_key(prompt: str, max_new_tokens: int | None) -> str:
    """Return the key of a reference: sha256 of the token budget and the prompt."""
    return hashlib.sha256(f"{max_new_tokens}\x00{prompt}".encode()).hexdigest()


@dataclass(frozen=True)
class Compared:
    """One output of one arm, its labels and its comparison with the reference."""

    key: str  # prompt_key of the canary
    bucket: str
    path: str
    decoding: str
    variant: str
    comparison: Comparison
    golden: bool | None = None  # equal to the golden answer; None: the canary has none


def summarize(items: Iterable[Compared]) -> tuple[AgreementGroup, ...]:
    """Group comparisons by (bucket, path, decoding, variant), in first-seen order."""
    groups: dict[tuple[str, str, str, str], list[Compared]] = {}
    for c in items:
        groups.setdefault((c.bucket, c.path, c.decoding, c.variant), []).append(c)
    out = []
    for (bucket, path, decoding, variant), cs in groups.items():
        divergences = [c.comparison.first_divergence for c in cs
                       if c.comparison.first_divergence is not None]
        worst = sorted((c for c in cs if not c.comparison.exact),
                       key=lambda c: (c.comparison.agreement, c.key))[:WORST_KEPT]
        out.append(AgreementGroup(
            bucket=bucket, path=path, decoding=decoding, variant=variant, count=len(cs),
            exact=sum(1 for c in cs if c.comparison.exact),
            agreement_sum=sum(c.comparison.agreement for c in cs),
            length_diff_sum=sum(abs(c.comparison.length_diff) for c in cs),
            first_divergence_min=min(divergences) if divergences else None,
            worst=tuple({"key": c.key, "agreement": c.comparison.agreement,
                         "first_divergence": c.comparison.first_divergence,
                         "length_diff": c.comparison.length_diff} for c in worst),
            golden_count=sum(1 for c in cs if c.golden is not None),
            golden_exact=sum(1 for c in cs if c.golden)))
    return tuple(out)
