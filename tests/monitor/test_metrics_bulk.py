"""Bulk histograms expose exactly what one prometheus_client observe() per value would."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import generate_latest

from monitor.histogram import BulkHistogram
from monitor.metrics import DURATION_BUCKETS, TOKEN_BUCKETS

_RNG = random.Random(1)


@pytest.mark.parametrize("buckets", [TOKEN_BUCKETS, DURATION_BUCKETS])
@pytest.mark.parametrize("values", [
    (), (0.003,), (0.0, 0.0, 0.0, 0.004),  # a speculative round: tokens confirmed together
    tuple(TOKEN_BUCKETS) + tuple(DURATION_BUCKETS[::7]) + (500.0,),  # on edges, above the last
    tuple(_RNG.lognormvariate(-6, 1) for _ in range(300)),
])
def test_bulk_histogram_matches_one_observe_per_value(
        buckets: tuple[float, ...], values: tuple[float, ...]) -> None:
    bulk_registry, each_registry = CollectorRegistry(), CollectorRegistry()
    bulk = BulkHistogram("t_seconds", "t", ("bucket",), buckets, bulk_registry)
    each = Histogram("t_seconds", "t", ("bucket",), buckets=buckets, registry=each_registry)
    # Two label sets in one add(), values split unevenly between them and over two calls.
    split = len(values) // 3
    bulk.add([bulk.row("64"), bulk.row("16")], [values[:split], values[split:2 * split]])
    bulk.add([bulk.row("64")], [values[2 * split:]])
    each.labels("64"), each.labels("16")  # both label sets exist, as rows do
    for v in values[:split] + values[2 * split:]:
        each.labels("64").observe(v)
    for v in values[split:2 * split]:
        each.labels("16").observe(v)
    for name in ("t_seconds_bucket", "t_seconds_count", "t_seconds_sum"):
        for labels in ({"bucket": "64"}, {"bucket": "16"}):
            les = [*(str(float(b)) for b in buckets), "+Inf"] if name.endswith("bucket") else [None]
            for le in les:
                key = {**labels, **({"le": le} if le else {})}
                got = bulk_registry.get_sample_value(name, key)
                want = each_registry.get_sample_value(name, key)
                assert got == pytest.approx(want), (name, key)
    # The same text a scrape reads, bar the _created series prometheus_client adds.
    want_text = [line for line in generate_latest(each_registry).decode().splitlines()
                 if "_created" not in line]
    assert generate_latest(bulk_registry).decode().splitlines() == want_text


def test_bulk_histogram_rows_grow_and_labels_are_checked() -> None:
    registry = CollectorRegistry()
    h = BulkHistogram("t_seconds", "t", ("bucket", "path"), TOKEN_BUCKETS, registry)
    rows = [h.row(str(b), "compiled") for b in range(40)]  # past the initial capacity
    assert rows == list(range(40)) and h.row("3", "compiled") == 3
    h.add(rows, [[0.001 * (i + 1)] for i in range(40)])
    assert registry.get_sample_value("t_seconds_count", {"bucket": "39", "path": "compiled"}) == 1
    with pytest.raises(ValueError, match="labels"):
        h.row("16")


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


def test_sinks_find_each_histograms_own_row_of_a_label_set() -> None:
    from monitor.metrics import Metrics, MetricsSink
    from tests.monitor.test_metrics import result

    registry = CollectorRegistry()
    metrics = Metrics(registry)
    a, b = MetricsSink(metrics), MetricsSink(metrics)
    # A label set one histogram already has (made there by anything): its rows differ
    # from the others' from now on, and each histogram keeps its own.
    metrics.latency["traffic"].ttft.row("64", "eager", "direct")
    a.observe(result(bucket="16", total_s=0.01))
    b.observe(result(bucket="32", total_s=0.02, ttft_s=0.002))
    b.fold()
    a.observe(result(bucket="32", total_s=0.03, ttft_s=0.004))
    a.fold()
    get = registry.get_sample_value
    key32 = {"bucket": "32", "path": "compiled", "decoding": "speculative"}
    key16 = {**key32, "bucket": "16"}
    assert get("tailwatch_request_duration_seconds_count", key32) == 2
    assert get("tailwatch_request_duration_seconds_sum", key32) == pytest.approx(0.05)
    assert get("tailwatch_request_ttft_seconds_sum", key32) == pytest.approx(0.006)
    assert get("tailwatch_request_duration_seconds_sum", key16) == pytest.approx(0.01)


def test_a_mixed_batch_folds_to_what_one_update_per_value_records() -> None:
    """Canary and traffic results, several label sets, ragged tokens and positions, folded once."""
    from prometheus_client import Counter

    from engine.protocol import SpecStats
    from monitor.metrics import FOLD_AT, LATENCY_BUCKETS, Metrics, MetricsSink
    from tests.monitor.test_metrics import result

    rng = random.Random(7)
    results = []
    for _ in range(FOLD_AT - 1):  # one fold, at the scrape below
        k = rng.choice((0, 0, 3, 5, 8))
        positions = tuple(rng.randrange(3) for _ in range(rng.randrange(1, k + 1))) if k else ()
        results.append(result(
            canary=rng.random() < 0.3, bucket=rng.choice(("16", "32", "64")),
            path=rng.choice(("compiled", "eager")), decoding="speculative" if k else "direct",
            total_s=rng.lognormvariate(-3, 1), ttft_s=rng.lognormvariate(-5, 1),
            queue_wait_s=rng.choice((0.0, rng.random() * 0.01)),
            decode_token_s=tuple(rng.random() * 0.01 for _ in range(rng.randrange(0, 20))),
            input_tokens=rng.randrange(1, 17), padded_length=16, output_tokens=rng.randrange(1, 40),
            spec=SpecStats(drafts=len(positions), draft_tokens=k * len(positions),
                           accepted_tokens=sum(positions), accepted_per_position=positions)))
    registry = CollectorRegistry()
    sink = MetricsSink(Metrics(registry))
    for r in results:
        sink.observe(r)
    assert sink.pending == FOLD_AT - 1
    # The reference: prometheus_client's own series, one update per value.
    ref = CollectorRegistry()
    labels = ("bucket", "path", "decoding")
    hist = {(kind, name): Histogram(f"tailwatch_{kind}_{name}", "r", labels, registry=ref,
                                    buckets=buckets)
            for kind in ("request", "canary")
            for name, buckets in (("duration_seconds", DURATION_BUCKETS),
                                  ("ttft_seconds", LATENCY_BUCKETS),
                                  ("queue_wait_seconds", LATENCY_BUCKETS),
                                  ("time_per_output_token_seconds", TOKEN_BUCKETS))}
    padding = Histogram("tailwatch_request_padding_ratio", "r", ("bucket",), registry=ref,
                        buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0))
    out = Counter("tailwatch_output_tokens", "r", ("source", "bucket"), registry=ref)
    spec = {name: Counter(f"tailwatch_spec_decode_num_{name}", "r", ("source", "bucket"),
                          registry=ref) for name in ("drafts", "draft_tokens", "accepted_tokens")}
    per_pos = Counter("tailwatch_spec_decode_num_accepted_tokens_per_pos", "r",
                      ("source", "bucket", "position"), registry=ref)
    for r in results:
        kind, source = ("canary", "canary") if r.canary else ("request", "traffic")
        key = (r.bucket, r.path, r.decoding)
        hist[kind, "duration_seconds"].labels(*key).observe(r.total_s)
        hist[kind, "ttft_seconds"].labels(*key).observe(r.ttft_s)
        hist[kind, "queue_wait_seconds"].labels(*key).observe(r.queue_wait_s)
        for v in r.decode_token_s:
            hist[kind, "time_per_output_token_seconds"].labels(*key).observe(v)
        if not r.canary:
            padding.labels(r.bucket).observe(r.padding_waste)
        out.labels(source, r.bucket).inc(r.output_tokens)
        if r.spec.drafts:
            spec["drafts"].labels(source, r.bucket).inc(r.spec.drafts)
            spec["draft_tokens"].labels(source, r.bucket).inc(r.spec.draft_tokens)
            spec["accepted_tokens"].labels(source, r.bucket).inc(r.spec.accepted_tokens)
            for pos, n in enumerate(r.spec.accepted_per_position):
                per_pos.labels(source, r.bucket, str(pos)).inc(n)
    want = {(s.name, tuple(sorted(s.labels.items()))): s.value
            for m in ref.collect() for s in m.samples if not s.name.endswith("_created")}
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for m in registry.collect() for s in m.samples
           if (s.name, tuple(sorted(s.labels.items()))) in want}
    assert sink.pending == 0  # the collection folded the batch
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-12), k
