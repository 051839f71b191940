"""Engines, timestamps and SQLite concurrency."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import Engine, func, select, text
from sqlalchemy.orm import Session, sessionmaker

from storage.db import make_engine, make_sessionmaker, normalize_url, reading
from storage.errors import InvalidQuery
from storage.models import Alert, MemorySample, NaiveDatetimeError, ProbeResult, scope_key
from storage.writer import Writer
from tests.storage.builders import T0, probe_run


@pytest.mark.parametrize("url", ["postgresql://u@h/db", "postgres://u@h/db",
                                 "postgresql+psycopg://u@h/db"])
def test_postgres_urls_use_psycopg3(url: str) -> None:
    assert normalize_url(url).drivername == "postgresql+psycopg"


@pytest.mark.parametrize("url", ["", "mysql://u@h/db", "not a url"])
def test_bad_urls_name_the_field(url: str) -> None:
    with pytest.raises(InvalidQuery, match="database_url"):
        normalize_url(url)


def test_sqlite_engine_creates_its_directory_and_sets_pragmas(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'var' / 'tw.db'}")
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 15000
    finally:
        engine.dispose()
    assert (tmp_path / "var" / "tw.db").exists()


def test_timestamps_come_back_aware_utc(sessionmaker: sessionmaker[Session]) -> None:
    plus2 = timezone(timedelta(hours=2))
    with sessionmaker.begin() as s:
        s.add(MemorySample(at=datetime(2026, 11, 2, 3, 0, tzinfo=plus2), instance_id="a",
                           rss_bytes=1))
    with sessionmaker() as s:
        at = s.scalar(select(MemorySample.at))
        later = s.scalar(select(func.count()).select_from(MemorySample)
                         .where(MemorySample.at >= datetime(2026, 11, 2, 1, 0, tzinfo=UTC)))
    assert at == datetime(2026, 11, 2, 1, 0, tzinfo=UTC) and at.tzinfo is UTC
    assert later == 1


def test_naive_datetimes_are_refused(sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker() as s, pytest.raises(Exception) as info:
        s.add(MemorySample(at=datetime(2026, 1, 1), instance_id="a", rss_bytes=1))
        s.flush()
    assert isinstance(info.value.__cause__ or info.value, NaiveDatetimeError)


def test_one_open_alert_per_fingerprint(sessionmaker: sessionmaker[Session]) -> None:
    from sqlalchemy.exc import IntegrityError

    with sessionmaker.begin() as s:
        s.add(Alert(fingerprint="f1", rule="r", state="resolved"))
        s.add(Alert(fingerprint="f1", rule="r", state="resolved"))
        s.add(Alert(fingerprint="f1", rule="r", state="firing"))
    with pytest.raises(IntegrityError), sessionmaker.begin() as s:
        s.add(Alert(fingerprint="f1", rule="r", state="pending"))


def test_a_reading_session_holds_no_write_lock_and_refuses_writes(
        db_engine: Engine, sessionmaker: sessionmaker[Session]) -> None:
    from sqlalchemy.exc import DBAPIError

    with sessionmaker.begin() as s:
        s.add(Alert(fingerprint="f1", rule="r", state="resolved"))
    other = make_sessionmaker(make_engine(db_engine.url, busy_timeout_s=0.0))
    try:
        with reading(sessionmaker) as r:
            assert r.scalar(select(func.count()).select_from(Alert)) == 1
            # Another connection writes at once (SQLite: BEGIN IMMEDIATE, no waiting)...
            with other.begin() as s:
                s.add(Alert(fingerprint="f2", rule="r", state="resolved"))
            # ...while this one keeps its snapshot, and may not write.
            assert r.scalar(select(func.count()).select_from(Alert)) == 1
            r.add(Alert(fingerprint="f3", rule="r", state="resolved"))
            with pytest.raises(DBAPIError):
                r.flush()
    finally:
        other.kw["bind"].dispose()
    # The pooled connection writes again for its next user.
    with sessionmaker.begin() as s:
        s.add(Alert(fingerprint="f4", rule="r", state="resolved"))
    with sessionmaker() as s:
        assert sorted(s.scalars(select(Alert.fingerprint))) == ["f1", "f2", "f4"]


def test_deleting_a_run_deletes_its_results(sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        s.add(probe_run(T0, [{"bucket": "16"}, {"bucket": "64"}]))
    with sessionmaker.begin() as s:
        s.execute(text("DELETE FROM probe_runs"))
    with sessionmaker() as s:
        assert s.scalar(select(func.count()).select_from(ProbeResult)) == 0


def test_scope_key_is_order_independent() -> None:
    assert scope_key({"path": "compiled", "bucket": "64"}) == "bucket=64,path=compiled"


def test_concurrent_sqlite_writers_and_readers_never_see_locked(tmp_path: Path) -> None:
    from storage import migrate

    url = f"sqlite:///{tmp_path / 'busy.db'}"
    migrate.upgrade(url)
    engine = make_engine(url)
    maker = make_sessionmaker(engine)
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for i in range(40):
                with maker.begin() as s:
                    # Read then write in one transaction: the case deferred BEGIN breaks.
                    seen = s.scalar(select(func.count()).select_from(MemorySample)) or 0
                    s.add(MemorySample(at=T0, instance_id=f"w{n}", rss_bytes=seen + i))
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    def reader() -> None:
        try:
            for _ in range(60):
                with maker() as s:
                    s.scalar(select(func.max(MemorySample.rss_bytes)))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    threads += [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    try:
        with maker() as s:
            total = s.scalar(select(func.count()).select_from(MemorySample))
    finally:
        engine.dispose()
    assert errors == []
    assert total == 160


def test_writer_waits_out_a_held_lock(tmp_path: Path) -> None:
    from storage import migrate

    url = f"sqlite:///{tmp_path / 'locked.db'}"
    migrate.upgrade(url)
    blocker = make_engine(url)
    engine = make_engine(url, busy_timeout_s=0.05)  # give up on the lock almost at once
    writer = Writer(make_sessionmaker(engine), initial_backoff_s=0.01, max_backoff_s=0.05)
    try:
        with blocker.begin() as conn:  # BEGIN IMMEDIATE: holds the write lock
            conn.execute(text("INSERT INTO reports (week, created_at, markdown, html, summary) "
                              "VALUES ('2026-W01', '2026-01-01 00:00:00', '', '', '{}')"))
            writer.submit(lambda s: s.add(MemorySample(at=T0, instance_id="x", rss_bytes=1)))
            assert not writer.flush(timeout=0.4)
            assert "locked" in (writer.stats.last_error or "")
        assert writer.flush(timeout=30)
        assert writer.stats.written == 1 and writer.stats.retries >= 1
    finally:
        writer.close()
        engine.dispose()
        blocker.dispose()


def _sqlite_heap_bytes() -> int:
    """Return SQLite's own count of the heap it holds in this process."""
    import _sqlite3  # the extension the pysqlite driver loads: the library's own counter
    import ctypes

    used = ctypes.CDLL(_sqlite3.__file__).sqlite3_memory_used
    used.restype = ctypes.c_int64
    return int(used())


