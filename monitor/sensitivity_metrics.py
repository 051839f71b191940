"""Rule sensitivity gauges, read from SQL at scrape time (DatabaseCollector).

tailwatch_rule_detectable_change_ratio{rule,scope}: the smallest relative shift (0.21 =
    21%, in the rule's direction) the rule confirms within N cycles at p95 on the series'
    own noise; absent while unknown (insufficient history, not detectable).
tailwatch_rule_expected_false_pages{rule,scope}: expected false pages per 30 days at the
    threshold in force.
tailwatch_rule_threshold_ratio{rule,scope}: that threshold (wider than configured where
    the false-page budget widened it).
scope: the series' scope key; where cohorts share a scope (a rollout), the newest estimate.
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily, Metric
from sqlalchemy.orm import Session

from storage.queries import sensitivity as queries

PREFIX = "tailwatch"
LABELS = ("rule", "scope")


def sensitivity_families(session: Session) -> list[Metric]:
    """Return the detectable-change, expected-false-pages and threshold gauges."""
    detectable = GaugeMetricFamily(
        f"{PREFIX}_rule_detectable_change_ratio",
        "Smallest relative shift the rule confirms within N cycles (p95) on this series.",
        labels=LABELS)
    pages = GaugeMetricFamily(
        f"{PREFIX}_rule_expected_false_pages",
        "Expected false pages per 30 days at the threshold in force.", labels=LABELS)
    threshold = GaugeMetricFamily(
        f"{PREFIX}_rule_threshold_ratio",
        "Relative threshold in force (widened past the configured one by the false-page "
        "budget).", labels=LABELS)
    newest: dict[tuple[str, str], queries.StoredSensitivity] = {}
    for s in queries.listing(session):
        old = newest.get((s.rule, s.scope_key))
        if old is None or s.computed_at > old.computed_at:
            newest[(s.rule, s.scope_key)] = s
    for (rule, scope), s in sorted(newest.items()):
        if s.detectable_change is not None:
            detectable.add_metric([rule, scope], s.detectable_change)
        if s.false_pages_30d is not None:
            pages.add_metric([rule, scope], s.false_pages_30d)
        threshold.add_metric([rule, scope], s.threshold)
    return [detectable, pages, threshold]
