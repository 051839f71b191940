"""Database fixtures shared by every package's tests (owned by storage).

Loaded for the whole suite by tests/conftest.py (`pytest_plugins`). Fixtures:

pg_admin_url   (session) URL of the maintenance database: postgresql+psycopg://postgres@
               127.0.0.1:5432/postgres (override with TAILWATCH_TEST_PG_ADMIN_URL).
pg_url         (session) a uniquely named, initially empty PostgreSQL database created
               for this test session and dropped at its end; skips with the reason
               when PostgreSQL is unreachable.
sqlite_url     (function) URL of a not-yet-existing SQLite file under tmp_path.
db_kind        (function, parametrized) "sqlite" and "postgres"; the postgres
               param carries `pytest.mark.postgres`. Every fixture below follows it.
db_url         (function) an empty database of db_kind: a fresh SQLite file, or
               pg_url downgraded to base (so tests may migrate it themselves).
migrated_url   (function) a database of db_kind at the migration head with empty
               tables: a copy of a migrated SQLite template, or pg_url upgraded
               and emptied (PostgreSQL tests share one database, never its rows).
db_engine      (function) a storage.make_engine() engine on migrated_url, disposed after.
sessionmaker   (function) storage.make_sessionmaker(db_engine).

Use `sqlite_url`/`pg_url` directly to test one database; request `migrated_url`
or `sessionmaker` to run a test on both.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session
from sqlalchemy.orm import sessionmaker as SessionMaker  # noqa: N812

PG_ADMIN_URL = os.environ.get(
    "TAILWATCH_TEST_PG_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


@pytest.fixture(scope="session")
def pg_admin_url() -> str:
    """Return the URL of the PostgreSQL maintenance database."""
    return PG_ADMIN_URL


def _admin_execute(admin_url: str, *statements: str) -> None:
    from storage.db import make_engine

    engine = make_engine(admin_url, connect_timeout_s=5)
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for statement in statements:
                conn.execute(text(statement))
    finally:
        engine.dispose()


@pytest.fixture(scope="session")
def pg_url(pg_admin_url: str) -> Iterator[str]:
    """Create a uniquely named PostgreSQL database for the session; drop it at the end."""
    from sqlalchemy.exc import OperationalError

    name = f"tailwatch_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    try:
        _admin_execute(pg_admin_url, f'CREATE DATABASE "{name}"')
    except OperationalError as exc:
        first = str(exc.orig or exc).strip().splitlines()[0]
        pytest.skip(f"PostgreSQL unreachable at {make_url(pg_admin_url).render_as_string()}: "
                    f"{first}")
    url = make_url(pg_admin_url).set(database=name).render_as_string(hide_password=False)
    try:
        yield url
    finally:
        _admin_execute(pg_admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """Return the URL of a not-yet-existing SQLite database file."""
    return f"sqlite:///{tmp_path / 'tailwatch.db'}"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_kind(request: pytest.FixtureRequest) -> str:
    """Return the database kind a test runs on ("sqlite" or "postgres")."""
    return request.param


@pytest.fixture
def db_url(db_kind: str, request: pytest.FixtureRequest) -> str:
    """Return an empty (never migrated or downgraded to base) database URL of db_kind."""
    if db_kind == "sqlite":
        return request.getfixturevalue("sqlite_url")
    from storage import migrate

    url = request.getfixturevalue("pg_url")
    migrate.downgrade(url, "base")
    return url


@pytest.fixture(scope="session")
def _sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from storage import migrate
    from storage.db import make_engine

    path = tmp_path_factory.mktemp("sqlite-template") / "template.db"
    engine = make_engine(f"sqlite:///{path}")
    try:
        migrate.upgrade(engine)
    finally:
        engine.dispose()  # the last connection closing checkpoints the WAL into the file
    assert not path.with_name(path.name + "-wal").exists()
    return path


def _truncate_all(url: str) -> None:
    from storage import migrate
    from storage.db import make_engine
    from storage.models import Base

    engine = make_engine(url)
    try:
        migrate.upgrade(engine)
        with engine.begin() as conn:
            present = set(inspect(conn).get_table_names())
            # DELETE beats TRUNCATE on near-empty tables (TRUNCATE swaps files per table).
            for table in reversed(Base.metadata.sorted_tables):
                if table.name in present:
                    conn.execute(table.delete())
    finally:
        engine.dispose()


@pytest.fixture
def migrated_url(db_kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Return a database URL of db_kind at the migration head with empty tables."""
    if db_kind == "sqlite":
        template: Path = request.getfixturevalue("_sqlite_template")
        path = tmp_path / "migrated.db"
        shutil.copyfile(template, path)
        return f"sqlite:///{path}"
    url = request.getfixturevalue("pg_url")
    _truncate_all(url)
    return url


@pytest.fixture
def db_engine(migrated_url: str) -> Iterator[Engine]:
    """Return an engine on migrated_url; disposed after the test."""
    from storage.db import make_engine

    engine = make_engine(migrated_url)
    yield engine
    engine.dispose()


@pytest.fixture
def sessionmaker(db_engine: Engine) -> SessionMaker[Session]:
    """Return a session factory on the migrated test database."""
    from storage.db import make_sessionmaker

    return make_sessionmaker(db_engine)
