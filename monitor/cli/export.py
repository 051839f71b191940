"""`tailwatch export`: one table's recent rows as CSV or Parquet, for notebooks."""

from __future__ import annotations

import click

FORMATS = ("csv", "parquet")


class BadExportInput(click.ClickException):
    """A bad option value: one line, exit code 2 (database or disk failures exit 1)."""

    exit_code = 2


@click.command()
@click.option("--table", required=True, metavar="NAME",
              help="probe_results, traffic_rollups, batch_rollups, alerts or flag_audits.")
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
        raise BadExportInput(f"--table: must be one of {', '.join(EXPORT_TABLES)}, got {table!r}")
    if fmt not in FORMATS:
        raise BadExportInput(f"--format: must be csv or parquet, got {fmt!r}")
    try:
        window_s = parse_duration(since)
    except ValueError as exc:
        raise BadExportInput(f"--since: {exc}") from None
    if window_s <= 0:
        raise BadExportInput(f"--since: must be longer than 0, got {since!r}")
    if fmt == "parquet" and out is None:
        raise BadExportInput("--out: Parquet is binary, name a file")

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
        raise click.ClickException(f"database or output: {_first_line(exc)}") from None
    finally:
        engine.dispose()
    if out is not None:
        click.echo(f"wrote {len(df)} {table} rows since {start:%Y-%m-%dT%H:%MZ} to {out}",
                   err=True)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
