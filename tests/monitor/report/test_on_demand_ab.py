"""The week's speedups read the drawn (and requested) A/B cycles, not the on-demand ones.

The arms also run in the cycle after a slow one (probes.ab_schedule, details["ab_reason"]
"slowdown"); those cycles crowd into slow periods, so a week's speedup over them would
over-sample its slow hours. Every cycle here is run by the real ProbeCycle, stored by the
sink and read back through build_report; the slowdown cycles are the schedule's own.
"""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.orm import Session, sessionmaker

from monitor.report import build_report, load_registry, render_markdown
from monitor.report.model import WeeklyReport
from monitor.settings import Settings
from probes.canaries import CanarySuite
from probes.cycle import CycleResult, ProbeCycle
from probes.fake import FakeEngine, FakeTimings
from storage.queries.speedups import ALL_BUCKETS, load_pairs, overall, scheduled, speedups
from tests.probes.fakes import placeholder_suites, store

NOW = datetime(2026, 11, 30, 6, 0, tzinfo=UTC)
AT = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)  # within 2026-W48
OPTIMIZED = ("16", "compiled", "speculative")
EAGER = ("16", "eager", "speculative")


class Never(random.Random):
    """An rng whose A/B draws never fall within the share (the order draws still work)."""

    def random(self) -> float:
        return 0.999


def _suites() -> dict[str, CanarySuite]:
    """Return the placeholder suites cut to their two bucket-16 prompts."""
    return {n: replace(s, prompts=s.prompts[:2]) for n, s in placeholder_suites(2).items()}


def _cycle(engine: FakeEngine, share: float, rng: random.Random, minute: list[int]) -> ProbeCycle:
    def clock() -> datetime:
        minute[0] += 1
        return AT + timedelta(minutes=minute[0])

    return ProbeCycle(engine, _suites(), instance_id="a", canaries_per_bucket=2,
                      ab_share=share, ab_arms=("eager",), rng=rng, clock=clock)


def _run(sessions: sessionmaker[Session], cycle: ProbeCycle, n: int,
         ab: bool | None = None) -> list[CycleResult]:
    out = [cycle.run("in_domain", ab=ab) for _ in range(n)]
    for r in out:
        store(sessions, r)
    return out


def _report(sessions: sessionmaker[Session], settings: Settings) -> WeeklyReport:
    with sessions.begin() as session:
        return build_report(session, "2026-W48", NOW, load_registry(), settings)


def _check(report: WeeklyReport, check_id: str):  # type: ignore[no-untyped-def]
    opt = next(o for o in report.optimizations if o.name == "torch.compile")
    return opt, next(c for c in opt.checks if c.assumption.id == check_id)


def test_the_week_reads_drawn_and_requested_cycles_and_says_what_it_left_out(
        sessionmaker: sessionmaker[Session], report_settings: Settings) -> None:
    # Compile pays 1.5x (0.2 s vs 0.3 s eager) on the drawn and requested cycles; in a
    # slow period (the optimized request at 0.4 s, eager alike) it measures 1.0x, and the
    # arms run there on demand, cycle after cycle: more pairs than the drawn ones.
    engine = FakeEngine(timings=FakeTimings(total_s={OPTIMIZED: 0.2, EAGER: 0.3}))
    engine.warm_up()
    minute = [0]
    _run(sessionmaker, _cycle(engine, 1.0, random.Random(1), minute), 2)  # drawn
    _run(sessionmaker, _cycle(engine, 0.0, random.Random(2), minute), 1, ab=True)
    before = _report(sessionmaker, report_settings)
    md = render_markdown(before).split("## Expected vs measured speedup")[1].split("\n## ")[0]
    assert ("Measured over the drawn and requested A/B cycles; no cycle ran the arms on "
            "demand after a slow one this week.") in md
    assert before.summary()["ab_on_demand_left_out"] == {"cycles": 0, "prompt_pairs": 0}

    watched = _cycle(engine, 0.25, Never(), minute)
    assert not any(r.ab for r in _run(sessionmaker, watched, 6))  # steady: never drawn
    engine.timings.total_s.update({OPTIMIZED: 0.4, EAGER: 0.4})  # the slow period
    slow = _run(sessionmaker, watched, 10)
    on_demand = [r for r in slow if r.ab]
    assert on_demand and {r.ab_reason for r in on_demand} == {"slowdown"}
    left_pairs = sum(len(r.pairs) for r in on_demand)
    assert left_pairs > 6  # more than the drawn and requested cycles' 6

    # The incident cause's reader still gets every pair; over all of them compile looks
    # like it earns nothing (1.0x, under 0.8 x the expected 1.3x).
    with sessionmaker() as s:
        every = load_pairs(s, AT, AT + timedelta(days=1))
    assert len(every) == 6 + left_pairs
    everything = overall(speedups(every), "compile")
    assert everything is not None and everything.speedup == pytest.approx(1.0)
    kept, left = scheduled(every)
    assert (len(kept), len(left)) == (6, left_pairs)
    assert {p.ab_reason for p in kept} == {"drawn", "requested"}

    report = _report(sessionmaker, report_settings)
    opt, check = _check(report, "compile-speedup")
    assert opt.measured_speedup == pytest.approx(1.5)
    assert opt.overall is not None and opt.overall.pairs == 6
    assert check.status == "holds" and check.verdict.value == pytest.approx(1.5 / 1.3)
    row = next(s for s in opt.speedups if s.bucket == "16")
    assert f"; {left_pairs} pairs of cycles run on demand after a slow one left out" in \
        row.evidence, row.evidence
    md = render_markdown(report).split("## Expected vs measured speedup")[1].split("\n## ")[0]
    assert (f"Measured over the drawn and requested A/B cycles only: {left_pairs} prompt "
            f"pairs of {len(on_demand)} cycles that ran the arms on demand after a slow one "
            "are left out") in md
    assert report.summary()["ab_on_demand_left_out"] == {
        "cycles": len(on_demand), "prompt_pairs": left_pairs}
    assert report.data.ab_on_demand.pairs("compile", ALL_BUCKETS) == left_pairs


def test_a_week_of_on_demand_cycles_only_measures_nothing_and_says_why(
        sessionmaker: sessionmaker[Session], report_settings: Settings) -> None:
    engine = FakeEngine(timings=FakeTimings(total_s={OPTIMIZED: 0.2, EAGER: 0.3}))
    engine.warm_up()
    watched = _cycle(engine, 0.25, Never(), [0])
    _run(sessionmaker, watched, 6)
    engine.timings.total_s.update({OPTIMIZED: 0.4, EAGER: 0.4})
    left_pairs = sum(len(r.pairs) for r in _run(sessionmaker, watched, 4) if r.ab)
    assert left_pairs
    report = _report(sessionmaker, report_settings)
    opt, check = _check(report, "compile-speedup")
    assert opt.measured_speedup is None and opt.overall is None
    assert check.status == "no data"
    assert (f"(only {left_pairs} pairs of cycles run on demand after a slow one, left out)"
            in check.verdict.reason + check.verdict.detail), check.verdict
    md = render_markdown(report)
    assert "_nothing measured: no A/B prompt pairs this week_" in md
    assert f"Measured over the drawn and requested A/B cycles only: {left_pairs}" in md
