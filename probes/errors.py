"""Exceptions of the probes package (tree drawn in `probes/__init__.py`)."""

from __future__ import annotations


class ProbeError(Exception):
    """Base class of probe errors."""


class SuiteError(ProbeError, ValueError):
    """A canary suite definition is invalid."""

    def __init__(self, file: str, field: str, message: str) -> None:
        super().__init__(f"{file}: {field}: {message}")
        self.file = file
        self.field = field
