"""Output agreement: the pure comparison, and references per cohort through the Prober."""

from __future__ import annotations

import logging
import random
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from engine.errors import Overloaded
from engine.protocol import REFERENCE, FlagOverride, GenerateResult
from probes.prober import Prober
from probes.quality import compare, prompt_key
from probes.reference import OutputChecker
from storage.models import CanaryReference, OutputAgreement
from storage.queries import quality as quality_queries
from storage.writer import Writer
from tests.probes.fakes import FakeEngine, placeholder_suites, prompt_of
from vocab import utcnow


def test_compare_exact_prefix_and_divergence() -> None:
    same = compare([1, 2, 3], [1, 2, 3])
    assert (same.exact, same.agreement, same.length_diff, same.first_divergence) == (
        True, 1.0, 0, None)
    diverged = compare([1, 9, 3, 4], [1, 2, 3, 4])
    assert (diverged.exact, diverged.agreement, diverged.first_divergence) == (False, 0.75, 1)
    prefix = compare([1, 2], [1, 2, 3, 4])
    assert (prefix.exact, prefix.agreement, prefix.length_diff, prefix.first_divergence) == (
        False, 1.0, -2, 2)
    assert compare([], []).agreement == 1.0
    empty = compare([], [5])
    assert (empty.agreement, empty.first_divergence) == (0.0, 0)


def test_prompt_key_depends_on_the_token_budget_and_the_text() -> None:
    assert prompt_key("a b", 16) != prompt_key("a b", 32)
    assert prompt_key("a b", 16) != prompt_key("a c", 16)
    # Stored references are found again by a later process or release: the key is pinned.
    assert prompt_key("a b", 16) == (
        "36f8f05f20fc02f909ab3a88bede9ecbfb1d8a0ff31638d776edae541991b294")


