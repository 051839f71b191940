"""`tailwatch report`: build, store and write the weekly assumption-review report."""

from __future__ import annotations

import click


class ReportFailed(click.ClickException):
    """A one-line failure with its own exit code (2: bad input, 1: database or disk)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@click.command()
@click.option("--week", default=None, metavar="YYYY-Www",
              help="ISO week to review, e.g. 2026-W48 (default: the week that just ended).")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="Directory for report-<week>.md/.html (default: settings report.out_dir).")
@click.option("--notify/--no-notify", default=None,
              help="Queue a short summary to the webhook targets (default: report.notify).")
@click.pass_context
def report(ctx: click.Context, week: str | None, out_dir: str | None,
           notify: bool | None) -> None:
    """Review this week's optimization assumptions and write the report."""
    from monitor.report.errors import InvalidWeek, RegistryError
    from monitor.report.week import parse_week

    if week is not None:
        try:
            parse_week(week)
        except InvalidWeek as exc:
            raise ReportFailed(f"--week: {exc}", 2) from None

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
    engine = make_engine(settings.database_url)
    try:
        migrate.check_schema(engine)
        outcome = run_weekly_report(make_sessionmaker(engine), settings, week=week,
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
    click.echo(f"wrote {outcome.markdown_path} and {outcome.html_path} (report id "
               f"{outcome.report_id}; summary queued for {outcome.enqueued} webhook targets)")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
