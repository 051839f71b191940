"""Run and check Alembic migrations from code (the CLI, the service, tests).

Example:
    upgrade("sqlite:///./var/tailwatch.db")
    check_schema(engine)  # raises SchemaBehind when `tailwatch db upgrade` is due
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine
from sqlalchemy.engine import URL

from storage.db import make_engine
from storage.errors import SchemaBehind

# The migrations package is installed next to storage (see pyproject's packages);
# found by path, not import, so an unrelated `migrations` on sys.path cannot shadow it.
SCRIPT_LOCATION = str(Path(__file__).resolve().parent.parent / "migrations")


def alembic_config(connection: Connection | None = None) -> Config:
    """Return an Alembic config for tailwatch's migrations, bound to `connection`."""
    cfg = Config()
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    cfg.set_main_option("path_separator", "os")
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


@contextmanager
def _connection(target: str | URL | Engine | Connection) -> Iterator[Connection]:
    """Yield a connection in a transaction; commit it unless the caller passed one."""
    if isinstance(target, Connection):
        # Alembic commits a connection with no transaction begun; one in a
        # transaction (engine.begin(), conn.begin()) is left to the caller.
        yield target
        return
    engine = target if isinstance(target, Engine) else make_engine(target)
    try:
        with engine.begin() as connection:
            yield connection
    finally:
        if engine is not target:
            engine.dispose()


def upgrade(target: str | URL | Engine | Connection, revision: str = "head") -> None:
    """Migrate the database up to `revision` (a Connection in a transaction is not committed)."""
    with _connection(target) as connection:
        command.upgrade(alembic_config(connection), revision)


def downgrade(target: str | URL | Engine | Connection, revision: str = "base") -> None:
    """Migrate the database down to `revision` (a Connection in a transaction is not committed)."""
    with _connection(target) as connection:
        command.downgrade(alembic_config(connection), revision)


def head() -> str:
    """Return the revision the code needs."""
    script = ScriptDirectory.from_config(alembic_config())
    rev = script.get_current_head()
    if rev is None:  # pragma: no cover - the repository ships a migration
        raise RuntimeError("no migrations found in " + SCRIPT_LOCATION)
    return rev


def current(target: str | URL | Engine | Connection) -> str | None:
    """Return the database's revision, or None when it was never migrated."""
    if isinstance(target, Connection):
        return MigrationContext.configure(target).get_current_revision()
    engine = target if isinstance(target, Engine) else make_engine(target)
    try:
        # Autocommit: a read that never takes SQLite's write lock (a transaction here
        # opens BEGIN IMMEDIATE), so a busy writer elsewhere cannot hold up a start-up check.
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        if engine is not target:
            engine.dispose()


def check_schema(target: str | URL | Engine | Connection) -> str:
    """Return the database's revision; raise SchemaBehind when it is not the head."""
    needed = head()
    at = current(target)
    if at != needed:
        raise SchemaBehind(at, needed)
    return at
