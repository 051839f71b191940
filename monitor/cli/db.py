"""`tailwatch db`: migrate and inspect the database schema."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import click

T = TypeVar("T")


def _url(ctx: click.Context) -> str:
    from pydantic import ValidationError

    from monitor.settings import get_settings

    try:
        return get_settings((ctx.obj or {}).get("config_file")).database_url
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "settings"
        raise click.ClickException(f"settings: {where}: {err['msg']}") from exc
    except ValueError as exc:
        raise click.ClickException(f"settings: {str(exc).strip().splitlines()[0]}") from exc


def _safe(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<unparsable url>"


def _run(url: str, action: Callable[[], T]) -> T:
    """Run `action`, turning storage and database errors into one CLI line."""
    from alembic.util.exc import CommandError
    from sqlalchemy.exc import SQLAlchemyError

    from storage.errors import StorageError

    try:
        return action()
    except (StorageError, CommandError) as exc:
        raise click.ClickException(str(exc)) from exc
    except SQLAlchemyError as exc:
        detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        raise click.ClickException(
            f"database {_safe(url)}: {detail[0] if detail else type(exc).__name__}"
        ) from exc


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
