"""Leader election for singleton jobs: a PostgreSQL advisory lock, or always-leader.

Several replicas share one PostgreSQL; singleton jobs (alert evaluation, webhook
delivery, retention, the weekly report) must run on one of them. The leader holds
`pg_try_advisory_lock(key)` on a dedicated connection: the lock lives exactly as long
as that session, so a crashed leader's lock is freed by PostgreSQL and another replica
takes over at its next check. On SQLite (one process) every instance is the leader.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from typing import Protocol, runtime_checkable

from sqlalchemy import Connection, Engine, text

log = logging.getLogger(__name__)


def lock_key(name: str) -> int:
    """Return a stable signed 64-bit advisory-lock key for `name`."""
    raw = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")
    return raw - (1 << 64) if raw >= 1 << 63 else raw


DEFAULT_LOCK_NAME = "tailwatch-scheduler-leader"


@runtime_checkable
class LeaderLock(Protocol):
    """Decides whether this replica runs singleton jobs."""

    def is_leader(self) -> bool:
        """Return whether this replica leads now (trying to become leader if not)."""
        ...

    def release(self) -> None:
        """Give up leadership (idempotent)."""
        ...


class AlwaysLeader:
    """The single-instance leader (SQLite, tests)."""

    def is_leader(self) -> bool:
        return True

    def release(self) -> None:
        return None


class PgAdvisoryLeader:
    """Leadership through a session-level PostgreSQL advisory lock.

    Example:
        leader = PgAdvisoryLeader(db_engine)
        if leader.is_leader(): run_singleton_job()
    """

    def __init__(self, engine: Engine, *, name: str = DEFAULT_LOCK_NAME) -> None:
        if engine.dialect.name != "postgresql":
            raise ValueError(f"database_url: advisory locks need PostgreSQL, got {engine.dialect.name}")
        self.engine = engine
        self.key = lock_key(name)
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self._unreachable = False  # warned once; the next success logs the recovery
        self._released = False  # after release() this replica never leads again

    def is_leader(self) -> bool:
        with self._lock:
            if self._released:
                # A job still running after shutdown must not take a lock (and a
                # connection) nobody will release.
                return False
            if self._conn is not None and not self._alive(self._conn):
                log.warning("leader connection lost; leadership dropped")
                self._discard()
            if self._conn is None:
                self._try_acquire()
            return self._conn is not None

    def _alive(self, conn: Connection) -> bool:
        try:
            conn.execute(text("SELECT 1"))
            return True
        except Exception:
            return False

    def _try_acquire(self) -> None:
        try:
            # AUTOCOMMIT: no transaction stays open ("idle in transaction") while we lead.
            conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        except Exception as exc:
            # Tried every few seconds while the database is down: warn once, not each time.
            (log.debug if self._unreachable else log.warning)(
                "cannot reach the database for leader election: %s", _first_line(exc))
            self._unreachable = True
            return
        if self._unreachable:
            log.info("database reachable again for leader election")
            self._unreachable = False
        try:
            got = conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": self.key}).scalar()
        except Exception as exc:
            log.warning("leader election query failed: %s", exc)
            conn.invalidate()
            conn.close()
            return
        if got:
            log.info("became scheduler leader (advisory lock %d)", self.key)
            self._conn = conn
        else:
            conn.close()

    def _discard(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.invalidate()  # never return a lock-holding session to the pool
                conn.close()
            except Exception:  # the connection is already broken
                log.debug("closing a broken leader connection failed", exc_info=True)

    def release(self) -> None:
        with self._lock:
            self._released = True
            conn = self._conn
            if conn is None:
                return
            try:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": self.key})
            except Exception:
                log.warning("advisory unlock failed; closing the session frees it", exc_info=True)
            self._discard()


def _first_line(exc: BaseException) -> str:
    lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def make_leader(engine: Engine, *, name: str = DEFAULT_LOCK_NAME) -> LeaderLock:
    """Return an advisory-lock leader on PostgreSQL, else an always-leader."""
    if engine.dialect.name == "postgresql":
        return PgAdvisoryLeader(engine, name=name)
    return AlwaysLeader()
