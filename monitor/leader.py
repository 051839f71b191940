"""Leader election for singleton jobs: a PostgreSQL advisory lock, a file lock, or always.

Several replicas share one PostgreSQL; singleton jobs (alert evaluation, webhook
delivery, retention, the weekly report) must run on one of them. The leader holds
`pg_try_advisory_lock(key)` on a dedicated connection: the lock lives exactly as long
as that session, so a crashed leader's lock is freed by PostgreSQL and another replica
takes over at its next check.

A SQLite file can be shared by processes of one host too (a `tailwatch worker` started
beside the one `serve` runs): there the leader holds an exclusive `flock` on a file
beside the database, freed by the kernel when the process exits or dies. An in-memory
SQLite database belongs to one process, which is always the leader.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Protocol, runtime_checkable

from sqlalchemy import Connection, Engine, text

if sys.platform != "win32":
    import fcntl

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
    """The single-instance leader (in-memory SQLite, tests)."""

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


class FileLockLeader:
    """Leadership through an exclusive `flock` on a lock file (processes of one host).

    The lock belongs to the open file: the process holds it for its life and the kernel
    frees it when the process exits or dies, so another takes over at its next check.
    The leader writes its pid into the file for operators; the file is never removed.

    Example:
        leader = FileLockLeader(Path("var/tailwatch.db.leader"))
        if leader.is_leader(): run_singleton_job()
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._waiting = False  # said once that another process leads
        self._unopenable = False  # warned once that the file cannot be opened
        self._released = False  # after release() this process never leads again

    def is_leader(self) -> bool:
        with self._lock:
            if self._released:
                return False
            if self._fd is None:
                self._try_acquire()
            return self._fd is not None

    def _try_acquire(self) -> None:
        try:
            # Non-inheritable (PEP 446): a child that `serve` spawns does not hold it.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            # Not leading is the safe side: another process may lead unseen. Tried at
            # every check, so warned once.
            (log.debug if self._unopenable else log.warning)(
                "cannot open the leader lock file %s: %s; not leading", self.path,
                exc.strerror or exc)
            self._unopenable = True
            return
        self._unopenable = False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                log.warning("leader lock on %s failed: %s", self.path, exc.strerror or exc)
            elif not self._waiting:
                log.info("another process leads the scheduler (%s); this one takes over "
                         "when it stops", self._holder())
                self._waiting = True
            return
        self._fd = fd
        self._waiting = False
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError:  # the pid is for operators; the lock is what counts
            log.debug("cannot write the pid into %s", self.path, exc_info=True)
        log.info("became scheduler leader (lock file %s)", self.path)

    def _holder(self) -> str:
        try:
            pid = self.path.read_text().strip()
        except OSError:
            pid = ""
        return f"pid {pid}, lock file {self.path}" if pid.isdigit() else f"lock file {self.path}"

    def release(self) -> None:
        with self._lock:
            self._released = True
            fd, self._fd = self._fd, None
            if fd is None:
                return
            # Unlock before closing: a child forked meanwhile shares the open file and
            # would keep the lock past our close. The file stays: removing it would let
            # a process that opened it before the removal lead beside one that creates
            # a new file after it.
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


def sqlite_file(engine: Engine) -> Path | None:
    """Return the absolute path of `engine`'s SQLite database file (None: in memory)."""
    url = engine.url
    database = url.database or ""
    if database.startswith("file:"):  # a URI filename (`?uri=true`)
        database = database[len("file:"):].split("?", 1)[0]
    if database in ("", ":memory:") or url.query.get("mode") == "memory":
        return None
    return Path(database).expanduser().absolute()


def lock_file(database: Path) -> Path:
    """Return the leader lock file of a SQLite database file (beside it)."""
    return database.with_name(database.name + ".leader")


def _first_line(exc: BaseException) -> str:
    lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def make_leader(engine: Engine, *, name: str = DEFAULT_LOCK_NAME) -> LeaderLock:
    """Return the leader lock for `engine`'s database.

    PostgreSQL: an advisory lock keyed by `name`. A SQLite file: a lock file beside it
    (one per database; `name` keys only advisory locks). In-memory SQLite: always-leader.
    """
    if engine.dialect.name == "postgresql":
        return PgAdvisoryLeader(engine, name=name)
    database = sqlite_file(engine)
    if database is None or sys.platform == "win32":
        # Windows has no flock; tailwatch runs on Linux, so a second worker there is
        # left to the operator.
        return AlwaysLeader()
    return FileLockLeader(lock_file(database))
