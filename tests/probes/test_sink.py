"""Probe results stored as rows (through the storage Writer) on SQLite and PostgreSQL."""

from __future__ import annotations

import random

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from engine.protocol import InMemoryFlagProvider, RuntimeFlags
from probes.burst import run_burst
from probes.cycle import ProbeCycle
from storage.models import CompileEvent, MemorySample, ProbeResult, ProbeRun
from tests.probes.fakes import FakeEngine, store


def test_cycle_stored_with_every_bucket_memory_and_compile(
        sessionmaker: sessionmaker[Session], suites: dict) -> None:
    engine = FakeEngine(flags=InMemoryFlagProvider(RuntimeFlags(bucketing=False)),
                        leak_bytes_per_call=4096)
    cycle = ProbeCycle(engine, suites, instance_id="replica-a", canaries_per_bucket=2,
                       ab_share=1.0, ab_arms=("eager", "direct"), rng=random.Random(0))
    result = cycle.run("in_domain")
    run_id = store(sessionmaker, result)
    with sessionmaker() as s:
        run = s.get(ProbeRun, run_id)
        assert (run.status, run.kind, run.suite, run.instance_id) == (
            "ok", "cycle", "in_domain", "replica-a")
        assert run.details["ab"] is True and run.details["rss_growth_bytes"] == 30 * 4096
        rows = s.scalars(select(ProbeResult).where(ProbeResult.run_id == run_id)).all()
        keys = {(r.bucket, r.path, r.variant) for r in rows}
        for b in ("16", "32", "64", "128", "256"):
            assert {(b, "exact", "optimized"), (b, "eager", "eager"), (b, "exact", "direct")} <= keys
        row = next(r for r in rows if r.variant == "optimized" and r.bucket == "64")
        assert row.count == 2 and row.p95_s >= row.p50_s > 0
        assert row.draft_tokens > 0 and len(row.accepted_per_position) == 4
        assert row.input_tokens_min <= row.input_tokens_max <= row.padded_length
        ev = s.scalars(select(CompileEvent).where(CompileEvent.run_id == run_id)).one()
        # Cold engine: the first shape compiles, each later new length recompiles. A
        # prompt's shape compiles in whichever of its optimized and direct calls ran first:
        # the event holds the optimized calls' share, details.ab_compile the arms'.
        assert (ev.graphs, ev.recompiles, ev.instance_id) == (
            result.compile.graphs, result.compile.recompiles, "replica-a")
        arms = run.details["ab_compile"]
        assert (ev.graphs + arms["graphs"], ev.recompiles + arms["recompiles"]) == (20, 9)
        assert all("size mismatch" in k for k in ev.recompile_reasons)
        assert run.details["jobs_during"] == []
        pairs = run.details["pairs"]
        assert len(pairs) == 10 and pairs[0] == {
            "bucket": "16", "prompt": result.pairs[0].prompt,
            "order": list(result.pairs[0].order),
            "latency_s": pytest.approx(dict(result.pairs[0].latency_s))}
        assert {frozenset(p["order"]) for p in pairs} == {
            frozenset({"optimized", "eager", "direct"})}
        assert all(set(p["latency_s"]) == set(p["order"]) for p in pairs)
        mem = s.scalars(select(MemorySample).order_by(MemorySample.at)).all()
        assert [m.rss_bytes for m in mem] == [result.memory_before.rss_bytes,
                                              result.memory_after.rss_bytes]


def test_timed_out_cycle_stored_as_timeout(sessionmaker: sessionmaker[Session],
                                           engine: FakeEngine, suites: dict) -> None:
    engine.hang.set()
    cycle = ProbeCycle(engine, suites, instance_id="a", timeout_s=0.1, rng=random.Random(0))
    run_id = store(sessionmaker, cycle.run("in_domain"))
    with sessionmaker() as s:
        run = s.get(ProbeRun, run_id)
        assert run.status == "timeout" and "cycle_timeout_s" in run.error
    engine.release.set()


def test_burst_stored_as_burst_run(sessionmaker: sessionmaker[Session],
                                   engine: FakeEngine, suites: dict) -> None:
    burst = run_burst(engine, suites["in_domain"].prompts, instance_id="a", suite="in_domain",
                      rate_per_s=400.0, duration_s=0.05, concurrency=2, rng=random.Random(3))
    run_id = store(sessionmaker, burst)
    with sessionmaker() as s:
        run = s.get(ProbeRun, run_id)
        assert (run.kind, run.requests, run.rejections) == ("burst", burst.offered, 0)
        assert run.details["completed"] == burst.completed > 0
        n = s.scalar(select(func.sum(ProbeResult.count)).where(ProbeResult.run_id == run_id))
        assert n == burst.completed


def test_results_are_stamped_when_the_cycle_finished(sessionmaker: sessionmaker[Session],
                                                     engine: FakeEngine, suites: dict) -> None:
    # A slowed cycle that outlasts a rule cycle must land in a window not yet judged.
    from datetime import UTC, datetime, timedelta
    ticks = iter(datetime(2026, 12, 1, 0, 0, tzinfo=UTC) + timedelta(seconds=90 * i)
                 for i in range(1000))
    cycle = ProbeCycle(engine, suites, instance_id="a", rng=random.Random(0),
                       clock=lambda: next(ticks))
    run_id = store(sessionmaker, cycle.run("in_domain"))
    with sessionmaker() as s:
        run = s.get(ProbeRun, run_id)
        ats = set(s.scalars(select(ProbeResult.at).where(ProbeResult.run_id == run_id)))
        assert run.finished_at > run.started_at
        assert ats == {run.finished_at}
