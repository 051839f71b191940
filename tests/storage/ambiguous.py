"""An ambiguous commit: COMMIT reaches the database, then the connection fails before the answer.

The client cannot tell this from a commit that never arrived; a retry has to find out.
`ambiguous_commit("probe_results", engine)` arms it once for the next transaction on
`engine` whose ORM Session flushes new or changed rows of that table (the storage Writer's
writes; migrations, which use plain connections, are left alone); without an engine it is
armed on every engine of the process (the service under test builds its own). On PostgreSQL the driver
connection is closed as well, so SQLAlchemy sees a disconnect and drops it from the pool.
With several tables, each fires once: a commit that wrote rows of more than one of those
still armed is that one ambiguous commit for each of them (a writer under load batches a
cycle's results and the traffic rollups into one transaction, and a commit fails once).

Example:
    with ambiguous_commit("traffic_rollups", engine=db_engine) as fired:
        ...  # write through the storage Writer
    assert fired == ["traffic_rollups"]
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import Engine, event
from sqlalchemy.engine.default import DefaultDialect
from sqlalchemy.orm import Session


@contextmanager
def ambiguous_commit(*tables: str, engine: Engine | None = None) -> Iterator[list[str]]:
    """Fail the next commit that wrote each of `tables` after it committed, once per
    table; yield the tables fired, in order."""
    fired: list[str] = []
    mark = f"ambiguous_commit:{id(fired)}"  # this context's own, should another enclose it

    def on_begin(conn: Any) -> None:
        conn.info.pop(mark, None)  # a rolled-back write does not arm the next transaction

    def on_flush(session: Session, _context: Any) -> None:
        if engine is not None and session.get_bind() is not engine:
            return
        wrote = {getattr(row, "__tablename__", None) for row in (*session.new, *session.dirty)}
        armed = [t for t in tables if t in wrote and t not in fired]
        if armed:
            held = session.connection().info.setdefault(mark, [])
            held += [t for t in armed if t not in held]

    def commit_then_fail(dialect: DefaultDialect, dbapi_connection: Any) -> None:
        committed(dialect, dbapi_connection)
        armed = [t for t in dbapi_connection.info.pop(mark, []) if t not in fired]
        if not armed:
            return
        fired.extend(armed)
        if dialect.name == "postgresql":
            dbapi_connection.dbapi_connection.close()
        raise dialect.loaded_dbapi.OperationalError(
            "server closed the connection unexpectedly (injected after COMMIT)")

    target: Any = Engine if engine is None else engine
    with pytest.MonkeyPatch.context() as patch:
        if engine is None:
            committed = DefaultDialect.do_commit  # as patched by an enclosing one, if any
            patch.setattr(DefaultDialect, "do_commit", commit_then_fail)
        else:
            dialect, inner = engine.dialect, engine.dialect.do_commit

            def committed(_dialect: DefaultDialect, dbapi_connection: Any) -> None:
                inner(dbapi_connection)

            patch.setattr(dialect, "do_commit",
                          lambda dbapi_connection: commit_then_fail(dialect, dbapi_connection),
                          raising=False)
        event.listen(target, "begin", on_begin)
        event.listen(Session, "after_flush", on_flush)
        try:
            yield fired
        finally:
            event.remove(Session, "after_flush", on_flush)
            event.remove(target, "begin", on_begin)
