"""The weekly review's batching readings on weeks where they have something to say: a
window that is not zero, and batch sizes that ran both speculative and direct."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from monitor.report.data import BatchingWeek, WeekData
from monitor.report.metrics import speculation_speedup_at_load, window_vs_token_time
from monitor.report.registry import load_registry
from monitor.report.week import last_seven_days
from storage.queries.batching import BatchLoop, BatchUsage

BATCHING = {o.name: o for o in load_registry().optimizations}["continuous batching"]


def _week(batching: BatchingWeek) -> WeekData:
    return WeekData(week=last_seven_days(datetime(2026, 12, 6, tzinfo=UTC)), buckets=(16, 32),
                    batching=batching)


def _loop(samples: int, window_s: float | None) -> BatchLoop:
    return BatchLoop(instance_id="a", samples=samples, rows_waiting_mean=0.0,
                     rows_waiting_max=0, batch_size_mean=2.0, window_mean_s=window_s,
                     steps=100, step_mean_s={})


def _usage(batch: str, decoding: str, requests: int, step_tps: float | None) -> BatchUsage:
    return BatchUsage(bucket="32", batch=batch, decoding=decoding, requests=requests,
                      batch_size_mean=float(batch), batch_size_max=int(batch),
                      queue_wait_share=0.1, step_tokens_per_s=step_tps, tokens_per_s=None,
                      latency_p50_s=0.02, latency_p99_s=0.05)


def test_the_window_is_weighed_by_samples_against_the_p50_token_time():
    week = _week(BatchingWeek(loop=(_loop(3, 0.002), _loop(1, 0.006)), token_p50_s=0.004))
    reading = window_vs_token_time(week, BATCHING).overall
    # (3 x 2 ms + 1 x 6 ms) / 4 samples = 3 ms over a 4 ms token: 0.75.
    assert reading.value == pytest.approx(0.75)
    assert "window 3.00 ms (mean of 4 samples)" in reading.detail


def test_speculation_at_load_weighs_the_classes_that_ran_both_ways():
    usage = (_usage("1", "speculative", 30, 300.0), _usage("1", "direct", 10, 100.0),
             _usage("8", "speculative", 10, 400.0), _usage("8", "direct", 50, 800.0),
             _usage("4", "speculative", 20, 500.0))  # no direct at 4 rows: not compared
    reading = speculation_speedup_at_load(_week(BatchingWeek(usage=usage)), BATCHING).overall
    # 3x at one row (30 speculative requests), 0.5x at 8 rows (10): (90 + 5) / 40.
    assert reading.value == pytest.approx(95 / 40)
    assert reading.n == 40
    assert "speculative share 50%" in reading.detail
    assert "1 rows: 3.00x, 8 rows: 0.50x" in reading.detail
