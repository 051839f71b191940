"""The flag snapshot: requests read memory; a thread refreshes it; an outage keeps the last one."""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from alerts.flags import FlagSnapshot, FlagStore, FlagsUnavailable, SqlFlagProvider
from bench.proxy import TcpProxy
from engine.flags import GuardedFlags
from engine.protocol import FlagProvider, RuntimeFlags
from storage import make_engine, make_sessionmaker
from storage.migrate import upgrade

WAIT_S = 30.0  # a deadline for a background refresh, never a sleep


def refreshed(snapshot: FlagSnapshot, times: int = 1) -> bool:
    """Wake the refresh thread; wait until `times` whole refreshes began after this call (short ttl)."""
    # One may be in flight already (it read before the change): wait for one more.
    target = snapshot.generation + times + 1
    snapshot.invalidate()
    return snapshot.wait_generation(target, WAIT_S)


def set_flag(url: str, value: bool) -> None:
    db = make_engine(url)
    try:
        with make_sessionmaker(db).begin() as s:
            FlagStore().set(s, "compiled", "global", value, reason="storm", actor="a")
    finally:
        db.dispose()


def test_the_refresh_thread_picks_up_a_change_made_elsewhere(sqlite_url: str) -> None:
    upgrade(sqlite_url)
    db = make_engine(sqlite_url)
    snapshot = FlagSnapshot(make_sessionmaker(db), ttl_s=0.05)
    assert isinstance(snapshot, FlagProvider)
    snapshot.start()
    try:
        assert snapshot.flags().compiled is True
        set_flag(sqlite_url, False)  # as the worker's policy would, from another process
        assert refreshed(snapshot)
        assert snapshot.flags().compiled is False
        assert snapshot.refresh_failures == 0
    finally:
        snapshot.close()
        db.dispose()


def test_a_flag_read_does_not_wait_for_a_writer(sqlite_url: str) -> None:
    upgrade(sqlite_url)
    set_flag(sqlite_url, False)
    db = make_engine(sqlite_url, busy_timeout_s=0.0)  # a wait for the lock would fail at once
    path = make_url(sqlite_url).database
    assert path is not None
    writer = sqlite3.connect(path, isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")  # the write lock, as an evaluation's write phase
        writer.execute("DELETE FROM flags")
        provider = SqlFlagProvider(make_sessionmaker(db), ttl_s=0.0)
        assert provider.flags().compiled is False  # the committed state, read at once
        writer.execute("COMMIT")
        assert provider.flags().compiled is True
    finally:
        writer.close()
        db.dispose()


def test_the_snapshot_serves_while_sqlite_is_exclusively_locked(
        sqlite_url: str, caplog: pytest.LogCaptureFixture) -> None:
    upgrade(sqlite_url)
    set_flag(sqlite_url, False)
    db = make_engine(sqlite_url, busy_timeout_s=0.2)
    snapshot = FlagSnapshot(make_sessionmaker(db), ttl_s=3600.0)  # refreshed on demand here
    snapshot.start()
    db.dispose()  # WAL: exclusive mode needs every other connection to the file closed
    path = make_url(sqlite_url).database
    assert path is not None
    locker = sqlite3.connect(path, isolation_level=None)
    try:
        # Exclusive locking mode on a WAL database: no other connection reads at all.
        locker.execute("PRAGMA locking_mode=EXCLUSIVE")
        locker.execute("BEGIN EXCLUSIVE")
        locker.execute("DELETE FROM flags")
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            sqlite3.connect(path, timeout=0.1).execute("SELECT count(*) FROM flags").fetchall()
        with caplog.at_level(logging.WARNING, logger="alerts.flags"):
            for _ in range(2):
                generation = snapshot.generation
                snapshot.invalidate()
                assert snapshot.wait_generation(generation + 1, WAIT_S)
            assert snapshot.refresh_failures == 2
            # Every read is answered from memory while SQL cannot answer at all.
            assert all(snapshot.flags().compiled is False for _ in range(1000))
            # The engine's guard reads it on the request's own thread: no reader thread.
            readers: list[threading.Thread] = []
            held = snapshot.flags

            def flags() -> RuntimeFlags:
                readers.append(threading.current_thread())
                return held()

            snapshot.flags = flags  # type: ignore[method-assign]
            guard = GuardedFlags(snapshot, timeout_s=0.05)
            try:
                assert all(guard.read().compiled is False for _ in range(100))
                assert guard.errors == 0 and guard.source == "live"
            finally:
                guard.close()
                del snapshot.flags
            assert readers == [threading.current_thread()] * 100
        warnings = [r for r in caplog.records if "cannot refresh the flag snapshot" in r.message]
        assert len(warnings) == 1  # once per outage, not once per refresh
        assert "locked" in (snapshot.last_error or "")
        locker.execute("COMMIT")  # the flag row is gone: the default (compiled) applies
    finally:
        locker.close()  # exclusive mode holds the lock until the connection closes
    try:
        generation = snapshot.generation
        snapshot.invalidate()
        assert snapshot.wait_generation(generation + 1, WAIT_S)
        assert snapshot.flags().compiled is True
    finally:
        snapshot.close()
        db.dispose()


@pytest.mark.postgres
def test_the_snapshot_serves_while_postgres_is_unreachable(pg_url: str) -> None:
    upgrade(pg_url)
    set_flag(pg_url, False)
    real = make_url(pg_url)
    proxy = TcpProxy((real.host or "127.0.0.1", real.port or 5432))
    proxy.start()
    db = make_engine(real.set(host="127.0.0.1", port=proxy.port), connect_timeout_s=2)
    snapshot = FlagSnapshot(make_sessionmaker(db), ttl_s=0.05)
    snapshot.start()
    try:
        assert snapshot.flags().compiled is False
        proxy.stop()  # connections cut, new ones refused
        assert refreshed(snapshot, 2)
        assert snapshot.refresh_failures >= 1
        assert snapshot.flags().compiled is False
    finally:
        snapshot.close()
        proxy.stop()
        db.dispose()
        set_flag(pg_url, True)  # leave the session's shared database as the others expect



def test_before_any_read_succeeds_flags_raise_at_once(tmp_path: Path) -> None:
    # No tables: the first read fails; the engine's guard keeps its own last flags.
    db = make_engine(f"sqlite:///{tmp_path / 'empty.db'}")
    snapshot = FlagSnapshot(make_sessionmaker(db), ttl_s=60.0)
    snapshot.start()
    try:
        with pytest.raises(FlagsUnavailable, match="OperationalError"):
            snapshot.flags()
        assert snapshot.refresh_failures == 1
    finally:
        snapshot.close()
        db.dispose()


def test_invalidate_refreshes_now_not_after_the_ttl(sqlite_url: str) -> None:
    upgrade(sqlite_url)
    db = make_engine(sqlite_url)
    snapshot = FlagSnapshot(make_sessionmaker(db), ttl_s=3600.0)
    snapshot.start()
    try:
        set_flag(sqlite_url, False)
        assert snapshot.flags().compiled is True  # a one-hour ttl: not re-read by itself
        generation = snapshot.generation  # the thread is idle (the ttl is an hour)
        snapshot.invalidate()
        assert snapshot.wait_generation(generation + 1, WAIT_S)
        assert snapshot.flags().compiled is False
    finally:
        snapshot.close()
        db.dispose()
