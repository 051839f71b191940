"""`tailwatch export`: one table's recent rows as CSV or Parquet, for notebooks."""

from __future__ import annotations

import click

FORMATS = ("csv", "parquet")


class ExportFailed(click.ClickException):
    """A one-line failure with its own exit code (2: bad input, 1: database or disk)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@click.command()
@click.option("--table", required=True, metavar="NAME",
              help="probe_results, traffic_rollups, alerts or flag_audits.")
@click.option("--since", default="7d", show_default=True,
              help="How far back, e.g. 90m, 36h, 7d, 2w.")
@click.option("--format", "fmt", default="csv", show_default=True, metavar="csv|parquet")
@click.option("--out", default=None, type=click.Path(dir_okay=False),
              help="Output file (default: CSV to stdout; Parquet needs a file).")
@click.pass_context
def export(ctx: click.Context, table: str, since: str, fmt: str, out: str | None) -> None:
    """Write a table's rows of the last --since as CSV or Parquet (load with pandas)."""
    from datetime import UTC, datetime, timedelta

    from alerts.durations import parse_duration
    from storage.queries.export import EXPORT_TABLES

    if table not in EXPORT_TABLES:
        raise ExportFailed(f"--table: must be one of {', '.join(EXPORT_TABLES)}, got {table!r}", 2)
    if fmt not in FORMATS:
        raise ExportFailed(f"--format: must be csv or parquet, got {fmt!r}", 2)
    try:
        window_s = parse_duration(since)
    except ValueError as exc:
        raise ExportFailed(f"--since: {exc}", 2) from None
    if window_s <= 0:
        raise ExportFailed(f"--since: must be longer than 0, got {since!r}", 2)
    if fmt == "parquet" and out is None:
        raise ExportFailed("--out: Parquet is binary, name a file", 2)

    from sqlalchemy.exc import SQLAlchemyError

    from monitor.cli.config import load_settings
    from storage import make_engine, make_sessionmaker, migrate
    from storage.errors import StorageError
    from storage.queries.export import table_frame

    settings = load_settings(ctx)
    start = datetime.now(UTC) - timedelta(seconds=window_s)
    engine = make_engine(settings.database_url)
    try:
        migrate.check_schema(engine)
        with make_sessionmaker(engine)() as session:
            df = table_frame(session, table, start)
        if fmt == "parquet":
            df.to_parquet(out, index=False)
        elif out is not None:
            df.to_csv(out, index=False)
        else:
            click.echo(df.to_csv(index=False), nl=False)
    except (SQLAlchemyError, StorageError, OSError) as exc:
        raise ExportFailed(f"database or output: {_first_line(exc)}", 1) from None
    finally:
        engine.dispose()
    if out is not None:
        click.echo(f"wrote {len(df)} {table} rows since {start:%Y-%m-%dT%H:%MZ} to {out}",
                   err=True)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
