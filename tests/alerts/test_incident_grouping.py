"""Incidents: the grouping window, joins by scope, resolution and reopening (alerts.incidents).

Alerts move through the production Lifecycle (as the evaluator moves them), then
`alerts.incidents.group` runs on the same Lifecycle, on an injected clock.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from alerts.incidents import IncidentConfig, IncidentReport, family, group
from alerts.lifecycle import Lifecycle, fingerprint, open_alerts
from alerts.rollout import ROLLOUT_RULE
from alerts.rule_file import load_rules, parse_rule
from alerts.rules import Rule, RuleResult
from storage.models import Incident, IncidentEvent, IncidentMember
from storage.queries import incidents as queries
from tests.alerts.builders import add_cycle

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
P99 = parse_rule({"name": "p99_latency_regression", "metric": "p99_latency", "change": "+15%",
                  "severity": "page"})
P50 = parse_rule({"name": "p50_latency_regression", "metric": "p50_latency", "change": "+15%"})
RECOMPILES = parse_rule({"name": "recompiles_per_hour", "metric": "recompiles_per_hour",
                         "change": "+50%", "per": ["instance"], "severity": "page"})
CONFIG = IncidentConfig(window_s=150.0, hold_s=600.0)


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


def fire(s: Session, now: datetime, rule: Rule, labels: dict[str, str]) -> IncidentReport:
    """Move one scope's alert to firing (pending first, as the lifecycle does), then group."""
    life = Lifecycle(s, now, per_alert=False)
    current = open_alerts(s).get(fingerprint(rule.name, labels))
    if current is None:
        life.apply(rule, RuleResult(rule.name, labels, 1.0, 1.5, 0.5, 0.15, False, "pending",
                                    breaching=True, severity=rule.severity), None)
        current = open_alerts(s)[fingerprint(rule.name, labels)]
    life.apply(rule, RuleResult(rule.name, labels, 1.0, 1.5, 0.5, 0.15, True, "fired",
                                breaching=True, severity=rule.severity), current)
    return group(s, now, life, CONFIG)


def recover(s: Session, now: datetime, rule: Rule, labels: dict[str, str]) -> IncidentReport:
    life = Lifecycle(s, now, per_alert=False)
    current = open_alerts(s)[fingerprint(rule.name, labels)]
    life.apply(rule, RuleResult(rule.name, labels, 1.0, 1.0, 0.0, 0.15, False, "recovered",
                                recovered=True, severity=rule.severity), current)
    return group(s, now, life, CONFIG)


def incidents(s: Session) -> list[Incident]:
    return list(s.scalars(select(Incident).order_by(Incident.id)))


