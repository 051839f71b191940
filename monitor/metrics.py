"""Prometheus metrics on a registry the app owns (never the global one).

`Metrics` holds the push-style series (latency histograms, speculative-decoding
counters, rejections, webhook deliveries); `MetricsSink.observe` turns a
`GenerateResult` into them and serves as a probe observer and for /v1/generate. A served
request only queues its result (no lock, no Prometheus call); queued results are folded
into the series in bulk when FOLD_AT are waiting and before every collection (a scrape
or `registry.get_sample_value` always sees every observed result). Values
owned by something else are read at scrape time by custom collectors: `EngineCollector`
(compile counters, memory, queue depth, admission by origin, flag-provider errors),
`DatabaseCollector` (flags, alerts, latest probe runs, webhook outbox),
`ProcessMemoryCollector` (RSS and the heaps in it) and `GcCollector` (garbage-collector
pauses), the last two in the serving process and the worker alike. Every series is listed in
docs/metrics.md (tests/monitor/test_metrics.py keeps the two in step).
"""

from __future__ import annotations

import logging
import platform
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from importlib import metadata
from itertools import chain

import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session, sessionmaker

from alerts.cause import CAUSES
from engine import malloc
from engine.protocol import (
    STEP_SECONDS_EDGES,
    AdmissionStats,
    BatchSnapshot,
    Engine,
    FlagProvider,
    GenerateResult,
    SpecStats,
)
from monitor import gc_heap
from monitor.gc_heap import GcSnapshot
from monitor.histogram import BulkHistogram
from monitor.quality_metrics import quality_families
from monitor.sensitivity_metrics import sensitivity_families
from probes.measure import add_positions
from probes.sampler import SamplerStats
from storage.db import reading, sqlite_memory_bytes
from storage.models import DELIVERY_STATES
from storage.queries import alerts as alert_queries
from storage.queries import flags as flag_queries
from storage.queries import incidents as incident_queries
from storage.queries import reports as report_queries
from storage.queries import runs as run_queries
from storage.queries import series as series_queries
from vocab import utcnow

log = logging.getLogger(__name__)

PREFIX = "tailwatch"
# End-to-end and time-to-first-token latency: 1 ms .. 60 s.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)
# End-to-end request and canary latency: 1 ms .. 62 s in steps of 10% (24 per decade, 3
# significant digits), so histogram_quantile resolves the relative-change panels'
# +15% at any latency (coarse 1-2.5-5 steps hide a change that stays within one step).
DURATION_BUCKETS = tuple(sorted({float(f"{10 ** (k / 24):.3g}") for k in range(-72, 44)}))
# Time per output token: 0.25 ms .. 1 s.
TOKEN_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02,
                 0.03, 0.05, 0.1, 0.25, 1.0)
REJECT_REASONS = ("overloaded", "not_ready", "invalid", "too_long", "timeout", "cancelled",
                  "error")
SOURCES = ("traffic", "canary")
DELIVERY_OUTCOMES = ("delivered", "retried", "failed")
# Results a MetricsSink queues before the observing thread folds them into the series.
FOLD_AT = 64


def _version() -> str:
    try:
        return metadata.version("tailwatch")
    except metadata.PackageNotFoundError:
        return "0+unknown"


@dataclass(frozen=True)
class _LatencySet:
    """The latency histograms of one traffic source."""

    e2e: BulkHistogram
    ttft: BulkHistogram
    per_token: BulkHistogram
    queue_wait: BulkHistogram


