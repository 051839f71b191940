"""bench.incidents --service: what a minute writes, and scenarios paged once per incident.

Each minute writes every bucket the engine serves (16 included) and the non-latency kinds
the shipped rules read (canary acceptance, compile counters, memory, output agreement),
through the production writers. Two scenarios run through the production evaluator,
policy, grouping and outbox: a host-wide slowdown (2x for 6 minutes on every arm, bucket
and the real traffic) is one firing and one resolved notification, the resolved one soon
after the slowdown ended (before, per-cycle hysteresis on noisy medians and pooled p99s
still holding the slowdown's samples kept the incident open for the rest of the
scenario), its members latency rules only; bucket 32's traffic shifting domain is one
page whose cause is that bucket's acceptance. An incident that fires again after its last
resolved notification counts as open at the end.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

import bench.service_incidents as service
from alerts.rule_file import load_rules
from alerts.series import RowCache, series
from bench.incidents import NOISE_FILE, BlockNoise
from bench.service_incidents import (
    ServiceOutcome,
    ServiceSim,
    World,
    minute,
    scenarios,
    summary,
    warmed,
)
from monitor.alerting import load_alerts
from monitor.jobs import evaluation_settle
from monitor.settings import get_settings
from storage import migrate
from storage.db import make_engine, make_sessionmaker
from storage.models import (
    CompileEvent,
    Incident,
    MemorySample,
    OutputAgreement,
    ProbeResult,
    TrafficRollup,
)

# The most cycles a recovering series' median is read over (the shipped rules' lookback).
RESOLVED_WITHIN_MIN = 30
HISTORY_MIN = 240  # quiet minutes before a scenario: enough for every baseline, kept short
# Shipped rules whose rows the bench does not write: bursts, and batching (max_batch 1).
UNWRITTEN = {"burst_p99_regression", "overbatching", "queue_wait_share", "step_throughput_drop"}
# Rules of what no scenario moves: none of them may join an incident.
UNMOVED = {"memory_growth", "recompiles_per_hour", "compile_failures", "output_agreement_drop",
           "native_step_agreement_drop", "canary_acceptance_drop", "probe_failures",
           "rejections", "overflow_share"}
LATENCY = {"p99_latency_regression", "p50_latency_regression", "ttft_regression",
           "per_token_regression", "traffic_p99_regression"}


def _noise() -> BlockNoise:
    return BlockNoise(json.loads(NOISE_FILE.read_text()), cv=0.10)


@pytest.fixture
def template(tmp_path: Path) -> Path:
    path = tmp_path / "template.db"
    migrate.upgrade(f"sqlite:///{path}")
    return path


def test_a_minute_writes_bucket_16_and_every_kind_the_rules_read(
        template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "RECOMPILE_PER_MIN", 1.0)  # every minute: visible in 20
    sim = ServiceSim(template, tmp_path, "rows", _noise().stream, seed=1)
    quiet = World()
    sim.history(20, lambda s: sim.write(s, quiet))
    with sim.sm() as s:
        arms = set(s.execute(select(ProbeResult.bucket, ProbeResult.variant)))
        assert {(b, v) for b in service.BUCKETS for v in service.ARMS} <= arms
        mean = {bucket: total / n for bucket, total, n in s.execute(
            select(TrafficRollup.bucket, func.sum(TrafficRollup.latency_sum_s),
                   func.sum(TrafficRollup.requests)).group_by(TrafficRollup.bucket))}
        assert set(mean) == set(service.BUCKETS)
        assert mean["16"] < mean["32"]
        assert s.scalar(select(func.count()).select_from(MemorySample)) == 2 * 20
        assert s.scalar(select(func.count()).select_from(CompileEvent)) == 20
        agreements = s.scalars(select(OutputAgreement)).all()
        assert {a.bucket for a in agreements} == set(service.BUCKETS)
        assert all(a.agreement_sum == a.count == a.exact for a in agreements)
        cache = RowCache(s)
        rules = {r.name: r for r in load_rules()}
        read = {name: series(r, cache, minute(0), minute(20)) for name, r in rules.items()}
    # Every shipped rule but the unwritten ones reads a series with values.
    assert {name for name, pts in read.items() if not any(
        p.value is not None for scope in pts.values() for p in scope)} == UNWRITTEN
    canary = read["canary_acceptance_drop"]
    for bucket, rate in service.ACCEPTANCE.items():
        values = [p.value for p in canary[(("bucket", bucket),)] if p.value is not None]
        assert values and all(abs(v - rate) < 0.03 for v in values), (bucket, values)
    # The trailing hour's recompiles (one a minute), and memory well inside its ceiling.
    assert [p.value for p in read["recompiles_per_hour"][(("instance", "i1"),)]][-1] == 20
    ceiling = rules["memory_growth"].ceiling
    assert ceiling is not None
    assert all(abs(p.value) < ceiling / 10 for p in read["memory_growth"][(("instance", "i1"),)]
               if p.value is not None)


def test_the_sim_evaluates_with_the_services_incident_config_and_settle(
        template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.replay as replay

    seen = []
    real = replay.evaluate

    def spy(session: Any, options: Any, now: Any, **kw: Any) -> Any:
        seen.append((options.incidents, kw.get("settle")))
        return real(session, options, now, **kw)

    monkeypatch.setattr(replay, "evaluate", spy)
    sim = ServiceSim(template, tmp_path, "config", _noise().stream, seed=1)
    sim.evaluate()
    settings = get_settings()
    assert seen == [(load_alerts(settings).incidents, evaluation_settle(settings))]
    assert {r.name for r in seen[0][0].cause.rules} == {r.name for r in sim.rules}
    sim.engine.dispose()


def test_an_incident_that_fired_again_after_its_last_resolution_is_open() -> None:
    # Fired at +3 min, resolved, fired again, resolved, fired again (minutes after the end).
    o = ServiceOutcome("rollout", (0, 30), "one_instance", pages=[(3, 1, "one_instance")],
                       resolved={1: [31.5, 43.5]}, fired={1: 49.0})
    assert o.open_at_end(1) and o.resolved_after() is None
    assert summary([o]).splitlines()[-2].endswith("1 still open at the end")
    o.fired[1] = 33.0
    assert not o.open_at_end(1) and o.resolved_after() == 43.5


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Return a database of one instance's quiet history, evaluated and estimated."""
    work = tmp_path_factory.mktemp("warm")
    path = work / "template.db"
    migrate.upgrade(f"sqlite:///{path}")
    yield warmed(path, work, {"i1": "m1"}, _noise().stream, seed=0, history=HISTORY_MIN)


