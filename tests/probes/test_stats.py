"""Percentiles and group summaries from hand-set values."""

from __future__ import annotations

import pytest

from engine.protocol import GenerateResult, SpecStats
from probes.measure import add_positions, group, summarize
from probes.stats import Distribution, percentile


def test_percentile_interpolates_like_numpy() -> None:
    xs = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 95) == pytest.approx(8.8)  # 4 + 0.8 * (10 - 4)
    assert percentile(xs, 100) == 10.0
    assert percentile([7.0], 99) == 7.0


def test_percentile_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="q"):
        percentile([1.0], 101)


def test_distribution_of_empty_is_all_none() -> None:
    d = Distribution.of([])
    assert d.count == 0 and d.p50 is None and d.max is None


def _result(total: float, *, bucket: str = "32", decoding: str = "speculative",
            drafts: int = 2, proposed: int = 8, accepted: int = 6,
            per_pos: tuple[int, ...] = (2, 2, 1, 1)) -> GenerateResult:
    return GenerateResult(
        text="x", output_ids=(1,), input_tokens=20, bucket=bucket, padded_length=32,
        output_tokens=3, path="compiled", decoding=decoding, queue_wait_s=0.001,
        encoder_s=0.002, ttft_s=0.01, decode_token_s=(0.004, 0.006), total_s=total,
        spec=SpecStats(drafts, proposed, accepted, per_pos, drafts), canary=True)


def test_summarize_derives_shapes_and_acceptance() -> None:
    g = summarize("optimized", [_result(0.1), _result(0.3, per_pos=(2, 1))])
    assert g.requests == 2
    assert g.latency.p50 == pytest.approx(0.2)
    assert g.latency.max == 0.3
    assert g.per_token.p50 == pytest.approx(0.005)
    assert g.padded_length == 32
    assert g.padding_waste == pytest.approx(12 / 32)
    assert g.output_tokens == 6
    assert (g.drafts, g.draft_tokens, g.accepted_tokens) == (4, 16, 12)
    assert g.accepted_per_position == (4, 3, 1, 1)
    assert g.acceptance_rate == pytest.approx(0.75)


def test_group_splits_by_bucket_decoding_and_variant() -> None:
    pairs = [("optimized", _result(0.1)), ("optimized", _result(0.1, bucket="64")),
             ("direct", _result(0.2, decoding="direct", drafts=0, proposed=0, accepted=0,
                                 per_pos=()))]
    keys = [g.key for g in group(pairs)]
    assert keys == [("32", "compiled", "speculative", "optimized"),
                    ("64", "compiled", "speculative", "optimized"),
                    ("32", "compiled", "direct", "direct")]
    assert group(pairs)[2].acceptance_rate is None


def test_add_positions_sums_counters_of_any_lengths() -> None:
    assert add_positions() == ()
    assert add_positions((2, 1)) == (2, 1)
    assert add_positions((), (1,), (3, 2, 1), (0, 4)) == (4, 6, 1)