class Metrics:
    """Every push-style tailwatch series, registered on `registry`.

    Example:
        registry = CollectorRegistry()
        metrics = Metrics(registry)
        MetricsSink(metrics).observe(result)
        registry.get_sample_value("tailwatch_request_duration_seconds_count", {...})
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        # Registered first: the registry collects in registration order, so queued
        # observations are folded in before any series below is read.
        self._before_collect: list[Callable[[], object]] = []
        registry.register(_BeforeCollect(self._before_collect))
        labels = ("bucket", "path", "decoding")
        self.latency = {
            "traffic": self._latency_set("request", labels),
            "canary": self._latency_set("canary", labels),
        }
        self.output_tokens = Counter(
            f"{PREFIX}_output_tokens", "Output tokens generated.",
            ("source", "bucket"), registry=registry)
        self.padding_waste = BulkHistogram(
            f"{PREFIX}_request_padding_ratio",
            "Share of the padded input that is padding (real traffic).",
            ("bucket",), (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry)
        spec = ("source", "bucket")
        self.spec_drafts = Counter(
            f"{PREFIX}_spec_decode_num_drafts",
            "Speculative verification steps (one target forward over the proposals).",
            spec, registry=registry)
        self.spec_draft_tokens = Counter(
            f"{PREFIX}_spec_decode_num_draft_tokens",
            "Tokens proposed by the draft model.", spec, registry=registry)
        self.spec_accepted = Counter(
            f"{PREFIX}_spec_decode_num_accepted_tokens",
            "Proposed tokens the target model accepted.", spec, registry=registry)
        self.spec_accepted_per_pos = Counter(
            f"{PREFIX}_spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose proposed token at `position` (0-based) was accepted.",
            (*spec, "position"), registry=registry)
        self.rejections = Counter(
            f"{PREFIX}_requests_rejected",
            "Requests refused before or during generation, by reason.",
            ("reason",), registry=registry)
        for reason in REJECT_REASONS:
            self.rejections.labels(reason)
        self.webhook_deliveries = Counter(
            f"{PREFIX}_webhook_deliveries",
            "Webhook delivery attempts by outcome (delivered, retried, failed).",
            ("outcome",), registry=registry)
        for outcome in DELIVERY_OUTCOMES:
            self.webhook_deliveries.labels(outcome)
        self.webhook_dead_letters = Counter(
            f"{PREFIX}_webhook_dead_letters",
            "Notifications given up on (4xx answer or past alerts.webhook_max_age_s), by target;"
            " listed by GET /v1/deliveries?state=dead.",
            ("target",), registry=registry)
        self.scrape_errors = Counter(
            f"{PREFIX}_scrape_errors", "Scrapes whose collector could not read its source.",
            ("collector",), registry=registry)
        for name in ("engine", "database"):
            self.scrape_errors.labels(name)
        build = Gauge(
            f"{PREFIX}_build_info", "Always 1; labels name the running tailwatch build.",
            ("version", "python"), registry=registry)
        build.labels(_version(), platform.python_version()).set(1)

    def before_collect(self, callback: Callable[[], object]) -> None:
        """Call `callback` at the start of every collection of this registry."""
        self._before_collect.append(callback)

    def _latency_set(self, kind: str, labels: tuple[str, ...]) -> _LatencySet:
        what = "real request" if kind == "request" else "canary probe"
        return _LatencySet(
            e2e=BulkHistogram(
                f"{PREFIX}_{kind}_duration_seconds",
                f"End-to-end latency of a {what}: engine entry to result.",
                labels, DURATION_BUCKETS, self.registry),
            ttft=BulkHistogram(
                f"{PREFIX}_{kind}_ttft_seconds",
                f"Time to first token of a {what}: slot granted to first token chosen.",
                labels, LATENCY_BUCKETS, self.registry),
            per_token=BulkHistogram(
                f"{PREFIX}_{kind}_time_per_output_token_seconds",
                f"Time between consecutive output tokens of a {what} (one sample per token).",
                labels, TOKEN_BUCKETS, self.registry),
            queue_wait=BulkHistogram(
                f"{PREFIX}_{kind}_queue_wait_seconds",
                f"Time a {what} waited for a decode slot.",
                labels, LATENCY_BUCKETS, self.registry),
        )


class _BeforeCollect(Collector):
    """Run callbacks (fold queued observations) when the registry is collected."""

    def __init__(self, callbacks: list[Callable[[], object]]) -> None:
        self._callbacks = callbacks

    def describe(self) -> list[Metric]:
        return []  # no series of its own (and register() must not call collect())

    def collect(self) -> Iterator[Metric]:
        for callback in self._callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001 - a scrape must survive a fold bug
                log.exception("metrics: folding queued observations failed")
        return iter(())


@dataclass(frozen=True)
class _Children:
    """The labelled series one (source, bucket, path, decoding) result touches."""

    # (histogram, the label set's row in it): end to end, TTFT, queue wait, per token.
    e2e: tuple[BulkHistogram, int]
    ttft: tuple[BulkHistogram, int]
    queue_wait: tuple[BulkHistogram, int]
    per_token: tuple[BulkHistogram, int]
    output_tokens: Counter
    padding: tuple[BulkHistogram, int] | None  # Metrics.padding_waste (real traffic only)


class MetricsSink:
    """Turn generate results into Prometheus observations (a probe observer).

    `observe` runs on every served request: it appends the result to a queue (a deque:
    thread-safe without a lock) and nothing else. `fold` (under the sink's one lock)
    empties the queue into the series in bulk: every latency value of the batch goes into
    its `BulkHistogram` in one numpy pass per histogram (per-token times included), and
    the speculative counters are summed first. It runs on the observing thread once
    FOLD_AT results wait (bounding the queue) and before every collection of the
    registry, so what a scrape reads is exactly what one observe() per value would have
    recorded (tests/monitor/test_metrics_bulk.py). Label sets are looked up once and kept.
    """

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._children: dict[tuple[bool, str, str, str], _Children] = {}
        self._spec: dict[tuple[str, str], tuple[Counter, Counter, Counter]] = {}
        self._per_pos: dict[tuple[str, str, int], Counter] = {}
        self._pending: deque[GenerateResult] = deque()
        self._fold_lock = threading.Lock()
        metrics.before_collect(self.fold)

    def __call__(self, result: GenerateResult) -> None:
        self.observe(result)

    def _for(self, key: tuple[bool, str, str, str]) -> _Children:
        c = self._children.get(key)
        if c is None:
            m = self.metrics
            canary, bucket = key[0], key[1]
            source = "canary" if canary else "traffic"
            h, labels = m.latency[source], key[1:]
            c = _Children(
                (h.e2e, h.e2e.row(*labels)), (h.ttft, h.ttft.row(*labels)),
                (h.queue_wait, h.queue_wait.row(*labels)),
                (h.per_token, h.per_token.row(*labels)), m.output_tokens.labels(source, bucket),
                None if canary else (m.padding_waste, m.padding_waste.row(bucket)))
            self._children[key] = c
        return c

    @property
    def pending(self) -> int:
        """Return the results queued for the next fold."""
        return len(self._pending)

    def observe(self, result: GenerateResult) -> None:
        """Record one generate result (canary or real traffic): queue it for the next fold."""
        pending = self._pending
        pending.append(result)
        if len(pending) >= FOLD_AT:
            self.fold()

    def fold(self) -> int:
        """Fold every queued result into the Prometheus series; return how many."""
        with self._fold_lock:
            pending = self._pending
            batch: list[GenerateResult] = []
            while pending:  # popleft, not a swap: an append racing the fold is never lost
                batch.append(pending.popleft())
            if not batch:
                return 0
            groups: dict[tuple[bool, str, str, str], list[GenerateResult]] = {}
            for r in batch:
                groups.setdefault((r.canary, r.bucket, r.path, r.decoding), []).append(r)
            adds: dict[BulkHistogram, tuple[list[int], list[Sequence[float]]]] = {}
            for key, rs in groups.items():
                c = self._for(key)
                c.output_tokens.inc(sum(r.output_tokens for r in rs))
                for (hist, row), values in self._observations(c, rs):
                    entry = adds.get(hist)
                    if entry is None:
                        entry = adds[hist] = ([], [])
                    entry[0].append(row)
                    entry[1].append(values)
            for hist, (rows, seqs) in adds.items():
                hist.add(rows, seqs)
            self._fold_spec(batch)
            return len(batch)

    @staticmethod
    def _observations(c: _Children, rs: list[GenerateResult]
                      ) -> Iterator[tuple[tuple[BulkHistogram, int], Sequence[float]]]:
        # A canary's own time: a pause it made for a real request is not the engine's.
        yield c.e2e, [r.own_s for r in rs]
        yield c.ttft, [r.ttft_s for r in rs]
        yield c.queue_wait, [r.queue_wait_s for r in rs]
        yield c.per_token, list(chain.from_iterable(r.decode_token_s for r in rs))
        if c.padding is not None:
            yield c.padding, [r.padding_waste for r in rs]

    def _fold_spec(self, batch: list[GenerateResult]) -> None:
        specs: dict[tuple[str, str], list[SpecStats]] = {}
        for r in batch:
            spec = r.spec
            if spec.drafts or spec.draft_tokens:
                specs.setdefault(("canary" if r.canary else "traffic", r.bucket), []).append(spec)
        m = self.metrics
        for key, ss in specs.items():
            counters = self._spec.get(key)
            if counters is None:
                counters = self._spec[key] = (m.spec_drafts.labels(*key),
                                              m.spec_draft_tokens.labels(*key),
                                              m.spec_accepted.labels(*key))
            counters[0].inc(sum(s.drafts for s in ss))
            counters[1].inc(sum(s.draft_tokens for s in ss))
            counters[2].inc(sum(s.accepted_tokens for s in ss))
            source, bucket = key
            for pos, n in enumerate(add_positions(*(s.accepted_per_position for s in ss))):
                child = self._per_pos.get((source, bucket, pos))
                if child is None:
                    child = self._per_pos[source, bucket, pos] = \
                        m.spec_accepted_per_pos.labels(source, bucket, str(pos))
                child.inc(n)

    def reject(self, reason: str) -> None:
        """Count a refused request; `reason` is one of REJECT_REASONS."""
        self.metrics.rejections.labels(reason).inc()

    def deliveries(self, report: object) -> None:
        """Count one outbox pass (an alerts.outbox.DeliveryReport) by outcome."""
        for outcome in DELIVERY_OUTCOMES:
            n = getattr(report, outcome, 0)
            if n:
                self.metrics.webhook_deliveries.labels(outcome).inc(n)
        for target in getattr(report, "dead_targets", ()):
            self.metrics.webhook_dead_letters.labels(target).inc()


class _SafeCollector(Collector):
    """A collector whose failures cost its own series, never the whole scrape."""

    name = "collector"

    def __init__(self, metrics: Metrics) -> None:
        self._errors = metrics.scrape_errors.labels(self.name)
        metrics.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        try:
            families = list(self._collect())
        except Exception as exc:  # a scrape must survive a dead DB or engine
            log.warning("metrics: %s collector failed: %s", self.name, exc)
            self._errors.inc()
            return iter(())
        return iter(families)

    def _collect(self) -> Iterable[Metric]:
        raise NotImplementedError


class EngineCollector(_SafeCollector):
    """Read compile counters, memory, queue depth and flag errors from the engine."""

    name = "engine"

    def __init__(self, metrics: Metrics, engine: Callable[[], Engine | None]) -> None:
        self._engine = engine
        super().__init__(metrics)

    def _collect(self) -> Iterable[Metric]:
        engine = self._engine()
        ready = GaugeMetricFamily(
            f"{PREFIX}_engine_ready", "1 when the engine is loaded and every bucket is warm.")
        if engine is None:
            ready.add_metric([], 0)
            yield ready
            return
        warm = engine.warmup_status()
        ready.add_metric([], 1 if warm.done and warm.error is None else 0)
        yield ready
        buckets = GaugeMetricFamily(
            f"{PREFIX}_engine_buckets", "Input-length buckets by warm-up state (warm, total).",
            labels=("state",))
        buckets.add_metric(["warm"], warm.warm_buckets)
        buckets.add_metric(["total"], warm.total_buckets)
        yield buckets
        per_bucket = GaugeMetricFamily(f"{PREFIX}_engine_warmup_seconds",
                                       "Seconds each bucket took to warm up.", labels=("bucket",))
        for label, seconds in warm.bucket_seconds.items():
            per_bucket.add_metric([label], seconds)
        yield per_bucket
        if warm.cache_hit is not None:
            yield _gauge("engine_compile_cache_hit",
                         "1 when the warm-up served every bucket from saved compiled functions.", {}, warm.cache_hit)
        if warm.ready_seconds is not None:
            yield _gauge("engine_ready_seconds", "Engine start to every bucket warm.", {},
                         warm.ready_seconds)
        k = GaugeMetricFamily(f"{PREFIX}_spec_decode_k", "Draft tokens per verification "
                              "chosen per bucket (0: falls back to direct).", labels=("bucket",))
        for label, value in engine.draft_length_snapshot().k.items():
            k.add_metric([label], value)
        yield k
        info = engine.info
        yield _gauge("spec_decode_available", "1 when a draft model is paired (speculation "
                     "possible), 0 when the engine decodes directly (no draft).", {},
                     1 if info.speculative_available else 0)
        yield _gauge("engine_info", "Always 1; labels identify the loaded model.",
                     {"model_version": info.model_version, "config_hash": info.config_hash,
                      "device": info.device, "dtype": info.dtype,
                      "compile_mode": info.compile_mode, "decode_step": info.decode_step}, 1)
        yield from _compile_families(engine)
        yield from _graph_families(engine, warm.eager_buckets)
        yield from _memory_families(engine)
        yield _gauge("queue_depth", "Requests waiting for a decode slot.", {},
                     engine.queue_depth())
        yield from _batch_families(engine.batch_snapshot())
        yield from _admission(engine.admission_stats())
        yield _counter("flag_provider_errors",
                       "Flag reads that failed: raised or hung (last flags kept; slow reads are not failures).",
                       engine.flag_errors())
        source = GaugeMetricFamily(
            f"{PREFIX}_flag_source",
            "Where the engine's flags come from: live (database), file (last known) or defaults.",
            labels=["source"])
        current = engine.flag_source()
        for name in ("live", "file", "defaults"):
            source.add_metric([name], 1.0 if name == current else 0.0)
        yield source


def _compile_families(engine: Engine) -> Iterator[Metric]:
    """Yield the engine's torch.compile counters."""
    snap = engine.compile_snapshot()
    yield _counter("compile_graphs", "Graphs compiled by torch.compile.", snap.graphs)
    yield _counter("compile_recompiles", "Recompiles (a guard failed).", snap.recompiles)
    yield _counter("compile_graph_breaks", "Graph breaks.", snap.graph_breaks)
    yield _counter("compile_seconds", "Seconds spent compiling.", snap.compile_seconds)
    yield _counter("compile_recompile_limit_hits",
                   "Times a function hit the recompile limit and runs eager for good.",
                   snap.recompile_limit_hits)
    yield _counter("compile_failures", "Compilations that failed.", snap.compile_failures)


def _graph_families(engine: Engine, eager_buckets: tuple[str, ...]) -> Iterator[Metric]:
    """Yield the CUDA graphs replayed and recorded, and the buckets that fell back to eager."""
    snap = engine.graph_snapshot()
    cuda = snap.cudagraphs
    yield _counter("engine_cudagraph_replays",
                   "Compiled calls that replayed a recorded CUDA graph (0 without CUDA graphs).",
                   snap.replayed if cuda else 0)
    recordings = CounterMetricFamily(
        f"{PREFIX}_engine_cudagraph_recordings",
        "CUDA graphs recorded, in the warm-up or while serving (serving must stay 0).",
        labels=("phase",))
    after = snap.recorded_after_warmup if cuda else 0
    recordings.add_metric(["warmup"], (snap.recorded - snap.recorded_after_warmup) if cuda else 0)
    recordings.add_metric(["serving"], after)
    yield recordings
    yield _gauge("engine_eager_buckets",
                 "Buckets whose warm-up failed, so they serve eager instead of compiled.", {},
                 len(eager_buckets))


def _memory_families(engine: Engine) -> Iterator[Metric]:
    """Yield the engine's memory by kind and its CUDA allocator counters."""
    mem = engine.memory_snapshot()
    memory = GaugeMetricFamily(
        f"{PREFIX}_memory_bytes",
        "Memory in bytes by kind: rss, kv_cache (kv_static + kv_request), weights; on CUDA also allocated, reserved, peak.",
        labels=("kind", "device"))
    memory.add_metric(["rss", mem.device], mem.rss_bytes)
    memory.add_metric(["kv_cache", mem.device], mem.kv_cache_bytes)
    for kind, value in (("kv_static", mem.kv_static_bytes), ("kv_request", mem.kv_request_bytes),
                        ("kv_request_peak", mem.kv_request_peak_bytes), ("kv_peak", mem.kv_peak_bytes)):
        memory.add_metric([kind, mem.device], value)
    memory.add_metric(["weights", mem.device], mem.weight_bytes)
    for kind, cuda in (("allocated", mem.cuda_allocated_bytes),
                       ("reserved", mem.cuda_reserved_bytes),
                       ("peak", mem.cuda_peak_bytes)):
        if cuda is not None:
            memory.add_metric([kind, mem.device], cuda)
    yield memory
    if mem.cuda_ooms is not None:
        yield _counter("cuda_ooms", "CUDA out-of-memory errors.", mem.cuda_ooms)
    if mem.cuda_alloc_retries is not None:
        yield _counter("cuda_alloc_retries", "CUDA allocator retries after a cache flush.",
                       mem.cuda_alloc_retries)


class ProcessMemoryCollector(_SafeCollector):
    """Read this process's RSS and the heaps that make it up at scrape time.

    RSS alone says a process grew, not what grew: SQLite's page caches (bounded by
    `storage.db.SQLITE_HEAP_LIMIT_BYTES`), glibc malloc's blocks in use, and what malloc
    keeps free (returned by the heap trim). The rest of RSS is Python's small-object
    arenas, the libraries' code and, in the serving process, the engine's tensors.
    Cost per scrape: glibc's `mallinfo2` walks the free lists of each arena under its lock
    (under a millisecond on a fragmented heap, about as the minutely heap trim does).
    """

    name = "process_memory"

    def __init__(self, metrics: Metrics, *,
                 heaps: Callable[[], Iterable[tuple[str, int | None]]] | None = None) -> None:
        self._heaps = heaps or process_heaps
        super().__init__(metrics)

    def _collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(
            f"{PREFIX}_process_memory_bytes",
            "This process's memory by kind: rss, sqlite (SQLite's page caches and "
            "statements), malloc_in_use, malloc_free (glibc: held, free).",
            labels=("kind",))
        for kind, value in self._heaps():
            if value is not None:
                family.add_metric([kind], value)
        return [family]


class GcCollector(_SafeCollector):
    """Export this process's garbage-collector pauses by generation and its frozen objects
    (`monitor.gc_heap`): a full collection stalls every thread, requests in flight too."""

    name = "gc"

    def __init__(self, metrics: Metrics, *,
                 snapshot: Callable[[], GcSnapshot] | None = None) -> None:
        if snapshot is None:
            gc_heap.PAUSES.install()
            snapshot = gc_heap.PAUSES.snapshot
        self._snapshot = snapshot
        super().__init__(metrics)

    def _collect(self) -> Iterable[Metric]:
        snap = self._snapshot()
        hist = HistogramMetricFamily(
            f"{PREFIX}_gc_pause_seconds",
            "Seconds each of this process's garbage collections held every thread, by "
            "generation (2: a full collection).", labels=("generation",))
        for generation in gc_heap.GENERATIONS:
            buckets = [(str(edge), float(n)) for edge, n in
                       zip(gc_heap.PAUSE_SECONDS_EDGES, snap.buckets[generation], strict=True)]
            buckets.append(("+Inf", float(snap.count[generation])))
            hist.add_metric([str(generation)], buckets, sum_value=snap.seconds[generation])
        return [hist, _gauge("gc_frozen_objects", "Objects in the collector's permanent "
                             "generation (frozen once the engine is warm; never walked).",
                             {}, snap.frozen)]


def process_heaps() -> list[tuple[str, int | None]]:
    """Return (kind, bytes) of this process: rss, sqlite, malloc_in_use, malloc_free."""
    glibc = malloc.usage()
    return [("rss", psutil.Process().memory_info().rss),
            ("sqlite", sqlite_memory_bytes()),
            ("malloc_in_use", None if glibc is None else glibc[0]),
            ("malloc_free", None if glibc is None else glibc[1])]


class SamplerCollector(_SafeCollector):
    """Export the traffic sampler's counters: what it drew, replayed, dropped and failed."""

    name = "sampler"

    def __init__(self, metrics: Metrics, stats: Callable[[], SamplerStats | None]) -> None:
        self._stats = stats
        super().__init__(metrics)

    def _collect(self) -> Iterable[Metric]:
        stats = self._stats()
        if stats is None:
            return
        # Dropped is the one to alert on: drawn requests that were never checked because
        # the reference replays fell behind (queue full) or the service was closing.
        family = CounterMetricFamily(
            f"{PREFIX}_sampler_requests",
            "Real-traffic requests drawn for an output-quality check, by outcome "
            "(offered: drawn; replayed: checked; dropped: queue full or closing; "
            "failed: the reference replay raised).", labels=("outcome",))
        for outcome in ("offered", "replayed", "dropped", "failed"):
            family.add_metric([outcome], getattr(stats, outcome))
        yield family
        yield _gauge("sampler_pending", "Drawn requests waiting for their reference replay.",
                     {}, stats.pending)


class DatabaseCollector(_SafeCollector):
    """Read flags, alerts, probe runs and the webhook outbox from SQL at scrape time."""

    name = "database"

    def __init__(self, metrics: Metrics, sessions: sessionmaker[Session],
                 flags: FlagProvider | None = None, buckets: tuple[int, ...] = ()) -> None:
        self._sessions = sessions
        self._flags = flags
        self._buckets = buckets
        super().__init__(metrics)

    def _collect(self) -> Iterable[Metric]:
        # A read-only snapshot: on SQLite a plain transaction takes the write lock at its
        # BEGIN, and every scrape would hold off the serving process's writes meanwhile.
        with reading(self._sessions) as session:
            families = [*self._overrides(session), *self._alerts(session),
                        *self._incidents(session), *self._probes(session), *self._deliveries(session),
                        *self._rollouts(session), *quality_families(session),
                        *sensitivity_families(session)]
        if self._flags is not None:
            families.append(_flag_states(self._flags, self._buckets))
        return families

    def _overrides(self, session: Session) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            f"{PREFIX}_flag_override",
            "Flag rows in the DB (manual or auto) by flag, scope and source; value 1/0 or the number.",
            labels=("flag", "scope", "source"))
        for flag in flag_queries.flag_rows(session):
            value = flag.value
            if isinstance(value, bool | int | float):
                family.add_metric([flag.name, flag.scope, flag.source], float(value))
        yield family

    def _alerts(self, session: Session) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            f"{PREFIX}_alerts", "Open alerts by rule, severity and state (pending, firing).",
            labels=("rule", "severity", "state"))
        rows = alert_queries.open_alert_counts(session)
        for c in rows:
            family.add_metric([c.rule, c.severity, c.state], c.count)
        yield family
        firing = sum(c.count for c in rows if c.state == "firing")
        yield GaugeMetricFamily(
            f"{PREFIX}_alerts_firing", "Alerts firing now (all rules).", value=firing)

    def _incidents(self, session: Session) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            f"{PREFIX}_incidents_open", "Incidents open now (alerts grouped, alerts.incidents).",
            value=incident_queries.open_counts(session))
        family = CounterMetricFamily(
            f"{PREFIX}_incidents", "Incidents by probable cause (host_or_load, optimization, "
            "one_instance, some_instances, one_bucket, unknown), each counted once: under its "
            "first cause other than unknown, or the one it resolved with.",
            labels=("cause",))
        counts = incident_queries.counts_by_cause(session)
        for cause in CAUSES:
            family.add_metric([cause], counts.get(cause, 0))
        yield family

    def _probes(self, session: Session) -> Iterator[Metric]:
        runs = run_queries.latest_finished_runs(session)
        labels = ("kind", "suite")
        success = GaugeMetricFamily(
            f"{PREFIX}_probe_success", "1 when the latest probe run of a kind succeeded.",
            labels=labels)
        duration = GaugeMetricFamily(
            f"{PREFIX}_probe_duration_seconds", "Duration of the latest probe run of a kind.",
            labels=labels)
        finished = GaugeMetricFamily(
            f"{PREFIX}_probe_last_run_timestamp_seconds",
            "Unix time the latest probe run of a kind finished.", labels=labels)
        for run in runs:
            key = [run.kind, run.suite]
            end = run.finished_at or run.started_at
            success.add_metric(key, 1 if run.status == "ok" else 0)
            duration.add_metric(key, (end - run.started_at).total_seconds())
            finished.add_metric(key, end.timestamp())
        yield from (success, duration, finished)

    def _deliveries(self, session: Session) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            f"{PREFIX}_webhook_outbox_messages",
            "Webhook outbox rows by state (pending, delivered, failed), from the DB.",
            labels=("state",))
        counts = report_queries.delivery_counts(session)
        for state in DELIVERY_STATES:
            family.add_metric([state], counts.get(state, 0))
        yield family


    def _rollouts(self, session: Session) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            f"{PREFIX}_rollout_verdict",
            "Rollout verdict of a new cohort vs the old one, updated in the last hour "
            "(0 pass, 1 marginal, 2 fail).",
            labels=("cohort", "old_cohort", "source", "metric", "bucket"))
        since = utcnow() - timedelta(hours=1)
        for v in series_queries.list_verdicts(session, since=since):
            family.add_metric([f"{v.new[0]}/{v.new[1]}", f"{v.old[0]}/{v.old[1]}", v.source,
                               v.metric, v.bucket], _VERDICT_VALUES.get(v.verdict, 0))
        yield family


