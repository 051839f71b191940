"""Row builders for storage tests: hand-set values so expected numbers are known."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from storage.models import ProbeResult, ProbeRun

T0 = datetime(2026, 11, 2, 0, 0, tzinfo=UTC)  # a Monday


def minutes(n: float) -> timedelta:
    """Return n minutes."""
    return timedelta(minutes=n)


def probe_run(at: datetime, results: list[dict[str, Any]], **run: Any) -> ProbeRun:
    """Return a finished cycle run at `at` holding one ProbeResult per dict (`run`
    overrides the run's columns)."""
    columns = {"instance_id": "i-1", "model_version": "m1", "config_hash": "c1",
               "device": "cpu", "suite": "in_domain", "kind": "cycle", **run}
    r = ProbeRun(started_at=at, finished_at=at + timedelta(seconds=5), **columns)
    for fields in results:
        defaults = {"bucket": "64", "path": "compiled", "decoding": "speculative", "count": 4}
        r.results.append(ProbeResult(at=at, **{**defaults, **fields}))
    return r
