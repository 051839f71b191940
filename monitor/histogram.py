"""A labelled Prometheus histogram that is filled in bulk.

prometheus_client's Histogram takes one lock per bucket increment, which costs a few
microseconds per value. The latency histograms get every served request and every
output token, so `BulkHistogram` keeps the bucket counts of all its label sets in one
numpy array instead. `add()` bins a whole fold of values in a few array operations, and
`collect()` exposes the usual `_bucket`/`_count`/`_sum` series. A scrape reads exactly
what one `observe()` per value would have recorded (tests/monitor/test_metrics_bulk.py).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from itertools import chain

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class BulkHistogram(Collector):
    """A labelled histogram whose bucket counts live in one numpy array (thread-safe).

    Example:
        h = BulkHistogram("x_seconds", "X.", ("bucket",), (0.01, 0.1), registry)
        h.add([h.row("16"), h.row("32")], [[0.004, 0.02], [0.3]])
    """

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 buckets: Sequence[float], registry: CollectorRegistry) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds):
            raise ValueError(f"buckets: must be sorted, got {buckets}")
        if bounds[-1] != math.inf:
            bounds.append(math.inf)  # every value finds a bucket, as in prometheus_client
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._bounds = np.asarray(bounds)
        self._le = [floatToGoString(b) for b in bounds]
        self._lock = threading.Lock()
        self._rows: dict[tuple[str, ...], int] = {}
        self._counts = np.zeros((4, len(bounds)), dtype=np.int64)
        self._sums = np.zeros(4)
        registry.register(self)

    def row(self, *labels: str) -> int:
        """Return the row of a label set, created empty on first use."""
        if len(labels) != len(self.labelnames):
            raise ValueError(f"labels: {self.name} takes {self.labelnames}, got {labels}")
        with self._lock:
            row = self._rows.get(labels)
            if row is None:
                row = self._rows[labels] = len(self._rows)
                if row == len(self._sums):  # grow by doubling: rows are few and long-lived
                    self._counts = np.concatenate([self._counts, np.zeros_like(self._counts)])
                    self._sums = np.concatenate([self._sums, np.zeros_like(self._sums)])
            return row

    def add(self, rows: Sequence[int], values: Sequence[Sequence[float]]) -> None:
        """Add `values[i]` to row `rows[i]`, exactly as one observe() per value would."""
        lengths = [len(v) for v in values]
        total = sum(lengths)
        if not total:
            return
        flat = np.fromiter(chain.from_iterable(values), dtype=float, count=total)
        row_of = np.repeat(np.asarray(rows, dtype=np.intp), lengths)
        # side="left" is prometheus_client's bisect_left: a value on a bound counts in it.
        idx = np.searchsorted(self._bounds, flat, side="left")
        idx += row_of * len(self._bounds)
        with self._lock:
            counts = self._counts
            counts += np.bincount(idx, minlength=counts.size).reshape(counts.shape)
            np.add.at(self._sums, row_of, flat)

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            labels = list(self._rows)
            cumulative = self._counts[:len(labels)].cumsum(axis=1).tolist()
            sums = self._sums[:len(labels)].tolist()
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for label_values, counts, total in zip(labels, cumulative, sums, strict=True):
            family.add_metric(label_values, list(zip(self._le, counts, strict=True)), total)
        yield family
