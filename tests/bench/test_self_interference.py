"""bench.self_interference's computations on rows the production code writes.

The history comes from `storage.synthetic.simulate` (as in `bench.evaluation`), the
canary cycles are stored with `probes.sink.add_cycle` (the prober's path), and the
ratios are read back with the bench's own query; only the service's timing is left to
the benchmark run.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select

from bench.self_interference import RunResult, fill_history, headline, measure, read_ratios
from bench.service import Answer
from bench.service_incidents import _group
from probes.cycle import CycleResult
from probes.sink import add_cycle
from storage.db import make_engine, make_sessionmaker
from storage.migrate import upgrade
from storage.models import ProbeRun

END = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def _cycle(s: object, minute: int, instance: str, lat: dict[str, dict[str, float]]) -> None:
    at = END + timedelta(minutes=minute)
    groups = tuple(_group(bucket, arm, [p50] * 4)
                   for bucket, arms in lat.items() for arm, p50 in arms.items())
    add_cycle(s, CycleResult(  # type: ignore[arg-type]
        suite="in_domain", instance_id=instance, started_at=at,
        finished_at=at + timedelta(seconds=5), status="ok", ab=len(groups) > len(lat),
        groups=groups, model_version="m", config_hash="c"))


def test_history_is_written_per_replica_up_to_the_start(tmp_path: Path) -> None:
    db = make_engine(f"sqlite:///{tmp_path / 'h.db'}")
    upgrade(db)
    rows = fill_history(db, END, days=0.02, replicas=2)
    with make_sessionmaker(db)() as s:
        per_instance = dict(s.execute(select(ProbeRun.instance_id, func.count())
                                      .group_by(ProbeRun.instance_id)).all())
        first, last = s.execute(select(func.min(ProbeRun.started_at),
                                       func.max(ProbeRun.started_at))).one()
    db.dispose()
    assert set(per_instance) == {"sim-1", "sim-2"}
    assert per_instance["sim-1"] == per_instance["sim-2"] == 28  # a cycle a minute
    assert rows > sum(per_instance.values())  # results, rollups and samples too
    assert END - timedelta(days=0.02) <= first.replace(tzinfo=UTC) < last.replace(tzinfo=UTC) < END


def test_ratios_pair_optimized_and_direct_canaries_of_the_same_cycle(tmp_path: Path) -> None:
    db = make_engine(f"sqlite:///{tmp_path / 'r.db'}")
    upgrade(db)
    with make_sessionmaker(db).begin() as s:
        _cycle(s, 0, "bench", {"16": {"optimized": 0.030, "direct": 0.015},
                               "32": {"optimized": 0.040, "direct": 0.040}})
        _cycle(s, 1, "bench", {"16": {"optimized": 0.040, "direct": 0.010}})
        _cycle(s, 2, "bench", {"16": {"optimized": 0.060, "direct": 0.020, "eager": 0.1}})
        _cycle(s, 3, "bench", {"16": {"optimized": 0.500}})  # no arms: not paired
        _cycle(s, 4, "sim-1", {"16": {"optimized": 0.900, "direct": 0.001}})  # history
    ratios, cycles = read_ratios(db)
    db.dispose()
    assert cycles == 3
    assert ratios == {"16": pytest.approx(3.0), "32": pytest.approx(1.0)}


def _answers(stall_s: float, p99_s: float, n429: int) -> list[Answer]:
    out = [Answer(float(i), 200, 0.02, "16") for i in range(100)]
    out += [Answer(float(i), 200, p99_s, "256") for i in range(100)]
    out.append(Answer(50.0, 200, 0.02 + stall_s, "16"))  # the one stalled request
    out += [Answer(40.0 + i / 10, 429, 0.001) for i in range(n429)]  # due during the burst
    return out + [Answer(10.0, 429, 0.001), Answer(20.0, 0, 120.0)]


def test_the_headline_compares_the_history_run_with_the_empty_one() -> None:
    empty = measure("empty", _answers(0.2, 0.05, 0), {"16": 2.0, "32": 1.0}, 10, "ok",
                    [(39.0, 43.0)])
    history = measure("history", _answers(0.3, 0.055, 2), {"16": 2.02, "32": 0.95, "64": 1.0},
                      10, "ok", [(39.0, 43.0)])
    assert isinstance(empty, RunResult)
    assert (history.ok, history.rejected_429, history.errors) == (201, 3, 1)
    assert history.rejected_in_burst == 2
    # One 429 in the 95 s outside the 4 s window: 4/95 of one expected inside it.
    assert history.expected_in_burst == pytest.approx(4 / 95)
    assert history.stall_s == pytest.approx(0.3)
    assert headline(empty, history) == ("history effect: ratio 5.0%, traffic p99 +10.0%, "
                                        "stall 1.50x; real requests shed by probes: 2")
