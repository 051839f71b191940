"""One read per row kind: a planned RowCache slices what per-window reads would return."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

from alerts.rule_file import load_rules
from alerts.rules import Point
from alerts.series import RowCache, cohort_series, plan_rules
from tests.alerts.builders import add_cycle, add_traffic

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def _plain(out: Mapping[Any, Mapping[Any, list[Point]]]) -> dict[Any, Any]:
    """Return the series with each point's fresh sketch as (count, bins): comparable."""
    return {k: {c: [(p.at, p.value, p.samples,
                     None if p.fresh is None else (p.fresh.count, p.fresh.bins))
                    for p in pts] for c, pts in per.items()} for k, per in out.items()}


def test_planned_reads_match_per_window_reads_in_one_query_per_kind(
        sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        for i in range(90):
            at = T0 + timedelta(minutes=i)
            add_cycle(s, at + timedelta(seconds=2), {"16": 0.05 + i / 1e4, "64": 0.1},
                      model_version="m1" if i < 75 else "m2")  # a rollout at minute 75
            add_traffic(s, at, "64", requests=3)  # short for a p99: pools reach back
    rules = load_rules()
    now = T0 + timedelta(minutes=90, seconds=30)
    windows = [(r, now - timedelta(seconds=r.window_s * r.lookback_cycles)) for r in rules]
    statements: list[str] = []
    with sessionmaker() as s:
        expected = {r.name: _plain(cohort_series(r, RowCache(s), start, now))
                    for r, start in windows}
        planned = RowCache(s)
        plan_rules(planned, rules, now)
        event.listen(s.get_bind(), "before_cursor_execute",
                     lambda *a: statements.append(a[2]))
        got = {r.name: _plain(cohort_series(r, planned, start, now)) for r, start in windows}
        # A read planned after the first one of its kind still sees every row.
        late = dataclasses.replace(rules[0], lookback_cycles=80)
        planned.plan("canary", now - timedelta(minutes=80), now)
        late_got = _plain(cohort_series(late, planned, now - timedelta(minutes=80), now))
    assert got == expected
    with sessionmaker() as s:
        assert late_got == _plain(cohort_series(late, RowCache(s), now - timedelta(minutes=80),
                                                now))
    assert any(len(v) == 2 for per in got.values() for v in per.values())  # both cohorts
    canary = [q for q in statements if "FROM probe_results" in q]
    traffic = [q for q in statements if "FROM traffic_rollups" in q]
    # The window, then once the older cycles pooled quantiles reach back for; canary: also
    # the late read.
    assert len(traffic) == 2 and len(canary) == 3, (len(traffic), len(canary))
