"""The alerts side of start-up: rules, policy and targets loaded, the webhook deliverer built."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session, sessionmaker

from monitor.hub import Seams
from monitor.settings import Settings

if TYPE_CHECKING:
    from alerts.cause import CauseConfig
    from alerts.config import AlertsConfig
    from alerts.outbox import Deliverer
    from alerts.rules import Rule

log = logging.getLogger(__name__)


def load_alerts(settings: Settings) -> AlertsConfig:
    """Return the alerts config whose targets carry this service's Prometheus labels."""
    from alerts.config import load_config
    from alerts.webhooks import source_labels, with_labels

    alerts = load_config(settings.alerts)  # bad rule, policy or webhook files fail here
    # Alerts carry service/job/instance as Prometheus labels the serving process's series
    # (the worker sends them too: they name the service, wherever evaluation ran).
    targets = with_labels(alerts.targets, source_labels(settings.api.host, settings.api.port))
    alerts = replace(alerts, targets=tuple(targets))
    if alerts.incidents.cause_wait_s > 0 and not runs_arms(settings):
        # No cycle ever runs an A/B arm: the cause the first page would wait for never
        # comes, so it pages at once instead of two cycles late.
        log.info("alerts.incidents.cause_wait_s: off (probes run no A/B arms)")
        alerts = replace(alerts, incidents=replace(alerts.incidents, cause_wait_s=0.0))
    cause = cause_config(settings, alerts.incidents.cause, alerts.rules)
    settle = ", ".join(f"{kind} {s:g} s" for kind, s in sorted(cause.settle.items()))
    log.info("alerts: an incident's cause window opens at the start of the rule cycle that "
             "breached (the rules' cycles judged as the evaluation does, settled: %s); "
             "%g s before it went pending for a member of a rule not configured",
             settle or "none", cause.lead_s)
    return replace(alerts, incidents=replace(alerts.incidents, cause=cause))


def cause_config(settings: Settings, cause: CauseConfig, rules: Sequence[Rule]) -> CauseConfig:
    """Return `cause` with the rules and settle this service's evaluation judges, and the
    fallback lead from its schedule (alerts.cause.window_start)."""
    from alerts.cause import window_lead_s
    from monitor.jobs import evaluation_settle

    settle = evaluation_settle(settings)
    lead = window_lead_s(rules, evaluate_interval_s=settings.scheduler.evaluate_interval_s,
                         settle=settle)
    return replace(cause, rules=tuple(rules), settle=settle, lead_s=lead)


def runs_arms(settings: Settings) -> bool:
    """Return whether probe cycles run A/B arms: drawn, or on demand after a slow cycle,
    which needs a share above 0 too (probes.ab_schedule)."""
    p = settings.probes
    return bool(p.ab_arms) and p.ab_share > 0


def make_deliverer(sessions: sessionmaker[Session], alerts: AlertsConfig, seams: Seams,
                   closers: list[Callable[[], object]]) -> Deliverer:
    """Return the webhook deliverer over the outbox; its closer goes on `closers`."""
    from alerts.outbox import Deliverer

    # run_wait_s: a hanging receiver's drain outlives its run instead of holding up the next.
    deliverer = Deliverer(sessions, alerts.targets, transport=seams.transport,
                          clock=seams.clock, max_age_s=alerts.webhook_max_age_s, run_wait_s=2.0)
    closers.append(deliverer.close)
    return deliverer