_VERDICT_VALUES = {"pass": 0, "marginal": 1, "fail": 2}


def _admission(stats: AdmissionStats) -> Iterator[Metric]:
    """Yield the admission counters by origin: real traffic, synthetic (probe) load."""
    admitted = CounterMetricFamily(
        f"{PREFIX}_admission_admitted",
        "Requests granted a decode slot, by origin (real: user traffic; synthetic: canaries,"
        " bursts, reference replays).", labels=("origin",))
    admitted.add_metric(["real"], stats.real_admitted)
    admitted.add_metric(["synthetic"], stats.synthetic_admitted)
    yield admitted
    rejected = CounterMetricFamily(
        f"{PREFIX}_admission_rejected",
        "Requests that got no decode slot, by origin and reason (queue_full; real_waiting:"
        " synthetic refused while real requests waited; shed: synthetic removed from the"
        " queue for a real request; timeout: deadline passed while waiting; token_budget:"
        " the queued tokens would pass engine.max_queue_tokens).",
        labels=("origin", "reason"))
    for origin, reason, count in stats.rejections():
        rejected.add_metric([origin, reason], count)
    yield rejected
    waiting = GaugeMetricFamily(f"{PREFIX}_admission_waiting",
                                "Requests waiting for a decode slot now, by origin.",
                                labels=("origin",))
    waiting.add_metric(["real"], stats.real_waiting)
    waiting.add_metric(["synthetic"], stats.synthetic_waiting)
    yield waiting
    yield CounterMetricFamily(
        f"{PREFIX}_admission_preemptions",
        "Real requests that made synthetic ones pause at their next step: granted the"
        " extra decode row while synthetic ones held the rows, or batched, beside a"
        " synthetic request running alone.",
        value=stats.preemptions)


