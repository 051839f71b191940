"""Batch rollups: requests and loop readings folded per minute, added on both databases,
by racing writers too, and pruned with the other rollups."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from engine.protocol import BatchSnapshot, GenerateResult
from probes.batching import BatchFolder
from storage.batch_rollups import (
    ENGINE_SCOPE,
    BatchDelta,
    BatchKey,
    add_batch_rollups,
    batch_class,
)
from storage.models import BatchRollup
from storage.queries.batching import batch_loop, batch_usage
from storage.queries.export import table_frame
from storage.retention import prune
from tests.storage.builders import T0


def _result(rows: float, *, total: float = 0.2, wait: float = 0.05) -> GenerateResult:
    return GenerateResult(
        text="x", output_ids=(1, 2, 3), input_tokens=10, bucket="16", padded_length=16,
        output_tokens=3, path="compiled", decoding="direct", queue_wait_s=wait, encoder_s=0.01,
        ttft_s=0.05, decode_token_s=(0.02, 0.02), total_s=total, batch_wait_s=0.01,
        batch_join_step=7, batch_size_mean=rows, batch_size_max=int(rows + 0.5))


def test_batch_classes_round_up_to_powers_of_two() -> None:
    assert [batch_class(x) for x in (1.0, 1.5, 2.0, 3.0, 4.0, 5.2, 32.0)] == [
        "1", "2", "2", "4", "4", "8", "32"]


def test_folded_requests_and_loop_readings_add_up(sessionmaker: sessionmaker[Session]) -> None:
    folder = BatchFolder("i-1", buffer_max=100)
    folder.add(T0, [_result(1.0), _result(3.0), _result(3.5, total=0.4)])
    steps = {"encode": 2, "decode": 10, "verify": 0}
    seconds = {"encode": 0.02, "decode": 0.1, "verify": 0.0}
    folder.sample(T0, BatchSnapshot(max_batch=8, batch_size=3, rows_waiting=2, window_s=0.001,
                                    steps=10, step_count=steps, step_seconds_sum=seconds))
    folder.sample(T0 + timedelta(seconds=30), BatchSnapshot(
        max_batch=8, batch_size=1, rows_waiting=5, window_s=0.003, steps=14,
        step_count={**steps, "decode": 14}, step_seconds_sum={**seconds, "decode": 0.18}))
    folder.sample(T0, BatchSnapshot(max_batch=1))  # unbatched: nothing to read
    with sessionmaker.begin() as s:
        add_batch_rollups(s, folder.drain())
        add_batch_rollups(s, [(BatchKey(T0, "i-1", "16", "4", "direct"), folder_delta())])
    with sessionmaker() as s:
        usage = {u.batch: u for u in batch_usage(s, T0, T0 + timedelta(minutes=1))}
        loop = batch_loop(s, T0, T0 + timedelta(minutes=1))
        exported = table_frame(s, "batch_rollups", T0)  # `tailwatch export --table`
    assert sorted(exported["batch"]) == ["1", "4", ENGINE_SCOPE]
    assert all(isinstance(v, str) for v in exported["latency_sketch"])  # JSON as text
    assert set(usage) == {"1", "4"}
    four = usage["4"]
    assert four.requests == 3 and four.batch_size_max == 4  # the max, not a sum
    assert four.batch_size_mean == pytest.approx((3.0 + 3.5 + 4.0) / 3)
    # (queue wait + wait for the loop) over latency, summed over requests.
    assert four.queue_wait_share == pytest.approx((3 * 0.06) / (0.2 + 0.4 + 0.2))
    assert four.step_tokens_per_s == pytest.approx((3.0 * 2 + 3.5 * 2 + 4.0 * 2) / (3 * 0.04))
    [one] = loop
    assert (one.samples, one.rows_waiting_max, one.steps) == (2, 5, 14)
    assert one.rows_waiting_mean == 3.5 and one.batch_size_mean == 2.0
    assert one.step_mean_s["decode"] == pytest.approx(0.18 / 14)
    assert one.step_mean_s["verify"] is None


def folder_delta() -> BatchDelta:
    """Return the delta of one more class-4 request (through the folder, as recorded)."""
    folder = BatchFolder("i-1", buffer_max=10)
    folder.add(T0, [_result(4.0)])
    [(_key, delta)] = folder.drain()
    return delta


def test_racing_writers_add_to_one_row_and_retention_prunes_it(
        sessionmaker: sessionmaker[Session]) -> None:
    key = BatchKey(T0, "i-1", "16", "8", "direct")
    engine_key = BatchKey(T0, "i-1", ENGINE_SCOPE, ENGINE_SCOPE, ENGINE_SCOPE)
    folder = BatchFolder("i-1", buffer_max=10)
    folder.add(T0, [_result(8.0)])
    [(_k, delta)] = folder.drain()
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def work() -> None:
        try:
            barrier.wait()
            for _ in range(5):
                with sessionmaker.begin() as s:
                    add_batch_rollups(s, [(key, delta), (engine_key, delta)])
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    with sessionmaker() as s:
        rows = s.scalars(select(BatchRollup).order_by(BatchRollup.bucket)).all()
        assert [(r.bucket, r.requests, r.batch_size_max) for r in rows] == [
            ("16", 20, 8), (ENGINE_SCOPE, 20, 8)]
    with sessionmaker.begin() as s:
        pruned = prune(s, T0 + timedelta(days=100), raw_days=14, rollup_days=90)
    assert pruned.batch_rollups == 2
    with sessionmaker() as s:
        assert s.scalar(select(func.count()).select_from(BatchRollup)) == 0