def test_sqlite_page_caches_stay_within_one_heap_limit(tmp_path: Path) -> None:
    from storage.db import SQLITE_HEAP_LIMIT_BYTES

    engine = make_engine(f"sqlite:///{tmp_path / 'tw.db'}")
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE big (x INTEGER, y TEXT)")
            conn.exec_driver_sql(  # about 24 MiB: more than one connection's 16 MiB cache
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n "
                "WHERE i < 100000) INSERT INTO big SELECT i, printf('%.240d', i) FROM n")
        # Five pooled connections each read the whole table (as jobs and scrapes do in
        # turn over hours): unbounded, each kept its own 16 MiB of pages.
        # (Autocommit: plain reads, none waits on another's BEGIN IMMEDIATE.)
        conns = [engine.connect().execution_options(isolation_level="AUTOCOMMIT")
                 for _ in range(5)]
        try:
            for conn in conns:
                assert conn.exec_driver_sql("SELECT count(y) FROM big").scalar() == 100000
            # A few MiB in all (reached during a process's warm-up, not hours later):
            # the 24 MiB read five times over does not stay.
            assert _sqlite_heap_bytes() < SQLITE_HEAP_LIMIT_BYTES + 4 * 1024 * 1024
            assert _sqlite_heap_bytes() < 8 * 1024 * 1024
        finally:
            for conn in conns:
                conn.close()
    finally:
        engine.dispose()


def test_a_long_sqlite_write_transaction_is_logged_with_its_caller(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import storage.db

    sm = make_sessionmaker(make_engine(f"sqlite:///{tmp_path / 'lock.db'}"))
    from storage.models import Base

    Base.metadata.create_all(sm.kw["bind"])
    monkeypatch.setattr(storage.db, "LONG_WRITE_LOCK_S", 0.0)  # every write counts as long

    def hold_the_lock() -> None:
        with sm.begin() as s:
            s.add(MemorySample(at=T0, instance_id="i1", rss_bytes=1))

    with caplog.at_level("WARNING", logger="storage.db"):
        hold_the_lock()
        with reading(sm) as s:  # a read-only snapshot holds no write lock: nothing logged
            s.scalar(select(func.count()).select_from(MemorySample))
    held = [r.getMessage() for r in caplog.records if "write lock held" in r.getMessage()]
    assert len(held) == 1
    assert "test_db:hold_the_lock" in held[0] and "MainThread" in held[0]
    sm.kw["bind"].dispose()


def test_naming_the_caller_of_a_long_write_reads_no_source_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import linecache

    import storage.db
    from storage.models import Base

    sm = make_sessionmaker(make_engine(f"sqlite:///{tmp_path / 'lock.db'}"))
    Base.metadata.create_all(sm.kw["bind"])
    monkeypatch.setattr(storage.db, "LONG_WRITE_LOCK_S", 0.0)
    linecache.clearcache()
    with caplog.at_level("WARNING", logger="storage.db"), sm.begin() as s:
        s.add(MemorySample(at=T0, instance_id="i1", rss_bytes=1))
    assert any("write lock held" in r.getMessage() for r in caplog.records)
    # A process that logs this now and then would otherwise keep the source of every
    # module on the stack (SQLAlchemy's session and engine among them) in memory for good.
    assert not [name for name, entry in linecache.cache.items() if len(entry) > 1]
    sm.kw["bind"].dispose()