def _flag_states(provider: FlagProvider, buckets: tuple[int, ...]) -> Metric:
    flags = provider.flags()
    family = GaugeMetricFamily(
        f"{PREFIX}_flag_enabled",
        "Effective runtime flag (1 on, 0 off) by flag and scope, as the engine reads it.",
        labels=("flag", "scope"))
    family.add_metric(["compiled", "global"], int(flags.compiled))
    family.add_metric(["bucketing", "global"], int(flags.bucketing))
    family.add_metric(["speculative", "global"], int(flags.speculative_default))
    for edge in buckets:
        family.add_metric(["speculative", str(edge)], int(flags.speculative_for(str(edge))))
    return family


def _batch_families(snap: BatchSnapshot) -> Iterator[Metric]:
    """Yield the batching scheduler's series (engine.protocol.BatchSnapshot)."""
    yield _gauge("batch_current_size", "Rows in the engine's running batch now.", {},
                 snap.batch_size)
    yield _gauge("batch_max_size", "Rows the batching scheduler may run (engine.max_batch).",
                 {}, snap.max_batch)
    yield _gauge("queue_size", "Requests waiting for a batch row or not yet taken up by the "
                 "batching loop.", {}, snap.rows_waiting)
    yield _gauge("batch_window_seconds", "The batching window now (adapted to the queue).",
                 {}, snap.window_s)
    yield _counter("batch_steps", "Batching-loop steps (batched decode steps and "
                   "speculative rounds).", snap.steps)
    yield _counter("batch_turn_steps", "Batching-loop steps in which rows waited their turn "
                   "(one row stepped alone while the others waited).", snap.turn_steps)
    hist = HistogramMetricFamily(
        f"{PREFIX}_batch_step_duration_seconds",
        "Batching-loop step seconds by phase: encode (one arrival), decode (one batched "
        "step), verify (one speculative round).", labels=("phase",))
    for phase, count in snap.step_count.items():
        cumulative = snap.step_buckets.get(phase, ())
        buckets = [(str(edge), float(n)) for edge, n in
                   zip(STEP_SECONDS_EDGES, cumulative, strict=False)]
        buckets.append(("+Inf", float(count)))
        hist.add_metric([phase], buckets, sum_value=snap.step_seconds_sum.get(phase, 0.0))
    yield hist


def _counter(name: str, doc: str, value: float) -> Metric:
    return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def _gauge(name: str, doc: str, labels: dict[str, str], value: float) -> Metric:
    family = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=tuple(labels))
    family.add_metric(list(labels.values()), value)
    return family
