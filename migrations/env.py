"""Alembic environment: metadata from storage, URL from the caller or settings.

Where the database comes from, first match wins:
1. `config.attributes["connection"]`: a Connection passed in (storage.migrate, tests);
2. the `sqlalchemy.url` main option (alembic.ini or `alembic -x`-less programmatic use);
3. tailwatch settings (`TAILWATCH_DATABASE_URL`, the YAML file, or the default).
"""

from __future__ import annotations

from logging.config import fileConfig
from typing import Any

from alembic import context
from sqlalchemy.engine import Connection

from storage.db import make_engine, normalize_url
from storage.models import Base, UTCDateTime

config = context.config
target_metadata = Base.metadata

if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from monitor.settings import get_settings  # only when no URL was given

    return get_settings().database_url


def _render_item(type_: str, obj: Any, autogen_context: Any) -> str | bool:
    # Migrations must not import storage.models: render the column type it stores.
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        render_item=_render_item,
    )


def run_migrations_offline() -> None:
    """Emit SQL for the configured URL without connecting."""
    context.configure(
        url=normalize_url(_url()),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_item=_render_item,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Run migrations on the passed connection, or on a new engine for the URL."""
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = make_engine(_url())
    try:
        with engine.connect() as connection:
            _configure(connection)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
