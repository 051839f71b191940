"""The weekly report's "What this monitor can see" section reads the stored estimates."""

from __future__ import annotations

from datetime import UTC, datetime

from monitor.report import build_report, load_registry, render_markdown
from monitor.report.html import render_html
from monitor.settings import Settings
from storage.models import RuleSensitivity

NOW = datetime(2026, 11, 30, 6, 0, tzinfo=UTC)
WHY = "threshold +15% -> +27% (noise: 30 days would page 3 times at +15%)"


def _row(bucket: str, **kw: object) -> RuleSensitivity:
    fields: dict[str, object] = dict(
        rule="p99_latency_regression", metric="p99_latency",
        scope={"bucket": bucket, "source": "canary"}, scope_key=f"bucket={bucket},source=canary",
        model_version="m1", config_hash="c1", computed_at=NOW, status="ok", direction=1,
        cycles=1440, within_cycles=10, configured_threshold=0.15, threshold=0.15,
        detectable_change=0.22, false_pages_30d=0.0, false_pages_configured=0.0,
        budget_per_30d=0.5, reason="", cpu_s=0.3)
    fields.update(kw)
    return RuleSensitivity(**fields)


def test_section_states_each_series_widened_ones_first(sessionmaker,
                                                        report_settings: Settings) -> None:
    with sessionmaker.begin() as s:
        s.add_all([_row("16"),
                   _row("64", threshold=0.27, detectable_change=0.31, false_pages_30d=0.5,
                        false_pages_configured=3.0, reason=WHY),
                   _row("256", status="insufficient history", detectable_change=None,
                        false_pages_30d=None, false_pages_configured=None,
                        reason="insufficient history: 100 of 360 cycles")])
    with sessionmaker.begin() as s:
        report = build_report(s, "2026-W48", NOW, load_registry(), report_settings)
    assert [r.scope for r in report.data.sensitivity] == [
        "bucket=64,source=canary", "bucket=16,source=canary", "bucket=256,source=canary"]
    md = render_markdown(report)
    section = md.split("## What this monitor can see", 1)[1].split("##", 1)[0]
    assert (f"| p99_latency_regression | bucket=64,source=canary | m1/c1 | +31% within 10 "
            f"cycles | 0.5 | +27% | {WHY} |") in section
    assert "| +22% within 10 cycles | 0 | +15% | as configured |" in section
    assert "| insufficient history | - | +15% | insufficient history: 100 of 360 cycles |" \
        in section
    assert "<h2>What this monitor can see</h2>" in render_html(report)
