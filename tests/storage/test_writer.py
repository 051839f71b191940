"""The writer delays writes while the database is down or locked, and never loses them."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from bench.proxy import TcpProxy as _Proxy
from storage import migrate
from storage.db import make_engine, make_sessionmaker
from storage.models import MemorySample
from storage.writer import Writer
from tests.storage.builders import T0, minutes


def _sample(i: int):
    def write(session: Session) -> None:
        session.add(MemorySample(at=T0 + minutes(i), instance_id="w", rss_bytes=i))
    return write


def _count(maker: sessionmaker[Session]) -> int:
    with maker() as s:
        return s.scalar(select(func.count()).select_from(MemorySample)) or 0


def test_writes_arrive_in_one_batch_per_transaction(sessionmaker: sessionmaker[Session]) -> None:
    writer = Writer(sessionmaker, batch_size=7)
    try:
        assert all(writer.submit(_sample(i)) for i in range(50))
        assert writer.flush(timeout=30)
        stats = writer.stats
    finally:
        assert writer.close() == 0
    assert _count(sessionmaker) == 50
    assert (stats.written, stats.pending, stats.dropped, stats.retries) == (50, 0, 0, 0)
    assert writer.submit(_sample(99)) is False  # after close: counted, not raised
    assert writer.stats.dropped == 1


def test_database_appearing_later_receives_every_write(tmp_path: Path) -> None:
    path = tmp_path / "not-yet" / "tailwatch.db"
    engine = make_engine(f"sqlite:///{path}", create_parent=False)
    writer = Writer(make_sessionmaker(engine), initial_backoff_s=0.01, max_backoff_s=0.05)
    try:
        for i in range(20):
            writer.submit(_sample(i))
        assert not writer.flush(timeout=0.5)  # directory missing: nothing can be written
        assert writer.stats.pending == 20 and writer.stats.retries >= 2
        assert writer.stats.last_error and "OperationalError" in writer.stats.last_error
        path.parent.mkdir()
        migrate.upgrade(f"sqlite:///{path}")
        assert writer.flush(timeout=30)
        assert writer.stats.written == 20
    finally:
        writer.close()
        engine.dispose()
    assert _count(make_sessionmaker(make_engine(f"sqlite:///{path}"))) == 20


def test_postgres_down_then_back_loses_nothing(pg_url: str) -> None:
    from sqlalchemy.engine import make_url

    migrate.upgrade(pg_url)
    direct = make_sessionmaker(make_engine(pg_url))
    with direct.begin() as s:
        s.query(MemorySample).delete()
    proxy = _Proxy(("127.0.0.1", 5432))
    url = make_url(pg_url).set(host="127.0.0.1", port=proxy.port)
    engine = make_engine(url, connect_timeout_s=2)
    writer = Writer(make_sessionmaker(engine), initial_backoff_s=0.01, max_backoff_s=0.05)
    try:
        proxy.start()
        writer.submit(_sample(0))
        assert writer.flush(timeout=30)
        proxy.stop()  # the database goes away, pooled connections included
        for i in range(1, 11):
            writer.submit(_sample(i))
        assert not writer.flush(timeout=0.5)
        assert writer.stats.retries >= 1
        proxy.start()
        assert writer.flush(timeout=30)
    finally:
        writer.close()
        engine.dispose()
        proxy.stop()
    assert _count(direct) == 11
    direct.kw["bind"].dispose()


def test_full_buffer_drops_and_counts(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'missing' / 'x.db'}", create_parent=False)
    writer = Writer(make_sessionmaker(engine), max_pending=5, initial_backoff_s=0.01,
                    max_backoff_s=0.02)
    try:
        accepted = [writer.submit(_sample(i)) for i in range(8)]
        assert accepted == [True] * 5 + [False] * 3
        assert writer.stats.dropped == 3 and writer.stats.pending == 5
    finally:
        assert writer.close(timeout=0.2) == 5  # still down: reported, not silently lost
        engine.dispose()


def test_a_bad_item_is_discarded_alone(sessionmaker: sessionmaker[Session]) -> None:
    writer = Writer(sessionmaker, batch_size=10)

    def bad(session: Session) -> None:
        raise ValueError("bad data")

    try:
        for i in range(3):
            writer.submit(_sample(i))
        writer.submit(bad)
        writer.submit(_sample(3))
        assert writer.flush(timeout=30)
        stats = writer.stats
    finally:
        writer.close()
    assert _count(sessionmaker) == 4
    assert stats.failed == 1 and stats.written == 4 and "bad data" in (stats.last_error or "")
