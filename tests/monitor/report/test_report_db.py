"""The report on a synthetic week stored in SQLite and PostgreSQL."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import select

from monitor.report import build_report, load_registry, render_markdown, run_weekly_report
from monitor.report.job import summary_text
from monitor.report.model import WeeklyReport
from monitor.settings import Settings
from storage.models import Report, WebhookDelivery
from tests.monitor.report.synthetic import fill_week

NOW = datetime(2026, 11, 30, 6, 0, tzinfo=UTC)


def _check(report: WeeklyReport, opt: str, check_id: str):  # type: ignore[no-untyped-def]
    review = next(o for o in report.optimizations if o.name == opt)
    return next(c for c in review.checks if c.assumption.id == check_id)


# tests/monitor/conftest.py pins db_kind to SQLite; the core case runs on both databases.
@pytest.mark.parametrize("db_kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_synthetic_week_verdicts_and_numbers(sessionmaker, report_settings: Settings) -> None:
    with sessionmaker.begin() as session:
        fill_week(session)
    with sessionmaker.begin() as session:
        report = build_report(session, "2026-W48", NOW, load_registry(), report_settings)

    status = {o.name: o.status for o in report.optimizations}
    assert status == {"torch.compile": "holds", "bucketing": "violated",
                      "static KV cache": "at risk", "speculative decoding": "violated",
                      "int8 weights": "no data"}  # the synthetic week has no int8 rows
    assert report.counts() == {"holds": 4, "at risk": 1, "violated": 3, "no data": 3}

    acc = _check(report, "speculative decoding", "acceptance")
    assert acc.status == "violated"
    per = {b.bucket: (b.verdict.status, b.verdict.value) for b in acc.buckets}
    assert per == {"16": ("holds", pytest.approx(0.8)), "64": ("violated", pytest.approx(0.4))}
    assert "280 accepted / 700 proposed" in acc.verdict.detail
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
    assert compile_.measured_speedup == pytest.approx(math.sqrt(1.5 * 1.4))
    spec = next(o for o in report.optimizations if o.name == "speculative decoding")
    assert {s.bucket: s.measured for s in spec.speedups} == {
        "16": pytest.approx(1.3), "64": pytest.approx(0.9)}
    sp = _check(report, "speculative decoding", "spec-speedup")
    assert sp.status == "violated" and sp.verdict.value == pytest.approx(0.9 / 1.4)

    assert [(c.name, c.slower_buckets) for c in report.costly] == [
        ("speculative decoding", (("64", pytest.approx(0.9)),))]

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
    assert "| speculative decoding | 64 | direct | 1.4 | 0.9 |" in md
    assert "last week's change" not in md


def test_empty_week_gives_no_data_report(sessionmaker, report_settings: Settings) -> None:
    with sessionmaker.begin() as session:
        report = build_report(session, "2026-W48", NOW, load_registry(), report_settings)
    assert not report.has_data
    assert report.counts()["no data"] == sum(report.counts().values())
    assert report.shapes is None and report.recommendations == () and report.costly == ()
    md = render_markdown(report)
    assert "**No data: nothing was recorded in this week's window.**" in md
    assert "no data was recorded" in summary_text(report)[1]


def test_run_weekly_report_stores_and_writes(sessionmaker, report_settings: Settings,
                                            tmp_path: Path) -> None:
    with sessionmaker.begin() as session:
        fill_week(session)
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
        assert rows[0].summary["counts"] == {"holds": 4, "at risk": 1, "violated": 3,
                                             "no data": 3}
        assert rows[0].summary["costly"] == ["speculative decoding"]
    title, text = summary_text(first.report)
    assert "2026-W48: 3 violated, 1 at risk, 4 hold" in text
    assert "Costs more than it earns: speculative decoding (1.08x)" in text


def test_summary_goes_to_the_outbox_once_per_week(sessionmaker, report_settings: Settings) -> None:
    settings = report_settings.model_copy(update={
        "report": report_settings.report.model_copy(update={"notify": True}),
        "alerts": report_settings.alerts.model_copy(update={"webhooks": [
            {"name": "ops", "url": "http://127.0.0.1:9/hook"}]}),
    })
    with sessionmaker.begin() as session:
        fill_week(session)
    assert run_weekly_report(sessionmaker, settings, NOW).enqueued == 1
    assert run_weekly_report(sessionmaker, settings, NOW).enqueued == 0  # same week: no repeat
    with sessionmaker.begin() as session:
        rows = session.scalars(select(WebhookDelivery)).all()
        assert [(r.target, r.idempotency_key, r.state) for r in rows] == [
            ("ops", "report-2026-W48", "pending")]
        assert "3 violated, 1 at risk" in json.dumps(rows[0].payload)


def test_the_last_seven_days_on_day_one_have_data_and_are_not_stored(
        sessionmaker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # The synthetic week ends Sunday 2026-11-29: on Monday its days are the last seven.
    from monitor.report.week import last_seven_days

    with sessionmaker.begin() as session:
        fill_week(session)
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
