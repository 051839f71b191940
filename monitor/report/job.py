"""Build, store, write and announce the weekly report (the scheduled job body).

Reading and rendering happen outside any write transaction (matplotlib takes seconds and
SQLite writers hold the database lock); the Report row and the webhook summary are then
written in one short transaction, so a summary is never sent for a report that was not
stored.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from monitor.report.builder import build_from_data
from monitor.report.collect import CollectOptions, collect_week
from monitor.report.html import render_html
from monitor.report.markdown import render_markdown
from monitor.report.model import WeeklyReport
from monitor.report.registry import Registry, load_registry
from monitor.report.verdict import AT_RISK, VIOLATED
from monitor.report.week import Period, Week, last_complete_week, parse_week
from monitor.settings import Settings
from storage.db import reading
from storage.models import Report
from storage.queries.reports import report_for_week

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReportOutcome:
    """What one run produced: the stored row, the files and whether a summary was queued."""

    week: str
    report: WeeklyReport
    report_id: int | None  # None: a by-hand window review, written but not stored
    markdown_path: Path
    html_path: Path
    enqueued: int  # webhook outbox rows added for the summary


def build_report(session: Session, week: str | Period, now: datetime,
                 registry: Registry | None = None,
                 settings: Settings | None = None) -> WeeklyReport:
    """Read `week` from the database and judge every assumption in `registry`."""
    settings = settings or Settings()
    if registry is None:
        registry = load_registry(settings.report.assumptions_file)
    w = parse_week(week) if isinstance(week, str) else week
    data = collect_week(session, w, collect_options(settings))
    return build_from_data(data, registry, now)


def collect_options(settings: Settings) -> CollectOptions:
    """Return the query options the settings describe."""
    return CollectOptions(buckets=tuple(settings.engine.buckets),
                          kv_budget_bytes=settings.report.kv_cache_budget_bytes,
                          warmup_s=settings.report.warmup_s)


def run_weekly_report(sessions: sessionmaker[Session], settings: Settings,
                      now: datetime | None = None, *, week: str | Period | None = None,
                      out_dir: str | Path | None = None,
                      notify: bool | None = None) -> ReportOutcome:
    """Build the report of `week` (default: the ISO week that ended before `now`) and publish it.

    An ISO week is stored (one row per week) and announced to the webhook targets; a
    `Window` (the last seven days, reviewed by hand) is only written to files.
    """
    now = now or datetime.now(UTC)
    w: Period
    if week is None:
        w = last_complete_week(now)
    else:
        w = parse_week(week) if isinstance(week, str) else week
    registry = load_registry(settings.report.assumptions_file)
    # Read-only (a snapshot, no write lock on SQLite): a week of rows takes a while to
    # read and summarize, and the serving process goes on writing meanwhile.
    with reading(sessions) as session:
        report = build_report(session, w, now, registry, settings)
    markdown = render_markdown(report)
    html = render_html(report)
    notify = settings.report.notify if notify is None else notify
    webhooks = settings.alerts.webhooks if notify else None
    report_id: int | None = None
    enqueued = 0
    if isinstance(w, Week):
        report_id, enqueued = _store(sessions, report, markdown, html, webhooks)
    md_path, html_path = write_files(report.week, markdown, html,
                                     out_dir or settings.report.out_dir)
    log.info("report %s %s and written to %s", report.week,
             f"stored as id {report_id}" if report_id is not None else "not stored (by hand)",
             md_path.parent)
    return ReportOutcome(report.week, report, report_id, md_path, html_path, enqueued)


def write_files(week: str, markdown: str, html: str, out_dir: str | Path) -> tuple[Path, Path]:
    """Write report-<week>.md and .html into `out_dir` (atomically) and return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = (out / f"report-{week}.md", out / f"report-{week}.html")
    for path, body in zip(paths, (markdown, html), strict=True):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(body, encoding="utf-8")
        tmp.replace(path)
    return paths


def _store(sessions: sessionmaker[Session], report: WeeklyReport, markdown: str, html: str,
           webhooks: Sequence[Mapping[str, Any]] | None) -> tuple[int, int]:
    # A second replica racing on the same week loses the insert; it then updates.
    for attempt in range(2):
        try:
            with sessions.begin() as session:
                row = report_for_week(session, report.week)
                if row is None:
                    row = Report(week=report.week)
                    session.add(row)
                row.created_at = report.generated_at
                row.markdown = markdown
                row.html = html
                row.summary = report.summary()
                session.flush()
                return row.id, enqueue_summary(session, report, webhooks)
        except IntegrityError:
            if attempt:
                raise
    raise AssertionError("unreachable")


def summary_text(report: WeeklyReport) -> tuple[str, str]:
    """Return (title, text) of the short webhook summary."""
    counts = report.counts()
    title = f"tailwatch weekly assumption review {report.week}"
    if not report.has_data:
        return title, f"{report.week}: no data was recorded this week; no assumption was checked."
    lines = [f"{report.week}: {counts[VIOLATED]} violated, {counts[AT_RISK]} at risk, "
             f"{counts['holds']} hold, {counts['no data']} without data."]
    for o in report.optimizations:
        bad = [c for c in o.checks if c.status in (VIOLATED, AT_RISK)]
        if bad:
            lines.append(f"{o.name}: " + "; ".join(
                f"{c.assumption.text} {c.status} ({c.verdict.reason})" for c in bad))
    if report.costly:
        lines.append("Costs more than it earns: " + ", ".join(
            c.name + (f" ({c.measured_speedup:.2f}x)" if c.measured_speedup else "")
            for c in report.costly))
    return title, "\n".join(lines)


def enqueue_summary(session: Session, report: WeeklyReport,
                    webhooks: Sequence[Mapping[str, Any]] | None) -> int:
    """Queue the short summary to every webhook target taking messages; return rows added.

    The key "report-<week>" makes a re-run of the same week send nothing new.
    """
    from alerts.outbox import enqueue_message
    from alerts.webhooks import parse_targets

    targets = parse_targets(webhooks, "alerts.webhooks")
    if not targets:
        return 0
    title, text = summary_text(report)
    rows = enqueue_message(session, title, text, targets, now=report.generated_at,
                           key=f"report-{report.week}",
                           labels={"kind": "weekly_report", "week": report.week})
    return len(rows)
