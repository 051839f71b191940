"""The demo's exceptions (tree in `monitor.demo`)."""

from __future__ import annotations


class DemoError(Exception):
    """The demo could not run as scripted."""


class CheckFailed(DemoError):
    """A step's check did not hold before its timeout."""

    def __init__(self, step: str, check: str, expected: str, seen: str) -> None:
        super().__init__(f"{step}: {check}: expected {expected}; seen {seen}")
        self.step = step
        self.check = check
        self.expected = expected
        self.seen = seen


class DemoSetupError(DemoError):
    """The service, the webhook receiver or the models could not start."""


class DemoOptionError(ValueError):
    """A bad demo option; the message names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
