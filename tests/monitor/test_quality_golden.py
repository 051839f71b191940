"""Golden answers read back from SQL: the metric families and the report's Quality table."""

from __future__ import annotations

from datetime import timedelta

from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session, sessionmaker

from monitor.metrics import DatabaseCollector, Metrics
from monitor.report.quality import collect_quality, quality_table
from storage.models import OutputAgreement
from vocab import utcnow


def _row(minutes_ago: float, bucket: str, golden: tuple[int, int]) -> OutputAgreement:
    return OutputAgreement(
        at=utcnow() - timedelta(minutes=minutes_ago), source="canary", bucket=bucket,
        path="compiled", decoding="direct", variant="optimized", count=4, exact=4,
        agreement_sum=4.0, length_diff_sum=0, golden_count=golden[0], golden_exact=golden[1])


def test_golden_accuracy_is_exported_and_reported(sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        s.add_all([_row(2, "32", (4, 3)), _row(1, "32", (4, 2)), _row(180, "32", (4, 0)),
                   _row(1, "16", (0, 0))])
    registry = CollectorRegistry()
    DatabaseCollector(Metrics(registry), sessionmaker)
    get = registry.get_sample_value
    labels = {"source": "canary", "bucket": "32", "arm": "optimized"}
    assert get("tailwatch_golden_accuracy_ratio", labels) == 5 / 8  # the last hour only
    assert get("tailwatch_golden_compared_total", labels) == 12
    assert get("tailwatch_golden_exact_matches_total", labels) == 5
    # A bucket without golden answers has no golden series (not a 0% accuracy).
    no_golden = {**labels, "bucket": "16"}
    assert get("tailwatch_golden_accuracy_ratio", no_golden) is None
    assert get("tailwatch_golden_compared_total", no_golden) is None

    now = utcnow()
    with sessionmaker() as s:
        table = quality_table(collect_quality(s, now - timedelta(days=7), now))
    column = table.headers.index("Golden answers matched")
    cells = {row[3]: row[column] for row in table.rows}
    assert cells == {"32": "5/12 (41.7%)", "16": "-"}