def _replay(warm: Path, tmp_path: Path, k: int) -> service.ServiceOutcome:
    """Replay quick scenario `k` from the warm history; return its outcome."""
    name, worlds, start, expected = scenarios(quick=True)[k]
    sim = ServiceSim(warm, tmp_path, f"s{k}", _noise().stream, seed=1,
                     warmed_at=HISTORY_MIN)
    first = sim.run(worlds, history=HISTORY_MIN)
    window = (first + start, first + start + worlds[1][0])
    return sim.outcome(name, window, expected, first)


@pytest.mark.slow
def test_a_host_wide_slowdown_pages_once_with_host_or_load(warm: Path, tmp_path: Path) -> None:
    assert scenarios(quick=True)[0][3] == "host_or_load"
    outcome = _replay(warm, tmp_path, 0)
    assert len(outcome.pages) == 1, outcome.causes
    assert outcome.cause_right, outcome.causes
    assert outcome.late == 0 and outcome.early == 0, outcome.causes
    assert summary([outcome]).splitlines()[-1].startswith(
        "pages per incident: max 1 (all rules), cause right: 1 of 1")
    # Latency rules only, every bucket's traffic p99 (16 too): memory, compiles and quality
    # stay out.
    assert set(outcome.members) <= LATENCY and not set(outcome.members) & UNMOVED, \
        outcome.members
    assert outcome.members.get("traffic_p99_regression") == len(service.BUCKETS), \
        outcome.members
    # The cause read from the earliest rule cycle a member breached in (the service's
    # incident config): the first slowed minute, or the one before where a member went
    # pending on noise then (here bucket 16's p50), not the library's minute of lead.
    assert outcome.window is not None
    engine = make_engine(f"sqlite:///{tmp_path / 's0.db'}")
    with make_sessionmaker(engine)() as s:
        incident_row = s.get(Incident, outcome.pages[0][1])
        assert incident_row is not None
        opened = datetime.fromisoformat(incident_row.evidence["window_start"])
    engine.dispose()
    assert minute(outcome.window[0] - 1) <= opened <= minute(outcome.window[0]), opened
    # One resolved notification, within the rules' lookback of the slowdown's end: the
    # members' last cycles back (their median, over as many cycles as each series' noise
    # needs; a pooled p99's own samples), not the pool emptying of the slowdown's samples
    # (25 cycles) nor a run of noisy cycles all inside a band narrower than their noise.
    [(incident, times)] = outcome.resolutions().items()
    assert len(times) == 1, (incident, times, outcome.causes)
    after = outcome.resolved_after()
    assert after is not None and 0 < after <= RESOLVED_WITHIN_MIN, after


@pytest.mark.slow
def test_a_domain_shift_in_bucket_32_pages_once_on_its_acceptance(
        warm: Path, tmp_path: Path) -> None:
    name, _, _, expected = scenarios(quick=True)[2]
    assert "bucket 32" in name and expected == "one_bucket"
    outcome = _replay(warm, tmp_path, 2)
    assert len(outcome.pages) == 1 and outcome.cause_right, outcome.causes
    assert outcome.late == 0 and outcome.early == 0, outcome.causes
    assert "acceptance in bucket 32" in outcome.causes[0], outcome.causes
    # The canaries are in-domain: their acceptance, and every latency, stays out.
    assert set(outcome.members) == {"acceptance_drop"}, outcome.members
