"""The sensitivity refresh on SQLite and PostgreSQL: stored with the baseline, in force in
the evaluation, exported as gauges; budget opt-out and the time bound honoured."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine, update
from sqlalchemy.orm import Session, sessionmaker

from alerts.baselines import rule_scope
from alerts.detection import BaselineStats
from alerts.evaluator import EvaluationOptions, evaluate
from alerts.rule_file import load_rules
from alerts.rules import Point, Rule
from alerts.sensitivity import (
    HELD_RECHECK_S,
    DueEstimates,
    RefreshReport,
    SensitivityConfig,
    refresh,
    widening_reason,
)
from alerts.series import RowCache, cohort_series, sliced_cohort_series
from monitor.metrics import DatabaseCollector, Metrics
from storage.db import make_engine, make_sessionmaker
from storage.models import Alert, Baseline, RuleSensitivity, scope_key
from storage.queries import sensitivity as queries
from tests.alerts.builders import add_traffic

T0 = datetime(2026, 11, 2, tzinfo=UTC)
MINUTES = 600
SCOPE_LABELS = {"bucket": "64"}


def acceptance_rule(**kw: object) -> Rule:
    r = {r.name: r for r in load_rules()}["acceptance_drop"]
    return replace(r, **kw)  # type: ignore[arg-type]


def fill(sm: sessionmaker[Session], sd: float = 0.2, phi: float = 0.8, seed: int = 1,
         drop_last: int = 0, dip: range = range(0)) -> None:
    """Store MINUTES of one bucket's traffic whose acceptance wanders (AR(1)) around 0.6,
    its last `drop_last` minutes and the minutes in `dip` half as high, and the rolling
    baseline of those minutes."""
    rng, x, values = random.Random(seed), 0.0, []
    with sm.begin() as s:
        for i in range(MINUTES):
            x = phi * x + rng.gauss(0.0, sd * (1 - phi * phi) ** 0.5)
            low = i >= MINUTES - drop_last or i in dip
            v = min(max(0.6 * (1 + x) * (0.5 if low else 1.0), 0.0), 1.0)
            values.append(v)
            add_traffic(s, T0 + timedelta(minutes=i), "64", acceptance=v)
        stats = BaselineStats.of(values)
        assert stats is not None
        scope = rule_scope(acceptance_rule(), SCOPE_LABELS)
        s.add(Baseline(metric="acceptance_rate", scope=scope, scope_key=scope_key(scope),
                       value=stats.center, spread=stats.spread, samples=stats.cycles,
                       kind="rolling", created_at=T0 + timedelta(minutes=MINUTES),
                       active=True))


NOW = T0 + timedelta(minutes=MINUTES)
# The per-series CPU bound has tests of its own (an injected clock); here a loaded host
# must not turn a widening test into a timing test.
CFG = SensitivityConfig(budget_per_30d=0.5, cpu_s=60.0)


def test_refresh_widens_and_the_evaluation_runs_at_the_threshold_in_force(
        sessionmaker: sessionmaker[Session]) -> None:
    fill(sessionmaker)
    rule = acceptance_rule()
    with sessionmaker.begin() as s:
        done = refresh(s, [rule], CFG, NOW, history_s=MINUTES * 60.0)
    assert done.estimated == 1 and done.left == 0 and not done.errors
    with sessionmaker() as s:
        [st] = queries.listing(s)
        baseline_id = s.query(Baseline.id).scalar()
    assert st.baseline_id == baseline_id and st.direction == -1 and st.cycles >= 500
    assert st.threshold > 0.20 and st.false_pages_configured is not None
    assert st.false_pages_configured > 0.5 >= (st.false_pages_30d or 0.0)
    assert st.reason == widening_reason(-1, 0.20, st.threshold, st.false_pages_configured)
    assert queries.describe(st).endswith(st.reason)
    # Stored, unchanged inputs: the next refresh has nothing to do.
    with sessionmaker.begin() as s:
        assert refresh(s, [rule], CFG, NOW, history_s=MINUTES * 60.0).estimated == 0
    with sessionmaker.begin() as s:
        report = evaluate(s, EvaluationOptions([rule]), NOW)
    [result] = report.results
    assert result.threshold == -st.threshold
    assert result.reason.endswith(f"; {st.reason}")

    registry = CollectorRegistry()
    DatabaseCollector(Metrics(registry), sessionmaker)
    labels = {"rule": "acceptance_drop", "scope": st.scope_key}
    assert registry.get_sample_value("tailwatch_rule_expected_false_pages", labels) \
        == st.false_pages_30d
    assert registry.get_sample_value("tailwatch_rule_detectable_change_ratio", labels) \
        == st.detectable_change
    assert registry.get_sample_value("tailwatch_rule_threshold_ratio", labels) == st.threshold


@pytest.mark.parametrize("drop_last", [0, 20])
def test_a_narrower_estimate_waits_while_a_run_is_under_way(
        sessionmaker: sessionmaker[Session], drop_last: int) -> None:
    # The late page of bench.incidents --service: a re-estimate narrowed a series' widened
    # threshold while its detector's run still held an ended slowdown's cycles, and the
    # next evaluation confirmed that run at the narrower threshold at once.
    fill(sessionmaker, drop_last=drop_last)
    with sessionmaker.begin() as s:
        refresh(s, [acceptance_rule()], CFG, NOW, history_s=MINUTES * 60.0)
        # As an earlier, noisier day's estimate left it: widened past the drop.
        [first] = queries.listing(s)
        queries.save(s, replace(first, threshold=0.6, reason=widening_reason(
            -1, 0.20, 0.6, first.false_pages_configured or 0.0)))
    with sessionmaker() as s:
        [wide] = queries.listing(s)
    # A budget the configured -20% meets: the re-estimate narrows the threshold to it.
    loose = acceptance_rule(budget_per_30d=1000.0)
    with sessionmaker.begin() as s:
        done = refresh(s, [loose], CFG, NOW, history_s=MINUTES * 60.0)
    with sessionmaker() as s:
        [st] = queries.listing(s)
    with sessionmaker.begin() as s:
        [result] = evaluate(s, EvaluationOptions([loose]), NOW).results
    if drop_last:
        # At -20% the last 20 minutes' run would confirm now: the wider threshold stays.
        assert not result.fired and result.threshold == -0.6 and st == wide
        assert done.deferred == 1 and done.estimated == 0
    else:
        assert done.deferred == 0 and done.estimated == 1
        assert st.threshold == 0.20 and result.threshold == -0.20 and not result.fired


@pytest.mark.parametrize("alerted", [True, False])
def test_an_incidents_cycles_are_no_noise_to_the_estimate(
        sessionmaker: sessionmaker[Session], alerted: bool) -> None:
    # An hour at half the acceptance in a quiet series: read as noise it widens the
    # threshold past -20% (a long regression's own estimate resolved its alert while it
    # went on, and it paged again: bench.incidents' ramps). While an alert fired on it,
    # it is left out, as the rolling baselines leave it out.
    dip = range(300, 360)
    fill(sessionmaker, sd=0.03, dip=dip)
    if alerted:
        with sessionmaker.begin() as s:
            s.add(Alert(fingerprint="f", rule="acceptance_drop", labels=SCOPE_LABELS,
                        severity="page", state="resolved",
                        started_at=T0 + timedelta(minutes=dip.start + 1),
                        fired_at=T0 + timedelta(minutes=dip.start + 4),
                        resolved_at=T0 + timedelta(minutes=dip.stop + 6)))
    with sessionmaker.begin() as s:
        done = refresh(s, [acceptance_rule()], CFG, NOW, history_s=MINUTES * 60.0)
    with sessionmaker() as s:
        [st] = queries.listing(s)
    assert done.estimated == 1 and not done.errors
    if alerted:
        assert st.threshold == 0.20 and st.reason == "" and st.cycles < MINUTES - 60
    else:
        assert st.threshold > 0.20, st  # what the estimate read without the alert


@pytest.mark.parametrize("opt_out", [{"budget_off": True},
                                     {"budget_off_for": ((("bucket", "64"),),)}])
def test_budget_off_keeps_the_configured_threshold(sessionmaker: sessionmaker[Session],
                                                   opt_out: dict[str, object]) -> None:
    fill(sessionmaker)
    with sessionmaker.begin() as s:
        refresh(s, [acceptance_rule()], CFG, NOW, history_s=MINUTES * 60.0)
    off = acceptance_rule(**opt_out)
    # Opted out after a widening: the evaluation drops it at once, the refresh restates it.
    with sessionmaker.begin() as s:
        [result] = evaluate(s, EvaluationOptions([off]), NOW).results
    assert result.threshold == -0.20 and "->" not in result.reason
    with sessionmaker.begin() as s:
        assert refresh(s, [off], CFG, NOW, history_s=MINUTES * 60.0).estimated == 1
    with sessionmaker() as s:
        [st] = queries.listing(s)
    assert st.budget_per_30d is None and st.threshold == 0.20 and st.reason == ""
    assert st.false_pages_30d is not None and st.false_pages_30d > 0.5  # its cost, stated


def test_insufficient_history_is_stated_and_the_time_bound_leaves_the_rest(
        sessionmaker: sessionmaker[Session]) -> None:
    fill(sessionmaker)
    rule = acceptance_rule()
    with sessionmaker.begin() as s:
        spent = refresh(s, [rule], CFG, NOW, history_s=MINUTES * 60.0, budget_s=0.0)
    assert spent.estimated == 0 and spent.left == 1
    # A history of 100 minutes: the read reaches back for the 360 cycles it needs, and
    # there are no more.
    with sessionmaker.begin() as s:
        refresh(s, [rule], CFG, T0 + timedelta(minutes=100), history_s=60 * 60.0)
    with sessionmaker() as s:
        [st] = queries.listing(s)
    assert st.status == "insufficient history" and st.threshold == 0.20
    assert queries.describe(st) == ("insufficient history: 100 of 360 cycles, 1.7 of 6 h; "
                                    "pages held as warnings until then; threshold -20% kept")


def test_the_scheduled_job_reads_its_settings(sessionmaker: sessionmaker[Session]) -> None:
    from alerts.config import load_config
    from alerts.settings import AlertSettings
    from monitor.jobs import refresh_sensitivity

    fill(sessionmaker)
    config = load_config(AlertSettings(false_page_budget_per_30d=None,
                                       sensitivity_within_cycles=5,
                                       sensitivity_history_s=MINUTES * 60.0))
    config = replace(config, rules=(acceptance_rule(),))
    done = refresh_sensitivity(sessionmaker, config, lambda: NOW)
    assert isinstance(done, RefreshReport)
    assert done.estimated == 1 and not done.errors
    with sessionmaker() as s:
        [st] = queries.listing(s)
    assert st.within_cycles == 5 and st.budget_per_30d is None and st.threshold == 0.20


def test_the_job_estimates_without_holding_the_write_lock(
        db_engine: Engine, sessionmaker: sessionmaker[Session]) -> None:
    from alerts.config import load_config
    from alerts.settings import AlertSettings
    from monitor.jobs import refresh_sensitivity

    fill(sessionmaker)
    config = replace(load_config(AlertSettings(sensitivity_history_s=MINUTES * 60.0)),
                     rules=(acceptance_rule(),))
    # A second engine that does not wait for a lock (SQLite: busy timeout 0).
    other = make_sessionmaker(make_engine(db_engine.url, busy_timeout_s=0.0))
    seen: list[DueEstimates] = []

    def write_meanwhile(due: DueEstimates) -> None:
        # The serving process's write (BEGIN IMMEDIATE on SQLite) during the read phase:
        # it fails at once if the job held the write lock.
        with other.begin() as s:
            add_traffic(s, NOW, "64", acceptance=0.6)
        seen.append(due)

    try:
        done = refresh_sensitivity(sessionmaker, config, lambda: NOW, estimated=write_meanwhile)
    finally:
        other.kw["bind"].dispose()
    assert [len(d.found) for d in seen] == [1]  # estimated before the write ran
    assert done.estimated == 1 and not done.errors
    with sessionmaker() as s:
        [st] = queries.listing(s)
        assert st.rule == "acceptance_drop" and st.computed_at == NOW


class _Reads:
    """Record how many rows each read of the traffic rollups returned (the loader's own
    result, passed through)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from storage.queries import measurements

        self.sizes: list[int] = []
        real = measurements.traffic_rollups

        def traffic_rollups(session: Session, start: datetime, end: datetime) -> list[Any]:
            rows = real(session, start, end)
            self.sizes.append(len(rows))
            return rows

        monkeypatch.setattr(measurements, "traffic_rollups", traffic_rollups)


