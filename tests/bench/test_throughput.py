"""bench.throughput's arithmetic on a fake engine: percentiles, the closed loop's count,
the p99 limit's stopping rule."""

from __future__ import annotations

from bench.throughput import OpenLoop, closed_loop, p99_limit, percentile
from probes.fake import FakeEngine


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile([3.0], 0.99) == 3.0


def test_closed_loop_sends_exactly_the_requests_asked() -> None:
    engine = FakeEngine()
    rps = closed_loop(lambda t: engine.generate(t), ["a b", "c d e"], callers=4, requests=10)
    assert engine.state.calls == 10 and rps > 0


def test_the_p99_limit_is_the_last_rate_within_twice_the_unloaded_p50(monkeypatch) -> None:
    import bench.throughput as bt

    p99 = {1.0: 0.010, 2.0: 0.019, 4.0: 0.050, 8.0: 0.010}

    def fake_open_loop(call, texts, rate, requests, seed=0):
        return OpenLoop(rate, 0.005, p99[rate], 0)

    monkeypatch.setattr(bt, "open_loop", fake_open_loop)
    limit, runs = p99_limit(lambda t: None, ["x"], [1.0, 2.0, 4.0, 8.0], 4, 0.010)
    assert limit == 2.0
    assert [r.rate for r in runs] == [1.0, 2.0, 4.0]  # stops at the first rate past it


def test_the_p99_limit_halves_the_lowest_rate_until_one_is_within(monkeypatch) -> None:
    import bench.throughput as bt

    def fake_open_loop(call, texts, rate, requests, seed=0):
        return OpenLoop(rate, 0.005, 0.010 if rate <= 0.25 else 0.050, 0)

    monkeypatch.setattr(bt, "open_loop", fake_open_loop)
    limit, runs = p99_limit(lambda t: None, ["x"], [1.0, 2.0], 4, 0.010)
    assert limit == 0.25
    assert [r.rate for r in runs] == [1.0, 0.5, 0.25]
    limit, runs = p99_limit(lambda t: None, ["x"], [4.0, 8.0], 4, 0.010, halvings=2)
    assert limit == 0.0 and [r.rate for r in runs] == [4.0, 2.0, 1.0]  # none: 0, said so
