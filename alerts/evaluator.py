"""The scheduled evaluation: every rule, every scope, one call with an injected clock.

    report = evaluate_split(sessions, config, now)  # AlertsConfig or EvaluationOptions

Two phases: `score` reads every rule's window and computes the baselines in a read-only
transaction (on SQLite no write lock, so the serving process keeps writing meanwhile);
`record` then stores the baselines and judges, moves alerts, groups incidents and applies
the policy in one short write transaction, from the alerts as stored then.
`evaluate(session, config, now)` runs both in the caller's transaction.

Reads baselines and per-cycle series, moves alerts (`alerts.lifecycle`), groups the
alerts that fired or resolved into incidents (`alerts.incidents`) and queues one
notification per incident in the same transaction, then lets the auto-fallback policy
act on the alerts now firing (per alert: an incident links the flag changes its members
caused). One rule failing (bad data) is reported and does not stop the others.

Cost: every rule's window is planned first, so each row kind is read once per evaluation
and sliced per rule (`alerts.series.RowCache`); what every rule needs (stored baselines,
chunked hours, resolved alerts) is read once too. The reads of a steady evaluation do not
grow with the rules or scopes (tests/alerts/test_evaluator_cost.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session, sessionmaker

from alerts import rollout
from alerts.baselines import BaselineConfig, BaselineWrites, CohortBaseline, baselines_for_rule
from alerts.cohorts import ServingCohorts, judge
from alerts.incidents import SERVING_LOOKBACK_S, IncidentConfig, IncidentReport, group
from alerts.lifecycle import Lifecycle, Transition, detector_start, fingerprint, open_alerts
from alerts.rules import Point, Rule, RuleResult
from alerts.series import Labels, RowCache, cohort_series, plan_rules
from alerts.webhooks import WebhookTarget
from storage.db import reading
from storage.models import Alert
from storage.queries.alerts import last_resolved_fired_by_rule
from storage.queries.instances import last_seen
from storage.queries.series import Cohort

if TYPE_CHECKING:
    from alerts.config import AlertsConfig
    from alerts.policy import Policy, PolicyAction

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvaluationReport:
    """What one evaluation saw and did."""

    at: datetime
    results: tuple[RuleResult, ...] = ()
    transitions: tuple[Transition, ...] = ()
    notifications: int = 0
    errors: tuple[str, ...] = ()
    actions: tuple[PolicyAction, ...] = field(default_factory=tuple)
    rows_read: int = 0  # measurement rows loaded: bounded by the windows read, not by history
    incidents: IncidentReport = field(default_factory=IncidentReport)

    @property
    def firing(self) -> list[RuleResult]:
        """Return the results that confirmed a change."""
        return [r for r in self.results if r.fired]


def _seen(session: Session, now: datetime, stale_after_s: float | None) -> dict[str, datetime]:
    """Return instance -> its newest row within twice the stale limit (read once)."""
    if stale_after_s is None:
        return {}
    # Look back a little further than the limit: older rows are just as stale.
    return last_seen(session, now - timedelta(seconds=2 * stale_after_s))


def _stale_instances(seen: Mapping[str, datetime], now: datetime,
                     stale_after_s: float | None) -> Callable[[str | None], bool]:
    """Return a test: has this instance written nothing for stale_after_s (None: never)?"""
    if stale_after_s is None:
        return lambda instance: False
    limit = now - timedelta(seconds=stale_after_s)
    return lambda instance: instance is not None and (
        instance not in seen or seen[instance] < limit)


def _retire_stale(seen: Mapping[str, datetime], life: Lifecycle, alerts: Iterable[Alert],
                  now: datetime, stale_after_s: float) -> list[Transition]:
    """Resolve open alerts of instances that stopped reporting (reason "stale ...")."""
    mine = [a for a in alerts if a.state != "resolved" and (a.labels or {}).get("instance")]
    limit = now - timedelta(seconds=stale_after_s)
    out = []
    for a in mine:
        inst = a.labels["instance"]
        at = seen.get(inst)
        if at is None or at < limit:
            since = f"since {at.isoformat()}" if at is not None else "within the limit"
            out.append(life.retire(a, f"stale: instance {inst} has not reported {since} "
                                      f"(stale_after_s {stale_after_s:g})"))
    return out


@dataclass(frozen=True)
class EvaluationOptions:
    """What one evaluation judges and where it sends what moved.

    stale_after_s: open alerts of an instance that has not reported for this long are
    resolved with reason "stale" (None: never).
    incidents: grouping window, hold and notification timings (None: the defaults).
    """

    rules: Sequence[Rule]
    targets: Sequence[WebhookTarget] = ()
    policy: Policy | None = None
    baseline_config: BaselineConfig | None = None
    external_url: str = ""
    resend_s: float = 120.0
    stale_after_s: float | None = None
    incidents: IncidentConfig | None = None

    @classmethod
    def of(cls, config: AlertsConfig) -> EvaluationOptions:
        """Return the options the loaded alerts config holds (the scheduled job's)."""
        return cls(rules=config.rules, targets=config.targets, policy=config.policy,
                   baseline_config=config.baselines, external_url=config.external_url,
                   resend_s=config.resend_s, stale_after_s=config.stale_after_s,
                   incidents=config.incidents)


def _own_samples(p: Point) -> int:
    """Return the samples cycle `p` measured itself (a pooled quantile's own, not its pool's)."""
    if p.value is None:
        return 0
    return p.fresh.count if p.fresh is not None else p.samples


def _last_own(per_cohort: Mapping[Cohort, Sequence[Point]]) -> datetime | None:
    """Return the start of the scope's newest cycle with samples of its own."""
    starts = [p.at for pts in per_cohort.values() for p in pts if _own_samples(p) > 0]
    return max(starts, default=None)


def series_gone(rule: Rule, labels: Labels, per_scope: Mapping[Labels, Mapping[Cohort,
                Sequence[Point]]], now: datetime) -> str | None:
    """Return why an open alert's series is gone, or None while it may still come back.

    A series that stops getting samples while the rule's other series (its instance's,
    where the rule is per instance) keep theirs has nothing left to judge: a canary whose
    engine stopped choosing a decoding mode, a bucket whose traffic stopped. No data is
    no recovery, so the alert would stay open (and keep its incident open) for ever;
    Prometheus resolves an alert whose series vanished, and so does this, once the series
    has been empty for `resolve_for` cycles, the cycles a recovery would have read. When
    every series is empty (a probe job down, no traffic at all) nothing is concluded.
    """
    step = timedelta(seconds=rule.window_s)
    recent = now - (rule.resolve_for + 1) * step  # + the cycle still running
    last = _last_own(per_scope.get(labels, {}))
    if last is not None and last >= recent:
        return None
    instance = dict(labels).get("instance")
    alive = [other for other, per_cohort in per_scope.items() if other != labels
             and (instance is None or dict(other).get("instance") == instance)
             and (seen := _last_own(per_cohort)) is not None and seen >= recent]
    if not alive:
        return None
    since = f"since the cycle of {last.isoformat()}" if last is not None else \
        "in the window"
    return (f"series gone: no samples of its own {since}, {rule.resolve_for} cycles, while "
            f"{len(alive)} other series of the rule reported; nothing left to judge")


def _retire_unconfigured(life: Lifecycle, alerts: Iterable[Alert],
                         rules: Sequence[Rule]) -> list[Transition]:
    """Resolve open alerts of rules that are no longer configured."""
    names = {r.name for r in rules} | {rollout.ROLLOUT_RULE}
    return [life.retire(a, f"rule {a.rule!r} is no longer configured")
            for a in alerts if a.rule not in names and a.state != "resolved"]


@dataclass
class Scoring:
    """What the read phase of one evaluation found, for its write phase (`record`).

    per_rule: rule -> (its series per scope and cohort, their baselines); failed rules are
    left out (their errors are in `errors`). writes: the baselines' rows, not stored yet.
    """

    at: datetime
    options: EvaluationOptions
    cache: RowCache
    seen: dict[str, datetime]
    per_rule: dict[str, tuple[Mapping[Labels, Mapping[Cohort, list[Point]]],
                              Mapping[Labels, Mapping[Cohort, CohortBaseline]]]]
    writes: BaselineWrites
    errors: list[str]


def score(
    session: Session,
    config: AlertsConfig | EvaluationOptions,
    now: datetime,
    *,
    settle: Mapping[str, float] | None = None,
) -> Scoring:
    """Read every rule's window and compute its baselines, writing nothing (the read phase).

    The long part of an evaluation (rows, chunks, baselines) runs here, so `session` may be
    a read-only one (`storage.db.reading`): on SQLite no write lock is held meanwhile.
    """
    if now.tzinfo is None:
        raise ValueError("now: must be timezone-aware")
    options = config if isinstance(config, EvaluationOptions) else EvaluationOptions.of(config)
    rules = options.rules
    baseline_config = options.baseline_config or BaselineConfig()
    cache = RowCache(session, settle)
    # One read per row kind for every rule's window (then sliced in memory per rule).
    plan_rules(cache, rules, now)
    # A stale instance cannot be judged: its sliding series (trailing-hour counts) would
    # keep showing its last hour and re-open the alert that went stale.
    seen = _seen(session, now, options.stale_after_s)
    scoring = Scoring(at=now, options=options, cache=cache, seen=seen, per_rule={},
                      writes=BaselineWrites(), errors=[])
    for rule in rules:
        writes = BaselineWrites()
        try:
            # A savepoint: on PostgreSQL a failed statement would abort the transaction.
            with session.begin_nested():
                start = now - timedelta(seconds=rule.window_s * rule.lookback_cycles)
                # Per cohort (model_version, config_hash): a rollout keeps detection on.
                per_scope = cohort_series(rule, cache, start, now)
                base = baselines_for_rule(session, rule, list(rules), now, cache,
                                          {k: list(v) for k, v in per_scope.items()},
                                          baseline_config, writes)
        except Exception as e:  # noqa: BLE001 - one bad rule must not silence the rest
            log.exception("rule %s failed", rule.name)
            cache.forget()  # its savepoint rolled back: re-read what the next rules share
            scoring.errors.append(f"{rule.name}: {type(e).__name__}: {e}")
            continue
        scoring.writes.extend(writes)
        scoring.per_rule[rule.name] = (per_scope, base)
    return scoring


def record(session: Session, scoring: Scoring, *, actor: str = "policy") -> EvaluationReport:
    """Store the baselines, judge every scope, move alerts, group incidents, apply the
    policy (the write phase: short, everything slow was computed by `score`).

    Alerts and their last resolution are read here, in the write transaction, so a rule
    is judged and its alert moved from the stored state, never from the read phase's.
    """
    options, now, cache = scoring.options, scoring.at, scoring.cache
    rules, stale_after_s = options.rules, options.stale_after_s
    cache.session = session  # rows already read stay; later reads (rollout) use this one
    scoring.writes.apply(session)
    alerts = open_alerts(session)
    life = Lifecycle(session, now, options.targets, external_url=options.external_url,
                     resend_s=options.resend_s, per_alert=False)
    results: list[RuleResult] = []
    transitions: list[Transition] = []
    errors = list(scoring.errors)
    stale = _stale_instances(scoring.seen, now, stale_after_s)
    # Alerts only move for their own rule below: one read serves every rule.
    resolved_by_rule = last_resolved_fired_by_rule(session, [r.name for r in rules])
    for rule in rules:
        if rule.name not in scoring.per_rule:
            continue  # failed in the read phase (its error is reported)
        per_scope, base = scoring.per_rule[rule.name]
        try:
            with session.begin_nested():
                scopes = set(per_scope)
                scopes |= {tuple((k, a.labels.get(k, "")) for k in rule.per)
                           for a in alerts.values() if a.rule == rule.name}
                resolved = resolved_by_rule.get(rule.name, {})
                for labels in sorted(scopes):
                    if stale(dict(labels).get("instance")):
                        continue
                    fp = fingerprint(rule.name, dict(labels))
                    since = detector_start(alerts.get(fp), resolved.get(fp), rule.window_s)
                    r = judge(rule, dict(labels), per_scope.get(labels, {}),
                              base.get(labels, {}), since)
                    results.append(r)
                    gone = series_gone(rule, labels, per_scope, now) \
                        if r.no_data and fp in alerts else None
                    if gone is not None:
                        transitions.append(life.retire(alerts[fp], gone))
                        continue
                    transitions += life.apply(rule, r, alerts.get(fp))
        except Exception as e:  # noqa: BLE001 - one bad rule must not silence the rest
            log.exception("rule %s failed", rule.name)
            errors.append(f"{rule.name}: {type(e).__name__}: {e}")
    # The cohort each instance serves, read once for the rollout check (its window) and
    # the incidents (an hour): the shorter lookback's answer is the longer read's.
    serving = ServingCohorts(session, now, SERVING_LOOKBACK_S)
    try:
        with session.begin_nested():
            _, moved = rollout.check(session, rules, now, cache, life, alerts,
                                     serving=serving)
            transitions += moved
    except Exception as e:  # noqa: BLE001 - the rollout check must not silence the rules
        log.exception("rollout check failed")
        errors.append(f"{rollout.ROLLOUT_RULE}: {type(e).__name__}: {e}")
    # The series and their rows are read no further: drop them before the incidents and
    # the policy read theirs.
    cache.release()
    transitions += _retire_unconfigured(life, alerts.values(), rules)
    if stale_after_s is not None:
        transitions += _retire_stale(scoring.seen, life, alerts.values(), now, stale_after_s)
    # Not in a savepoint: an incident that failed to form would lose its members' pages,
    # so a failure here fails the evaluation and the transaction (retried next cycle).
    grouped = group(session, now, life, options.incidents, serving)
    actions: list[PolicyAction] = []
    if options.policy is not None:
        actions = options.policy.apply(session, now, actor=actor)
    return EvaluationReport(at=now, results=tuple(results), transitions=tuple(transitions),
                            notifications=life.notifications, errors=tuple(errors),
                            actions=tuple(actions), rows_read=cache.rows_read,
                            incidents=grouped)


def evaluate(
    session: Session,
    config: AlertsConfig | EvaluationOptions,
    now: datetime,
    *,
    settle: Mapping[str, float] | None = None,
    actor: str = "policy",
) -> EvaluationReport:
    """Evaluate the rules at `now` in one transaction: `score`, then `record`.

    config: the loaded alerts config, or the options of one evaluation.
    settle: row kind ("traffic", ...) -> seconds after a cycle's end before it is judged
    (its rows still arriving; alerts.series.RowCache).
    """
    return record(session, score(session, config, now, settle=settle), actor=actor)


def evaluate_split(
    sessions: sessionmaker[Session],
    config: AlertsConfig | EvaluationOptions,
    now: datetime,
    *,
    settle: Mapping[str, float] | None = None,
    actor: str = "policy",
    scored: Callable[[Scoring], None] = lambda scoring: None,
) -> EvaluationReport:
    """Evaluate the rules at `now` as the scheduled job does: `score` in a read-only
    transaction, then `record` in a short write transaction.

    On SQLite every write transaction takes the database's one write lock: reading and
    computing under it would make every other writer (probe rows, traffic, flag changes)
    wait for as long as the evaluation computes. `scored` is called between the two
    phases, the read transaction still open (tests synchronise on it).
    """
    with reading(sessions) as session:
        scoring = score(session, config, now, settle=settle)
        scored(scoring)
    with sessions.begin() as session:
        return record(session, scoring, actor=actor)
