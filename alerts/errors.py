"""Exceptions of the alerts package (tree drawn in `alerts/__init__.py`)."""

from __future__ import annotations


class AlertsError(Exception):
    """Base class of alerts errors."""


class ConfigError(AlertsError, ValueError):
    """A rules, policy or webhook definition is invalid; names the file, entry and field."""

    def __init__(self, source: str, entry: str, field: str, message: str) -> None:
        where = f"{source}: {entry}: " if entry else f"{source}: "
        super().__init__(f"{where}{field}: {message}")
        self.source = source
        self.entry = entry
        self.field = field


class RuleError(ConfigError):
    """An alert rule is invalid."""


class PolicyError(ConfigError):
    """An auto-fallback policy is invalid."""


class WebhookConfigError(ConfigError):
    """A webhook target is invalid."""


class FlagError(AlertsError, ValueError):
    """A flag change is invalid (unknown flag, bad scope or value, empty reason)."""

    def __init__(self, field: str, message: str, *, value: object = None) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.value = value


class BaselineError(AlertsError, ValueError):
    """A baseline request is invalid (unknown metric, bad scope)."""

    def __init__(self, field: str, message: str, *, value: object = None) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.value = value


class DeliveryError(AlertsError):
    """A webhook delivery attempt failed (kept in the outbox, retried when transient)."""
