"""Alert rules as written in YAML: the schema, its validation and the layered loader.

Example (alerts/rules.yaml holds the defaults):

    rules:
      - name: p99_regression
        metric: p99_latency
        source: canary          # canary | traffic
        per: [bucket]           # labels that split the scope: bucket, path, instance
        change: "+15%"          # relative threshold and direction vs the baseline
        resolve_change: "+5%"   # hysteresis: resolve once back under this
        for: 3                  # the change must hold (median) over at least this many cycles
        resolve_for: 5          # cycles whose median is back inside the band to resolve
        min_samples: 3          # a cycle with fewer samples counts as empty
        ceiling: 2.0            # optional absolute limit (floor: for downward metrics)
        min_delta: 0.05         # optional: the least absolute change (metric units) that breaches
        seasonality: hour_of_week  # optional: baseline from the same hour of the week
        budget: off             # optional: keep the threshold whatever the noise costs
        budget_off_for: [{bucket: "256"}]  # optional: scopes that opt out of the budget
        severity: page
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    StrictFloat,
    StrictInt,
    StringConstraints,
    ValidationInfo,
    field_validator,
)

from alerts.detection import Cusum
from alerts.durations import parse_duration
from alerts.errors import RuleError
from alerts.rules import Rule
from alerts.schema import Entry, read_layered, validate
from vocab import Source

DEFAULT_RULES_FILE = Path(__file__).with_name("rules.yaml")

# metric -> (description, sources it can be measured from)
METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "p50_latency": ("p50 of request total_s per cycle (seconds)", ("canary", "traffic")),
    "p95_latency": ("p95 of request total_s per cycle (seconds)", ("canary", "traffic")),
    "p99_latency": ("p99 of request total_s per cycle (seconds)", ("canary", "traffic")),
    "ttft": ("p95 of time to first token per cycle (seconds)", ("canary", "traffic")),
    "per_token": ("p50 of mean time per output token per cycle (seconds)", ("canary", "traffic")),
    "acceptance_rate": ("accepted / draft tokens per cycle", ("canary", "traffic")),
    "memory_growth": ("RSS (or CUDA allocated) growth per hour (bytes)", ("canary",)),
    "recompiles_per_hour": ("torch.compile recompiles per hour", ("canary",)),
    "compile_failures": ("recompile-limit hits + compile failures in the trailing hour",
                         ("canary",)),
    "overflow_share": ("share of requests on the overflow path", ("canary", "traffic")),
    "padding_waste": ("mean share of padded input that is padding", ("canary", "traffic")),
    "probe_failures": ("share of canary probes that failed or timed out", ("canary",)),
    "burst_p99": ("p99 latency of the latest burst probe (seconds)", ("burst",)),
    "rejections": ("share of requests rejected (overloaded or timed out)", ("traffic", "burst")),
    "output_agreement": ("mean token agreement of outputs with the reference path per cycle",
                         ("canary", "traffic")),
    "batch_p99_ratio": ("p99 latency of the largest batch-size class over the smallest's "
                        "per cycle", ("traffic",)),
    "queue_wait_share": ("share of request latency spent waiting for a row or the batching "
                         "loop", ("traffic",)),
    "step_throughput": ("tokens per second of the batching steps requests took part in "
                        "(all rows)", ("traffic",)),
}
# variant: the A/B arm (only output_agreement rows carry it); batch: the batch-size class
# (only the batching metrics' rows carry it).
SCOPE_LABELS = ("bucket", "path", "decoding", "instance", "variant", "batch")
SOURCES = tuple(s.value for s in Source)
SEVERITIES = ("page", "warning", "info")
_CHANGE_RE = re.compile(r"^\s*([+-])\s*(\d+(?:\.\d+)?)\s*%\s*$")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")



def parse_change(value: object) -> tuple[int, float]:
    """Return (direction, relative threshold) for "+15%" / "-20%"; raise ValueError."""
    if isinstance(value, str):
        m = _CHANGE_RE.match(value)
        if m:
            pct = float(m.group(2)) / 100.0
            if pct <= 0:
                raise ValueError(f"must be non-zero, got {value!r}")
            return (1 if m.group(1) == "+" else -1), pct
    raise ValueError(f'expected a signed percentage such as "+15%" or "-20%", got {value!r}')


class RuleEntry(Entry):
    """One rule as written in YAML (see the module docstring); `parse_rule` validates it."""

    name: Annotated[str, StringConstraints(pattern=_NAME_RE.pattern)]
    metric: str
    source: str = "canary"
    per: tuple[str, ...] = ("bucket",)
    match: dict[str, str] = Field(default_factory=dict)
    change: tuple[int, float] = Field(None, validate_default=True)
    resolve_change: tuple[int, float] | None = None
    for_: StrictInt = Field(3, alias="for", ge=2)
    resolve_for: StrictInt = Field(5, ge=1)
    min_samples: StrictInt = Field(1, ge=1)
    lookback: StrictInt = Field(30, ge=2)
    min_baseline_cycles: StrictInt = Field(30, ge=1)
    ceiling: StrictFloat | None = None
    floor: StrictFloat | None = None
    min_delta: float = 0.0
    severity: str = "warning"
    window: float = 60.0
    baseline_window: float = 7 * 86400.0
    description: str = ""
    cusum: Cusum = Field(default_factory=Cusum)
    pool: StrictInt = Field(30, ge=1)
    seasonality: Literal["", "hour_of_week"] = ""
    # `off` (YAML reads it as false), `on` / true, or this rule's false pages per 30 days.
    budget: bool | float | None = None
    budget_off_for: tuple[dict[str, str], ...] = ()

    @field_validator("budget", mode="before")
    @classmethod
    def _budget(cls, v: object) -> bool | float | None:
        if v is None or isinstance(v, bool):
            return v
        if v in ("off", "on"):
            return v == "on"
        if isinstance(v, int | float) and v >= 0:
            return float(v)
        raise ValueError(f"must be off, on or false pages per 30 days (>= 0), got {v!r}")

    @field_validator("budget_off_for", mode="before")
    @classmethod
    def _budget_off_for(cls, v: object) -> object:
        items = v or []
        if not isinstance(items, list) or not all(
                isinstance(m, dict) and m and all(k in SCOPE_LABELS for k in m) for m in items):
            raise ValueError(f"must be a list of label matches ({', '.join(SCOPE_LABELS)}), "
                             f"got {v!r}")
        return tuple({str(k): str(x) for k, x in m.items()} for m in items)

    @field_validator("min_delta", mode="before")
    @classmethod
    def _min_delta(cls, v: object) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                or v < 0:
            raise ValueError("must be a finite number >= 0, in the metric's own units "
                             f"(memory_growth: bytes per hour), got {v!r}")
        return float(v)

    @field_validator("metric")
    @classmethod
    def _metric(cls, v: str) -> str:
        if v not in METRICS:
            raise ValueError(f"must be one of {', '.join(METRICS)}, got {v!r}")
        return v

    @field_validator("source")
    @classmethod
    def _source(cls, v: str, info: ValidationInfo) -> str:
        metric = info.data.get("metric")
        if metric is not None and v not in METRICS[metric][1]:
            raise ValueError(f"{metric} is measured from {'/'.join(METRICS[metric][1])}, "
                             f"got {v!r}")
        return v

    @field_validator("per", mode="before")
    @classmethod
    def _per(cls, v: object) -> object:
        per = [] if v in ("all", None) else [v] if isinstance(v, str) else v
        if not isinstance(per, list | tuple) or any(p not in SCOPE_LABELS for p in per):
            raise ValueError(f"must be 'all' or a list of {', '.join(SCOPE_LABELS)}, got {v!r}")
        return tuple(per)

    @field_validator("match", mode="before")
    @classmethod
    def _match(cls, v: object) -> object:
        match = v or {}
        if not isinstance(match, dict) or any(k not in SCOPE_LABELS for k in match):
            raise ValueError(f"must map {', '.join(SCOPE_LABELS)} to values, got {v!r}")
        return {str(k): str(x) for k, x in match.items()}

    @field_validator("change", mode="before")
    @classmethod
    def _change(cls, v: object) -> tuple[int, float]:
        if v is None:
            raise ValueError('is required (a signed percentage such as "+15%")')
        return parse_change(v)

    @field_validator("resolve_change", mode="before")
    @classmethod
    def _resolve_change(cls, v: object, info: ValidationInfo) -> tuple[int, float] | None:
        if v is None:
            return None
        rdir, rthr = parse_change(v)
        change = info.data.get("change")
        if change is not None and (rdir != change[0] or rthr >= change[1]):
            raise ValueError("must point the same way as change and be smaller")
        return rdir, rthr

    @field_validator("lookback")
    @classmethod
    def _lookback(cls, v: int, info: ValidationInfo) -> int:
        if v < max(info.data.get("for_", 0), info.data.get("resolve_for", 0)):
            raise ValueError("must be >= for and resolve_for")
        return v

    @field_validator("severity")
    @classmethod
    def _severity(cls, v: str) -> str:
        if v not in SEVERITIES:
            raise ValueError(f"must be one of {', '.join(SEVERITIES)}, got {v!r}")
        return v

    @field_validator("window", "baseline_window", mode="before")
    @classmethod
    def _duration(cls, v: object) -> float:
        seconds = parse_duration(v)
        if seconds <= 0:
            raise ValueError("must be positive")
        return seconds

    @field_validator("cusum", mode="before")
    @classmethod
    def _cusum(cls, v: object) -> Cusum:
        raw = v or {}
        if not isinstance(raw, dict) or set(raw) - {"h", "min_cycles", "min_spread_rel"}:
            raise ValueError(f"must map h, min_cycles, min_spread_rel to numbers, got {v!r}")
        try:
            fields: dict[str, Any] = {k: (int(x) if k == "min_cycles" else float(x))
                                      for k, x in raw.items()}
            return Cusum(**fields)
        except TypeError as e:
            raise ValueError(str(e)) from None

    def to_rule(self) -> Rule:
        """Return the Rule this entry describes."""
        direction, threshold = self.change
        resolve = self.resolve_change
        return Rule(
            name=self.name, metric=self.metric, direction=direction, threshold=threshold,
            resolve_threshold=threshold / 3.0 if resolve is None else resolve[1],
            source=self.source, per=self.per, match=dict(self.match),
            for_cycles=self.for_, resolve_for=self.resolve_for, min_samples=self.min_samples,
            ceiling=self.ceiling, floor=self.floor, min_delta=self.min_delta,
            severity=self.severity,
            window_s=self.window, lookback_cycles=self.lookback,
            baseline_window_s=self.baseline_window,
            min_baseline_cycles=self.min_baseline_cycles, description=self.description,
            cusum=self.cusum, seasonality=self.seasonality, pool_cycles=self.pool,
            budget_off=self.budget is False,
            budget_per_30d=None if isinstance(self.budget, bool) else self.budget,
            budget_off_for=tuple(tuple(sorted(m.items())) for m in self.budget_off_for),
        )


def parse_rule(raw: object, source: str = "<rules>", index: int = 0) -> Rule:
    """Validate one YAML rule mapping; raise RuleError naming the rule and field."""
    entry = f"rule #{index + 1}"
    if not isinstance(raw, dict):
        raise RuleError(source, entry, "rule", "must be a mapping")
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise RuleError(source, entry, "name", f"must be an identifier, got {name!r}")
    return validate(RuleEntry, raw, RuleError, source, f"rule {name!r}", nested=False).to_rule()


def parse_rules(data: object, source: str = "<rules>") -> list[Rule]:
    """Validate a `{rules: [...]}` document; raise RuleError on the first bad rule."""
    if data is None:
        return []
    if not isinstance(data, dict) or set(data) - {"rules"}:
        raise RuleError(source, "", "rules", "the document must be a mapping with one key 'rules'")
    items = data.get("rules")
    items = [] if items is None else items
    if not isinstance(items, list):
        raise RuleError(source, "", "rules", "must be a list")
    rules = [parse_rule(r, source, i) for i, r in enumerate(items)]
    seen: set[str] = set()
    for r in rules:
        if r.name in seen:
            raise RuleError(source, f"rule {r.name!r}", "name", "is defined twice")
        seen.add(r.name)
    return rules


def load_rules(rules_file: str | None = None, *, defaults: bool = True) -> list[Rule]:
    """Return the shipped rules plus the user's; a user rule replaces a shipped one by name."""
    rules: dict[str, Rule] = {}
    for source, data in read_layered(DEFAULT_RULES_FILE, rules_file, defaults=defaults,
                                     error=RuleError, file_field="rules_file",
                                     doc_field="rules"):
        for r in parse_rules(data, source):
            rules[r.name] = r
    return list(rules.values())
