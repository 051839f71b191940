"""`tailwatch db`: migrate and inspect the database schema."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import click

T = TypeVar("T")


def _url(ctx: click.Context) -> str:
    from monitor.cli.config import load_settings

    return load_settings(ctx).database_url


def _safe(url: str) -> str:
    from monitor.secrets import mask_url

    return mask_url(url)  # userinfo and secret query values hidden; unparsable: hidden whole


def _run(url: str, action: Callable[[], T]) -> T:
    """Run `action`, turning storage and database errors into one CLI line."""
    from alembic.util.exc import CommandError
    from sqlalchemy.exc import SQLAlchemyError

    from monitor.secrets import Masker
    from storage.errors import StorageError

    mask = Masker.from_data({"database_url": url}).text  # drivers quote URLs in errors
    try:
        return action()
    except (StorageError, CommandError) as exc:
        raise click.ClickException(mask(str(exc))) from exc
    except SQLAlchemyError as exc:
        detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        raise click.ClickException(
            f"database {_safe(url)}: {mask(detail[0]) if detail else type(exc).__name__}"
        ) from exc
    except ValueError as exc:  # a URL SQLAlchemy cannot parse (e.g. a non-numeric port)
        raise click.ClickException(f"database_url: {_safe(url)}: {mask(str(exc))}") from exc


@click.group()
def db() -> None:
    """Manage the database schema."""


@db.command()
@click.option("--revision", default="head", show_default=True, help="Target revision.")
@click.pass_context
def upgrade(ctx: click.Context, revision: str) -> None:
    """Migrate the database to the latest schema (or --revision)."""
    from storage import migrate

    url = _url(ctx)
    _run(url, lambda: migrate.upgrade(url, revision))
    at = _run(url, lambda: migrate.current(url))
    click.echo(f"database {_safe(url)} is at {at or 'base'}")


@db.command()
@click.pass_context
def current(ctx: click.Context) -> None:
    """Print the database's schema revision and whether it is the head."""
    from storage import migrate

    url = _url(ctx)
    at = _run(url, lambda: migrate.current(url))
    head = migrate.head()
    state = "head" if at == head else f"behind: code needs {head}"
    click.echo(f"{at or 'base'} ({state})")


@db.command()
@click.pass_context
def check(ctx: click.Context) -> None:
    """Exit 1 unless the database schema is at the head."""
    from storage import migrate

    url = _url(ctx)
    at = _run(url, lambda: migrate.check_schema(url))
    click.echo(f"{at} (head)")
