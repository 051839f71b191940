"""The weekly assumption-review report.

Each optimization's assumptions (registry: `assumptions.yaml` plus a user file) are judged
on one ISO week of measurements: holds, at risk, violated or no data, with the evidence.

    build_report(session, "2026-W48", now, registry, settings) -> WeeklyReport
    render_markdown(report) / render_html(report)  -> str
    job.run_weekly_report(sessionmaker, settings, now) -> ReportOutcome  (scheduled job)

Errors (monitor.report.errors):
    ReportError
    ├── InvalidWeek (ValueError)
    └── RegistryError (ValueError)
"""

from __future__ import annotations

from monitor.report.builder import build_from_data
from monitor.report.errors import InvalidWeek, RegistryError, ReportError
from monitor.report.html import render_html
from monitor.report.job import build_report, run_weekly_report
from monitor.report.markdown import render_markdown
from monitor.report.model import WeeklyReport
from monitor.report.registry import Registry, load_registry
from monitor.report.week import Week, last_complete_week, parse_week

__all__ = [
    "InvalidWeek",
    "Registry",
    "RegistryError",
    "ReportError",
    "Week",
    "WeeklyReport",
    "build_from_data",
    "build_report",
    "last_complete_week",
    "load_registry",
    "parse_week",
    "render_html",
    "render_markdown",
    "run_weekly_report",
]

