"""`tailwatch report`: build, store and write the weekly assumption-review report."""

from __future__ import annotations

import click


class ReportFailed(click.ClickException):
    """A one-line failure with its own exit code (2: bad input, 1: database or disk)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        # click declares exit_code a class attribute; this failure carries its own.
        self.exit_code = exit_code  # type: ignore[misc]


@click.command()
@click.option("--week", default=None, metavar="YYYY-Www",
              help="ISO week to review, e.g. 2026-W48; stored and announced like the "
                   "scheduled report (default: the last 7 days, written to files only).")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="Directory for report-<week>.md/.html (default: settings report.out_dir).")
@click.option("--notify/--no-notify", default=None,
              help="Queue a short summary to the webhook targets (default: report.notify).")
@click.pass_context
def report(ctx: click.Context, week: str | None, out_dir: str | None,
           notify: bool | None) -> None:
    """Review the optimization assumptions over the last 7 days (or --week) and write the report."""
    from datetime import UTC, datetime

    from monitor.report.errors import InvalidWeek, RegistryError
    from monitor.report.week import Period, last_seven_days, parse_week

    period: Period
    try:
        period = parse_week(week) if week is not None else last_seven_days(datetime.now(UTC))
    except InvalidWeek as exc:
        raise ReportFailed(f"--week: {exc}", 2) from None
    if out_dir is not None and out_dir.lower().endswith((".md", ".html", ".htm")):
        # --out report.md would create a directory of that name: say what it takes instead.
        raise ReportFailed(f"--out: {out_dir!r} looks like a file name; --out takes a "
                           "directory (both report-<week>.md and .html are written there)", 2)

    from sqlalchemy.exc import SQLAlchemyError

    from alerts.errors import WebhookConfigError
    from monitor.cli.config import load_settings
    from monitor.report.job import run_weekly_report
    from storage import make_engine, make_sessionmaker, migrate
    from storage.errors import StorageError

    try:
        settings = load_settings(ctx)
    except click.ClickException as exc:
        raise ReportFailed(exc.message, 2) from None
    missing = _missing_sqlite_file(settings.database_url)
    if missing is not None:
        # Connecting would create an empty file that every later command then trips on.
        raise ReportFailed(f"database or output: {missing} does not exist: run "
                           f"`tailwatch db upgrade` (or set TAILWATCH_DATABASE_URL)", 1)
    engine = make_engine(settings.database_url)
    try:
        migrate.check_schema(engine)
        outcome = run_weekly_report(make_sessionmaker(engine), settings, week=period,
                                    out_dir=out_dir, notify=notify)
    except (RegistryError, WebhookConfigError) as exc:
        raise ReportFailed(_first_line(exc), 2) from None
    except (SQLAlchemyError, StorageError, OSError) as exc:
        raise ReportFailed(f"database or output: {_first_line(exc)}", 1) from None
    finally:
        engine.dispose()
    counts = outcome.report.counts()
    click.echo(f"{outcome.week}: {counts['violated']} violated, {counts['at risk']} at risk, "
               f"{counts['holds']} hold, {counts['no data']} no data"
               + ("" if outcome.report.has_data else " (no data this week)"))
    if outcome.report_id is None:
        click.echo(f"wrote {outcome.markdown_path} and {outcome.html_path} (not stored: "
                   f"--week YYYY-Www stores and announces a week's report)")
    else:
        click.echo(f"wrote {outcome.markdown_path} and {outcome.html_path} (report id "
                   f"{outcome.report_id}; summary queued for {outcome.enqueued} webhook "
                   f"targets)")


def _missing_sqlite_file(url: str) -> str | None:
    """Return the path of a SQLite database file that does not exist, else None."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return None  # make_engine reports it
    path = parsed.database
    if parsed.get_backend_name() != "sqlite" or not path or path == ":memory:" or \
            path.startswith("file:"):
        return None
    from pathlib import Path

    return None if Path(path).exists() else path


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
