"""Bulk per-token observations expose exactly what one observe() per token would."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram

from monitor.metrics import TOKEN_BUCKETS, observe_many


def _hist(registry: CollectorRegistry) -> Histogram:
    return Histogram("t_seconds", "t", ("bucket",), buckets=TOKEN_BUCKETS, registry=registry)


@pytest.mark.parametrize("values", [
    (), (0.003,), (0.0, 0.0, 0.0, 0.004),  # a speculative round: tokens confirmed together
    tuple(TOKEN_BUCKETS) + (5.0,),  # on every edge (upper-inclusive) and above the last
    tuple(random.Random(1).lognormvariate(-6, 1) for _ in range(300)),
])
def test_observe_many_matches_one_observe_per_value(values: tuple[float, ...]) -> None:
    bulk, each = CollectorRegistry(), CollectorRegistry()
    observe_many(_hist(bulk).labels("64"), values)
    h = _hist(each).labels("64")
    for v in values:
        h.observe(v)
    names = ["t_seconds_bucket", "t_seconds_count", "t_seconds_sum"]
    for name in names:
        for le in [*(str(b) for b in TOKEN_BUCKETS), "+Inf"] if name.endswith("bucket") \
                else [None]:
            labels = {"bucket": "64", **({"le": le} if le else {})}
            got, want = bulk.get_sample_value(name, labels), each.get_sample_value(name, labels)
            assert got == pytest.approx(want), (name, le)
