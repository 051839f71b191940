"""Database preparation at start-up: schema at head (or migrated), one-line errors."""

from __future__ import annotations

from sqlalchemy import Engine as DbEngine
from sqlalchemy.exc import DBAPIError

from monitor.secrets import mask_url
from monitor.settings import Settings
from storage.db import make_engine
from storage.errors import DatabaseUnavailable
from storage.migrate import check_schema, upgrade


def prepare_database(settings: Settings) -> DbEngine:
    """Return a DB engine whose schema is at head (migrating when auto_migrate).

    Raises storage.SchemaBehind (naming `tailwatch db upgrade`) when the schema is
    behind and auto_migrate is off, storage.DatabaseUnavailable (one line, password
    masked) when the database cannot be reached or refuses the connection.
    """
    db = make_engine(settings.database_url)
    try:
        if settings.auto_migrate:
            upgrade(db)
        check_schema(db)
    except DBAPIError as exc:
        db.dispose()
        # The driver's message spans lines and SQLAlchemy appends a link: keep the reason.
        raise DatabaseUnavailable(
            # Quoted: a masker scanning text for URLs stops at the quote, not at the colon.
            f"database: cannot connect to '{mask_url(db.url.render_as_string())}': "
            f"{one_line(str(exc.orig))}") from exc
    except Exception:
        # Not logged here: `serve` prints it as its one error line, uvicorn logs a lifespan failure.
        db.dispose()
        raise
    return db


def one_line(text: str) -> str:
    """Return `text` as one line: its lines joined, SQLAlchemy's "Background on" link dropped."""
    lines = [ln.strip() for ln in text.splitlines()]
    return " ".join(ln for ln in lines if ln and not ln.startswith("(Background on this error"))


def preflight(settings: Settings, *, probes: bool = True) -> None:
    """Check what start-up would trip on (schema, rules, policy, suites); raise one error.

    `probes=False` (the worker) leaves the canary suites unchecked: it runs no probes.
    """
    from alerts.config import load_config
    from probes.canaries import load_suites

    prepare_database(settings).dispose()
    load_config(settings.alerts)
    if probes and settings.scheduler.enabled and settings.scheduler.probes_enabled:
        suites = load_suites(settings.probes.suites_file)
        if settings.probes.suite not in suites:
            raise ValueError(f"probes.suite: unknown suite {settings.probes.suite!r}; "
                             f"known: {sorted(suites)}")
