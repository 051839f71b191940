"""bench.incidents' replay: one page per incident, a storm's fallback holds.

The bench drives the production evaluator, lifecycle, policy and outbox; these tests run
small pieces of it so a regression shows in the suite, not only in docs/benchmarks.md#benchincidents.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

import pytest

from bench.incidents import (
    NOISE_FILE,
    BlockNoise,
    Sim,
    _rollout_note,
    _rules,
    report,
    rollout,
    step_shift,
    storm,
)
from storage import migrate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("incidents") / "template.db"
    migrate.upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="module")
def noise() -> BlockNoise:
    return BlockNoise(json.loads(NOISE_FILE.read_text()), cv=0.10)


def test_noise_keeps_the_recorded_autocorrelation(noise: BlockNoise) -> None:
    assert "lag-1 autocorrelation" in noise.what
    recorded = noise._lag1()
    assert recorded > 0.05  # recorded cycles are not independent
    stream = noise.stream(random.Random(0))
    xs = [math.log(max(next(stream))) for _ in range(20000)]
    m = statistics.fmean(xs)
    lag1 = sum((a - m) * (b - m) for a, b in zip(xs, xs[1:], strict=False)) / sum(
        (a - m) ** 2 for a in xs)
    # Blocks of 5 keep 4 of every 5 neighbouring pairs; i.i.d. resampling would give ~0.
    assert lag1 == pytest.approx(recorded * (noise.block - 1) / noise.block, abs=0.03)


def test_a_shift_pages_once_and_resolves(template: Path, noise: BlockNoise,
                                         tmp_path: Path, capsys) -> None:
    sim = Sim(template, tmp_path, "step", _rules("p99_latency_regression"), None, noise, 3)
    first, start, end = step_shift(sim, 0.30, 15, 45)
    out = sim.outcome("step", (start, end), True, first)
    assert len(out.pages) == 1 and out.false_pages == 0
    assert out.notifications == 2  # one firing, one resolved
    fired, resolved, _ = out.pages[0]
    assert start < fired < end + 15 and resolved is not None
    assert report([out]) == (1, 0.0)
    assert "step" in capsys.readouterr().out


def test_a_recompile_storm_keeps_eager_on_the_storming_instance(
        template: Path, noise: BlockNoise, tmp_path: Path) -> None:
    from alerts.policy import load_policy

    sim = Sim(template, tmp_path, "storm", _rules("recompiles_per_hour", "compile_failures"),
              load_policy(), noise, 4)
    storm(sim, 90, 0)
    on = sim.compiled_minutes.get("i1", 0)
    # Each restore is a trial: while the alert still fires, eager comes straight back.
    assert on <= 10, sim.notes
    out = sim.outcome("storm", (0, sim.i), True, 0)
    assert len(out.pages) == 1
    assert all("instance:i1" in f for f in out.flags)  # never the fleet, never i2


def test_a_regression_of_the_new_version_in_a_rollout_pages_once(
        template: Path, noise: BlockNoise, tmp_path: Path) -> None:
    from alerts.baselines import BaselineConfig

    sim = Sim(template, tmp_path, "rollout", _rules("p99_latency_regression"), None, noise, 5)
    sim.config = BaselineConfig()  # m2 warms in on m1's baseline
    first, start, end = rollout(sim, 0.50, 30, 30)
    out = sim.outcome("rollout", (start, end), True, first)
    assert len(out.pages) == 1 and out.false_pages == 0
    fired, resolved, _ = out.pages[0]
    assert start < fired <= start + 30 and resolved is not None
    # The rollout verdict notifies first, as a warning; the page is the cohort's rule.
    note = _rollout_note(sim, start)
    assert "rollout_regression (warning)" in note and "p99_latency_regression (page)" in note


def test_a_peak_without_seasonality_is_shown_but_not_counted(capsys) -> None:
    from bench.incidents import Outcome

    seasonal = Outcome("daily peak (hour_of_week)", None, False, 270, false_pages=1, daily=True)
    flat = Outcome("daily peak (7-day)", None, False, 270, false_pages=1, daily=True,
                   counted=False)
    assert report([flat]) == (0, 0.0)
    assert "not counted" in capsys.readouterr().out
    assert report([seasonal, flat]) == (0, 30.0)  # a daily false page counts every day


def test_the_replay_runs_the_sensitivity_job_as_the_service_does(
        template: Path, noise: BlockNoise, tmp_path: Path) -> None:
    """The false-page budget is in force in the replay: the job runs at the first
    evaluation until every series is estimated, then on its interval."""
    from bench.replay import SENSITIVITY_INTERVAL_MIN
    from storage.queries import sensitivity as sensitivity_queries

    sim = Sim(template, tmp_path, "job", _rules("p99_latency_regression"), None, noise, 6)
    sim.history(420, lambda s: sim.canary(s))
    sim.step(lambda s: sim.canary(s))
    assert sim.job_at == sim.i and len(sim.jobs) >= 1
    with sim.sm() as s:
        (est,) = sensitivity_queries.by_key(s).values()
    # A day is not yet there, but the series' usable cycles are: estimated, not skipped.
    assert est.rule == "p99_latency_regression" and est.status == "ok", est.reason
    assert est.threshold >= est.configured_threshold
    runs = len(sim.jobs)
    sim.step(lambda s: sim.canary(s), SENSITIVITY_INTERVAL_MIN)
    assert len(sim.jobs) == runs + 1 and sim.job_at == sim.i