def test_the_refresh_holds_an_hour_of_rows_however_long_the_history(
        sessionmaker: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch) -> None:
    fill(sessionmaker)  # 600 minutes: one traffic row each
    reads = _Reads(monkeypatch)
    with sessionmaker.begin() as s:
        done = refresh(s, [acceptance_rule()], CFG, NOW, history_s=MINUTES * 60.0)
    assert done.estimated == 1 and not done.errors
    # Read whole, one read held all 600 minutes: the job's peak grew with the history.
    assert sum(reads.sizes) >= MINUTES
    assert max(reads.sizes) <= 60 and 0 < done.rows_held <= 61  # an hour, a cohort span


def test_a_refresh_with_nothing_due_reads_no_history(
        sessionmaker: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch) -> None:
    fill(sessionmaker)
    rule = acceptance_rule()
    with sessionmaker.begin() as s:
        assert refresh(s, [rule], CFG, NOW, history_s=MINUTES * 60.0).estimated == 1
    reads = _Reads(monkeypatch)
    with sessionmaker.begin() as s:
        assert refresh(s, [rule], CFG, NOW, history_s=MINUTES * 60.0).estimated == 0
    assert reads.sizes == []


def test_sliced_reads_give_the_points_of_one_read(sessionmaker: sessionmaker[Session]) -> None:
    # Minutes of 5 to 150 requests: a p99 pools earlier minutes (across slice edges) when
    # a minute holds fewer than 100.
    rng = random.Random(3)
    with sessionmaker.begin() as s:
        for i in range(200):
            for bucket in ("16", "64"):
                add_traffic(s, T0 + timedelta(minutes=i), bucket,
                            requests=rng.randint(5, 150), latency_s=rng.uniform(0.05, 0.2))
    rule = {r.name: r for r in load_rules()}["traffic_p99_regression"]
    start, end = T0 + timedelta(seconds=30), T0 + timedelta(minutes=200)
    with sessionmaker() as s:
        whole = cohort_series(rule, RowCache(s), start, end)
        sliced, held = sliced_cohort_series(rule, s, start, end, slice_s=1800.0)
    assert set(sliced) == set(whole) and len(whole) == 2

    def values(series: dict[Any, dict[Any, list[Point]]]) -> dict[Any, list[Any]]:
        return {(labels, cohort): [(p.at, p.value, p.samples) for p in pts if p.value is not None]
                for labels, per in series.items() for cohort, pts in per.items()}

    assert values(sliced) == values(whole)
    assert any(p.samples > 150 for per in whole.values() for pts in per.values() for p in pts)
    assert held < 2 * 200  # at most half an hour of two buckets, plus the pooled cycles