class SpyEngine(FakeEngine):
    """The fake engine, counting reference-path calls; `shift` perturbs one bucket's output."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.reference_calls = 0
        self.shift_bucket: str | None = None

    def generate(self, text: str, *, override: FlagOverride | None = None,
                 **kw: Any) -> GenerateResult:
        r = super().generate(text, override=override, **kw)
        if override == REFERENCE:
            self.reference_calls += 1
        elif r.bucket == self.shift_bucket:
            ids = (r.output_ids[0], *(i + 1 for i in r.output_ids[1:]))
            return GenerateResult(**{**r.__dict__, "output_ids": ids})
        return r


def _prober(engine: FakeEngine, sessions: sessionmaker[Session], writer: Writer) -> Prober:
    checker = OutputChecker(engine, sessions=sessions, writer=writer)
    return Prober(engine, writer, placeholder_suites(per_bucket=2), instance_id="a",
                  canaries_per_bucket=2, ab_share=0.0, rng=random.Random(0), checker=checker)


def test_references_per_cohort_and_agreement_rows(sessionmaker: sessionmaker[Session]) -> None:
    writer = Writer(sessionmaker)
    try:
        first = SpyEngine(model_version="model-a")
        prober = _prober(first, sessionmaker, writer)
        prober.run_cycle(ab=True)
        canaries = 10  # 5 buckets x 2 prompts
        assert first.reference_calls == canaries
        prober.run_cycle()
        assert first.reference_calls == canaries  # kept in memory: not generated again
        assert writer.flush(timeout=30) and writer.stats.failed == 0

        # A new cohort (another model) generates its own references.
        other = SpyEngine(model_version="model-b")
        _prober(other, sessionmaker, writer).run_cycle()
        assert other.reference_calls == canaries
        # The first cohort again (a restart): its references load from SQL.
        assert writer.flush(timeout=30)
        again = SpyEngine(model_version="model-a")
        again.shift_bucket = "32"
        p = _prober(again, sessionmaker, writer)
        p.run_cycle()
        assert again.reference_calls == 0
        assert writer.flush(timeout=30) and writer.stats.failed == 0
        by_bucket = {g.bucket: g for g in p.agreements}
        assert by_bucket["32"].exact == 0 and by_bucket["32"].agreement is not None
        assert by_bucket["32"].agreement < 0.1 and by_bucket["32"].first_divergence_min == 1
        assert by_bucket["16"].exact == by_bucket["16"].count == 2
        # What the prober measured is what the read path returns: one view, stored.
        with sessionmaker() as s:
            stored = quality_queries.agreements(s, utcnow() - timedelta(days=1),
                                                utcnow() + timedelta(minutes=1))
        newest = {r.key: r for r in stored}  # oldest first: the last cycle's rows win
        for g in p.agreements:
            row = newest[g.key]
            assert (row.count, row.exact, row.agreement, row.first_divergence_min) == (
                g.count, g.exact, g.agreement, g.first_divergence_min)
            assert [w["key"] for w in row.worst] == [str(w["key"])[:16] for w in g.worst]
    finally:
        writer.close()
    with sessionmaker() as s:
        refs = s.execute(select(CanaryReference.model_version)).scalars().all()
        rows = s.scalars(select(OutputAgreement)).all()
    assert sorted(set(refs)) == ["model-a", "model-b"] and len(refs) == 2 * canaries
    variants = {r.variant for r in rows}
    assert {"optimized", "eager", "direct"} <= variants  # the A/B arms are compared too
    worst = [r for r in rows if r.bucket == "32" and r.exact == 0]
    assert worst and worst[-1].worst[0]["first_divergence"] == 1
    assert all(r.run_id is not None and r.source == "canary" for r in rows)


def test_golden_answers_are_counted_per_bucket_and_arm(
        sessionmaker: sessionmaker[Session], tmp_path: Any) -> None:
    from probes.canaries import load_suites_file

    engine = FakeEngine(model_version="model-g")
    right = [prompt_of(10 - i, seed=i) for i in range(2)]  # bucket 16
    wrong = [prompt_of(25 - i, seed=i) for i in range(2)]  # bucket 32
    lines = [f"      - {{text: '{p}', expected: '{engine.generate(p, max_new_tokens=16).text}'}}"
             for p in right]
    lines += [f"      - {{text: '{wrong[0]}', expected: 'not what it says'}}",
              f"      - '{wrong[1]}'", f"      - '{prompt_of(50)}'"]
    f = tmp_path / "golden.yaml"
    f.write_text("suites:\n  - name: g\n    domain: d\n    max_new_tokens: 16\n"
                 "    prompts:\n" + "\n".join(lines) + "\n")
    suites = load_suites_file(f)
    writer = Writer(sessionmaker)
    try:
        checker = OutputChecker(engine, sessions=sessionmaker, writer=writer)
        prober = Prober(engine, writer, suites, instance_id="a", suite="g",
                        canaries_per_bucket=2, ab_share=0.0, rng=random.Random(0),
                        checker=checker)
        prober.run_cycle(ab=True)
        assert writer.flush(timeout=30) and writer.stats.failed == 0
    finally:
        writer.close()
    with sessionmaker() as s:
        rows = s.scalars(select(OutputAgreement)).all()
    got = {(r.bucket, r.variant): (r.golden_count, r.golden_exact) for r in rows}
    assert got[("16", "optimized")] == (2, 2)
    assert got[("32", "optimized")] == (1, 0)  # one canary has no golden answer
    assert got[("64", "optimized")] == (0, 0)
    assert got[("16", "eager")] == (2, 2)  # A/B arms are checked too
    assert {g.bucket: g.golden_accuracy for g in prober.agreements}["32"] == 0.0


class SheddingEngine(SpyEngine):
    """Refuses reference-path requests (synthetic) while `waiting` real requests wait."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.waiting = 0
        self.refused = 0

    def generate(self, text: str, *, override: FlagOverride | None = None,
                 **kw: Any) -> GenerateResult:
        if override == REFERENCE and self.waiting:
            self.refused += 1
            raise Overloaded(f"synthetic request refused: {self.waiting} real requests waiting")
        return super().generate(text, override=override, **kw)


def test_references_shed_for_real_traffic_wait_for_a_later_cycle(
        sessionmaker: sessionmaker[Session], caplog: pytest.LogCaptureFixture) -> None:
    engine = SheddingEngine(model_version="model-s")
    checker = OutputChecker(engine, sessions=sessionmaker)
    prompts = [prompt_of(10 + i, seed=i) for i in range(4)]
    engine.waiting = 2
    with caplog.at_level(logging.INFO, logger="probes.reference"):
        assert checker.references(("model-s", "c"), prompts, 16) == {}
    # One refusal ends the cycle's attempts: the rest would be shed too, each a warning.
    assert engine.refused == 1 and checker.generated == 0
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "4 left for a later cycle" in caplog.records[0].getMessage()
    engine.waiting = 0
    assert len(checker.references(("model-s", "c"), prompts, 16)) == 4
    assert engine.reference_calls == 4
