"""What a demo run did: each step's result and the outcome the summary and exit code read."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class StepResult:
    """How one step went; `started_s` counts from the start of the demo."""

    number: int
    name: str
    passed: bool
    started_s: float = 0.0
    duration_s: float = 0.0
    headline: str = ""
    events: tuple[str, ...] = ()
    error: str | None = None
    skipped: bool = False


@dataclass(frozen=True)
class DemoOutcome:
    """Everything the demo did; exit code 0 only when every step passed."""

    profile: str
    steps: tuple[StepResult, ...]
    duration_s: float
    planned: int  # how many steps the scenario has: a run cut short did not pass
    workdir: Path | None = None  # None once removed
    report_path: Path | None = None
    alerts: tuple[dict[str, Any], ...] = ()
    flag_changes: tuple[dict[str, Any], ...] = field(default_factory=tuple)

    @property
    def passed(self) -> bool:
        """Return whether every scripted step passed."""
        return len(self.steps) == self.planned and all(s.passed for s in self.steps)

    @property
    def exit_code(self) -> int:
        """Return 0 when every step passed, else 1."""
        return 0 if self.passed else 1
