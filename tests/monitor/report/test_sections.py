"""Both renderers walk monitor.report.sections.SECTIONS: one list sets the sections' order."""

from __future__ import annotations

import re
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from monitor.report import build_report, load_registry, render_html, render_markdown, sections
from monitor.report.model import WeeklyReport
from monitor.report.sections import Bullets, Heading, Item, Paragraph, Section
from monitor.report.tables import Table
from monitor.settings import Settings
from tests.monitor.report.synthetic import fill_week


@pytest.fixture
def report(sessionmaker, report_settings: Settings) -> WeeklyReport:
    fill_week(sessionmaker)
    with sessionmaker.begin() as session:
        return build_report(session, "2026-W48", datetime(2026, 11, 30, 6, tzinfo=UTC),
                            load_registry(), report_settings)


def test_both_renderers_show_the_sections_in_list_order(report: WeeklyReport) -> None:
    titles = [s.title for s in sections.SECTIONS]
    assert re.findall(r"^## (.+)$", render_markdown(report), re.M) == titles
    assert re.findall(r"<h2>(.+?)</h2>", render_html(report, plots=())) == [*titles, "Plots"]


def test_a_section_added_to_the_list_appears_in_both_renderers(
        report: WeeklyReport, monkeypatch: pytest.MonkeyPatch) -> None:
    extra = Section("Canary <budget>", lambda r: (
        Heading("spend", "at risk"), Paragraph("Weeks: 1 | 2  "),
        Table(("Week", "Cost"), (("W48", "3"),)),
        Bullets((Item("cut canaries", strong="Do"),), "Then:")))
    monkeypatch.setattr(sections, "SECTIONS", (sections.SECTIONS[1], extra, sections.SECTIONS[0]))

    md = render_markdown(replace(report, recommendations=()))
    assert re.findall(r"^## (.+)$", md, re.M) == [
        "Expected vs measured speedup", "Canary <budget>", "Optimizations"]
    assert ("## Canary <budget>\n\n### spend: AT RISK\n\nWeeks: 1 | 2\n\n| Week | Cost |\n"
            "|---|---|\n| W48 | 3 |\n\nThen:\n\n- **Do** cut canaries\n\n## Optimizations") in md

    html = render_html(report, plots=())
    assert re.findall(r"<h2>(.+?)</h2>", html) == [
        "Expected vs measured speedup", "Canary &lt;budget&gt;", "Optimizations", "Plots"]
    assert ('<h2>Canary &lt;budget&gt;</h2>\n<h3>spend: <span class="s-at-risk">AT RISK'
            "</span></h3>\n<p>Weeks: 1 | 2  </p>\n<table><tr><th>Week</th><th>Cost</th></tr>"
            "<tr><td>W48</td><td>3</td></tr></table>\n<p>Then:</p><ul><li><strong>Do</strong> "
            "cut canaries</li></ul>\n<h2>Optimizations</h2>") in html
