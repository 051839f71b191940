"""bench.worker_memory's replay: the worker's real jobs over the production prober's rows."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select

from bench.worker_memory import Replay
from storage.models import ProbeRun


def test_the_ab_share_reaches_the_prober_and_one_tick_stores_a_cycle(tmp_path: Path) -> None:
    replay = Replay(tmp_path, ab_share=1.0, rate=1.0)
    try:
        assert replay.settings.probes.ab_share == 1.0
        replay.tick()
        with replay.sessions() as s:
            (run,) = s.scalars(select(ProbeRun)).all()
        assert run.details and run.details["pairs"]  # every cycle ran its A/B arms
    finally:
        replay.close()
    (tmp_path / "default").mkdir()
    shipped = Replay(tmp_path / "default", rate=1.0)
    try:
        assert shipped.settings.probes.ab_share == 0.25  # probes.ab_share's default
    finally:
        shipped.close()
