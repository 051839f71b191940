"""Quantile sketches: 1% relative error, exact merges, stored form, sample needs."""

from __future__ import annotations

import random

import pytest

from storage.sketches import (
    RELATIVE_ACCURACY,
    Sketch,
    exact_lower_quantile,
    lengths_add,
    lengths_items,
    lengths_of,
    merged,
    min_samples,
)


def _stalled(rng: random.Random, n: int) -> list[float]:
    # Lognormal around 50 ms with 2% stalls x10: a long, lumpy tail.
    return [rng.lognormvariate(-3.0, 0.3) * (10.0 if rng.random() < 0.02 else 1.0)
            for _ in range(n)]


@pytest.mark.parametrize("q", [0.0, 0.5, 0.9, 0.95, 0.99, 0.999, 1.0])
def test_quantiles_are_within_one_percent_of_the_exact_order_statistic(q: float) -> None:
    xs = _stalled(random.Random(1), 20_000)
    got = Sketch.of(xs).quantile(q)
    want = exact_lower_quantile(xs, q)
    assert got is not None and abs(got - want) / want <= RELATIVE_ACCURACY


def test_merging_stored_parts_equals_the_sketch_of_the_union() -> None:
    rng = random.Random(2)
    parts = [_stalled(rng, rng.randint(1, 300)) for _ in range(200)]  # minutes x replicas
    union = [x for p in parts for x in p]
    pooled = merged(Sketch.of(p).to_json() for p in parts)
    whole = Sketch.of(union)
    assert pooled.count == len(union) and pooled.bins == whole.bins
    for q in (0.5, 0.95, 0.99):
        want = exact_lower_quantile(union, q)
        assert abs(pooled.quantile(q) - want) / want <= RELATIVE_ACCURACY  # type: ignore[operator]


def test_weighted_add_zero_bin_and_round_trip() -> None:
    s = Sketch()
    s.add(0.002, 9)
    s.add(0.0)  # at or below MIN_VALUE: the zero bin
    s.add(0.5, 0)  # no weight: ignored
    assert s.count == 10 and s.quantile(0.0) == 0.0
    assert s.quantile(0.5) == pytest.approx(0.002, rel=RELATIVE_ACCURACY)
    back = Sketch.from_json(s.to_json())
    assert (back.count, back.zeros, back.bins) == (10, 1, s.bins)
    assert Sketch().to_json() == {} and Sketch.from_json(None).quantile(0.99) is None
    with pytest.raises(ValueError, match="q"):
        s.quantile(1.5)


def test_a_quantile_needs_one_expected_sample_above_it() -> None:
    assert (min_samples(0.99), min_samples(0.95), min_samples(0.5)) == (100, 20, 2)
    assert min_samples(0.0) == 1
    with pytest.raises(ValueError, match="q"):
        min_samples(1.0)


def test_lengths_are_exact_sparse_counts() -> None:
    a = lengths_of([36, 40, 40])
    assert a == {"36": 1, "40": 2}
    assert lengths_items(lengths_add(a, {"40": 1, "7": 3})) == [(7, 3), (36, 1), (40, 3)]


def test_add_many_is_add_per_value_zeros_included() -> None:
    values = [0.0, 1e-7, 0.003, 0.003, 0.05, 2.5] + _stalled(random.Random(3), 200)
    one_by_one = Sketch()
    for v in values:
        one_by_one.add(v)
    bulk = Sketch()
    bulk.add_many(values[:50])
    bulk.add_many(iter(values[50:]))  # any iterable, counted as it goes
    assert bulk.to_json() == one_by_one.to_json()
    assert (bulk.count, bulk.zeros) == (len(values), 2)
