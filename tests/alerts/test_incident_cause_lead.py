"""The cause's window opens at the start of the rule cycle that breached, on the service's
own schedule, and the A/B pairs count by when their cycle finished.

The incident config is the one the service builds at start-up (`monitor.alerting.
load_alerts`); cycles are written by the production probe sink, the alerts move through
the production Lifecycle and `alerts.incidents.group` measures the cause, as an
evaluation does. Where the evaluation judges a rule's latest cycle is read from the
production series (`alerts.series.series`), not restated here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime, timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from alerts.cause import CauseConfig, window_start
from alerts.incidents import IncidentConfig, group
from alerts.lifecycle import Lifecycle, fingerprint, open_alerts
from alerts.rollout import ROLLOUT_RULE
from alerts.rule_file import parse_rule
from alerts.rules import RuleResult
from alerts.series import RowCache, judged_cycle, series
from monitor.alerting import load_alerts
from monitor.settings import get_settings
from probes.cycle import CycleResult, PromptPair
from probes.sink import add_cycle
from storage.models import Incident
from tests.alerts.test_incident_cause import ACCEPT, BUCKETS, P99, PROMPTS, T0, VARIANTS, arm

HOST = {"optimized": 2.12, "eager": 2.08, "direct": 2.08}
# An optimization regressed: the optimized arm 30% slower, the reference arms not.
OPTIMIZATION = {"optimized": 1.30}
TAKES = timedelta(seconds=40)  # each probe cycle, well inside the cycle timeout
BURST = parse_rule({"name": "burst_p99_regression", "metric": "burst_p99", "change": "+20%",
                    "source": "burst", "window": "15m"})
MEMORY = parse_rule({"name": "memory_growth", "metric": "memory_growth", "change": "+50%",
                     "per": ["instance"], "window": "10m"})


def cycle(s: Session, t: datetime, slow: Mapping[str, float], *, ab: bool = True) -> None:
    """Write the cycle started at `t` (finished TAKES later): every arm and its prompt
    pairs where `ab`."""
    variants = VARIANTS if ab else VARIANTS[:1]
    groups = tuple(arm(b, v, p * slow.get(v, 1.0)) for b, p in BUCKETS.items() for v in variants)
    pairs = tuple(PromptPair(b, f"{b}{name}", VARIANTS,
                             {v: p * f * slow.get(v, 1.0) for v in VARIANTS})
                  for b, p in BUCKETS.items() for name, f in PROMPTS.items()) if ab else ()
    add_cycle(s, CycleResult(suite="in_domain", instance_id="i1", started_at=t,
                             finished_at=t + TAKES, status="ok", ab=ab, groups=groups,
                             pairs=pairs, model_version="m1", config_hash="c1"))


def incident(s: Session, config: IncidentConfig, pending: datetime,
             fired: datetime) -> Incident:
    """Page every bucket's p99 (pending at `pending`, fired at `fired`), group, return it."""
    members = [(P99, {"bucket": b}) for b in BUCKETS]
    life = Lifecycle(s, pending, per_alert=False)
    for rule, labels in members:
        life.apply(rule, RuleResult(rule.name, labels, 1.0, 1.5, 0.5, 0.15, False, "pending",
                                    breaching=True, severity=rule.severity), None)
    life = Lifecycle(s, fired, per_alert=False)
    for rule, labels in members:
        life.apply(rule, RuleResult(rule.name, labels, 1.0, 2.0, 1.0, 0.15, True, "fired",
                                    breaching=True, severity=rule.severity),
                   open_alerts(s)[fingerprint(rule.name, labels)])
    group(s, fired, life, config)
    return s.scalars(select(Incident)).one()


def service_config(**scheduler: float) -> IncidentConfig:
    """Return the incident config a service on `scheduler` settings builds at start-up."""
    return load_alerts(get_settings(scheduler=scheduler)).incidents


