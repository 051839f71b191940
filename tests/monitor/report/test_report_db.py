"""The report on a synthetic week written by the production writers, SQLite and PostgreSQL."""

from __future__ import annotations

import json
import math
import random
from datetime import UTC, datetime
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from engine.protocol import InMemoryFlagProvider, RuntimeFlags
from monitor.report import build_report, load_registry, render_markdown, run_weekly_report
from monitor.report.job import summary_text
from monitor.report.model import WeeklyReport
from monitor.settings import Settings
from probes.cycle import ProbeCycle
from storage.models import Report, WebhookDelivery
from tests.monitor.report.synthetic import LATENCY, fill_week
from tests.probes.fakes import FakeEngine, FakeTimings, placeholder_suites, store

NOW = datetime(2026, 11, 30, 6, 0, tzinfo=UTC)


def _check(report: WeeklyReport, opt: str, check_id: str):  # type: ignore[no-untyped-def]
    review = next(o for o in report.optimizations if o.name == opt)
    return next(c for c in review.checks if c.assumption.id == check_id)


# tests/monitor/conftest.py pins db_kind to SQLite; the core case runs on both databases.
@pytest.mark.parametrize("db_kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_synthetic_week_verdicts_and_numbers(sessionmaker, report_settings: Settings) -> None:
    fill_week(sessionmaker)
    with sessionmaker.begin() as session:
        report = build_report(session, "2026-W48", NOW, load_registry(), report_settings)

    status = {o.name: o.status for o in report.optimizations}
    assert status == {"torch.compile": "holds", "bucketing": "violated",
                      "static KV cache": "at risk", "speculative decoding": "violated",
                      "int8 weights": "no data",  # the synthetic week has no int8 rows
                      # Its C step: the compiled step takes 1.2x its time (synthetic.py).
                      "C decode step": "holds",
                      # Traffic ran one row at a time: speculation measured slower per
                      # token than direct there; no burst arms, no batching loop.
                      "continuous batching": "violated"}
    assert report.counts() == {"holds": 6, "at risk": 1, "violated": 4, "no data": 5}

    acc = _check(report, "speculative decoding", "acceptance")
    assert acc.status == "violated"
    per = {b.bucket: (b.verdict.status, b.verdict.value) for b in acc.buckets}
    # The fake engine's acceptance: 0.8 in-domain, 0.4 per proposal (rounded per request).
    assert per == {"16": ("holds", pytest.approx(0.8)), "64": ("violated", pytest.approx(0.40625))}
    assert "9100 accepted / 22400 proposed" in acc.verdict.detail
    assert acc.window.startswith("2026-11-23T00:00Z .. 2026-11-30T00:00Z")

    waste = _check(report, "bucketing", "padding-waste")
    assert (waste.status, waste.verdict.value) == ("violated", pytest.approx(0.30))
    fit = _check(report, "bucketing", "largest-bucket-fits")
    assert (fit.status, fit.verdict.value) == ("holds", pytest.approx(1400 / 1401))
    assert _check(report, "bucketing", "bucketing-speedup").status == "no data"

    kv = _check(report, "static KV cache", "kv-budget")
    assert (kv.status, kv.verdict.value) == ("at risk", pytest.approx(0.70))
    assert kv.verdict.projected == pytest.approx(1.075)
    growth = _check(report, "static KV cache", "memory-growth")
    assert (growth.status, growth.verdict.value) == ("holds", pytest.approx(0.01, rel=1e-4))

    rec = _check(report, "torch.compile", "no-recompiles-after-warmup")
    assert (rec.status, rec.verdict.value) == ("holds", 0.0)

    compile_ = next(o for o in report.optimizations if o.name == "torch.compile")
    assert {s.bucket: s.measured for s in compile_.speedups} == {
        "16": pytest.approx(1.5), "64": pytest.approx(1.4)}
    # Over every bucket's pairs: 168 at 1.4 and 168 at 1.5, so the median of the logarithms
    # is the geometric mean of the two middle ratios.
    assert compile_.measured_speedup == pytest.approx(math.sqrt(1.5 * 1.4))
    assert compile_.overall is not None and compile_.overall.pairs == 336
    assert (compile_.overall.ci_low, compile_.overall.ci_high) == (
        pytest.approx(1.4), pytest.approx(1.5))
    cs = _check(report, "torch.compile", "compile-speedup")
    assert cs.status == "holds"
    assert {b.bucket: b.verdict.value for b in cs.buckets} == {
        "16": pytest.approx(1.5 / 1.3), "64": pytest.approx(1.4 / 1.3)}
    assert [b.verdict.detail.split(";")[0] for b in cs.buckets] == [
        "measured 1.50x / expected 1.3x", "measured 1.40x / expected 1.3x"]
    spec = next(o for o in report.optimizations if o.name == "speculative decoding")
    assert {s.bucket: s.measured for s in spec.speedups} == {
        "16": pytest.approx(1.3), "64": pytest.approx(0.9)}
    sp = _check(report, "speculative decoding", "spec-speedup")
    assert sp.status == "violated" and sp.verdict.value == pytest.approx(0.9 / 1.4)

    assert [(c.name, c.slower_buckets) for c in report.costly] == [
        ("speculative decoding", (("64", pytest.approx(0.9)),))]
    (row,) = report.costly[0].rows
    assert row.turn_off == ('speculative=false in scope 64: PUT /v1/flags/speculative '
                            '{"scope": "64", "value": false}')
    assert "median of 168 per-prompt pairs in 42 A/B cycles" in row.evidence

    assert report.data.p99_week == {"16": pytest.approx(0.2), "64": pytest.approx(0.3)}
    assert report.data.baseline_p99 == {"16": pytest.approx(0.18), "64": pytest.approx(0.25)}
    assert [a.name for a in report.alerts] == ["acceptance_drop"]
    assert "pending -> firing (acceptance_rate 0.4 vs baseline 0.7 (-43%))" in \
        report.alerts[0].transitions[-1]
    assert [(f.flag, f.actor, f.reason) for f in report.flag_changes] == [
        ("speculative[64]", "auto-fallback (auto)", "acceptance_drop fired in bucket 64")]

    assert report.shapes is not None
    # Exact lengths (6 and 50 tokens): waste from the data, (700*10 + 700*14) / 56000.
    assert (report.shapes.p50, report.shapes.p99, report.shapes.requests) == (50, 50, 1401)
    assert report.shapes.padding_waste == pytest.approx(16800 / 56000)
    recs = {r.kind: r for r in report.recommendations}
    assert recs["bucket_edges"].text.endswith("to [8, 56]")  # pads 12.5%, the least
    assert "30.0% -> 12.5%" in recs["bucket_edges"].evidence
    assert recs["context_cap"].text.startswith("Cap the context at 56 tokens")
    assert recs["speculation_off"].text == "Keep speculation off in bucket 64"

    md = render_markdown(report)
    assert "### speculative decoding: VIOLATED" in md
    assert "### torch.compile: HOLDS" in md
    assert "| speculative decoding | 64 | direct | 1.4 | 0.9 | 0.9-0.9 | 168 |" in md
    assert "| speculative decoding | 64 | 0.90x | median of 168" in md
    # The C step's line: the compiled_step arm against the C step, reviewed as an assumption.
    assert "### C decode step: HOLDS" in md
    assert "| C decode step | all (every bucket's pairs) | compiled_step | 1.3 | 1.2 |" in md
    faster = _check(report, "C decode step", "native-step-faster")
    assert faster.status == "holds"
    assert {b.bucket: round(b.verdict.value, 6) for b in faster.buckets} == {"16": 1.2, "64": 1.2}
    assert "every measured optimization earns its cost" not in md
    assert "last week's change" not in md


@pytest.mark.parametrize("db_kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_the_report_quotes_the_speedups_the_api_serves(
        sessionmaker, report_settings: Settings, client: TestClient,
        auth: dict[str, str]) -> None:
    # One database: the week the real prober wrote (synthetic.py), read by the report and
    # by the service's GET /v1/probes/speedups over the same window.
    fill_week(sessionmaker)
    with sessionmaker.begin() as session:
        report = build_report(session, "2026-W48", NOW, load_registry(), report_settings)
    r = client.get("/v1/probes/speedups", headers=auth,
                   params={"since": report.start.isoformat(), "until": report.end.isoformat()})
    assert r.status_code == 200, r.text
    served = {(s["optimization"], s["bucket"]): s for s in r.json()}
    assert len(served) == 9  # compile, speculative, native_step: buckets 16, 64 and all
    names = {"torch.compile": "compile", "speculative decoding": "speculative",
             "C decode step": "native_step"}
    shown = {(names[o.name], s.bucket): s for o in report.optimizations if o.name in names
             for s in (*o.speedups, o.overall) if s is not None}
    assert shown.keys() == served.keys()
    for key, s in served.items():
        assert shown[key].measured == pytest.approx(s["speedup"], rel=0.01), key
        assert (shown[key].pairs, shown[key].ci_low, shown[key].ci_high) == (
            s["pairs"], s["ci_low"], s["ci_high"]), key
    # Speculation is listed as costing more than it earns wherever it is slower than
    # direct (bucket 64 at 0.9x; 1.3x in bucket 16, and over both buckets it pays).
    slower = {b for (o, b), s in served.items() if o == "speculative" and s["speedup"] < 1}
    assert slower == {"64"}
    (spec,) = [c for c in report.costly if c.name == "speculative decoding"]
    assert {row.bucket for row in spec.rows} == slower
    md = render_markdown(report).split("## Optimizations that cost more than they earn")[1]
    assert "| speculative decoding | 64 | 0.90x |" in md.split("\n## ")[0]


def test_every_optimization_that_pays_earns_its_cost(sessionmaker,
                                                      report_settings: Settings) -> None:
    faster = {**LATENCY, ("64", "compiled", "direct"): 0.39}  # speculation 1.3x in 64 too
    fill_week(sessionmaker, faster)
    with sessionmaker.begin() as session:
        report = build_report(session, "2026-W48", NOW, load_registry(), report_settings)
    assert report.costly == () and report.measured
    md = render_markdown(report)
    assert ("## Optimizations that cost more than they earn\n\n"
            "_every measured optimization earns its cost_") in md


def test_speculation_switched_back_on_is_measured_and_already_off(
        sessionmaker, report_settings: Settings) -> None:
    # Bucket 64 runs direct all week (its flag is off): its A/B arm speculates, and that
    # is slower (0.27 s direct vs 0.30 s speculative): off is right, and the report says so.
    fill_week(sessionmaker, {**LATENCY, ("64", "eager", "direct"): 0.39},
              speculation_off=("64",))
    with sessionmaker.begin() as session:
        report = build_report(session, "2026-W48", NOW, load_registry(), report_settings)
    spec = next(o for o in report.optimizations if o.name == "speculative decoding")
    assert {(s.bucket, s.arm): s.measured for s in spec.speedups} == {
        ("16", "direct"): pytest.approx(1.3), ("64", "speculative"): pytest.approx(0.9)}
    (costly,) = report.costly
    assert [(r.bucket, r.turn_off) for r in costly.rows] == [
        ("64", "already off (speculative=false; measured switched back on): keep it off")]


def test_empty_week_gives_no_data_report(sessionmaker, report_settings: Settings) -> None:
    with sessionmaker.begin() as session:
        report = build_report(session, "2026-W48", NOW, load_registry(), report_settings)
    assert not report.has_data
    assert report.counts()["no data"] == sum(report.counts().values())
    assert report.shapes is None and report.recommendations == () and report.costly == ()
    assert not report.measured
    md = render_markdown(report)
    assert "**No data: nothing was recorded in this week's window.**" in md
    assert "## Optimizations that cost more than they earn\n\n_nothing measured" in md
    assert "earns its cost" not in md
    sp = _check(report, "speculative decoding", "spec-speedup")
    assert sp.status == "no data" and "nothing measured" in sp.verdict.reason
    assert "no data was recorded" in summary_text(report)[1]


def test_run_weekly_report_stores_and_writes(sessionmaker, report_settings: Settings,
                                            tmp_path: Path) -> None:
    fill_week(sessionmaker)
    first = run_weekly_report(sessionmaker, report_settings, NOW)
    # Monday 06:00 of W49 reviews W48; a re-run replaces the row instead of adding one.
    again = run_weekly_report(sessionmaker, report_settings, NOW)
    assert first.week == again.week == "2026-W48"
    assert first.report_id == again.report_id
    assert first.markdown_path == tmp_path / "reports" / "report-2026-W48.md"
    assert first.html_path.read_text().startswith("<!DOCTYPE html>")
    with sessionmaker.begin() as session:
        rows = session.scalars(select(Report)).all()
        assert [r.week for r in rows] == ["2026-W48"]
        assert rows[0].markdown == first.markdown_path.read_text()
        assert rows[0].summary["counts"] == {"holds": 6, "at risk": 1, "violated": 4,
                                             "no data": 5}
        assert rows[0].summary["costly"] == ["speculative decoding"]
        assert rows[0].summary["measured"] is True
    title, text = summary_text(first.report)
    assert "2026-W48: 4 violated, 1 at risk, 6 hold" in text
    assert "Costs more than it earns: speculative decoding (1.08x)" in text


def test_summary_goes_to_the_outbox_once_per_week(sessionmaker, report_settings: Settings) -> None:
    settings = report_settings.model_copy(update={
        "report": report_settings.report.model_copy(update={"notify": True}),
        "alerts": report_settings.alerts.model_copy(update={"webhooks": [
            {"name": "ops", "url": "http://127.0.0.1:9/hook"}]}),
    })
    fill_week(sessionmaker)
    assert run_weekly_report(sessionmaker, settings, NOW).enqueued == 1
    assert run_weekly_report(sessionmaker, settings, NOW).enqueued == 0  # same week: no repeat
    with sessionmaker.begin() as session:
        rows = session.scalars(select(WebhookDelivery)).all()
        assert [(r.target, r.idempotency_key, r.state) for r in rows] == [
            ("ops", "report-2026-W48", "pending")]
        assert "4 violated, 1 at risk" in json.dumps(rows[0].payload)


def test_the_last_seven_days_on_day_one_have_data_and_are_not_stored(
        sessionmaker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # The synthetic week ends Sunday 2026-11-29: on Monday its days are the last seven.
    from monitor.report.week import last_seven_days

    fill_week(sessionmaker)
    now = datetime(2026, 11, 30, 9, tzinfo=UTC)
    window = last_seven_days(now)
    assert (window.start, window.end) == (datetime(2026, 11, 24, tzinfo=UTC),
                                          datetime(2026, 12, 1, tzinfo=UTC))
    outcome = run_weekly_report(sessionmaker, Settings(database_url="sqlite://"), now,
                                week=window, out_dir=tmp_path, notify=False)
    assert outcome.week == "2026-11-24..2026-11-30"
    assert outcome.report.has_data
    assert outcome.report_id is None
    with sessionmaker() as session:
        assert session.scalars(select(Report)).all() == []


@pytest.mark.parametrize("db_kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_costly_evidence_reads_without_vs_with_when_the_flag_changed_in_the_week(
        sessionmaker, report_settings: Settings) -> None:
    # Speculation costs 0.4 s, direct 0.2 s in bucket 16. One cycle measures it with the
    # `direct` arm (speculation on), three with the reverse `speculative` arm (its flag off
    # in 16, as the engine's or the policy's fallback leaves it): the optimized request is
    # the slow side in one cycle and the fast side in three.
    flags = InMemoryFlagProvider(RuntimeFlags())
    engine = FakeEngine(flags=flags, timings=FakeTimings(total_s={
        ("16", "compiled", "speculative"): 0.4, ("16", "compiled", "direct"): 0.2}))
    engine.warm_up()
    suites = placeholder_suites(per_bucket=2)
    for i, off in enumerate((False, True, True, True)):
        flags.set(RuntimeFlags(speculative={"16": False} if off else {}))
        at = datetime(2026, 11, 25, 12, i, tzinfo=UTC)
        store(sessionmaker, ProbeCycle(engine, suites, instance_id="a", canaries_per_bucket=2,
                                       ab_share=1.0, ab_arms=("direct",), rng=random.Random(i),
                                       clock=lambda at=at: at).run("in_domain"))
    with sessionmaker.begin() as session:
        report = build_report(session, "2026-W48", NOW, load_registry(), report_settings)
    (costly,) = [c for c in report.costly if c.name == "speculative decoding"]
    row = next(r for r in costly.rows if r.bucket == "16")
    assert row.measured == pytest.approx(0.5)
    # The faster side is the one without speculation, as the 0.5x says.
    assert "without it 200.0 ms vs with it 400.0 ms (medians; arms direct/speculative)" in \
        row.evidence, row.evidence


def test_the_report_reads_without_holding_the_write_lock(
        sessionmaker, report_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    from monitor.report import job
    from storage.db import make_engine, make_sessionmaker
    from storage.models import TrafficRollup
    from tests.alerts.builders import add_traffic

    fill_week(sessionmaker)
    # A second engine that does not wait for a lock (SQLite: busy timeout 0).
    other = make_sessionmaker(make_engine(sessionmaker.kw["bind"].url, busy_timeout_s=0.0))
    real = job.build_report

    def build_while_writing(session, *args, **kwargs):  # type: ignore[no-untyped-def]
        # The serving process's write (BEGIN IMMEDIATE on SQLite) once the report's
        # transaction has begun: it fails at once if the report held the write lock.
        session.scalar(select(Report.id).limit(1))
        with other.begin() as s:
            add_traffic(s, NOW, "64", acceptance=0.6)
        return real(session, *args, **kwargs)

    monkeypatch.setattr(job, "build_report", build_while_writing)
    try:
        outcome = run_weekly_report(sessionmaker, report_settings, NOW)
    finally:
        other.kw["bind"].dispose()
    assert outcome.week == "2026-W48" and outcome.report_id is not None
    with sessionmaker() as session:
        assert session.scalar(select(TrafficRollup.id).where(TrafficRollup.minute == NOW)) \
            is not None
