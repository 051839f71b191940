"""bench.throughput's arithmetic on a fake engine: percentiles, the closed loop's count,
the p99 limit's stopping rule and its per-input slowdown."""

from __future__ import annotations

import math

from bench.throughput import (
    OpenLoop,
    OutputCheck,
    closed_loop,
    open_loop,
    p99_limit,
    percentile,
    sequential_slowdown,
)
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


def test_the_p99_limit_is_the_last_rate_whose_p99_slowdown_is_within_two(monkeypatch) -> None:
    import bench.throughput as bt

    slowdown = {1.0: 1.2, 2.0: 1.9, 4.0: 2.5, 8.0: 1.0}
    seen = []

    def fake_open_loop(call, texts, rate, requests, seed=0, unloaded=None):
        seen.append(unloaded)
        # p99 latency far past twice the p50: a mixed workload's spread, not a failure
        return OpenLoop(rate, 0.005, 0.050, 0, slowdown[rate])

    monkeypatch.setattr(bt, "open_loop", fake_open_loop)
    limit, runs = p99_limit(lambda t: None, ["x"], [4.0, 1.0, 8.0, 2.0], 4, [0.010])
    assert limit == 2.0
    assert [r.rate for r in runs] == [1.0, 2.0, 4.0]  # upward, stops at the first past it
    assert seen == [[0.010]] * 3  # every run measures against the inputs' unloaded latency


def test_a_run_with_errors_is_past_the_limit(monkeypatch) -> None:
    import bench.throughput as bt

    monkeypatch.setattr(bt, "open_loop", lambda call, texts, rate, requests, seed=0,
                        unloaded=None: OpenLoop(rate, 0.005, 0.006, 1 if rate > 1 else 0, 1.0))
    limit, runs = p99_limit(lambda t: None, ["x"], [1.0, 2.0, 3.0], 4, [0.010])
    assert limit == 1.0 and len(runs) == 2


def test_the_open_loop_slowdown_is_each_latency_over_its_own_inputs_unloaded_latency() -> None:
    sent: list[str] = []

    def call(text: str) -> None:
        sent.append(text)
        if text == "bad":
            raise RuntimeError("429")

    # An hour of unloaded latency per input: every slowdown is far below 1, and the failed
    # input counts as an error, not a latency.
    run = open_loop(call, ["a", "bad", "b"], rate=1000.0, requests=6,
                    unloaded=[3600.0, 3600.0, 3600.0])
    assert sorted(sent) == ["a", "a", "b", "b", "bad", "bad"]
    assert run.errors == 2
    assert 0 < run.p99_slowdown < 0.01
    assert math.isnan(open_loop(lambda t: None, ["a"], 1000.0, 2).p99_slowdown)


def test_the_p99_limit_halves_the_lowest_rate_until_one_is_within(monkeypatch) -> None:
    import bench.throughput as bt

    def fake_open_loop(call, texts, rate, requests, seed=0, unloaded=None):
        return OpenLoop(rate, 0.005, 0.050, 0, 1.5 if rate <= 0.25 else 2.5)

    monkeypatch.setattr(bt, "open_loop", fake_open_loop)
    limit, runs = p99_limit(lambda t: None, ["x"], [1.0, 2.0], 4, [0.010])
    assert limit == 0.25
    assert [r.rate for r in runs] == [1.0, 0.5, 0.25]
    limit, runs = p99_limit(lambda t: None, ["x"], [4.0, 8.0], 4, [0.010], halvings=2)
    assert limit == 0.0 and [r.rate for r in runs] == [4.0, 2.0, 1.0]  # none: 0, said so


def test_the_floor_is_the_p99_slowdown_of_requests_sent_one_at_a_time() -> None:
    sent: list[str] = []
    # 100 requests cycling over two inputs, unloaded latency 10 s each: far below 1, and
    # every request of the cycle sent, in order, one at a time.
    floor = sequential_slowdown(sent.append, ["a", "b"], 100, [10.0, 10.0])
    assert sent == ["a", "b"] * 50
    assert 0 < floor < 0.01


def test_unloaded_requests_each_find_the_engine_idle_for_the_pause(monkeypatch) -> None:
    import bench.throughput as bt

    events: list[object] = []
    monkeypatch.setattr(bt.time, "sleep", lambda s: events.append(s))
    latencies = bt.unloaded_latencies(events.append, ["a", "b"], repeats=2, idle_s=0.5)
    # every request, the first included, sent only after the engine sat idle for the pause
    assert events == [0.5, "a", 0.5, "b", 0.5, "a", 0.5, "b"]
    assert len(latencies) == 2
    events.clear()
    bt.sequential_slowdown(events.append, ["a"], 2, [10.0], idle_s=0.25)
    assert events == [0.25, "a", 0.25, "a"]
    events.clear()
    bt.unloaded_latencies(events.append, ["a"], repeats=1)  # back to back: no pause
    assert events == ["a"]


def test_every_output_under_load_is_checked_against_the_unbatched_engines_alone() -> None:
    check = OutputCheck(["batched", "unbatched"])
    check.seen("batched", "a", (1, 2))  # before the reference: the warm pass itself
    check.reference.update({"a": (1, 2), "b": (3,)})
    for _ in range(3):
        check.seen("batched", "a", (1, 2))
    check.seen("batched", "b", (3, 4))  # a batch-mate changed a token: counted
    check.seen("unbatched", "b", (3,))
    assert check.differing == {"batched": 1, "unbatched": 0}
