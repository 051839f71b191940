"""The weekly report's Rollouts section reads the stored rollout verdicts of the week."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from monitor.report import build_report, load_registry, render_markdown
from monitor.report.html import render_html
from monitor.settings import Settings
from storage.models import RolloutVerdict

NOW = datetime(2026, 11, 30, 6, 0, tzinfo=UTC)  # report of 2026-W48: Nov 23 .. Nov 30


def _verdict(at: datetime, bucket: str, verdict: str) -> RolloutVerdict:
    return RolloutVerdict(
        new_model_version="t5-v2", new_config_hash="c", old_model_version="t5-v1",
        old_config_hash="c", source="canary", metric="p99_latency", bucket=bucket,
        verdict=verdict, p_value=2e-6, relative_change=0.92, threshold=0.15, new_median=0.19,
        old_median=0.1, new_cycles=29, old_cycles=31, window_start=at - timedelta(minutes=30),
        first_at=at, updated_at=at)


def test_rollouts_section_lists_the_weeks_verdicts_fails_first(
        sessionmaker, report_settings: Settings) -> None:
    with sessionmaker.begin() as s:
        s.add_all([_verdict(datetime(2026, 11, 25, 10, tzinfo=UTC), "16", "pass"),
                   _verdict(datetime(2026, 11, 25, 10, tzinfo=UTC), "64", "fail"),
                   _verdict(datetime(2026, 11, 20, 10, tzinfo=UTC), "32", "fail")])  # W47
    with sessionmaker.begin() as s:
        report = build_report(s, "2026-W48", NOW, load_registry(), report_settings)
    assert [(r.bucket, r.verdict) for r in report.data.rollouts] == [("64", "fail"),
                                                                     ("16", "pass")]
    md = render_markdown(report)
    section = md.split("## Rollouts", 1)[1].split("##", 1)[0]
    assert "| t5-v2/c | t5-v1/c | canary | p99_latency | 64 | FAIL | +92.0% | 2e-06 | 29 |" \
        in section
    assert "<h2>Rollouts</h2>" in render_html(report)
