"""The probable cause, measured from A/B cycles written by the production probe sink.

Canary cycles are CycleResult values (groups and, on A/B cycles, the prompt pairs) stored
through `probes.sink.add_cycle` (as the prober stores them); the incident's cause is read
back by `alerts.cause.measure` from the evaluation's grouping and stored on the incident
with its evidence.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from alerts.cause import Scope, classify
from alerts.incidents import IncidentConfig, awaits_evidence, group
from alerts.lifecycle import Lifecycle, fingerprint, open_alerts
from alerts.rule_file import parse_rule
from alerts.rules import Rule, RuleResult
from probes.cycle import CycleResult, PromptPair
from probes.measure import GroupResult
from probes.sink import add_cycle
from probes.stats import Distribution
from storage.models import Incident

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
BUCKETS = {"32": 0.20, "64": 0.30, "128": 0.45}
P99 = parse_rule({"name": "p99_latency_regression", "metric": "p99_latency", "change": "+15%",
                  "severity": "page"})
ACCEPT = parse_rule({"name": "acceptance_drop", "metric": "acceptance_rate", "change": "-20%",
                     "source": "traffic", "severity": "page"})


def arm(bucket: str, variant: str, p50: float) -> GroupResult:
    """One canary group of 4 requests around `p50` seconds."""
    lat = [p50 * f for f in (0.95, 1.0, 1.0, 1.1)]
    return GroupResult(bucket=bucket, path="compiled" if variant != "eager" else "eager",
                       decoding="speculative" if variant != "direct" else "direct",
                       variant=variant, requests=4, latency=Distribution.of(lat),
                       ttft=Distribution.of([x / 4 for x in lat]),
                       per_token=Distribution.of([x / 40 for x in lat]),
                       queue_wait=Distribution.of([0.0] * 4),
                       input_tokens=Distribution.of([10.0] * 4), padded_length=16,
                       padding_waste=0.1, output_tokens=160)


VARIANTS = ("optimized", "eager", "direct")
# Per-prompt latency around the bucket's p50: each arm of a prompt shares its factor.
PROMPTS = {"a": 0.95, "b": 1.0, "c": 1.1}


def cycles(s: Session, start: int, end: int, slow: Mapping[str, float], *,
           instance: str = "i1", pairs: Mapping[str, float] | None = None) -> None:
    """Write one A/B cycle per minute in [start, end): variant -> slowdown factor.

    pairs: the slowdowns the prompt pairs show (default `slow`): a test may make the
    pairs disagree with the groups to show which one the cause reads.
    """
    paired = slow if pairs is None else pairs
    for i in range(start, end):
        t = T0 + timedelta(minutes=i)
        groups = tuple(arm(b, v, p * slow.get(v, 1.0))
                       for b, p in BUCKETS.items() for v in VARIANTS)
        prompt_pairs = tuple(
            PromptPair(b, f"{b}{name}", VARIANTS,
                       {v: p * f * paired.get(v, 1.0) for v in VARIANTS})
            for b, p in BUCKETS.items() for name, f in PROMPTS.items())
        add_cycle(s, CycleResult(suite="in_domain", instance_id=instance, started_at=t,
                                 finished_at=t + timedelta(seconds=20), status="ok", ab=True,
                                 groups=groups, pairs=prompt_pairs, model_version="m1",
                                 config_hash="c1"))


def incident_after(s: Session, fired: list[tuple[Rule, dict[str, str]]]) -> Incident:
    """Fire `fired` at minute 70 (pending since 64) through the lifecycle, group, return it."""
    pend, now = T0 + timedelta(minutes=64), T0 + timedelta(minutes=70)
    for rule, labels in fired:
        life = Lifecycle(s, pend, per_alert=False)
        life.apply(rule, RuleResult(rule.name, labels, 1.0, 1.5, 0.5, 0.15, False, "pending",
                                    breaching=True, severity=rule.severity), None)
    life = Lifecycle(s, now, per_alert=False)
    for rule, labels in fired:
        life.apply(rule, RuleResult(rule.name, labels, 1.0, 2.0, 1.0, 0.15, True, "fired",
                                    breaching=True, severity=rule.severity),
                   open_alerts(s)[fingerprint(rule.name, labels)])
    group(s, now, life, IncidentConfig())
    return s.scalars(select(Incident)).one()


def test_host_or_load_when_the_optimized_and_reference_arms_slow_alike(
        sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        cycles(s, 0, 64, {})
        cycles(s, 64, 71, {"optimized": 2.12, "eager": 2.08, "direct": 2.08})
        inc = incident_after(s, [(P99, {"bucket": b}) for b in BUCKETS])
        assert inc.cause == "host_or_load"
        assert inc.cause_text == ("host or load (optimized and eager/direct arms slowed alike: "
                                  "+112% / +108%)")
        assert inc.evidence["arms"]["optimized"] == pytest.approx(1.12, abs=0.005)
        assert inc.evidence["arms"]["eager"] == pytest.approx(1.08, abs=0.005)
        # The reference arm's change is read through its paired speedup per bucket:
        # eager / optimized was 1.0 the hour before (3 prompts x the 58 cycles up to the
        # edge, minute 58) and 2.08 / 2.12 during the incident (minutes 63, a cycle before
        # the alert went pending and not yet slowed, to 69: 3 prompts x 7 cycles).
        paired = inc.evidence["paired"]["eager"]["64"]
        assert paired["before"] == {"speedup": 1.0, "pairs": 174, "cycles": 58,
                                    "ci95": [1.0, 1.0]}
        assert paired["during"]["speedup"] == pytest.approx(2.08 / 2.12, abs=1e-4)
        assert (paired["during"]["pairs"], paired["during"]["cycles"]) == (21, 7)
        assert "paired per prompt within a cycle" in inc.evidence["measured_by"]
        assert inc.summary.endswith("probable cause: " + inc.cause_text)
        assert "3 buckets (128, 32, 64)" in inc.summary


def test_optimization_regressed_when_only_the_optimized_arm_slows(
        sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        cycles(s, 0, 64, {})
        cycles(s, 64, 71, {"optimized": 1.80, "eager": 1.02, "direct": 1.02})
        inc = incident_after(s, [(P99, {"bucket": "64"})])
        assert inc.cause == "optimization"
        # Every pair of a cycle reads the same ratio here: the interval is that ratio.
        assert inc.cause_text == ("optimization regressed (optimized +80%, eager/direct +2%, "
                                  "95% CI up to +2%)")
        assert inc.evidence["buckets_read"] == ["64"]
        assert inc.evidence["arms_ci95_high"]["eager"] == pytest.approx(0.02, abs=0.005)


def test_the_reference_arms_are_read_from_the_prompt_pairs_not_the_cycle_groups(
        sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        cycles(s, 0, 64, {})
        # The cycle's groups say every arm slowed alike; the pairs, each prompt's requests
        # back to back, say only the optimized one did: the pairs decide.
        cycles(s, 64, 71, {"optimized": 1.8, "eager": 1.8, "direct": 1.8},
               pairs={"optimized": 1.8, "eager": 1.0, "direct": 1.0})
        inc = incident_after(s, [(P99, {"bucket": "64"})])
        assert inc.cause == "optimization"
        assert inc.evidence["paired"]["direct"]["64"]["during"]["speedup"] == pytest.approx(
            1 / 1.8, abs=1e-4)


def test_one_instance_when_the_other_replicas_did_not_slow(
        sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        for name in ("i1", "i2", "i3"):
            cycles(s, 0, 64, {}, instance=name)
            cycles(s, 64, 71, {"optimized": 1.9, "eager": 1.9, "direct": 1.9} if name == "i2"
                   else {}, instance=name)
        inc = incident_after(s, [(P99, {"bucket": "64"})])
        assert inc.cause == "one_instance"
        assert inc.cause_text.startswith("one instance (2 of 3 replicas unaffected")
        assert inc.evidence["instances"]["i2"] == pytest.approx(0.9, abs=0.01)


def test_one_buckets_traffic_when_the_arms_did_not_move(
        sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        cycles(s, 0, 71, {})
        inc = incident_after(s, [(ACCEPT, {"bucket": "32"})])
        assert inc.cause == "one_bucket"
        assert inc.cause_text == "one bucket's traffic (acceptance in bucket 32 only)"
        assert inc.families == ["speculation"]


def test_one_canary_bucket_without_pairs_awaits_the_arms_not_traffic(
        sessionmaker: sessionmaker[Session]) -> None:
    """A canary latency rule in one bucket, the optimized p50 not risen there and no A/B
    pair during the incident: traffic and an optimization read the same. Unknown, with no
    pairs in the evidence, so the first page waits for the arms (alerts.incidents)."""
    with sessionmaker.begin() as s:
        cycles(s, 0, 63, {})
        optimized_only(s, 63, 71, 1.0)
        inc = incident_after(s, [(P99, {"bucket": "64"})])
        assert inc.cause == "unknown"
        assert inc.cause_text.startswith(
            "unknown (latency in bucket 64 only: its traffic or an optimization, not told "
            "apart before an A/B pair runs there; no optimization slowed: optimized p50 +0%")
        assert not inc.evidence["paired"]
        assert awaits_evidence(inc.cause, inc.evidence)


def test_one_canary_bucket_with_no_canary_row_during_it_awaits_the_arms(
        sessionmaker: sessionmaker[Session]) -> None:
    """The first evaluation of a slowdown can read no cycle in the incident's window (the
    cycle that breached started before it): nothing measured, nothing stated."""
    with sessionmaker.begin() as s:
        cycles(s, 0, 62, {})
        inc = incident_after(s, [(P99, {"bucket": "64"})])
        assert inc.cause == "unknown"
        assert "nothing measured on both sides" in inc.cause_text
        assert awaits_evidence(inc.cause, inc.evidence)


def test_one_canary_bucket_whose_speedup_fell_is_no_traffic(
        sessionmaker: sessionmaker[Session]) -> None:
    """The optimized canaries' p50 rose under `slowed`, but paired with the reference arms
    it lost ground (an optimization's tail): measured, not one bucket's traffic."""
    with sessionmaker.begin() as s:
        cycles(s, 0, 63, {})
        cycles(s, 63, 71, {"optimized": 1.05}, pairs={"optimized": 1.3})
        inc = incident_after(s, [(P99, {"bucket": "64"})])
        assert inc.cause == "unknown"
        assert inc.cause_text == (
            "unknown (latency in bucket 64 only; a speedup fell, the optimized arm did not "
            "slow (arm speedups: eager 1.00x -> 0.77x over 21 pairs, direct 1.00x -> 0.77x "
            "over 21 pairs; optimized p50 +5%); down to -23% within its 95% CI: traffic or "
            "optimization not told apart)")
        assert not awaits_evidence(inc.cause, inc.evidence)


def test_one_canary_bucket_with_too_few_pairs_says_so(
        sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        cycles(s, 0, 63, {})
        optimized_only(s, 63, 69, 1.0)
        cycles(s, 69, 70, {})  # one A/B cycle: 3 pairs in bucket 64
        inc = incident_after(s, [(P99, {"bucket": "64"})])
        assert inc.cause == "unknown"
        assert inc.cause_text.startswith(
            "unknown (latency in bucket 64 only; needs more A/B pairs: 3 in the incident's "
            "window, 6 in a bucket give a 95% confidence interval;")
        assert awaits_evidence(inc.cause, inc.evidence)  # the next A/B cycle may settle it


def test_one_canary_bucket_whose_speedups_held_is_one_buckets_traffic(
        sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        cycles(s, 0, 71, {})
        inc = incident_after(s, [(P99, {"bucket": "64"})])
        assert inc.cause == "one_bucket"
        assert inc.cause_text == (
            "one bucket's traffic (latency in bucket 64 only; arm speedups held: eager 1.00x "
            "-> 1.00x over 21 pairs, direct 1.00x -> 1.00x over 21 pairs, 95% CI down to +0%)")


def test_real_traffic_in_one_bucket_needs_a_canary_cycle_during_it(
        sessionmaker: sessionmaker[Session]) -> None:
    """Real traffic's acceptance fell in one bucket; no canary cycle ran during the
    incident to say the same prompts did not change: not stated yet."""
    with sessionmaker.begin() as s:
        cycles(s, 0, 62, {})
        inc = incident_after(s, [(ACCEPT, {"bucket": "32"})])
        assert inc.cause == "unknown"
        assert inc.cause_text.startswith(
            "unknown (acceptance in bucket 32 only: its traffic or an optimization, not told "
            "apart before a canary cycle runs there;")
        assert awaits_evidence(inc.cause, inc.evidence)


@pytest.mark.parametrize(("sources", "kind"), [
    (("traffic",), "one_bucket"), (("canary",), "unknown"), (("canary", "traffic"), "unknown"),
    ((), "unknown")])
def test_only_real_traffic_members_alone_make_one_buckets_traffic_without_pairs(
        sources: tuple[str, ...], kind: str) -> None:
    """The canaries' optimized arm measured, not slowed, no A/B pair: one bucket's traffic
    only where every member observed real traffic (a canary member, or one whose source is
    not known, needs the pairs)."""
    cause = classify(Scope(("64",), (), ("latency",), sources), {"optimized": 0.02}, {})
    assert cause.kind == kind


def optimized_only(s: Session, start: int, end: int, slow: float) -> None:
    """Write one canary cycle per minute in [start, end) without A/B arms (no pairs)."""
    for i in range(start, end):
        t = T0 + timedelta(minutes=i)
        add_cycle(s, CycleResult(
            suite="in_domain", instance_id="i1", started_at=t,
            finished_at=t + timedelta(seconds=20), status="ok",
            groups=tuple(arm(b, "optimized", p * slow) for b, p in BUCKETS.items())))


def test_an_optimization_is_blamed_only_once_the_pairs_confidence_interval_says_so(
        sessionmaker: sessionmaker[Session]) -> None:
    """Under 6 pairs a median speedup has no 95% confidence interval: the cause waits for
    more pairs rather than guessing; with them, the interval's upper end must fall short
    of "slowed alike"."""
    with sessionmaker.begin() as s:
        cycles(s, 0, 63, {})
        optimized_only(s, 63, 69, 1.8)
        # One A/B cycle in the incident's window: 3 pairs in bucket 64.
        cycles(s, 69, 70, {"optimized": 1.80, "eager": 1.02, "direct": 1.02})
        inc = incident_after(s, [(P99, {"bucket": "64"})])
        assert inc.cause == "unknown"
        assert inc.cause_text == (
            "unknown (optimized +80%, eager/direct +2%; needs more A/B pairs: 3 in the "
            "incident's window, 6 in a bucket give a 95% confidence interval)")
        # Two more A/B cycles: 9 pairs per arm, measured again while the incident is open.
        cycles(s, 70, 72, {"optimized": 1.80, "eager": 1.02, "direct": 1.02})
        group(s, T0 + timedelta(minutes=72), Lifecycle(s, T0 + timedelta(minutes=72),
                                                       per_alert=False), IncidentConfig())
        assert inc.cause == "optimization"
        assert inc.cause_text.endswith("95% CI up to +2%)")


def test_pairs_that_may_have_slowed_alike_are_no_optimization_regression(
        sessionmaker: sessionmaker[Session]) -> None:
    """The pairs' median says the reference arms held (an optimization), but the upper end
    of its 95% CI reaches "slowed alike" (a host): the cause says it cannot tell yet."""
    with sessionmaker.begin() as s:
        cycles(s, 0, 63, {})
        # 9 pairs where every arm slowed alike, then 12 where only the optimized one did.
        cycles(s, 63, 66, {"optimized": 1.8, "eager": 1.8, "direct": 1.8})
        cycles(s, 66, 70, {"optimized": 1.8, "eager": 1.0, "direct": 1.0})
        inc = incident_after(s, [(P99, {"bucket": "64"})])
        assert inc.cause == "unknown"
        assert inc.cause_text == ("unknown (optimized +80%, eager/direct +0% but up to +80% "
                                  "within its 95% CI: host or optimization not told apart yet)")
        assert inc.evidence["arms_ci95_high"]["direct"] == pytest.approx(0.8, abs=0.01)


QUEUE = parse_rule({"name": "queue_wait_share", "metric": "queue_wait_share",
                    "source": "traffic", "per": ["instance"], "change": "+50%",
                    "resolve_change": "+15%", "min_samples": 20, "ceiling": 0.5})


def test_a_queue_wait_alert_is_load_and_says_what_the_arms_showed(
        sessionmaker: sessionmaker[Session]) -> None:
    """Real traffic waiting behind the canaries' A/B arms: no arm slowed, and the cause is
    load (queueing), with the speedups it compared; not "no A/B arm rows"."""
    with sessionmaker.begin() as s:
        cycles(s, 0, 71, {})
        inc = incident_after(s, [(QUEUE, {"instance": "i1"})])
        assert inc.families == ["load"]
        assert inc.cause == "host_or_load"
        assert inc.cause_text == (
            "load (queueing: queue wait rose; no optimization slowed (arm speedups within "
            "band: eager 1.00x -> 1.00x over 63 pairs, direct 1.00x -> 1.00x over 63 pairs; "
            "optimized p50 +0%))")
        assert inc.evidence["rows"] > 0


def test_no_arm_slowed_over_several_buckets_says_what_was_compared(
        sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        cycles(s, 0, 71, {})
        inc = incident_after(s, [(P99, {"bucket": "32"}), (P99, {"bucket": "64"})])
        assert inc.cause == "unknown"
        assert inc.cause_text == (
            "unknown (no optimization slowed (arm speedups within band: eager 1.00x -> 1.00x "
            "over 42 pairs, direct 1.00x -> 1.00x over 42 pairs; optimized p50 +0%))")


def test_rows_on_one_side_only_are_counted_not_called_absent(
        sessionmaker: sessionmaker[Session]) -> None:
    """A service started minutes before the incident has A/B rows only in its window:
    the cause counts them rather than saying there were none."""
    with sessionmaker.begin() as s:
        cycles(s, 62, 71, {})
        inc = incident_after(s, [(P99, {"bucket": "32"}), (P99, {"bucket": "64"})])
        assert inc.cause == "unknown"
        assert inc.cause_text == (
            "unknown (optimized canary rows 0 before / 21 during, A/B pairs 0 before / 63 "
            "during the incident: nothing measured on both sides)")


def test_no_arm_rows_is_an_unknown_cause_that_says_so() -> None:
    cause = classify(Scope(("32", "64"), (), ("latency",)), {}, {})
    assert cause.kind == "unknown" and "no A/B arm rows" in cause.text


def test_a_cause_not_measurable_at_the_page_is_measured_while_the_incident_is_open(
        sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        cycles(s, 0, 63, {})
        # Only the optimized arm ran since the slowdown began (the A/B arms take a share
        # of the cycles): the page cannot say whether the host or the optimization. The
        # cycle of minute 63 breached first; the alert went pending at the next evaluation.
        for i in range(63, 71):
            t = T0 + timedelta(minutes=i)
            add_cycle(s, CycleResult(
                suite="in_domain", instance_id="i1", started_at=t,
                finished_at=t + timedelta(seconds=20), status="ok",
                groups=tuple(arm(b, "optimized", p * 2.0) for b, p in BUCKETS.items())))
        inc = incident_after(s, [(P99, {"bucket": "64"})])
        assert inc.cause == "unknown" and "no reference arm" in inc.cause_text
        cycles(s, 71, 72, {"optimized": 2.0, "eager": 2.0, "direct": 2.0})
        group(s, T0 + timedelta(minutes=72), Lifecycle(s, T0 + timedelta(minutes=72),
                                                       per_alert=False), IncidentConfig())
        assert inc.cause == "host_or_load"
