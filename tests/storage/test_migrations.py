"""Migrations: empty -> head -> base on SQLite and PostgreSQL, and models match them."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from storage import migrate
from storage.db import make_engine
from storage.errors import SchemaBehind
from storage.models import Base

TABLES = {t.name for t in Base.metadata.sorted_tables}


def test_upgrade_to_head_then_downgrade_to_base(db_url: str) -> None:
    assert migrate.current(db_url) is None
    migrate.upgrade(db_url)
    assert migrate.current(db_url) == migrate.head()
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            assert set(inspect(conn).get_table_names()) >= TABLES
        migrate.downgrade(db_url, "base")
        with engine.connect() as conn:
            assert set(inspect(conn).get_table_names()) & TABLES == set()
    finally:
        engine.dispose()
    assert migrate.current(db_url) is None


def test_models_match_migrations(migrated_url: str) -> None:
    engine = make_engine(migrated_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(context, Base.metadata) == []
    finally:
        engine.dispose()


def test_check_schema_names_both_revisions_and_the_command(db_url: str) -> None:
    with pytest.raises(SchemaBehind) as info:
        migrate.check_schema(db_url)
    message = str(info.value)
    assert migrate.head() in message and "tailwatch db upgrade" in message
    migrate.upgrade(db_url)
    assert migrate.check_schema(db_url) == migrate.head()


def test_upgrade_on_a_passed_connection_leaves_commit_to_the_caller(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url)
    try:
        with engine.connect() as conn:
            conn.begin()
            migrate.upgrade(conn)
            conn.rollback()
        assert migrate.current(engine) is None
        with engine.begin() as conn:
            migrate.upgrade(conn)
        assert migrate.current(engine) == migrate.head()
    finally:
        engine.dispose()
