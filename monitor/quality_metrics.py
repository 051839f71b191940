"""Output-quality metric families, read from SQL at scrape time (DatabaseCollector).

tailwatch_output_agreement_ratio{source,bucket,arm}: mean token agreement with the
    reference path over the last hour (probes.quality).
tailwatch_output_compared_total / tailwatch_output_exact_matches_total{source,bucket,arm}:
    outputs compared with their reference, and those equal to it (rows kept in SQL).
tailwatch_golden_accuracy_ratio{source,bucket,arm}: exact-match accuracy against the
    canaries' golden answers (`expected` in a suites file) over the last hour;
tailwatch_golden_compared_total / tailwatch_golden_exact_matches_total: outputs checked
    against a golden answer, and those equal to it. Absent without golden answers.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from sqlalchemy.orm import Session

from storage.queries import quality as queries
from vocab import utcnow

PREFIX = "tailwatch"
WINDOW = timedelta(hours=1)
LABELS = ("source", "bucket", "arm")


def quality_families(session: Session, clock: Callable[[], datetime] = utcnow) -> list[Metric]:
    """Return the agreement and golden-accuracy gauges and their counters."""
    ratio = GaugeMetricFamily(
        f"{PREFIX}_output_agreement_ratio",
        "Mean token agreement of outputs with the reference path over the last hour "
        "(1.0: identical), by source (canary, traffic), bucket and arm.", labels=LABELS)
    now = clock()
    golden = GaugeMetricFamily(
        f"{PREFIX}_golden_accuracy_ratio",
        "Share of outputs equal to their canary's golden answer over the last hour, by"
        " source, bucket and arm (canaries with an `expected` answer only).", labels=LABELS)
    for r in queries.agreement_rollups(session, now - WINDOW, now):
        if r.agreement is not None:
            ratio.add_metric([r.source, r.bucket, r.variant], r.agreement)
        if r.golden_accuracy is not None:
            golden.add_metric([r.source, r.bucket, r.variant], r.golden_accuracy)
    compared = CounterMetricFamily(
        f"{PREFIX}_output_compared", "Outputs compared with their reference output.",
        labels=LABELS)
    exact = CounterMetricFamily(
        f"{PREFIX}_output_exact_matches", "Outputs equal to their reference output.",
        labels=LABELS)
    golden_compared = CounterMetricFamily(
        f"{PREFIX}_golden_compared", "Outputs checked against their canary's golden answer.",
        labels=LABELS)
    golden_exact = CounterMetricFamily(
        f"{PREFIX}_golden_exact_matches", "Outputs equal to their canary's golden answer.",
        labels=LABELS)
    for t in queries.agreement_totals(session):
        compared.add_metric([t.source, t.bucket, t.variant], t.count)
        exact.add_metric([t.source, t.bucket, t.variant], t.exact)
        if t.golden_count:
            golden_compared.add_metric([t.source, t.bucket, t.variant], t.golden_count)
            golden_exact.add_metric([t.source, t.bucket, t.variant], t.golden_exact)
    return [ratio, compared, exact, golden, golden_compared, golden_exact]
