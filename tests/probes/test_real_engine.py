"""Probe cycles against the real torch runtime with a tiny random T5 (dynamo, no inductor)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from sqlalchemy import select

from engine.protocol import InMemoryFlagProvider, RuntimeFlags
from probes.canaries import CanarySuite
from probes.cycle import ProbeCycle
from storage import make_engine, make_sessionmaker
from storage.migrate import upgrade
from storage.models import CompileEvent
from tests.probes.fakes import store

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory):
    from engine import EngineConfig, load_engine
    from tests.engine.conftest import build_tiny_t5

    target = build_tiny_t5(tmp_path_factory.mktemp("probe-t5") / "target", seed=0)
    flags = InMemoryFlagProvider(RuntimeFlags(bucketing=False))
    config = EngineConfig(model_dir=str(target), use_draft=False, device="cpu",
                          buckets=(16, 32), max_input_tokens=64, max_new_tokens=4,
                          max_new_tokens_cap=8, compile_backend="eager")
    engine = load_engine(config, flags=flags)
    yield engine
    engine.close()


def test_new_length_without_bucketing_is_a_recorded_recompile(runtime, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade(url)
    db = make_engine(url)

    def cycle(*prompts: str) -> ProbeCycle:
        suite = CanarySuite("s", "in_domain", prompts)
        return ProbeCycle(runtime, {"s": suite}, instance_id="a", canaries_per_bucket=4,
                          ab_share=0.0, rng=random.Random(0), timeout_s=300)

    first = cycle("the quick brown fox").run("s")  # compiles the exact path once
    assert first.status == "ok", first.error
    assert {g.path for g in first.groups} == {"exact"}
    again = cycle("the quick brown fox").run("s")  # same length: nothing new
    assert again.compile.recompiles == 0
    result = cycle("the quick brown fox jumps").run("s")  # a new input length
    assert result.status == "ok", result.error
    assert result.compile.recompiles >= 1
    assert result.compile.recompile_reasons, "a recompile must carry its guard failure"
    run_id = store(make_sessionmaker(db), result)
    with make_sessionmaker(db)() as s:
        ev = s.scalars(select(CompileEvent).where(CompileEvent.run_id == run_id)).one()
    assert ev.recompiles == result.compile.recompiles
    assert ev.recompile_reasons == dict(result.compile.recompile_reasons)
    assert any("size" in reason or "shape" in reason for reason in ev.recompile_reasons)
    db.dispose()
