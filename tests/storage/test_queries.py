"""Queries return the right numbers on hand-built data, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import date, timedelta

import pytest
from sqlalchemy.orm import Session, sessionmaker

from storage import queries
from storage.errors import InvalidQuery, UnknownMetric
from storage.models import Baseline, CompileEvent, MemorySample, ProbeRun
from storage.rollups import RollupDelta, RollupKey, add_rollups
from tests.storage.builders import T0, minutes, probe_run

HOUR = timedelta(hours=1)


def _request(latency: float, tokens: int = 50, **kw: object) -> RollupDelta:
    return RollupDelta.for_request(latency_s=latency, ttft_s=latency / 4, input_tokens=tokens,
                                   padded_length=kw.pop("padded", 64), output_tokens=10, **kw)  # type: ignore[arg-type]


def test_probe_percentiles_take_the_median_cycle_and_the_worst_max(
    sessionmaker: sessionmaker[Session],
) -> None:
    with sessionmaker.begin() as s:
        for i, (p95, mx) in enumerate([(0.1, 0.2), (0.2, 0.3), (0.9, 1.5)]):
            s.add(probe_run(T0 + minutes(i), [
                {"p50_s": 0.05 * (i + 1), "p95_s": p95, "p99_s": p95 * 2, "max_s": mx, "errors": 1},
                {"variant": "eager", "p95_s": 5.0, "max_s": 9.0},
            ]))
        s.add(probe_run(T0 + HOUR, [{"p95_s": 7.0}]))  # outside the window
    with sessionmaker() as s:
        (row,) = queries.probe_percentiles(s, T0, T0 + minutes(30))
        eager = queries.probe_percentiles(s, T0, T0 + minutes(30), variant="eager")
    assert (row.bucket, row.path, row.decoding, row.variant) == ("64", "compiled", "speculative",
                                                                 "optimized")
    assert row.samples == 3 and row.requests == 9
    assert row.p50_s == pytest.approx(0.10)
    assert row.p95_s == pytest.approx(0.2) and row.p99_s == pytest.approx(0.4)
    assert row.max_s == pytest.approx(1.5)
    assert [e.p95_s for e in eager] == [5.0]


def test_traffic_percentiles_interpolate_the_summed_histograms(
    sessionmaker: sessionmaker[Session],
) -> None:
    key_a = RollupKey(T0, "i-1", "64", "compiled", "speculative")
    key_b = RollupKey(T0 + minutes(1), "i-2", "64", "compiled", "speculative")
    with sessionmaker.begin() as s:
        add_rollups(s, [(key_a, _request(0.04))] * 50)
        add_rollups(s, [(key_b, _request(0.4))] * 50)
        add_rollups(s, [(RollupKey(T0 + HOUR, "i-1", "64", "compiled", "speculative"),
                         _request(9.0))])
    with sessionmaker() as s:
        (row,) = queries.traffic_percentiles(s, T0, T0 + minutes(10))
        (only_b,) = queries.traffic_percentiles(s, T0, T0 + minutes(10), instance_id="i-2")
    assert row.requests == 100 and row.variant is None
    assert row.mean_s == pytest.approx(0.22)
    assert row.p50_s == pytest.approx(0.05)  # top of the (0.025, 0.05] bin
    assert row.p95_s == pytest.approx(0.48)  # 45 of 50 into (0.3, 0.5]
    assert only_b.requests == 50 and only_b.p50_s == pytest.approx(0.4)


def test_relative_change_guards_empty_and_zero_baselines() -> None:
    assert queries.relative_change(1.5, 1.0).relative_change == pytest.approx(0.5)
    assert queries.relative_change(0.5, -1.0).relative_change == pytest.approx(1.5)
    assert queries.relative_change(0.0, 0.0).relative_change == 0.0
    zero = queries.relative_change(1.0, 0.0)
    assert zero.relative_change is None and zero.reason == "zero baseline"
    assert queries.relative_change(None, 1.0).reason == "no current value"
    assert queries.relative_change(1.0, None).reason == "no baseline"
    assert queries.relative_change(float("nan"), 1.0).relative_change is None


def test_active_baseline_prefers_pinned_and_ignores_inactive(
    sessionmaker: sessionmaker[Session],
) -> None:
    scope = {"bucket": "64", "path": "compiled"}
    with sessionmaker.begin() as s:
        s.add_all([
            Baseline(metric="p95_s", scope=scope, scope_key="bucket=64,path=compiled", value=0.1,
                     kind="pinned", created_at=T0, pinned_by="ana"),
            Baseline(metric="p95_s", scope=scope, scope_key="bucket=64,path=compiled", value=0.3,
                     kind="rolling", created_at=T0 + HOUR),
            Baseline(metric="p95_s", scope=scope, scope_key="bucket=64,path=compiled", value=9.0,
                     kind="pinned", created_at=T0 + 2 * HOUR, active=False),
        ])
    with sessionmaker() as s:
        base = queries.active_baseline(s, "p95_s", scope)
        change = queries.change_against_baseline(s, "p95_s", scope, 0.15)
        missing = queries.change_against_baseline(s, "p95_s", {"bucket": "16"}, 0.15)
    assert base is not None and base.value == 0.1 and base.kind == "pinned"
    assert change.relative_change == pytest.approx(0.5) and change.baseline_id == base.id
    assert missing.relative_change is None and missing.reason == "no baseline"


def test_memory_growth_fits_a_slope_per_instance(sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        for h in range(25):
            s.add(MemorySample(at=T0 + h * HOUR, instance_id="i-1",
                               rss_bytes=1_000_000_000 + h * 1_000_000, kv_cache_bytes=5))
            s.add(MemorySample(at=T0 + h * HOUR, instance_id="i-2", rss_bytes=500, kv_cache_bytes=5))
    with sessionmaker() as s:
        one, flat = queries.memory_growth(s, T0, T0 + 30 * HOUR)
        with pytest.raises(InvalidQuery, match="field"):
            queries.memory_growth(s, T0, T0 + HOUR, field="bogus")
    assert one.instance_id == "i-1" and one.samples == 25
    assert one.slope_bytes_per_hour == pytest.approx(1_000_000)
    assert one.growth_pct_per_day == pytest.approx(2.4)
    assert one.last_bytes - one.first_bytes == 24_000_000
    assert flat.slope_bytes_per_hour == pytest.approx(0.0)


def test_recompiles_per_hour_sums_counts_and_reasons(sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        s.add(CompileEvent(at=T0, instance_id="i-1", recompiles=3, graphs=2,
                           recompile_reasons={"size mismatch": 2, "flag": 1}, limit_hits=1))
        s.add(CompileEvent(at=T0 + HOUR, instance_id="i-1", recompiles=1,
                           recompile_reasons={"size mismatch": 1}, compile_seconds=20.5))
        s.add(CompileEvent(at=T0 + 5 * HOUR, instance_id="i-1", recompiles=50))
    with sessionmaker() as s:
        rate = queries.recompiles_per_hour(s, T0, T0 + 2 * HOUR)
    assert rate.recompiles == 4 and rate.recompiles_per_hour == pytest.approx(2.0)
    assert rate.limit_hits == 1 and rate.compile_seconds == pytest.approx(20.5)
    assert rate.top_recompile_reasons[0] == ("size mismatch", 3)


def test_acceptance_per_bucket_per_day_for_canaries_traffic_and_probation(
    sessionmaker: sessionmaker[Session],
) -> None:
    day2 = T0 + timedelta(days=1)
    spec = {"drafts": 5, "draft_tokens": 20, "accepted_tokens": 10,
            "accepted_per_position": [4, 3, 2, 1]}
    with sessionmaker.begin() as s:
        s.add(probe_run(T0, [dict(spec), {"bucket": "16", **spec, "accepted_tokens": 20}]))
        s.add(probe_run(T0 + HOUR, [dict(spec)]))
        s.add(probe_run(day2, [{**spec, "accepted_tokens": 0, "accepted_per_position": [0]}]))
        key = RollupKey(T0, "i-1", "64", "compiled", "speculative")
        add_rollups(s, [(key, _request(0.1, drafts=4, draft_tokens=16, accepted_tokens=12,
                                       accepted_per_position=(4, 4, 3, 1)))])
        add_rollups(s, [(key, _request(0.1, drafts=4, draft_tokens=16, accepted_tokens=4,
                                       probation=True))])
    with sessionmaker() as s:
        daily = queries.acceptance(s, T0, T0 + timedelta(days=2), by_day=True)
        traffic = queries.acceptance(s, T0, T0 + HOUR, source="traffic")
        probation = queries.acceptance(s, T0, T0 + HOUR, source="probation")
        with pytest.raises(InvalidQuery, match="source"):
            queries.acceptance(s, T0, T0 + HOUR, source="nope")
    got = {(a.day, a.bucket): a for a in daily}
    first = got[(date(2026, 11, 2), "64")]
    assert first.draft_tokens == 40 and first.accepted_tokens == 20
    assert first.acceptance_rate == pytest.approx(0.5)
    assert first.mean_acceptance_length == pytest.approx(3.0)
    assert first.accepted_per_position == (8, 6, 4, 2)
    assert got[(date(2026, 11, 2), "16")].acceptance_rate == pytest.approx(1.0)
    assert got[(date(2026, 11, 3), "64")].acceptance_rate == 0.0
    (t,) = traffic
    assert t.requests == 2 and t.acceptance_rate == pytest.approx(0.5)
    assert t.accepted_per_position == (4, 4, 3, 1)
    (p,) = probation
    assert p.requests == 1 and p.acceptance_rate == pytest.approx(0.25)


def test_traffic_shape_reports_shares_above_bucket_edges(sessionmaker: sessionmaker[Session]) -> None:
    key = RollupKey(T0, "i-1", "64", "compiled", "direct")
    with sessionmaker.begin() as s:
        add_rollups(s, [(key, _request(0.1, tokens=20, padded=32))] * 10)
        add_rollups(s, [(key, _request(0.1, tokens=100, padded=128))] * 8)
        add_rollups(s, [(key, _request(0.1, tokens=2000, padded=2000, overflow=True))] * 2)
    with sessionmaker() as s:
        shape = queries.traffic_shape(s, T0, T0 + HOUR)
        empty = queries.traffic_shape(s, T0 + HOUR, T0 + 2 * HOUR)
    assert shape.requests == 20
    assert shape.share_above[16] == pytest.approx(1.0)
    assert shape.share_above[32] == pytest.approx(0.5)
    assert shape.share_above[128] == pytest.approx(0.1)
    assert shape.overflow_share == pytest.approx(0.1)
    assert 16 < shape.input_p50 <= 24 and 96 < shape.input_p95 <= 1024
    assert shape.padding_waste == pytest.approx((5344 - 5000) / 5344)  # padded vs input tokens
    assert empty.requests == 0 and empty.input_p50 is None and empty.overflow_share is None


def test_metric_series_is_per_cycle_oldest_first(sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        s.add(probe_run(T0 + minutes(2), [{"p95_s": 0.3, "draft_tokens": 8, "accepted_tokens": 2}]))
        s.add(probe_run(T0, [{"p95_s": 0.1, "draft_tokens": 8, "accepted_tokens": 6},
                             {"bucket": "16", "p95_s": 0.05}]))
        s.add(probe_run(T0 + minutes(1), [{"p95_s": 0.2, "errors": 2}]))
    with sessionmaker() as s:
        p95 = queries.metric_series(s, "p95_s", T0, T0 + HOUR, bucket="64")
        acc = queries.metric_series(s, "acceptance_rate", T0, T0 + HOUR, bucket="64")
        err = queries.metric_series(s, "error_rate", T0, T0 + HOUR, bucket="64")
        with pytest.raises(UnknownMetric):
            queries.metric_series(s, "p42", T0, T0 + HOUR)
        with pytest.raises(ValueError, match="end"):
            queries.metric_series(s, "p95_s", T0, T0)
    assert [p.value for p in p95] == [0.1, 0.2, 0.3]
    assert [p.at for p in p95] == [T0, T0 + minutes(1), T0 + minutes(2)]
    assert [p.value for p in acc] == [0.75, 0.25]  # the cycle without drafts is left out
    assert [p.value for p in err] == [0.0, 0.5, 0.0]


def test_traffic_and_burst_series(sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker.begin() as s:
        for i in range(3):
            key = RollupKey(T0 + minutes(i), "i-1", "64", "compiled", "speculative")
            add_rollups(s, [(key, _request(0.1 * (i + 1), drafts=1, draft_tokens=4,
                                           accepted_tokens=i))])
            add_rollups(s, [(RollupKey(T0 + minutes(i), "i-2", "64", "eager", "direct"),
                             _request(0.1 * (i + 1)))])
        s.add(ProbeRun(started_at=T0, instance_id="i-1", kind="burst", requests=40,
                       rejections=10, queue_wait_p95_s=0.7))
    with sessionmaker() as s:
        lat = queries.traffic_series(s, "mean_latency_s", T0, T0 + HOUR, bucket="64")
        acc = queries.traffic_series(s, "acceptance_rate", T0, T0 + HOUR)
        burst = queries.burst_series(s, "rejection_rate", T0, T0 + HOUR)
    assert [round(p.value, 6) for p in lat] == [0.1, 0.2, 0.3]
    assert [p.count for p in lat] == [2, 2, 2]
    assert [p.value for p in acc] == [0.0, 0.25, 0.5]
    assert [b.value for b in burst] == [0.25]
