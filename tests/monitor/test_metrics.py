"""Prometheus series: names, types, values from results, engine and database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session, sessionmaker

from alerts.outbox import DeliveryReport
from engine.protocol import (
    CompileSnapshot,
    GenerateResult,
    InMemoryFlagProvider,
    MemorySnapshot,
    RuntimeFlags,
    SpecStats,
)
from monitor.metrics import DatabaseCollector, EngineCollector, Metrics, MetricsSink
from probes.fake import FakeEngine
from storage.models import Alert, Flag, ProbeRun, WebhookDelivery

T0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)



def result(**kw: object) -> GenerateResult:
    values: dict[str, object] = dict(
        text="abc", output_ids=(1, 2, 3), input_tokens=10, bucket="16", padded_length=16,
        output_tokens=3, path="compiled", decoding="speculative", queue_wait_s=0.002,
        encoder_s=0.003, ttft_s=0.02, decode_token_s=(0.004, 0.006), total_s=0.05,
        spec=SpecStats(drafts=2, draft_tokens=8, accepted_tokens=5,
                       accepted_per_position=(2, 2, 1, 0), target_forwards=2))
    values.update(kw)
    return GenerateResult(**values)  # type: ignore[arg-type]


def types(registry: CollectorRegistry) -> dict[str, str]:
    return {m.name: m.type for m in registry.collect()}


def test_sink_turns_a_result_into_histograms_and_counters() -> None:
    registry = CollectorRegistry()
    sink = MetricsSink(Metrics(registry))
    sink.observe(result())
    sink.observe(result(canary=True, bucket="32"))
    key = {"bucket": "16", "path": "compiled", "decoding": "speculative"}
    get = registry.get_sample_value
    assert get("tailwatch_request_duration_seconds_sum", key) == 0.05
    # 0.05 s lies between two of the 10%-spaced bucket bounds (0.0464 < 0.05 <= 0.0511).
    assert get("tailwatch_request_duration_seconds_bucket", {**key, "le": "0.0511"}) == 1
    assert get("tailwatch_request_duration_seconds_bucket", {**key, "le": "0.0464"}) == 0
    assert get("tailwatch_request_ttft_seconds_sum", key) == 0.02
    # One per-token sample per decoded token after the first.
    assert get("tailwatch_request_time_per_output_token_seconds_count", key) == 2
    assert get("tailwatch_request_time_per_output_token_seconds_sum", key) == 0.01
    assert get("tailwatch_request_queue_wait_seconds_sum", key) == 0.002
    assert get("tailwatch_request_padding_ratio_sum", {"bucket": "16"}) == 6 / 16
    spec = {"source": "traffic", "bucket": "16"}
    assert get("tailwatch_spec_decode_num_drafts_total", spec) == 2
    assert get("tailwatch_spec_decode_num_draft_tokens_total", spec) == 8
    assert get("tailwatch_spec_decode_num_accepted_tokens_total", spec) == 5
    assert get("tailwatch_spec_decode_num_accepted_tokens_per_pos_total",
               {**spec, "position": "2"}) == 1
    # Canaries go to their own histograms and never into real-traffic ones.
    ckey = {"bucket": "32", "path": "compiled", "decoding": "speculative"}
    assert get("tailwatch_canary_duration_seconds_count", ckey) == 1
    assert get("tailwatch_request_duration_seconds_count", ckey) is None
    assert get("tailwatch_spec_decode_num_drafts_total", {"source": "canary",
                                                          "bucket": "32"}) == 2
    assert get("tailwatch_output_tokens_total", {"source": "traffic", "bucket": "16"}) == 3


def test_delivery_reports_become_counters() -> None:
    registry = CollectorRegistry()
    sink = MetricsSink(Metrics(registry))
    assert registry.get_sample_value("tailwatch_webhook_deliveries_total",
                                     {"outcome": "failed"}) == 0
    sink.deliveries(DeliveryReport(claimed=4, delivered=2, retried=1, failed=1))
    sink.deliveries(DeliveryReport(claimed=1, delivered=1))
    got = {o: registry.get_sample_value("tailwatch_webhook_deliveries_total", {"outcome": o})
           for o in ("delivered", "retried", "failed")}
    assert got == {"delivered": 3, "retried": 1, "failed": 1}


def test_direct_decoding_adds_no_speculative_counts() -> None:
    registry = CollectorRegistry()
    MetricsSink(Metrics(registry)).observe(result(decoding="direct", spec=SpecStats()))
    assert registry.get_sample_value("tailwatch_spec_decode_num_drafts_total",
                                     {"source": "traffic", "bucket": "16"}) is None


def test_metric_types_and_units() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    MetricsSink(metrics).observe(result())
    got = types(registry)
    for name in ("tailwatch_request_duration_seconds", "tailwatch_request_ttft_seconds",
                 "tailwatch_request_time_per_output_token_seconds",
                 "tailwatch_canary_duration_seconds", "tailwatch_canary_ttft_seconds",
                 "tailwatch_canary_time_per_output_token_seconds"):
        assert got[name] == "histogram", name
    for name in ("tailwatch_spec_decode_num_drafts", "tailwatch_spec_decode_num_draft_tokens",
                 "tailwatch_spec_decode_num_accepted_tokens",
                 "tailwatch_spec_decode_num_accepted_tokens_per_pos",
                 "tailwatch_requests_rejected", "tailwatch_output_tokens"):
        assert got[name] == "counter", name
    assert got["tailwatch_build_info"] == "gauge"
    assert registry.get_sample_value("tailwatch_requests_rejected_total",
                                     {"reason": "overloaded"}) == 0
    # Never the global registry.
    from prometheus_client import REGISTRY
    assert REGISTRY.get_sample_value("tailwatch_requests_rejected_total",
                                     {"reason": "overloaded"}) is None


class _Engine(FakeEngine):
    def compile_snapshot(self) -> CompileSnapshot:
        return CompileSnapshot(graphs=10, recompiles=3, graph_breaks=2, compile_seconds=41.5,
                               recompile_limit_hits=1, compile_failures=0)

    def memory_snapshot(self) -> MemorySnapshot:
        return MemorySnapshot(device="cuda:0", rss_bytes=900, kv_cache_bytes=64,
                              cuda_allocated_bytes=500, cuda_reserved_bytes=800,
                              cuda_peak_bytes=700, cuda_alloc_retries=2, cuda_ooms=1)

    def queue_depth(self) -> int:
        return 5

    def flag_errors(self) -> int:
        return 7

    def flag_source(self) -> str:
        return "file"


def test_engine_collector_reads_the_engine_at_scrape() -> None:
    registry = CollectorRegistry()
    engine: _Engine | None = None
    EngineCollector(Metrics(registry), lambda: engine)
    get = registry.get_sample_value
    assert get("tailwatch_engine_ready") == 0
    assert get("tailwatch_compile_recompiles_total") is None
    engine = _Engine()
    assert get("tailwatch_engine_ready") == 1
    assert get("tailwatch_compile_graphs_total") == 10
    assert get("tailwatch_compile_recompiles_total") == 3
    assert get("tailwatch_compile_graph_breaks_total") == 2
    assert get("tailwatch_compile_seconds_total") == 41.5
    assert get("tailwatch_compile_recompile_limit_hits_total") == 1
    assert get("tailwatch_memory_bytes", {"kind": "rss", "device": "cuda:0"}) == 900
    assert get("tailwatch_memory_bytes", {"kind": "kv_cache", "device": "cuda:0"}) == 64
    assert get("tailwatch_memory_bytes", {"kind": "peak", "device": "cuda:0"}) == 700
    assert get("tailwatch_cuda_ooms_total") == 1
    assert get("tailwatch_queue_depth") == 5
    assert get("tailwatch_flag_provider_errors_total") == 7
    assert get("tailwatch_engine_buckets", {"state": "total"}) == 5
    assert types(registry)["tailwatch_compile_recompiles"] == "counter"


def test_database_collector_reads_alerts_flags_probes_and_deliveries(
        sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        s.add_all([
            Alert(fingerprint="a", rule="latency_p99_up", severity="page", state="firing"),
            Alert(fingerprint="b", rule="latency_p99_up", severity="page", state="firing"),
            Alert(fingerprint="c", rule="acceptance_down", severity="warning", state="pending"),
            Alert(fingerprint="d", rule="acceptance_down", severity="warning",
                  state="resolved"),
            Flag(name="speculative", scope="64", value=False, source="auto", actor="policy"),
            ProbeRun(instance_id="i", kind="cycle", suite="in_domain", status="ok",
                     started_at=T0, finished_at=T0 + timedelta(seconds=12)),
            ProbeRun(instance_id="i", kind="cycle", suite="in_domain", status="timeout",
                     started_at=T0 + timedelta(minutes=1),
                     finished_at=T0 + timedelta(minutes=1, seconds=120)),
            WebhookDelivery(target="t", url="http://x", payload={}, idempotency_key="k1",
                            state="delivered", attempts=1),
            WebhookDelivery(target="t", url="http://x", payload={}, idempotency_key="k2",
                            state="pending", attempts=3),
        ])
    registry = CollectorRegistry()
    flags = InMemoryFlagProvider(RuntimeFlags(speculative={"64": False}))
    DatabaseCollector(Metrics(registry), sessionmaker, flags, (16, 64))
    get = registry.get_sample_value
    assert get("tailwatch_alerts_firing") == 2
    assert get("tailwatch_alerts", {"rule": "latency_p99_up", "severity": "page",
                                     "state": "firing"}) == 2
    assert get("tailwatch_alerts", {"rule": "acceptance_down", "severity": "warning",
                                     "state": "pending"}) == 1
    assert get("tailwatch_flag_override", {"flag": "speculative", "scope": "64",
                                           "source": "auto"}) == 0
    assert get("tailwatch_flag_enabled", {"flag": "speculative", "scope": "64"}) == 0
    assert get("tailwatch_flag_enabled", {"flag": "speculative", "scope": "16"}) == 1
    assert get("tailwatch_flag_enabled", {"flag": "compiled", "scope": "global"}) == 1
    probe = {"kind": "cycle", "suite": "in_domain"}
    assert get("tailwatch_probe_success", probe) == 0  # the latest run timed out
    assert get("tailwatch_probe_duration_seconds", probe) == 120
    assert get("tailwatch_webhook_outbox_messages", {"state": "delivered"}) == 1
    assert get("tailwatch_webhook_outbox_messages", {"state": "pending"}) == 1
    assert get("tailwatch_webhook_outbox_messages", {"state": "failed"}) == 0


def test_database_collector_reads_output_agreement(sessionmaker: sessionmaker[Session]) -> None:
    from storage.models import OutputAgreement
    from vocab import utcnow

    now = utcnow()
    with sessionmaker.begin() as s:
        s.add_all([
            OutputAgreement(at=now - timedelta(minutes=2), source="canary", bucket="32",
                            path="compiled", decoding="direct", variant="optimized", count=4,
                            exact=3, agreement_sum=3.5, length_diff_sum=0),
            OutputAgreement(at=now - timedelta(minutes=1), source="canary", bucket="32",
                            path="compiled", decoding="direct", variant="optimized", count=4,
                            exact=4, agreement_sum=4.0, length_diff_sum=0),
            OutputAgreement(at=now - timedelta(hours=3), source="canary", bucket="32",
                            path="compiled", decoding="direct", variant="optimized", count=4,
                            exact=0, agreement_sum=0.0, length_diff_sum=0),
        ])
    registry = CollectorRegistry()
    DatabaseCollector(Metrics(registry), sessionmaker)
    labels = {"source": "canary", "bucket": "32", "arm": "optimized"}
    get = registry.get_sample_value
    assert get("tailwatch_output_agreement_ratio", labels) == 7.5 / 8  # the last hour only
    assert get("tailwatch_output_compared_total", labels) == 12
    assert get("tailwatch_output_exact_matches_total", labels) == 7


def test_metrics_endpoint_serves_the_apps_registry(client: TestClient) -> None:
    client.post("/v1/generate", json={"text": "hello river"})
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    assert 'tailwatch_request_duration_seconds_count{bucket="16"' in r.text
    assert "tailwatch_build_info{" in r.text
    assert "tailwatch_engine_ready 1.0" in r.text


def test_the_serving_process_exports_its_memory_and_the_heaps_in_it(client: TestClient) -> None:
    import sqlite3

    from storage.db import sqlite_memory_bytes

    client.post("/v1/generate", json={"text": "hello river"})
    text = client.get("/metrics").text
    for kind in ("rss", "sqlite", "malloc_in_use", "malloc_free"):
        assert f'tailwatch_process_memory_bytes{{kind="{kind}"}}' in text
    # SQLite's figure is the library the sqlite3 module links: a page cache it fills shows.
    before = sqlite_memory_bytes()
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (x TEXT)")
    conn.executemany("INSERT INTO t VALUES (?)", [("x" * 100,) for _ in range(20_000)])
    assert sqlite_memory_bytes() > before + 1_000_000
    conn.close()


def test_process_memory_leaves_out_what_the_platform_cannot_tell() -> None:
    from monitor.metrics import ProcessMemoryCollector

    registry = CollectorRegistry()
    ProcessMemoryCollector(Metrics(registry), heaps=lambda: [("rss", 5), ("sqlite", None)])
    assert registry.get_sample_value("tailwatch_process_memory_bytes", {"kind": "rss"}) == 5
    assert registry.get_sample_value("tailwatch_process_memory_bytes", {"kind": "sqlite"}) is None


def test_engine_collector_reads_the_batching_scheduler() -> None:
    from engine.protocol import STEP_SECONDS_EDGES, BatchSnapshot

    class Batched(FakeEngine):
        def batch_snapshot(self) -> BatchSnapshot:
            buckets = tuple(0 if e < 0.002 else (2 if e < 0.01 else 3)
                            for e in STEP_SECONDS_EDGES)
            return BatchSnapshot(max_batch=8, batch_size=5, rows_waiting=4, window_s=0.002,
                                 window_max_s=0.004, steps=11, turn_steps=7,
                                 step_count={"decode": 3, "encode": 0},
                                 step_seconds_sum={"decode": 0.021},
                                 step_buckets={"decode": buckets})

    registry = CollectorRegistry()
    EngineCollector(Metrics(registry), lambda: Batched())
    get = registry.get_sample_value
    assert get("tailwatch_batch_current_size") == 5
    assert get("tailwatch_batch_max_size") == 8
    assert get("tailwatch_queue_size") == 4
    assert get("tailwatch_batch_window_seconds") == 0.002
    assert get("tailwatch_batch_steps_total") == 11
    assert get("tailwatch_batch_turn_steps_total") == 7
    step = "tailwatch_batch_step_duration_seconds"
    assert get(f"{step}_count", {"phase": "decode"}) == 3
    assert get(f"{step}_sum", {"phase": "decode"}) == 0.021
    assert get(f"{step}_bucket", {"phase": "decode", "le": "0.005"}) == 2
    assert get(f"{step}_bucket", {"phase": "decode", "le": "+Inf"}) == 3
    assert get(f"{step}_count", {"phase": "encode"}) == 0
    assert types(registry)["tailwatch_batch_step_duration_seconds"] == "histogram"


def test_every_exported_metric_is_documented_in_docs_metrics(client: TestClient) -> None:
    import re
    from pathlib import Path

    client.post("/v1/generate", json={"text": "hello river"})
    text = client.get("/metrics").text
    exported = {n for n in re.findall(r"^# TYPE (tailwatch_\w+) ", text, re.M)
                if not n.endswith("_created")}  # prometheus_client's per-series timestamps
    reference = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"tailwatch_\w+", reference))
    suffixes = ("_total", "_seconds")

    def covered(name: str) -> bool:
        return name in documented or any(name.removesuffix(s) in documented for s in suffixes)

    assert exported, "no tailwatch_ metric exported"
    assert sorted(n for n in exported if not covered(n)) == []


def test_latency_buckets_step_about_ten_percent() -> None:
    from monitor.metrics import DURATION_BUCKETS

    steps = [b / a for a, b in zip(DURATION_BUCKETS, DURATION_BUCKETS[1:], strict=False)]
    assert DURATION_BUCKETS[0] == 0.001 and DURATION_BUCKETS[-1] >= 60.0
    assert min(steps) > 1.09 and max(steps) < 1.11
    # +15% at 0.17 s crosses at least one bound: the relative-change panels can see it.
    assert any(0.17 < b <= 0.17 * 1.15 for b in DURATION_BUCKETS)


def test_a_scrape_reads_the_database_without_holding_the_write_lock(
        sessionmaker: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch) -> None:
    from monitor import metrics
    from storage.db import make_engine, make_sessionmaker

    with sessionmaker.begin() as s:
        s.add(Alert(fingerprint="a", rule="p99", state="firing", severity="page",
                    started_at=datetime.now(UTC), labels={"bucket": "64"}))
    # A second engine that does not wait for a lock (SQLite: busy timeout 0).
    other = make_sessionmaker(make_engine(sessionmaker.kw["bind"].url, busy_timeout_s=0.0))
    real = metrics.quality_families

    def write_meanwhile(session: Session):  # type: ignore[no-untyped-def]
        # The serving process's write (BEGIN IMMEDIATE on SQLite) in the middle of the
        # scrape's reads: it fails at once if the scrape held the write lock.
        with other.begin() as s:
            s.add(Flag(name="compiled", scope="global", value=False, source="manual",
                       actor="test"))
        return real(session)

    monkeypatch.setattr(metrics, "quality_families", write_meanwhile)
    registry = CollectorRegistry()
    try:
        DatabaseCollector(Metrics(registry), sessionmaker)
        firing = registry.get_sample_value("tailwatch_alerts_firing")
        errors = registry.get_sample_value("tailwatch_scrape_errors_total",
                                           {"collector": "database"})
    finally:
        other.kw["bind"].dispose()
    assert (firing, errors) == (1, 0)
