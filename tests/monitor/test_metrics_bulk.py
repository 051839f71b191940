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


def test_sink_queues_folds_in_bulk_and_loses_nothing_under_concurrency() -> None:
    import threading

    from monitor.metrics import FOLD_AT, Metrics, MetricsSink
    from tests.monitor.test_metrics import result

    registry = CollectorRegistry()
    sink = MetricsSink(Metrics(registry))
    key = {"bucket": "16", "path": "compiled", "decoding": "speculative"}
    sink.observe(result())
    assert sink.pending == 1  # a request only queues its result
    # Any collection folds first: a scrape sees every observed result.
    assert registry.get_sample_value("tailwatch_request_duration_seconds_count", key) == 1
    assert sink.pending == 0
    stop = threading.Event()
    seen: list[int] = []

    def scraper() -> None:
        while not stop.is_set():
            registry.get_sample_value("tailwatch_request_duration_seconds_count", key)

    def worker() -> None:
        for i in range(1000):
            sink.observe(result(total_s=0.01 * (1 + i % 7)))
            seen.append(sink.pending)

    reader = threading.Thread(target=scraper)
    reader.start()
    workers = [threading.Thread(target=worker) for _ in range(4)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    stop.set()
    reader.join()
    assert max(seen) <= FOLD_AT + 4  # bounded: an observer folds every FOLD_AT results
    get = registry.get_sample_value
    assert get("tailwatch_request_duration_seconds_count", key) == 4001
    assert get("tailwatch_request_time_per_output_token_seconds_count", key) == 2 * 4001
    assert get("tailwatch_spec_decode_num_drafts_total",
               {"source": "traffic", "bucket": "16"}) == 2 * 4001
    assert get("tailwatch_spec_decode_num_accepted_tokens_per_pos_total",
               {"source": "traffic", "bucket": "16", "position": "0"}) == 2 * 4001
    assert get("tailwatch_request_duration_seconds_sum", key) == pytest.approx(
        0.05 + 4 * sum(0.01 * (1 + i % 7) for i in range(1000)))
