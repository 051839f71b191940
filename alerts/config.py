"""Build the alerts package's runtime objects from `monitor.settings.AlertSettings`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from alerts.baselines import BaselineConfig
from alerts.policy import Policy, load_policy
from alerts.rules import Rule, load_rules
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


def load_config(settings: Any) -> AlertsConfig:
    """Return validated rules, targets and policy for an AlertSettings-like object.

    Raises ConfigError (a ValueError) naming the file, entry and field on bad input.
    """
    return AlertsConfig(
        rules=tuple(load_rules(getattr(settings, "rules_file", None))),
        targets=tuple(parse_targets(getattr(settings, "webhooks", None) or [])),
        policy=load_policy(getattr(settings, "policy_file", None)),
        baselines=BaselineConfig(
            refresh_s=float(getattr(settings, "baseline_refresh_s", 3600.0)),
            warm_in_s=float(getattr(settings, "baseline_warm_in_s", 1800.0))),
        external_url=str(getattr(settings, "external_url", "") or ""),
        resend_s=float(getattr(settings, "resend_interval_s", 120.0)),
    )
