"""Confirmed runs (fired or late) and the cohort each instance serves, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session, sessionmaker

from storage.models import Alert, AlertTransition
from storage.queries import alerts as alert_queries
from storage.queries import baselines as baseline_queries
from storage.queries.runs import latest_cycles, serving_cohorts, serving_since
from tests.storage.builders import T0, minutes, probe_run


def _alert(s: Session, fp: str, moves: list[tuple[str | None, str]], *,
           fired_at: datetime | None = None) -> Alert:
    """Store a resolved alert of rule "p99" that started at T0 and resolved at T0+10m."""
    a = Alert(fingerprint=fp, rule="p99", labels={"bucket": fp}, annotations={},
              severity="page", state="resolved", started_at=T0, updated_at=T0 + minutes(10),
              fired_at=fired_at, resolved_at=T0 + minutes(10), consecutive_breaches=0,
              consecutive_ok=0)
    s.add(a)
    s.flush()
    for k, (old, new) in enumerate(moves):
        s.add(AlertTransition(alert_id=a.id, at=T0 + minutes(5 * k), from_state=old,
                              to_state=new))
    return a


def test_a_late_run_restarts_the_detector_and_stays_out_of_baselines_but_never_fired(
        sessionmaker: sessionmaker[Session]) -> None:
    """fired: pending -> firing -> resolved; late: pending -> late (no fired_at);
    unconfirmed: pending -> resolved, noise the baselines keep."""
    with sessionmaker.begin() as s:
        _alert(s, "fired", [(None, "pending"), ("pending", "firing"), ("firing", "resolved")],
               fired_at=T0 + minutes(5))
        _alert(s, "late", [(None, "pending"), ("pending", "late")])
        _alert(s, "unconfirmed", [(None, "pending"), ("pending", "resolved")])
    with sessionmaker() as s:
        restarts = alert_queries.last_resolved_fired_by_rule(s, ["p99"])["p99"]
        one = alert_queries.last_resolved_fired(s, "p99")
        periods = baseline_queries.alert_periods(s, ["p99"], T0)
        week = [a.fingerprint for a in
                alert_queries.alerts_active_between(s, T0 - minutes(60), T0 + minutes(60))]
    assert set(restarts) == {"fired", "late"}
    assert restarts == one and set(restarts.values()) == {T0 + minutes(10)}
    assert sorted(p.labels["bucket"] for p in periods) == ["fired", "late"]
    assert week == ["fired"]


def test_each_instance_serves_the_cohort_of_its_latest_canary_cycle_in_the_window(
        sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        s.add_all([
            probe_run(T0, [], instance_id="i1", model_version="m1"),
            probe_run(T0 + minutes(30), [], instance_id="i1", model_version="m2"),
            probe_run(T0 + minutes(20), [], instance_id="i2", model_version="m1"),
            # A burst is no canary cycle; a cycle at the window's end is not in it.
            probe_run(T0 + minutes(40), [], instance_id="i2", model_version="m3", kind="burst"),
            probe_run(T0 + minutes(60), [], instance_id="i2", model_version="m4"),
            probe_run(T0 - minutes(5), [], instance_id="i3", model_version="m1"),
        ])
    with sessionmaker() as s:
        got = serving_cohorts(s, T0, T0 + minutes(60))
    assert got == {"i1": ("m2", "c1"), "i2": ("m1", "c1")}


def test_a_shorter_lookbacks_serving_cohorts_come_from_a_longer_read(
        sessionmaker: sessionmaker[Session]) -> None:
    """The rollout check's 30 minutes out of the incidents' hour: one read serves both."""
    with sessionmaker.begin() as s:
        s.add_all([
            probe_run(T0 + minutes(5), [], instance_id="i1", model_version="m1"),
            probe_run(T0 + minutes(40), [], instance_id="i1", model_version="m2"),
            probe_run(T0 + minutes(20), [], instance_id="i2", model_version="m1"),  # left
            probe_run(T0 + minutes(30), [], instance_id="i3", model_version="m3"),  # the edge
            probe_run(T0 + minutes(50), [], instance_id="i4", model_version="m4", kind="burst"),
        ])
    end = T0 + minutes(60)
    with sessionmaker() as s:
        latest = latest_cycles(s, T0, end)
        for since in (T0, T0 + minutes(20), T0 + minutes(30), T0 + minutes(45)):
            assert serving_since(latest, since) == serving_cohorts(s, since, end), since
    assert latest["i1"].started_at == T0 + minutes(40) and latest["i1"].cohort == ("m2", "c1")
    assert serving_since(latest, T0 + minutes(30)) == {"i1": ("m2", "c1"), "i3": ("m3", "c1")}
