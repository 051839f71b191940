"""The assumption registry: the shipped file, user entries and errors naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from monitor.report.errors import RegistryError
from monitor.report.metrics import METRICS
from monitor.report.registry import load_registry, parse_registry


def test_shipped_registry_covers_the_optimizations() -> None:
    reg = load_registry()
    assert reg.names() == ("torch.compile", "bucketing", "static KV cache",
                           "speculative decoding", "int8 weights", "C decode step",
                           "continuous batching")
    step = reg.get("C decode step")
    assert step.ab_arm == "compiled_step"
    assert (step.assumptions[0].metric, step.assumptions[0].op,
            step.assumptions[0].threshold) == ("speedup", ">", 1.0)
    acc = reg.get("speculative decoding").assumptions[0]
    assert (acc.metric, acc.op, acc.threshold, acc.per_bucket) == (
        "acceptance_rate", ">=", 0.6, True)
    assert acc.passes(0.6) and not acc.passes(0.59)
    assert all(a.metric in METRICS for o in reg.optimizations for a in o.assumptions)
    assert reg.get("torch.compile").disable_when


def _entry(**changes: object) -> dict:
    base = {"name": "int8 weights", "owner": "alice", "expected_speedup": 1.5,
            "ab_arm": "eager",
            "assumptions": [{"id": "spd", "metric": "speedup", "op": ">=", "threshold": 1.0,
                             "per_bucket": True}]}
    base.update(changes)
    return base


def test_user_file_adds_and_replaces_entries(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    replaced = _entry(name="bucketing", owner="bob")
    path.write_text(yaml.safe_dump({"optimizations": [_entry(), replaced]}))
    reg = load_registry(path)
    assert reg.names()[-1] == "continuous batching"
    assert reg.get("bucketing").owner == "bob"
    assert len(reg.optimizations) == 7


@pytest.mark.parametrize(("entry", "field", "why"), [
    (_entry(owner=""), "optimizations[0].owner", "non-empty string"),
    (_entry(ab_arm="fast"), "optimizations[0].ab_arm", "must be one of"),
    (_entry(expected_speedup="fast"), "optimizations[0].expected_speedup", "finite number"),
    (_entry(assumptions=[{"id": "a", "metric": "vibes", "op": ">=", "threshold": 1}]),
     "optimizations[0].assumptions[0].metric", "unknown metric 'vibes'"),
    (_entry(assumptions=[{"id": "a", "metric": "speedup", "op": "=>", "threshold": 1}]),
     "optimizations[0].assumptions[0].op", "must be one of"),
    (_entry(assumptions=[{"id": "a", "metric": "speedup", "op": ">="}]),
     "optimizations[0].assumptions[0].threshold", "is required"),
    (_entry(assumptions=[{"id": "a", "metric": "padding_waste", "op": "<=", "threshold": 0.2,
                          "per_bucket": "yes"}]),
     "optimizations[0].assumptions[0].per_bucket", "true or false"),
    (_entry(assumptions=[{"id": "a", "metric": "memory_growth_per_day", "op": "<=",
                          "threshold": 0.1, "per_bucket": True}]),
     "optimizations[0].assumptions[0].per_bucket", "no per-bucket values"),
    (_entry(ab_arm=None), "optimizations[0].assumptions[0].metric", "needs ab_arm"),
    (_entry(colour="red"), "optimizations[0].colour", "unknown field"),
    (_entry(disable_when=[{"when": "x"}]), "optimizations[0].disable_when[0].action",
     "non-empty string"),
])
def test_bad_entries_name_the_field(entry: dict, field: str, why: str) -> None:
    with pytest.raises(RegistryError, match=why) as exc:
        parse_registry({"optimizations": [entry]}, source="mine.yaml")
    assert exc.value.field == field
    assert str(exc.value).startswith(f"mine.yaml: {field}: ")


def test_missing_or_broken_user_file(tmp_path: Path) -> None:
    with pytest.raises(RegistryError, match="file does not exist"):
        load_registry(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optimizations: [unclosed")
    with pytest.raises(RegistryError, match="not valid YAML"):
        load_registry(bad)
