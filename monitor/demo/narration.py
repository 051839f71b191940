"""Tell the demo as it happens: step headers, timed notes, a live wait line, the summary."""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

if TYPE_CHECKING:
    from monitor.demo.outcome import DemoOutcome


class Narrator:
    """Print the story; a progress display shows the current step and what is awaited.

    Example:
        with Narrator(Console(), steps=6) as say:
            say.step(1, "Warm-up", "Start the service ...")
            say.waiting("engine warming: 1/3 buckets")
            say.ok("engine ready", "3/3 buckets compiled")
    """

    def __init__(self, console: Console, *, steps: int) -> None:
        self.console = console
        self.started = time.monotonic()
        self._progress = Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=20),
            MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True)
        self._overall: TaskID | None = None
        self._steps = steps

    def __enter__(self) -> Narrator:
        self._progress.start()
        self._overall = self._progress.add_task("starting", total=self._steps)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._progress.stop()

    def elapsed(self) -> float:
        """Return seconds since the demo began."""
        return time.monotonic() - self.started

    def _print(self, text: str) -> None:
        self._progress.console.print(f"[dim]{self.elapsed():6.1f}s[/dim]  {text}",
                                     highlight=False)

    def step(self, number: int, title: str, story: str) -> None:
        """Announce a step and what it will show."""
        self._progress.console.rule(f"[bold]Step {number}/{self._steps}: {title}")
        self._progress.console.print(f"[italic]{story}[/italic]", highlight=False)
        self.waiting(f"step {number}: {title}")

    def waiting(self, what: str) -> None:
        """Show what the demo is waiting for on the live line."""
        if self._overall is not None:
            self._progress.update(self._overall, description=what)

    def step_done(self) -> None:
        """Advance the overall progress by one step."""
        if self._overall is not None:
            self._progress.advance(self._overall)

    def say(self, text: str) -> None:
        """Print one timed line."""
        self._print(text)

    def ok(self, check: str, seen: str) -> None:
        """Report a check that held."""
        self._print(f"[green]PASS[/green] {check}: {seen}")

    def fail(self, check: str, expected: str, seen: str) -> None:
        """Report a check that did not hold."""
        self._print(f"[red]FAIL[/red] {check}\n          expected: {expected}\n"
                    f"          seen:     {seen}")


def summary_tables(outcome: DemoOutcome) -> list[Table]:
    """Return the steps table, the alerts table and the flag-changes table."""
    steps = Table(title="tailwatch demo: summary", title_justify="left")
    for col in ("#", "step", "result", "at", "took", "what happened"):
        steps.add_column(col, overflow="fold")
    for s in outcome.steps:
        result = ("[green]passed[/green]" if s.passed else
                  "[yellow]skipped[/yellow]" if s.skipped else "[red]FAILED[/red]")
        steps.add_row(str(s.number), s.name, result, f"{s.started_s:.0f}s",
                      f"{s.duration_s:.0f}s", s.error or s.headline)
    alerts = Table(title="alerts", title_justify="left")
    for col in ("rule", "labels", "fired", "resolved", "change"):
        alerts.add_column(col, overflow="fold")
    fired = [a for a in outcome.alerts if a.get("fired_at")]
    for a in fired:
        alerts.add_row(a["rule"], _labels(a.get("labels") or {}), _clock(a.get("fired_at")),
                       _clock(a.get("resolved_at")) or "-", _pct(a.get("relative_change")))
    pending = len(outcome.alerts) - len(fired)
    if pending:
        alerts.caption = f"{pending} more went pending and cleared without firing"
    flags = Table(title="flag changes", title_justify="left")
    for col in ("at", "flag", "scope", "action", "value", "by", "reason"):
        flags.add_column(col, overflow="fold")
    for f in outcome.flag_changes:
        flags.add_row(_clock(f.get("at")), f["name"], f["scope"], f["action"],
                      str(f.get("new_value")), f"{f['actor']} ({f['source']})",
                      _short(f.get("reason") or "", 48))
    return [steps, alerts, flags]


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _labels(labels: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _clock(value: Any) -> str:
    if not value:
        return ""
    text = str(value)
    return text[11:19] if len(text) >= 19 else text


def _pct(value: Any) -> str:
    return f"{value:+.0%}" if isinstance(value, int | float) else "-"


def print_summary(console: Console, outcome: DemoOutcome, extra: Sequence[str] = ()) -> None:
    """Print the summary tables and closing lines."""
    for table in summary_tables(outcome):
        console.print(table)
    for line in extra:
        console.print(line, highlight=False)