def during(inc: Incident, arm_name: str = "eager", bucket: str = "64") -> tuple[int, int]:
    """Return (cycles, pairs) of one reference arm's speedup during the incident."""
    side = inc.evidence["paired"][arm_name][bucket]["during"]
    return side["cycles"], side["pairs"]


# An evaluation at `now` judges the rule's latest settled cycle: its start, as the
# production series ends (late in the evaluation's interval, on the grid, with a settle).
@pytest.mark.parametrize(("now_s", "settle_s"), [(50, 0.0), (0, 0.0), (110, 0.0), (50, 20.0),
                                                 (10, 20.0)])
def test_the_judged_cycle_is_the_last_point_of_the_production_series(
        sessionmaker: sessionmaker[Session], now_s: float, settle_s: float) -> None:
    now = T0 + timedelta(minutes=63, seconds=now_s)
    settle = {"canary": settle_s}
    with sessionmaker.begin() as s:
        for minute in range(55, 66):
            cycle(s, T0 + timedelta(minutes=minute), {}, ab=False)
        points = series(P99, RowCache(s, settle), now - timedelta(minutes=5), now)
        last = {pts[-1].at for pts in points.values()}
    assert last == {judged_cycle(P99, settle, now)}


def test_the_breaching_cycle_is_in_the_window_when_the_evaluation_ran_late(
        sessionmaker: sessionmaker[Session]) -> None:
    # Probe cycles every two minutes: the A/B cycle started at 62 is the first slowed; its
    # rows finished in the rule cycle [62, 63), which the evaluation 50 s after that one
    # ended judged: the alert went pending 110 s after the cycle started.
    breached = T0 + timedelta(minutes=62)
    pending = breached + timedelta(seconds=110)
    config = service_config(probe_interval_s=120.0, evaluate_interval_s=60.0)
    with sessionmaker.begin() as s:
        for minute in range(0, 60, 2):
            cycle(s, T0 + timedelta(minutes=minute), {})
        cycle(s, T0 + timedelta(minutes=60), {}, ab=False)
        cycle(s, breached, HOST)
        cycle(s, T0 + timedelta(minutes=64), HOST, ab=False)
        inc = incident(s, config, pending, pending + timedelta(minutes=1))
        assert datetime.fromisoformat(inc.evidence["window_start"]) == breached
        assert inc.cause == "host_or_load"
        # The breaching cycle's pairs are the incident's: the one A/B cycle during it.
        assert during(inc) == during(inc, "direct") == (1, len(PROMPTS))


def test_a_minute_of_lead_misses_that_cycle(sessionmaker: sessionmaker[Session]) -> None:
    # The library default, no rules known: a minute before the alert went pending, after
    # the breaching cycle started (62): it falls between the baseline and the window.
    pending = T0 + timedelta(minutes=63, seconds=50)
    with sessionmaker.begin() as s:
        for minute in range(0, 60, 2):
            cycle(s, T0 + timedelta(minutes=minute), {})
        cycle(s, T0 + timedelta(minutes=62), HOST)
        cycle(s, T0 + timedelta(minutes=64), HOST, ab=False)
        inc = incident(s, IncidentConfig(), pending, pending + timedelta(minutes=1))
        assert datetime.fromisoformat(inc.evidence["window_start"]) > T0 + timedelta(minutes=62)
        assert inc.cause == "unknown"
        assert "no reference arm in the window yet" in inc.cause_text


def minute_cycles(s: Session, offset: timedelta, change: int, slow: Mapping[str, float],
                  until: datetime) -> None:
    """Write an A/B cycle a minute, each started `offset` into its minute, those finished
    by `until` (a cycle's rows are stored when it finishes); those from minute `change` on
    are slowed by `slow`."""
    minute = 0
    while (t := T0 + timedelta(minutes=minute) + offset) + TAKES <= until:
        cycle(s, t, slow if minute >= change else {})
        minute += 1


