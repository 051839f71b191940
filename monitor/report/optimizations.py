"""The assumption registry's entries: optimizations, their checks and kill conditions.

Plain frozen values with no imports from the rest of the report, so metrics, verdicts
and the report model can name them; monitor.report.registry loads and validates them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Assumption:
    """One measurable check: `metric op threshold`, judged per bucket when per_bucket."""

    id: str
    text: str
    metric: str
    op: str
    threshold: float
    per_bucket: bool = False

    def passes(self, value: float) -> bool:
        """Return whether `value` satisfies the check."""
        if self.op == "<=":
            return value <= self.threshold
        if self.op == "<":
            return value < self.threshold
        if self.op == ">=":
            return value >= self.threshold
        return value > self.threshold

    @property
    def condition(self) -> str:
        """Return the check as text, e.g. 'acceptance_rate >= 0.6'."""
        return f"{self.metric} {self.op} {self.threshold:g}"


@dataclass(frozen=True)
class DisableCondition:
    """When to turn an optimization off, and how."""

    when: str
    action: str


@dataclass(frozen=True)
class Optimization:
    """One optimization under review.

    ab_arm: the fallback variant of the A/B canary rows that measures this optimization
        (one of registry.AB_ARMS), or None when it has no A/B arm.
    expected_speedup: fallback latency / optimized latency the owner expects, or None.
    """

    name: str
    owner: str
    description: str
    expected_speedup: float | None
    ab_arm: str | None
    assumptions: tuple[Assumption, ...]
    disable_when: tuple[DisableCondition, ...]


@dataclass(frozen=True)
class Registry:
    """All optimizations under review, in file order (shipped first)."""

    optimizations: tuple[Optimization, ...]

    def get(self, name: str) -> Optimization:
        """Return the optimization called `name`; raise KeyError when absent."""
        for opt in self.optimizations:
            if opt.name == name:
                return opt
        raise KeyError(name)

    def names(self) -> tuple[str, ...]:
        """Return every optimization name."""
        return tuple(o.name for o in self.optimizations)
