"""The assumption registry: optimizations, their measurable assumptions and kill conditions.

Loaded from the shipped `assumptions.yaml` plus an optional user file; every entry is
validated and a bad one raises RegistryError naming the file and the field.

Example:
    registry = load_registry(user_file="ops/assumptions.yaml")
    registry.get("bucketing").assumptions[0].metric  # "largest_bucket_fit"
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from monitor.report.errors import RegistryError
from monitor.report.metrics import METRICS
from monitor.report.optimizations import Assumption, DisableCondition, Optimization, Registry

SHIPPED_FILE = Path(__file__).with_name("assumptions.yaml")
COMPARATORS = ("<=", "<", ">=", ">")
AB_ARMS = ("eager", "direct", "exact", "float32", "compiled_step")


def load_registry(user_file: str | Path | None = None, *, shipped: bool = True) -> Registry:
    """Load the shipped registry plus `user_file`; a user entry replaces one of the same name."""
    merged: dict[str, Optimization] = {}
    sources: list[Path] = []
    if shipped:
        sources.append(SHIPPED_FILE)
    if user_file is not None:
        path = Path(user_file)
        if not path.is_file():
            raise RegistryError(str(user_file), "report.assumptions_file", "file does not exist")
        sources.append(path)
    for path in sources:
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise RegistryError(str(path), "(file)", f"is not valid YAML: {exc}") from None
        for opt in parse_registry(data, source=str(path)).optimizations:
            merged[opt.name] = opt
    return Registry(tuple(merged.values()))


def parse_registry(data: Any, *, source: str = "<registry>") -> Registry:
    """Validate a registry mapping (as read from YAML) and return it."""
    if not isinstance(data, Mapping):
        raise RegistryError(source, "(file)", "must hold a mapping with key 'optimizations'")
    _only_keys(data, {"optimizations"}, source, "")
    items = data.get("optimizations")
    if not isinstance(items, list) or not items:
        raise RegistryError(source, "optimizations", "must be a non-empty list")
    out: list[Optimization] = []
    seen: set[str] = set()
    for i, item in enumerate(items):
        opt = _optimization(item, source, f"optimizations[{i}]")
        if opt.name in seen:
            raise RegistryError(source, f"optimizations[{i}].name", f"duplicate name {opt.name!r}")
        seen.add(opt.name)
        out.append(opt)
    return Registry(tuple(out))


_OPT_KEYS = {"name", "owner", "description", "expected_speedup", "ab_arm", "assumptions",
             "disable_when"}
_CHECK_KEYS = {"id", "text", "metric", "op", "threshold", "per_bucket"}


def _optimization(item: Any, source: str, where: str) -> Optimization:
    if not isinstance(item, Mapping):
        raise RegistryError(source, where, "must be a mapping")
    _only_keys(item, _OPT_KEYS, source, where)
    name = _text(item, "name", source, where)
    owner = _text(item, "owner", source, where)
    description = str(item.get("description") or "")
    expected = item.get("expected_speedup")
    if expected is not None:
        expected = _number(expected, source, f"{where}.expected_speedup")
        if expected <= 0:
            raise RegistryError(source, f"{where}.expected_speedup", "must be > 0")
    arm = item.get("ab_arm")
    if arm is not None and arm not in AB_ARMS:
        raise RegistryError(source, f"{where}.ab_arm", f"must be one of {AB_ARMS} or null, got {arm!r}")
    checks = item.get("assumptions")
    if not isinstance(checks, list) or not checks:
        raise RegistryError(source, f"{where}.assumptions", "must be a non-empty list")
    assumptions = tuple(_assumption(c, source, f"{where}.assumptions[{j}]")
                        for j, c in enumerate(checks))
    ids = [a.id for a in assumptions]
    for j, a in enumerate(assumptions):
        if ids.index(a.id) != j:
            raise RegistryError(source, f"{where}.assumptions[{j}].id", f"duplicate id {a.id!r}")
        spec = METRICS[a.metric]
        if spec.needs_ab and arm is None:
            raise RegistryError(source, f"{where}.assumptions[{j}].metric",
                                f"{a.metric} needs ab_arm to be set")
        if spec.needs_expected and expected is None:
            raise RegistryError(source, f"{where}.assumptions[{j}].metric",
                                f"{a.metric} needs expected_speedup to be set")
    raw_disable = item.get("disable_when") or []
    if not isinstance(raw_disable, list):
        raise RegistryError(source, f"{where}.disable_when", "must be a list")
    disable = []
    for j, d in enumerate(raw_disable):
        w = f"{where}.disable_when[{j}]"
        if not isinstance(d, Mapping):
            raise RegistryError(source, w, "must be a mapping with 'when' and 'action'")
        _only_keys(d, {"when", "action"}, source, w)
        disable.append(DisableCondition(_text(d, "when", source, w), _text(d, "action", source, w)))
    return Optimization(name, owner, description, expected, arm, assumptions, tuple(disable))


def _assumption(item: Any, source: str, where: str) -> Assumption:
    if not isinstance(item, Mapping):
        raise RegistryError(source, where, "must be a mapping")
    _only_keys(item, _CHECK_KEYS, source, where)
    metric = _text(item, "metric", source, where)
    if metric not in METRICS:
        raise RegistryError(source, f"{where}.metric",
                            f"unknown metric {metric!r}; known: {', '.join(sorted(METRICS))}")
    op = item.get("op")
    if op not in COMPARATORS:
        raise RegistryError(source, f"{where}.op", f"must be one of {COMPARATORS}, got {op!r}")
    if "threshold" not in item:
        raise RegistryError(source, f"{where}.threshold", "is required")
    threshold = _number(item["threshold"], source, f"{where}.threshold")
    per_bucket = item.get("per_bucket", False)
    if not isinstance(per_bucket, bool):
        raise RegistryError(source, f"{where}.per_bucket", "must be true or false")
    if per_bucket and not METRICS[metric].per_bucket:
        raise RegistryError(source, f"{where}.per_bucket", f"{metric} has no per-bucket values")
    aid = _text(item, "id", source, where)
    text = str(item.get("text") or f"{metric} {op} {threshold:g}")
    return Assumption(aid, text, metric, op, threshold, per_bucket)


def _only_keys(item: Mapping[str, Any], allowed: set[str], source: str, where: str) -> None:
    unknown = sorted(set(item) - allowed)
    if unknown:
        field = f"{where}.{unknown[0]}" if where else str(unknown[0])
        raise RegistryError(source, field, f"unknown field (allowed: {', '.join(sorted(allowed))})")


def _text(item: Mapping[str, Any], key: str, source: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value.strip():
        raise RegistryError(source, f"{where}.{key}", "must be a non-empty string")
    return value.strip()


def _number(value: Any, source: str, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RegistryError(source, field, f"must be a finite number, got {value!r}")
    return float(value)
