"""Real-traffic rollups: canaries excluded, bounded buffer, flushes that add up."""

from __future__ import annotations

import threading
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from engine.protocol import GenerateResult, SpecStats
from probes.traffic import TrafficRecorder
from storage.models import TrafficRollup
from storage.sketches import Sketch
from storage.writer import Writer

T0 = datetime(2026, 11, 30, 10, 0, 12, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


def served(total: float = 0.03, *, bucket: str = "32", canary: bool = False,
           probation: bool = False, path: str = "compiled") -> GenerateResult:
    return GenerateResult(
        text="x", output_ids=(1, 2), input_tokens=20, bucket=bucket, padded_length=32,
        output_tokens=10, path=path, decoding="speculative", queue_wait_s=0.0,
        encoder_s=0.001, ttft_s=0.005, decode_token_s=(0.002,) * 9, total_s=total,
        spec=SpecStats(2, 8, 6, (2, 2, 1, 1), 2), canary=canary, probation=probation)


def test_canary_traffic_never_enters_rollups() -> None:
    rec = TrafficRecorder("a", clock=Clock())
    rec.record(served(canary=True))
    assert rec.drain() == []
    rec.record(served())
    assert [d.requests for _, d in rec.drain()] == [1]


def test_rollup_folds_sketches_lengths_acceptance_and_probation() -> None:
    clock = Clock()
    rec = TrafficRecorder("a", clock=clock)
    rec.record(served(0.03))
    rec.record(served(100.0, probation=True))  # above the last latency edge
    rec.record(served(0.2, bucket="overflow", path="overflow"))
    rec.record_rejection("32")
    clock.now = T0 + timedelta(minutes=1)
    rec.record(served())
    rollups = {(k.minute, k.bucket, k.path): d for k, d in rec.drain()}
    d = rollups[(T0.replace(second=0), "32", "compiled")]
    assert d.requests == 2 and d.latency_sum_s == pytest.approx(100.03)
    lat = Sketch.from_json(d.latency_sketch)
    assert lat.count == 2 and lat.quantile(1.0) == pytest.approx(100.0, rel=0.01)
    assert lat.quantile(0.0) == pytest.approx(0.03, rel=0.01)
    assert Sketch.from_json(d.ttft_sketch).quantile(0.5) == pytest.approx(0.005, rel=0.01)
    per_token = Sketch.from_json(d.per_token_sketch)  # one update per request, 9 tokens each
    assert per_token.count == 18 and per_token.quantile(0.5) == pytest.approx(0.002, rel=0.01)
    assert d.input_lens == {"20": 2} and d.output_lens == {"10": 2}
    assert (d.drafts, d.draft_tokens, d.accepted_tokens) == (4, 16, 12)
    assert d.accepted_per_position == (4, 4, 2, 2)
    assert (d.probation_requests, d.probation_draft_tokens, d.probation_accepted) == (1, 8, 6)
    assert rollups[(T0.replace(second=0), "overflow", "overflow")].overflow == 1
    assert rollups[(T0.replace(second=0), "32", "rejected")].rejections == 1
    assert rollups[(T0.replace(second=0, minute=1), "32", "compiled")].requests == 1


def test_bounded_buffer_counts_drops() -> None:
    clock = Clock()
    rec = TrafficRecorder("a", buffer_max=2, clock=clock)
    for minute in range(5):
        clock.now = T0 + timedelta(minutes=minute)
        rec.record(served())
        rec.record(served())  # same key: no new rollup needed
    assert len(rec) == 2
    assert rec.dropped == 6
    clock.now = T0
    rec.record(served())  # an existing rollup still takes requests
    assert rec.dropped == 6


def test_flushes_add_up_in_the_database(sessionmaker: sessionmaker[Session]) -> None:
    clock = Clock()
    rec = TrafficRecorder("replica-a", clock=clock)
    writer = Writer(sessionmaker)
    try:
        rec.record(served())
        rec.record(served(canary=True))
        assert rec.flush(writer) == 1
        rec.record(served())
        rec.record(replace(served(), probation=True))
        rec.flush(writer)
        assert rec.flush(writer) == 0  # nothing new
        assert writer.flush(timeout=30)
    finally:
        writer.close()
    with sessionmaker() as s:
        rows = s.scalars(select(TrafficRollup)).all()
    assert len(rows) == 1
    row = rows[0]
    assert (row.minute, row.instance_id, row.bucket) == (T0.replace(second=0), "replica-a", "32")
    assert row.requests == 3 and row.draft_tokens == 24 and row.probation_requests == 1
    assert Sketch.from_json(row.latency_sketch).count == 3 and row.input_lens == {"20": 3}


def test_a_full_writer_drops_and_counts_the_flush(sessionmaker: sessionmaker[Session]) -> None:
    writer = Writer(sessionmaker, max_pending=1)
    rec = TrafficRecorder("a", clock=Clock())
    gate = threading.Event()
    try:
        rec.record(served())
        assert writer.submit(lambda s: gate.wait(10))  # the writer is busy and full
        assert rec.flush(writer) == 0
        assert writer.stats.dropped == 1 and len(rec) == 0
        gate.set()
        assert writer.flush(timeout=10)
        rec.record(served())
        assert rec.flush(writer) == 1
        assert writer.flush(timeout=10)
    finally:
        gate.set()
        writer.close()
    with sessionmaker() as s:
        assert s.scalars(select(TrafficRollup)).one().requests == 1


def test_requests_keep_the_minute_they_were_served_in_until_the_fold() -> None:
    from probes.traffic import FOLD_AT

    clock = Clock()
    rec = TrafficRecorder("a", clock=clock)
    rec.record(served(0.03))
    assert rec.pending == 1  # queued, not folded: the request path took no lock
    clock.now = T0 + timedelta(minutes=5)  # folded later, counted in its own minute
    for _ in range(FOLD_AT - 1):
        rec.record(served(0.05))
    assert rec.pending == 0  # the FOLD_AT-th request folded the queue: it stays bounded
    rollups = {k.minute: d for k, d in rec.drain()}
    assert rollups[T0.replace(second=0)].requests == 1
    assert rollups[T0.replace(second=0) + timedelta(minutes=5)].requests == FOLD_AT - 1


def test_concurrent_records_are_all_counted() -> None:
    rec = TrafficRecorder("a", clock=Clock())
    stop = threading.Event()
    drained: list[int] = []

    def drainer() -> None:
        while not stop.is_set():
            drained.extend(d.requests for _, d in rec.drain())

    def worker() -> None:
        for _ in range(1000):
            rec.record(served())

    reader = threading.Thread(target=drainer)
    reader.start()
    workers = [threading.Thread(target=worker) for _ in range(4)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    stop.set()
    reader.join()
    drained.extend(d.requests for _, d in rec.drain())
    assert sum(drained) == 4000
