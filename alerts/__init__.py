"""Relative-change alert rules, alert lifecycle, durable webhooks, flags and auto-fallback.

Imports storage and `engine.protocol` only (never torch). The scheduled job body is
`alerts.evaluator.evaluate(session, config, now)`; webhooks leave through the SQL outbox
(`alerts.outbox`), flags live in SQL (`alerts.flags`), and `alerts.policy` flips them.

Exceptions (alerts.errors):

AlertsError
 ├── ConfigError (also ValueError): a YAML definition is invalid; names file, entry and field
 │    ├── RuleError: an alert rule
 │    ├── PolicyError: an auto-fallback policy
 │    └── WebhookConfigError: a webhook target
 ├── FlagError (also ValueError): unknown flag, bad scope or value, empty reason
 ├── BaselineError (also ValueError): unknown metric or scope in a baseline request
 └── DeliveryError: one webhook attempt failed (the outbox retries transient ones)
"""

from __future__ import annotations

from alerts.errors import (
    AlertsError,
    BaselineError,
    ConfigError,
    DeliveryError,
    FlagError,
    PolicyError,
    RuleError,
    WebhookConfigError,
)

__all__ = [
    "AlertsError",
    "BaselineError",
    "ConfigError",
    "DeliveryError",
    "FlagError",
    "PolicyError",
    "RuleError",
    "WebhookConfigError",
]
