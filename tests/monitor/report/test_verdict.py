"""Holds, at risk (near the threshold or trending across it), violated, no data."""

from __future__ import annotations

import pytest

from monitor.report.metrics import MetricReading, Reading
from monitor.report.optimizations import Assumption
from monitor.report.verdict import judge, judge_metric, overall, project

LE = Assumption("w", "waste", "padding_waste", "<=", 0.25)
GE_SHARE = Assumption("fit", "fit", "largest_bucket_fit", ">=", 0.99)


@pytest.mark.parametrize(("check", "reading", "unit", "status"), [
    (LE, Reading(0.10, "", 1, (0.10,) * 7), "share", "holds"),
    (LE, Reading(0.30, "", 1), "share", "violated"),
    (LE, Reading(0.24, "", 1), "share", "at risk"),  # within 10% of 0.25
    # Flat at 0.10 on average, but rising 0.03 a day: 0.28 a week after the week ends.
    (LE, Reading(0.10, "", 1, (0.01, 0.04, 0.07, 0.10, 0.13, 0.16, 0.19)), "share", "at risk"),
    (LE, Reading(None, "no rows", 0), "share", "no data"),
    # A high share is judged on what it may miss: 0.995 uses half of the 1% allowed.
    (GE_SHARE, Reading(0.995, "", 1), "share", "holds"),
    (GE_SHARE, Reading(0.9905, "", 1), "share", "at risk"),
    (GE_SHARE, Reading(0.98, "", 1), "share", "violated"),
])
def test_judge(check: Assumption, reading: Reading, unit: str, status: str) -> None:
    assert judge(check, reading, unit).status == status


def test_trend_needs_three_days_and_projects_a_week_past_the_end() -> None:
    assert project((0.1, None, 0.2) + (None,) * 4) is None
    assert project((0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0)) == pytest.approx(13.5)


def test_worst_bucket_decides_and_is_named() -> None:
    check = Assumption("acc", "acc", "acceptance_rate", ">=", 0.6, per_bucket=True)
    reading = MetricReading(Reading(0.6, "", 2), {"16": Reading(0.8, "a", 1),
                                                  "64": Reading(0.4, "b", 1)})
    verdict, buckets = judge_metric(check, reading, "share")
    assert verdict.status == "violated" and verdict.value == 0.4
    assert verdict.reason.startswith("bucket 64:")
    assert [(b.bucket, b.verdict.status) for b in buckets] == [("16", "holds"), ("64", "violated")]


@pytest.mark.parametrize(("statuses", "status"), [
    (["holds", "holds"], "holds"),
    (["holds", "no data"], "partially checked"),
    (["holds", "no data", "no data", "holds"], "partially checked"),
    (["at risk", "no data"], "at risk"),
    (["violated", "holds", "no data"], "violated"),
    (["no data", "no data"], "no data"),
    ([], "no data"),
])
def test_an_optimization_with_unchecked_assumptions_is_partially_checked(
        statuses: list[str], status: str) -> None:
    assert overall(statuses) == status