def test_alerts_within_the_window_join_one_incident_with_families_as_labels(
        sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        first = fire(s, at(0), P99, {"bucket": "64"})
        fire(s, at(1), P50, {"bucket": "32"})
        fire(s, at(2), RECOMPILES, {"instance": "i1"})
    with sessionmaker() as s:
        (inc,) = incidents(s)
        assert first.opened == (inc.id,)
        assert inc.state == "open" and inc.severity == "page"
        assert inc.families == ["compile", "latency"] and inc.buckets == ["32", "64"]
        assert inc.instances == ["i1"]
        assert len(queries.members(s, inc.id)) == 3
        kinds = [e.kind for e in queries.events(s, inc.id)]
        assert kinds == ["opened", "joined", "joined"]


def test_an_alert_after_the_window_joins_an_open_incident_and_opens_one_after_it_ended(
        sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        fire(s, at(0), P99, {"bucket": "64"})
        fire(s, at(30), P50, {"bucket": "32"})  # long after the window, but it is open
        assert len(incidents(s)) == 1
        recover(s, at(40), P99, {"bucket": "64"})
        assert incidents(s)[0].state == "open"  # one member still fires
        rep = recover(s, at(41), P50, {"bucket": "32"})
        (inc,) = incidents(s)
        assert rep.resolved == (inc.id,) and inc.state == "resolved"
        assert inc.resolved_at == at(41)
        # Beyond the window and the hold, another rule's alert opens a new incident.
        fire(s, at(60), P50, {"bucket": "128"})
        assert [i.state for i in incidents(s)] == ["resolved", "open"]


def test_instances_that_share_nothing_are_separate_incidents(
        sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        fire(s, at(0), RECOMPILES, {"instance": "i1"})
        fire(s, at(1), RECOMPILES, {"instance": "i2"})
        assert [i.instances for i in incidents(s)] == [["i1"], ["i2"]]
        # A service-wide alert (no instance label) shares every instance: it joins the
        # latest open incident rather than opening a third.
        fire(s, at(1.5), P99, {"bucket": "64"})
        assert len(incidents(s)) == 2


def test_a_member_firing_again_within_the_hold_reopens_its_incident(
        sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        fire(s, at(0), P99, {"bucket": "64"})
        recover(s, at(10), P99, {"bucket": "64"})
        rep = fire(s, at(15), P99, {"bucket": "64"})  # 5 minutes later: within the 10-minute hold
        (inc,) = incidents(s)
        assert rep.reopened == (inc.id,) and inc.state == "open" and inc.reopened == 1
        assert len(s.scalars(select(IncidentMember)).all()) == 2
        recover(s, at(20), P99, {"bucket": "64"})
        # After the hold: a new incident.
        fire(s, at(31), P99, {"bucket": "64"})
        assert [i.state for i in incidents(s)] == ["resolved", "open"]
        kinds = [e.kind for e in s.scalars(select(IncidentEvent).where(
            IncidentEvent.incident_id == inc.id).order_by(IncidentEvent.id))]
        assert kinds == ["opened", "left", "resolved", "reopened", "joined", "left", "resolved"]


def test_the_window_comes_from_the_config(sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        fire(s, at(0), RECOMPILES, {"instance": "i1"})
        recover(s, at(1), RECOMPILES, {"instance": "i1"})
        # Started within the window (2.5 minutes) and shares i1: joins, though resolved.
        fire(s, at(2), P50, {"bucket": "32", "instance": "i1"})
        assert len(incidents(s)) == 1
        recover(s, at(3), P50, {"bucket": "32", "instance": "i1"})
        fire(s, at(4), P99, {"bucket": "64", "instance": "i1"})  # outside it, not a member
        assert len(incidents(s)) == 2


ROLLOUT = parse_rule({"name": ROLLOUT_RULE, "metric": "p99_latency", "change": "+15%"})


def test_during_a_rollout_instances_serving_one_cohort_share_it_and_two_cohorts_stay_apart(
        sessionmaker: sessionmaker[Session]) -> None:
    """The rollout reached i1 and i2 (cohort m2), not i3 (m1): each instance's cohort is
    the one its latest canary cycle ran, and a rollout alert's the new cohort it judged."""
    with sessionmaker.begin() as s:
        for inst, version in (("i1", "m2"), ("i2", "m2"), ("i3", "m1")):
            add_cycle(s, at(-30), {"64": 0.1}, instance=inst, model_version="m1")
            add_cycle(s, at(-1), {"64": 0.1}, instance=inst, model_version=version)
        fire(s, at(0), RECOMPILES, {"instance": "i1"})
        fire(s, at(1), RECOMPILES, {"instance": "i3"})  # another cohort, no shared instance
        fire(s, at(1.5), RECOMPILES, {"instance": "i2"})  # i1's cohort: joins its incident
        fire(s, at(2), ROLLOUT, {"bucket": "64", "metric": "p99_latency", "source": "canary",
                                 "new": "m2/c1", "old": "m1/c1"})
        new, old = incidents(s)
        assert (new.instances, new.cohorts) == (["i1", "i2"], ["m2/c1"])
        assert (old.instances, old.cohorts) == (["i3"], ["m1/c1"])
        assert new.families == ["compile", "rollout"] and old.families == ["compile"]
        assert len(queries.members(s, new.id)) == 3 and len(queries.members(s, old.id)) == 1
        assert "cohorts m2/c1" in new.summary


def test_without_canary_cycles_instances_name_no_cohort_and_stay_apart(
        sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        # i2's only cycle is over an hour old: it serves no cohort we can name now.
        add_cycle(s, at(-90), {"64": 0.1}, instance="i2", model_version="m2")
        add_cycle(s, at(-1), {"64": 0.1}, instance="i1", model_version="m2")
        fire(s, at(0), RECOMPILES, {"instance": "i1"})
        fire(s, at(1), RECOMPILES, {"instance": "i2"})
        assert [(i.instances, i.cohorts) for i in incidents(s)] == [
            (["i1"], ["m2/c1"]), (["i2"], [])]


def test_every_shipped_rule_is_labelled_with_a_family(
        sessionmaker: sessionmaker[Session]) -> None:
    """Each rule of alerts/rules.yaml, its alert as the lifecycle writes it: none is "other"."""
    shipped = load_rules()
    with sessionmaker.begin() as s:
        life = Lifecycle(s, at(0), per_alert=False)
        for rule in shipped:
            labels = {k: "x" for k in rule.per}
            life.apply(rule, RuleResult(rule.name, labels, 1.0, 1.5, 0.5, 0.15, False,
                                        "pending", breaching=True, severity=rule.severity),
                       None)
        got = {a.rule: family(a) for a in open_alerts(s).values()}
    assert sorted(got) == sorted(r.name for r in shipped)
    assert {name: f for name, f in got.items() if f == "other"} == {}
    assert got["overbatching"] == got["step_throughput_drop"] == "batching"
    assert got["queue_wait_share"] == "load"  # queueing: the probable cause reads it as load
