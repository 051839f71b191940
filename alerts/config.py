"""Build the alerts package's runtime objects from its settings section.

`load_config` is the one loader of rules, policy and webhook targets: the service's
lifespan, `tailwatch serve`'s preflight and the tests call it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from alerts.baselines import BaselineConfig
from alerts.incidents import IncidentConfig
from alerts.policy import Policy, load_policy
from alerts.rule_file import load_rules
from alerts.rules import Rule
from alerts.sensitivity import SensitivityConfig
from alerts.settings import AlertSettings
from alerts.webhooks import WebhookTarget, parse_targets


@dataclass(frozen=True)
class AlertsConfig:
    """Everything the evaluation job and the deliverer need, validated."""

    rules: tuple[Rule, ...]
    targets: tuple[WebhookTarget, ...]
    policy: Policy
    baselines: BaselineConfig
    external_url: str = ""
    resend_s: float = 120.0
    flags_ttl_s: float = 1.0
    webhook_max_age_s: float = 86400.0
    stale_after_s: float = 900.0
    incidents: IncidentConfig = field(default_factory=IncidentConfig)
    sensitivity: SensitivityConfig = SensitivityConfig()
    sensitivity_history_s: float = 86400.0
    sensitivity_job_cpu_s: float = 20.0


def load_config(settings: AlertSettings) -> AlertsConfig:
    """Return validated rules, targets and policy for the `alerts` settings section.

    Raises ConfigError (a ValueError) naming the file, entry and field on bad input.
    """
    sensitivity = SensitivityConfig(within_cycles=settings.sensitivity_within_cycles,
                                    budget_per_30d=settings.false_page_budget_per_30d,
                                    cpu_s=settings.sensitivity_cpu_s,
                                    min_history_s=settings.sensitivity_min_history_s,
                                    max_history_s=settings.sensitivity_max_history_s,
                                    min_history=settings.sensitivity_min_history_cycles)
    budget_on = settings.false_page_budget_per_30d is not None
    return AlertsConfig(
        rules=tuple(load_rules(settings.rules_file)),
        targets=tuple(parse_targets(settings.webhooks)),
        policy=load_policy(settings.policy_file),
        baselines=BaselineConfig(refresh_s=settings.baseline_refresh_s,
                                 warm_in_s=settings.baseline_warm_in_s,
                                 false_page_budget=budget_on,
                                 # Until a series can state its false pages, it warns.
                                 hold_cycles=sensitivity.min_history if budget_on else 0,
                                 hold_s=sensitivity.min_history_s if budget_on else 0.0),
        external_url=settings.external_url,
        resend_s=settings.resend_interval_s,
        flags_ttl_s=settings.flags_ttl_s,
        webhook_max_age_s=settings.webhook_max_age_s,
        stale_after_s=settings.stale_after_s,
        incidents=IncidentConfig(
            window_s=settings.incidents.window_s, hold_s=settings.incidents.hold_s,
            group_interval_s=settings.incidents.group_interval_s,
            update_formats=frozenset(settings.incidents.update_formats),
            cause_wait_s=settings.incidents.cause_wait_s),
        sensitivity=sensitivity,
        sensitivity_history_s=settings.sensitivity_history_s,
        sensitivity_job_cpu_s=settings.sensitivity_job_cpu_s,
    )
