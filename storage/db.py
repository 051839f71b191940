"""Engine and session factories for SQLite (default) and PostgreSQL.

SQLite runs in WAL mode with a busy timeout, foreign keys on, and every
transaction opened with BEGIN IMMEDIATE: a transaction that reads then writes
can otherwise fail at once with "database is locked" (the busy timeout does not
cover a deferred read lock that must be upgraded), so writers queue instead.

Read-only work that is long (the evaluation's reading and scoring) opens its session with
`reading`: a deferred `BEGIN` under `PRAGMA query_only` on SQLite (a WAL snapshot, no write
lock, so writers go on meanwhile) and a `REPEATABLE READ, READ ONLY` transaction on
PostgreSQL.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import sqlite3
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import Session, sessionmaker

from storage.errors import InvalidQuery

DEFAULT_DB_URL = "sqlite:///./var/tailwatch.db"
# SQLite's heap in this process, all connections together (`PRAGMA soft_heap_limit`: past
# it, a connection's page cache recycles its own pages instead of growing). The caches
# fill with the pages that a growing database's writes and reads touch, every pooled
# connection in turn, so whatever this allows a long-running process (serving or worker)
# comes to hold, and it fills over hours of history: so the limit is small enough to be
# reached during warm-up. An evaluation's recent windows fit in it, and a page not cached
# is read from the OS's page cache, not the disk (docs/benchmarks.md#benchworker_memory).
SQLITE_HEAP_LIMIT_BYTES = 4 * 1024 * 1024
# Execution option of a connection whose transaction only reads (see `reading`).
READ_ONLY_OPTION = "tailwatch_read_only"
# A SQLite write transaction holding the database's one write lock this long is logged
# with where it ended: every other writer waited for it meanwhile, and "database is
# locked" in another process's log does not say who held it.
LONG_WRITE_LOCK_S = 5.0
_WRITE_BEGAN = "tailwatch_write_began"

log = logging.getLogger(__name__)


def normalize_url(url: str | URL) -> URL:
    """Return `url` parsed, with PostgreSQL URLs rewritten to the psycopg 3 driver."""
    if isinstance(url, str):
        if not url.strip():
            raise InvalidQuery("database_url", "must not be empty", value=url)
        if url.startswith("postgres://"):
            url = "postgresql://" + url[len("postgres://"):]
        try:
            parsed = make_url(url)
        except (ArgumentError, ValueError) as exc:  # ValueError: a non-numeric port
            # Not echoed: an unparsable URL may hold a password where no masker finds it.
            raise InvalidQuery("database_url", "cannot parse the URL (not shown); expected e.g. "
                               "postgresql://user@host:5432/db or sqlite:///path/to.db",
                               value=url) from exc
    else:
        parsed = url
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    backend = parsed.get_backend_name()
    if backend not in ("sqlite", "postgresql"):
        raise InvalidQuery(
            "database_url", f"unsupported database {backend!r} (use sqlite or postgresql)",
            value=parsed.render_as_string(hide_password=True),
        )
    return parsed


compact_json = partial(json.dumps, separators=(",", ":"))


def make_engine(
    url: str | URL = DEFAULT_DB_URL,
    *,
    busy_timeout_s: float = 15.0,
    create_parent: bool = True,
    connect_timeout_s: int = 10,
    **kwargs: Any,
) -> Engine:
    """Create an engine for `url` with tailwatch's connection settings.

    Args:
        url: SQLAlchemy URL; `postgresql://` and `postgres://` use psycopg 3.
        busy_timeout_s: SQLite only: how long a writer waits for the lock.
        create_parent: SQLite only: create the database file's directory.
        connect_timeout_s: PostgreSQL only: TCP connect timeout.
        kwargs: passed to `sqlalchemy.create_engine`.
    """
    parsed = normalize_url(url)
    # Compact JSON: histogram lists are most of a rollup row.
    kwargs.setdefault("json_serializer", compact_json)
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(parsed, busy_timeout_s, create_parent, kwargs)
    connect_args = {"connect_timeout": connect_timeout_s, **kwargs.pop("connect_args", {})}
    kwargs.setdefault("pool_pre_ping", True)
    return create_engine(parsed, connect_args=connect_args, **kwargs)


def _sqlite_engine(url: URL, busy_timeout_s: float, create_parent: bool,
                   kwargs: dict[str, Any]) -> Engine:
    database = url.database or ""
    in_memory = database in ("", ":memory:") or database.startswith("file::memory:")
    if create_parent and not in_memory:
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    connect_args = {
        "check_same_thread": False,
        "timeout": busy_timeout_s,
        **kwargs.pop("connect_args", {}),
    }
    engine = create_engine(url, connect_args=connect_args, **kwargs)
    busy_ms = int(busy_timeout_s * 1000)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy, not pysqlite, decide when transactions begin (see "begin").
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            if not in_memory:
                cursor.execute("PRAGMA journal_mode=WAL")
                cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute(f"PRAGMA busy_timeout={busy_ms}")
            # A connection may cache the whole process's allowance (the soft heap limit),
            # not SQLite's default 2 MiB: one long scan (a report's weeks) gets it all.
            cursor.execute(f"PRAGMA cache_size=-{SQLITE_HEAP_LIMIT_BYTES // 1024}")
            cursor.execute(f"PRAGMA soft_heap_limit={SQLITE_HEAP_LIMIT_BYTES}")  # per process
            cursor.execute("PRAGMA foreign_keys=ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        options = conn.get_execution_options()
        if options.get("isolation_level") == "AUTOCOMMIT":
            return
        if options.get(READ_ONLY_OPTION):
            # Deferred: a snapshot at the first read and no write lock, so other
            # connections' writes go on; query_only turns a stray write into an error
            # instead of a lock upgrade that could fail with "database is locked".
            conn.exec_driver_sql("PRAGMA query_only=ON")
            conn.info[READ_ONLY_OPTION] = True  # the pool record's: reset at checkin
            conn.exec_driver_sql("BEGIN")
        else:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
            conn.info[_WRITE_BEGAN] = time.monotonic()

    @event.listens_for(engine, "commit")
    @event.listens_for(engine, "rollback")
    def _on_end(conn: Any) -> None:
        began = conn.info.pop(_WRITE_BEGAN, None)
        if began is not None and time.monotonic() - began >= LONG_WRITE_LOCK_S:
            log.warning("SQLite write lock held %.1f s by thread %s (%s): other writers "
                        "waited meanwhile", time.monotonic() - began,
                        threading.current_thread().name, _caller())

    @event.listens_for(engine, "checkin")
    def _on_checkin(dbapi_connection: Any, _record: Any) -> None:
        # Returning an AUTOCOMMIT connection (`ping`) resets pysqlite's isolation_level to
        # "", its own implicit BEGINs: hand transactions back to SQLAlchemy (see "connect").
        if dbapi_connection is None:
            return  # invalidated
        dbapi_connection.isolation_level = None
        # A pooled connection that served `reading` writes again for its next user.
        if _record.info.pop(READ_ONLY_OPTION, False):
            dbapi_connection.execute("PRAGMA query_only=OFF")

    return engine


def _caller() -> str:
    """Return the innermost tailwatch frames ending the transaction ("module:function")."""
    # The frames' names only: `traceback.extract_stack` would read every file on the
    # stack into `linecache` for good, SQLAlchemy's largest modules among them.
    ours: list[tuple[str, str]] = []
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and len(ours) < 3:
        filename = frame.f_code.co_filename
        if "/site-packages/" not in filename and not filename.startswith("<") \
                and not filename.endswith(("storage/db.py", "contextlib.py", "threading.py")):
            ours.append((Path(filename).stem, frame.f_code.co_name))
        frame = frame.f_back
    return " < ".join(f"{stem}:{name}" for stem, name in ours) or "unknown"


@contextmanager
def reading(sessions: sessionmaker[Session]) -> Iterator[Session]:
    """Open a session whose one transaction only reads; roll it back at the end.

    SQLite: a deferred `BEGIN` (no write lock: other connections write meanwhile) under
    `PRAGMA query_only`. PostgreSQL: a `REPEATABLE READ, READ ONLY` transaction. Either
    way its reads share one snapshot and a write raises.
    """
    with sessions() as session:
        session.connection(execution_options={READ_ONLY_OPTION: True})
        if dialect_name(session) == "postgresql":
            # One snapshot for all its reads, as SQLite's WAL gives (a read-only
            # REPEATABLE READ transaction never fails to serialize).
            session.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"))
        try:
            yield session
        finally:
            session.rollback()


def ping(engine: Engine) -> None:
    """Run `SELECT 1` outside any transaction; raise when the database does not answer.

    No transaction, so on SQLite no `BEGIN IMMEDIATE` that would queue behind another
    connection's write transaction: a database busy with a long write still answers.
    """
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("SELECT 1")


def is_locked(error: BaseException) -> bool:
    """Return True when `error` is SQLite's "database is locked" (another connection's lock)."""
    orig = getattr(error, "orig", None) or error
    code = getattr(orig, "sqlite_errorcode", None)  # the extended code: BUSY_SNAPSHOT too
    return code is not None and code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


@functools.cache  # looked up once: the reading runs at every metrics scrape
def _sqlite_memory_used() -> Any | None:
    try:
        # Through the sqlite3 module's own extension: the library instance it links, not
        # a second copy loaded beside it.
        import _sqlite3

        fn = ctypes.CDLL(_sqlite3.__file__).sqlite3_memory_used
    except (ImportError, OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int64
    fn.argtypes = ()
    return fn


def sqlite_memory_bytes() -> int | None:
    """Return the bytes SQLite's library holds in this process (page caches, statements),
    all connections together; None where the symbol cannot be reached."""
    fn = _sqlite_memory_used()
    return None if fn is None else int(fn())


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Return a session factory bound to `engine` (objects stay readable after commit)."""
    return sessionmaker(bind=engine, expire_on_commit=False)


def dialect_name(session_or_engine: Session | Engine) -> str:
    """Return "sqlite" or "postgresql" for a session or engine."""
    bind = session_or_engine.get_bind() if isinstance(session_or_engine, Session) else session_or_engine
    return bind.dialect.name