def test_a_held_series_is_estimated_again_as_its_history_grows(
        sessionmaker: sessionmaker[Session]) -> None:
    """Its baseline unchanged: a series too young to state its false pages is due again
    HELD_RECHECK_S after its estimate, and states them once its history suffices."""
    fill(sessionmaker)
    rule = acceptance_rule()
    cfg = replace(CFG, min_history=60, min_history_s=3600.0)
    younger = NOW - timedelta(minutes=MINUTES - 60)  # 60 of the 120 cycles it needs
    with sessionmaker.begin() as s:
        assert refresh(s, [rule], cfg, younger, history_s=MINUTES * 60.0).estimated == 1
    # 50 minutes on, it cannot have 120 cycles yet: its history is not read again.
    young = younger + timedelta(minutes=50)  # 110 cycles
    with sessionmaker.begin() as s:
        assert refresh(s, [rule], cfg, young, history_s=MINUTES * 60.0).estimated == 0
    with sessionmaker.begin() as s:  # an estimate an hour old could now have 120: due
        s.execute(update(RuleSensitivity).values(computed_at=young - timedelta(hours=1)))
    with sessionmaker.begin() as s:
        assert refresh(s, [rule], cfg, young, history_s=MINUTES * 60.0).estimated == 1
    soon = young + timedelta(seconds=HELD_RECHECK_S - 60)
    with sessionmaker.begin() as s:
        assert refresh(s, [rule], cfg, soon, history_s=MINUTES * 60.0).estimated == 0
    later = young + timedelta(seconds=HELD_RECHECK_S)  # 120 cycles, 2 hours
    with sessionmaker.begin() as s:
        assert refresh(s, [rule], cfg, later, history_s=MINUTES * 60.0).estimated == 1
    with sessionmaker() as s:
        [st] = queries.listing(s)
    assert st.status != "insufficient history" and st.computed_at == later
    with sessionmaker.begin() as s:  # stated: due again only when its baseline changes
        assert refresh(s, [rule], cfg, later + timedelta(hours=1),
                       history_s=MINUTES * 60.0).estimated == 0
