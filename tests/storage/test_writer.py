"""The writer delays writes while the database is down or locked, never loses them, and
never writes a batch twice when a retry follows a commit that did arrive."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session, sessionmaker

from bench.proxy import TcpProxy as _Proxy
from engine.protocol import GenerateResult, SpecStats
from probes.prober import Prober
from probes.traffic import TrafficRecorder
from storage import migrate
from storage.db import make_engine, make_sessionmaker
from storage.models import (
    AppliedBatch,
    BatchRollup,
    MemorySample,
    ProbeResult,
    ProbeRun,
    TrafficRollup,
)
from storage.writer import TOKENS_KEPT, Writer
from tests.probes.fakes import FakeEngine, placeholder_suites
from tests.storage.ambiguous import ambiguous_commit
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


def _rows(maker: sessionmaker[Session], model: type) -> int:
    with maker() as s:
        return s.scalar(select(func.count()).select_from(model)) or 0


def test_a_probe_cycle_committed_before_the_connection_failed_is_stored_once(
        db_engine: Engine, sessionmaker: sessionmaker[Session],
        caplog: pytest.LogCaptureFixture) -> None:
    engine = FakeEngine()
    engine.warm_up()
    writer = Writer(sessionmaker, initial_backoff_s=0.01, max_backoff_s=0.05)
    prober = Prober(engine, writer, placeholder_suites(per_bucket=1), instance_id="a",
                    canaries_per_bucket=1, ab_share=0.0, rng=random.Random(0))
    try:
        with ambiguous_commit("probe_results", engine=db_engine) as fired:
            result = prober.run_cycle()
            assert writer.flush(timeout=30)
        stats = writer.stats
    finally:
        writer.close()
        engine.close()
    assert fired == ["probe_results"]  # the commit arrived and the writer saw it fail
    assert _rows(sessionmaker, ProbeRun) == 1
    assert _rows(sessionmaker, ProbeResult) == len(result.groups) > 0
    assert (stats.retries, stats.already_applied, stats.written, stats.failed) == (1, 1, 1, 0)
    assert "batch already applied" in caplog.text


def _served() -> GenerateResult:
    return GenerateResult(
        text="x", output_ids=(1, 2), input_tokens=20, bucket="32", padded_length=32,
        output_tokens=10, path="compiled", decoding="speculative", queue_wait_s=0.0,
        encoder_s=0.001, ttft_s=0.005, decode_token_s=(0.002,) * 9, total_s=0.03,
        spec=SpecStats(2, 8, 6, (2, 2, 1, 1), 2))


def test_rollup_deltas_committed_before_the_connection_failed_are_added_once(
        db_engine: Engine, sessionmaker: sessionmaker[Session]) -> None:
    recorder = TrafficRecorder("a", clock=lambda: T0)
    writer = Writer(sessionmaker, initial_backoff_s=0.01, max_backoff_s=0.05)
    try:
        for _ in range(3):
            recorder.record(_served())
        assert recorder.flush(writer) == 1  # creates the minute's rows
        assert writer.flush(timeout=30)
        with ambiguous_commit("traffic_rollups", engine=db_engine) as fired:
            for _ in range(2):
                recorder.record(_served())
            assert recorder.flush(writer) == 1  # adds to them: must not add twice
            assert writer.flush(timeout=30)
        stats = writer.stats
    finally:
        writer.close()
    assert fired == ["traffic_rollups"]
    with sessionmaker() as s:
        assert s.scalars(select(TrafficRollup.requests)).all() == [5]
        assert s.scalar(select(func.sum(BatchRollup.requests))) == 5
    assert (stats.retries, stats.already_applied, stats.written) == (1, 1, 2)


def test_a_writer_deletes_its_committed_batch_tokens_in_bulk(
        sessionmaker: sessionmaker[Session]) -> None:
    writer = Writer(sessionmaker, batch_size=1)
    batches = TOKENS_KEPT + 6
    try:
        for i in range(batches):
            writer.submit(_sample(i))
        assert writer.flush(timeout=60)
    finally:
        writer.close()
    assert writer.stats.written == batches and _count(sessionmaker) == batches
    # The 65th batch deleted the first 64 tokens; retention prunes the rest once stopped.
    assert _rows(sessionmaker, AppliedBatch) == 6
