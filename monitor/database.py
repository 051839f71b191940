"""Database preparation at start-up: schema at head (or migrated), one-line errors.

A SQLite database another process holds locked (`serve`'s writer draining a backlog, a
migration, a backup) is waited for, not reported: `serve` starts its worker while it
writes, and a worker that exited on the lock would be restarted only to meet it again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy import Engine as DbEngine
from sqlalchemy.exc import DBAPIError

from monitor.secrets import mask_url
from monitor.settings import Settings
from storage.db import is_locked, make_engine
from storage.errors import DatabaseUnavailable
from storage.migrate import check_schema, current, head, upgrade

log = logging.getLogger(__name__)

LOCKED_BACKOFF_S = 0.5  # the first wait between tries on a locked database; doubles
LOCKED_BACKOFF_MAX_S = 10.0


def prepare_database(settings: Settings, *, stop: threading.Event | None = None,
                     busy_timeout_s: float = 15.0) -> DbEngine:
    """Return a DB engine whose schema is at head (migrating when auto_migrate).

    While SQLite stays locked, tries again with backoff (logged once) until it frees or
    `stop` is set. Raises storage.SchemaBehind (naming `tailwatch db upgrade`) when the
    schema is behind and auto_migrate is off, storage.DatabaseUnavailable (one line,
    password masked) when the database cannot be reached or refuses the connection, or
    `stop` was set while it waited.
    """
    db = make_engine(settings.database_url, busy_timeout_s=busy_timeout_s)
    try:
        until_unlocked(lambda: _migrate_and_check(db, settings.auto_migrate), stop)
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


def _migrate_and_check(db: DbEngine, auto_migrate: bool) -> None:
    # An upgrade takes the write lock even with nothing to do: only when a migration is due.
    if auto_migrate and current(db) != head():
        upgrade(db)
    check_schema(db)


def until_unlocked(step: Callable[[], object], stop: threading.Event | None = None) -> None:
    """Run `step`; while it fails on a locked SQLite database, wait and run it again.

    The first lock is logged as a warning, the release as info; the tries between are
    debug lines. Raises the last locked error when `stop` is set while it waits.
    """
    stop = stop if stop is not None else threading.Event()
    backoff, since = LOCKED_BACKOFF_S, None
    while True:
        try:
            step()
            break
        except DBAPIError as exc:
            if not is_locked(exc):
                raise
            if since is None:
                since = time.monotonic()
                log.warning("database: locked by another connection; waiting for it "
                            "(trying again with backoff): %s", one_line(str(exc.orig)))
            else:
                log.debug("database: still locked; next try in %.1f s", backoff)
            if stop.wait(backoff):
                raise
            backoff = min(backoff * 2, LOCKED_BACKOFF_MAX_S)
    if since is not None:
        log.info("database: the lock was released after %.0f s", time.monotonic() - since)


def one_line(text: str) -> str:
    """Return `text` as one line: its lines joined, SQLAlchemy's "Background on" link dropped."""
    lines = [ln.strip() for ln in text.splitlines()]
    return " ".join(ln for ln in lines if ln and not ln.startswith("(Background on this error"))


def preflight(settings: Settings, *, probes: bool = True,
              stop: threading.Event | None = None) -> None:
    """Check what start-up would trip on (schema, rules, policy, suites); raise one error.

    `probes=False` (the worker) leaves the canary suites unchecked: it runs no probes.
    `stop` ends a wait for a locked database (see prepare_database).
    """
    from alerts.config import load_config
    from probes.canaries import load_suites

    prepare_database(settings, stop=stop).dispose()
    load_config(settings.alerts)
    if probes and settings.scheduler.enabled and settings.scheduler.probes_enabled:
        suites = load_suites(settings.probes.suites_file)
        if settings.probes.suite not in suites:
            raise ValueError(f"probes.suite: unknown suite {settings.probes.suite!r}; "
                             f"known: {sorted(suites)}")