def test_cycles_that_finished_before_the_breaching_rule_cycle_are_not_during(
        sessionmaker: sessionmaker[Session]) -> None:
    # The shipped one-minute cycles: the optimization regressed from the cycle started at
    # 62; its rows finished in the rule cycle [62, 63), judged at 63:10. The bound of
    # before (260 s of lead) opened the window at 58:50: the cycles of 59, 60 and 61,
    # unchanged, counted as during and halved the change the cause compares.
    pending, fired = T0 + timedelta(minutes=63, seconds=10), T0 + timedelta(minutes=65,
                                                                            seconds=10)
    config = service_config()
    bound = replace(config, cause=replace(config.cause, rules=(), lead_s=260.0))
    for incidents, start, cycles, optimized in (
            (config, T0 + timedelta(minutes=62), 3, 0.30),
            (bound, pending - timedelta(seconds=260), 6, 0.15)):
        with sessionmaker.begin() as s:
            minute_cycles(s, timedelta(0), 62, OPTIMIZATION, fired)
            inc = incident(s, incidents, pending, fired)
            assert datetime.fromisoformat(inc.evidence["window_start"]) == start
            # 62, 63 and 64 (65 has not finished); the bound adds 59, 60 and 61.
            assert during(inc)[0] == cycles
            assert inc.evidence["arms"]["optimized"] == pytest.approx(optimized, abs=0.005)
            if incidents is config:
                # The whole change: the optimized arm +30%, the reference arms unchanged.
                assert inc.cause_text.startswith("optimization regressed (optimized +30%")
            else:
                assert inc.cause == "unknown"
            s.rollback()  # the next config reads the same cycles afresh


def test_a_cycle_that_started_before_the_rule_cycle_and_finished_in_it_is_during(
        sessionmaker: sessionmaker[Session]) -> None:
    # Cycles start 50 s into each minute and take 40 s: the first slowed one started at
    # 61:50, finished at 62:30, in the rule cycle [62, 63) that breached.
    pending, fired = T0 + timedelta(minutes=63, seconds=10), T0 + timedelta(minutes=65,
                                                                            seconds=10)
    with sessionmaker.begin() as s:
        minute_cycles(s, timedelta(seconds=50), 61, HOST, fired)
        inc = incident(s, service_config(), pending, fired)
        assert datetime.fromisoformat(inc.evidence["window_start"]) == T0 + timedelta(minutes=62)
        # 61:50, 62:50 and 63:50 (finished 64:30); by their start the first was before.
        assert during(inc) == (3, 3 * len(PROMPTS))
        assert inc.cause == "host_or_load"


def test_the_window_opens_at_the_earliest_breaching_cycle_of_the_members() -> None:
    config = CauseConfig(rules=(P99, ACCEPT, BURST, MEMORY), settle={"traffic": 20.0},
                         lead_s=140.0)
    at = T0 + timedelta(minutes=63, seconds=10)
    # A canary minute judged at 63:10 is [62, 63); a traffic minute settles 20 s
    # later: [61, 62), the earlier one.
    assert window_start([(P99.name, at)], config) == T0 + timedelta(minutes=62)
    assert window_start([(P99.name, at), (ACCEPT.name, at)], config) == T0 + timedelta(
        minutes=61)
    # A burst's quarter hour, a sliding hour and the rollout check's half hour say
    # little of when the change began: left out.
    later = at + timedelta(minutes=2)
    assert window_start([(P99.name, later), (BURST.name, at), (MEMORY.name, at),
                         (ROLLOUT_RULE, at)], config) == T0 + timedelta(minutes=64)
    # A rule not configured: `lead_s` before it went pending; so are members of none but
    # the rules left out.
    assert window_start([(P99.name, later), ("gone", at)], config) == at - timedelta(
        seconds=140)
    assert window_start([(BURST.name, at)], config) == at - timedelta(seconds=140)
