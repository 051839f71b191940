"""Errors of the report package.

    ReportError
    ├── InvalidWeek (ValueError)        a --week / week argument that is not YYYY-Www
    └── RegistryError (ValueError)      an assumption registry entry that does not validate
"""

from __future__ import annotations


class ReportError(Exception):
    """Base of every report error."""


class InvalidWeek(ReportError, ValueError):
    """A week string that is not an ISO week such as 2026-W48."""

    def __init__(self, value: object, reason: str) -> None:
        self.value = value
        super().__init__(f"week: {value!r} {reason} (expected an ISO week such as 2026-W48)")


class RegistryError(ReportError, ValueError):
    """An assumption registry that does not validate; the message names the field."""

    def __init__(self, source: str, field: str, reason: str) -> None:
        self.source = source
        self.field = field
        super().__init__(f"{source}: {field}: {reason}")
