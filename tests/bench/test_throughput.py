"""bench.throughput's arithmetic on a fake engine: percentiles, the closed loop's count,
the p99 limit's stopping rule and its per-input slowdown."""

from __future__ import annotations

import math
import threading

import pytest

from bench.throughput import (
    PAST,
    UNRESOLVED,
    WITHIN,
    Limit,
    OpenLoop,
    OutputCheck,
    Ratio,
    closed_loop,
    limit_ratio,
    open_loop,
    p99_limit,
    percentile,
    quantile_interval,
    round_order,
    sequential_slowdowns,
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


def _run(rate: float, low: float, high: float, errors: int = 0) -> OpenLoop:
    # p99 latency far past twice the p50: a mixed workload's spread, not a failure
    return OpenLoop(rate, 0.005, 0.050, errors, (low + high) / 2, low, high)


def test_a_rate_is_within_past_or_unresolved_by_its_p99_slowdowns_interval() -> None:
    assert _run(1.0, 1.2, 2.0).verdict == WITHIN
    assert _run(1.0, 2.01, 9.0).verdict == PAST
    assert _run(1.0, 1.2, 2.5).verdict == UNRESOLVED
    assert _run(1.0, 1.2, math.inf).verdict == UNRESOLVED  # too few requests to bound it
    assert _run(1.0, 1.0, 1.1, errors=1).verdict == PAST


def test_the_p99_limit_is_bounded_by_the_rates_shown_within_and_past_it(monkeypatch) -> None:
    import bench.throughput as bt

    bounds = {1.0: (1.1, 1.6), 2.0: (1.3, 1.9), 3.0: (1.5, 2.6), 4.0: (2.1, 3.0),
              8.0: (1.0, 1.1)}
    seen = []

    def fake_open_loop(call, texts, rate, requests, seed=0, unloaded=None):
        seen.append(unloaded)
        return _run(rate, *bounds[rate])

    monkeypatch.setattr(bt, "open_loop", fake_open_loop)
    limit = p99_limit(lambda t: None, ["x"], [4.0, 1.0, 8.0, 3.0, 2.0], 4, [0.010])
    # Upward; 3/s spans the limit and bounds nothing; 4/s is past it: the sweep stops.
    assert (limit.within, limit.past) == (2.0, 4.0)
    assert [r.rate for r in limit.runs] == [1.0, 2.0, 3.0, 4.0]
    assert seen == [[0.010]] * 4  # every run measures against the inputs' unloaded latency
    assert limit.describe() == "at least 2.0, below 4.0 req/s"


def test_a_run_with_errors_is_past_the_limit(monkeypatch) -> None:
    import bench.throughput as bt

    monkeypatch.setattr(bt, "open_loop", lambda call, texts, rate, requests, seed=0,
                        unloaded=None: _run(rate, 1.0, 1.1, errors=1 if rate > 1 else 0))
    limit = p99_limit(lambda t: None, ["x"], [1.0, 2.0, 3.0], 4, [0.010])
    assert (limit.within, limit.past, len(limit.runs)) == (1.0, 2.0, 2)


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


def test_the_open_loop_counts_the_requests_that_found_another_in_flight() -> None:
    release = threading.Event()
    sent: list[str] = []

    def call(text: str) -> None:
        sent.append(text)
        if len(sent) == 1:  # the first holds the engine while the others arrive
            assert release.wait(10)
        elif len(sent) == 5:
            release.set()

    run = open_loop(call, ["a"], rate=1000.0, requests=5, unloaded=[3600.0])
    assert run.busy_share == 0.8  # all but the first met it in flight
    assert 0 < run.idle_p99_slowdown < 0.01  # the first alone
    assert math.isnan(open_loop(lambda t: None, ["a"], 1000.0, 2).idle_p99_slowdown)


def test_the_p99_limit_halves_the_lowest_rate_until_one_is_within(monkeypatch) -> None:
    import bench.throughput as bt

    def fake_open_loop(call, texts, rate, requests, seed=0, unloaded=None):
        if rate <= 0.25:
            return _run(rate, 1.2, 1.8)
        return _run(rate, 1.5, 2.5) if rate <= 1.0 else _run(rate, 2.2, 3.0)

    monkeypatch.setattr(bt, "open_loop", fake_open_loop)
    limit = p99_limit(lambda t: None, ["x"], [1.0, 2.0], 4, [0.010])
    assert (limit.within, limit.past) == (0.25, 2.0)
    assert [r.rate for r in limit.runs] == [1.0, 2.0, 0.5, 0.25]
    limit = p99_limit(lambda t: None, ["x"], [4.0, 8.0], 4, [0.010], halvings=2)
    # None within: the halvings shown past lower the upper bound.
    assert (limit.within, limit.past) == (0.0, 2.0)  # 1/s spans it
    assert [r.rate for r in limit.runs] == [4.0, 2.0, 1.0]
    assert limit.describe() == "below 2.0 req/s (no rate shown within it)"


def test_the_last_line_compares_the_bounds_or_says_unresolved() -> None:
    batched, unbatched = Limit(4.0, 8.0, ()), Limit(1.0, 2.0, ())
    assert limit_ratio(batched, unbatched) == "4.00x unbatched (the bounds allow 2.00x to 8.00x)"
    assert limit_ratio(Limit(4.0, math.inf, ()), unbatched) \
        == "4.00x unbatched (the bounds allow at least 2.00x)"
    assert limit_ratio(batched, Limit(0.0, 2.0, ())) \
        == "unresolved (no offered rate shown within the limit for unbatched)"
    assert limit_ratio(Limit(0.0, 1.0, ()), Limit(0.0, math.inf, ())) == (
        "unresolved (no offered rate shown within the limit for batched or unbatched)")
    assert Limit(0.0, math.inf, ()).describe() == "unresolved (no rate shown within or past it)"
    assert Limit(3.0, math.inf, ()).describe() == "at least 3.0 req/s (no rate shown past it)"


def test_a_p99s_interval_is_two_order_statistics_and_unbounded_where_too_few() -> None:
    values = [float(v) for v in range(1, 1001)]
    low, high = quantile_interval(values)
    # The binomial(1000, 0.99) count under the p99: 983rd to 997th smallest at 95%.
    assert (low, high) == (983.0, 997.0)
    assert quantile_interval(values[::-1]) == (983.0, 997.0)  # order of arrival is moot
    # 128 requests bound a p99 from below only; 400 from above by the slowest one.
    assert quantile_interval(values[:128])[1] == math.inf
    assert quantile_interval(values[:400])[1] == 400.0
    # One value is under the p99 but for a 1% chance: a lower bound, nothing above.
    assert quantile_interval([5.0]) == (5.0, math.inf)


def test_the_open_loop_reports_its_p99_slowdowns_interval() -> None:
    run = open_loop(lambda t: None, ["a"], rate=1000.0, requests=400, unloaded=[3600.0])
    assert run.slowdown_low <= run.p99_slowdown <= run.slowdown_high < 0.01
    assert run.verdict == WITHIN
    assert open_loop(lambda t: None, ["a"], rate=1000.0, requests=8,
                     unloaded=[3600.0]).verdict == UNRESOLVED


def test_the_floor_is_the_p99_slowdown_of_requests_sent_one_at_a_time() -> None:
    sent: list[str] = []
    # 100 requests cycling over two inputs, unloaded latency 10 s each: far below 1, and
    # every request of the cycle sent, in order, one at a time.
    floor = sequential_slowdowns(sent.append, ["a", "b"], 100, [10.0, 10.0])
    assert sent == ["a", "b"] * 50
    assert len(floor) == 100 and 0 < percentile(floor, 0.99) < 0.01


def test_unloaded_requests_each_find_the_engine_idle_for_the_pause(monkeypatch) -> None:
    import bench.throughput as bt

    events: list[object] = []
    monkeypatch.setattr(bt.time, "sleep", lambda s: events.append(s))
    latencies = bt.unloaded_latencies(events.append, ["a", "b"], repeats=2, idle_s=0.5)
    # every request, the first included, sent only after the engine sat idle for the pause
    assert events == [0.5, "a", 0.5, "b", 0.5, "a", 0.5, "b"]
    assert len(latencies) == 2
    events.clear()
    bt.sequential_slowdowns(events.append, ["a"], 2, [10.0], idle_s=0.25)
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


def test_one_bucket_keeps_only_the_canaries_of_that_length_bucket() -> None:
    from bench.throughput import in_bucket

    engine = FakeEngine()
    short, longer = "one two three", " ".join(["w"] * 40)
    assert engine.bucket_for(engine.count_tokens(short)) != engine.bucket_for(
        engine.count_tokens(longer))
    label = engine.bucket_for(engine.count_tokens(short))
    assert in_bucket(engine, [short, longer, short], label) == [short, short]


def test_a_bucket_without_canaries_is_one_line_naming_the_buckets_there_are() -> None:
    import pytest

    from bench.throughput import in_bucket

    engine = FakeEngine()
    with pytest.raises(ValueError, match=r"--bucket 999: no canary in that bucket "
                       r"\(buckets with canaries: 16\)"):
        in_bucket(engine, ["one two", "three"], "999")


def test_requests_are_binned_by_the_most_rows_they_stepped_with() -> None:
    from bench.throughput import row_bins

    got = row_bins([(1, 1.0), (1, 1.2), (1, 1.4), (2, 2.0), (4, 3.0), (3, 2.6), (40, 9.0)])
    assert got == (("1", 3, 1.2), ("2", 1, 2.0), ("3-4", 2, 2.8), ("17+", 1, 9.0))


def test_the_open_loop_splits_its_slowdowns_by_the_rows_each_request_stepped_with() -> None:
    class Result:
        def __init__(self, rows: int) -> None:
            self.batch_size_max = rows

    rows = {"a": 1, "b": 3}
    run = open_loop(lambda t: Result(rows[t]), ["a", "b"], rate=2000.0, requests=20,
                    unloaded=[1.0, 1.0])
    assert [(label, n) for label, n, _s in run.by_rows] == [("1", 10), ("3-4", 10)]
    # An engine whose results say nothing of rows (a fake, CTranslate2) gets no split.
    assert open_loop(lambda t: None, ["a"], 2000.0, 5, unloaded=[1.0]).by_rows == ()


def test_the_cli_refuses_a_bucket_without_canaries_in_one_line_before_warm_up(
        tmp_path) -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "bench.throughput", "--bucket", "999", "--no-ct2",
         "--cache-dir", str(tmp_path / "cache")],
        cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1].endswith(
        "--bucket 999: no canary in that bucket (buckets with canaries: 16, 32, 64, 128, "
        "256)")
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_the_phase_split_is_the_recorders_seconds_between_two_totals_per_request() -> None:
    from bench.throughput import phase_split
    from engine.scheduler_recorder import PHASE_DECODE, PHASE_VERIFY, StepRecorder

    class Row:
        joined_step = -1
        steps = 0
        batch_sum = 0

    recorder = StepRecorder()
    recorder.joined(Row(), 0.5)  # before the run: not in its split
    before = recorder.totals()
    rows = [Row(), Row()]
    for row in rows:
        recorder.joined(row, 0.004)
    recorder.stepped(PHASE_DECODE, 0.003, rows)
    recorder.stepped(PHASE_DECODE, 0.001, rows)
    recorder.stepped(PHASE_VERIFY, 0.010, rows)
    split = phase_split(before, recorder.totals(), requests=2)
    assert split.counts == {"encode": 2, "decode": 2, "verify": 1}
    assert split.seconds["encode"] == pytest.approx(0.008)
    assert split.seconds["decode"] == pytest.approx(0.004)
    assert split.describe() == ("encode 4.00 ms (36%, 2 arrivals), decode 2.00 ms (18%, "
                                "2 steps), verify 5.00 ms (45%, 1 step)")


def test_the_engines_run_in_an_order_reversed_every_round() -> None:
    names = ["batched", "unbatched", "batched_without_turns"]
    assert round_order(names, 0) == names
    assert round_order(names, 1) == list(reversed(names))
    assert round_order(names, 2) == names


def test_a_ratio_pairs_the_rates_of_each_round_and_keeps_their_median_and_range() -> None:
    # The host sped up in round two: the engines' medians alone would give 66 / 50 = 1.32x;
    # the rounds' own ratios are 1.25x, 1.10x and 1.40x.
    ratio = Ratio.paired([50.0, 66.0, 70.0], [40.0, 60.0, 50.0])
    assert ratio.values == pytest.approx((1.25, 1.10, 1.40))
    assert ratio.median == pytest.approx(1.25)
    assert ratio.describe() == "1.25x [1.10, 1.40]" and ratio.spread() == "1.10-1.40"
    assert Ratio.paired([3.0], [2.0]).describe() == "1.50x"
    assert Ratio.paired([3.0], [2.0]).spread() == "-"
    with pytest.raises(ValueError):
        Ratio.paired([1.0, 2.0], [1.0])  # a round without its pair is a bug, not a ratio


def test_the_cli_refuses_fewer_than_one_round_in_one_line() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "bench.throughput", "--rounds", "0", "--no-ct2"],
        cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1].endswith("--rounds: must be at least 1, got 0")
    assert "Traceback" not in done.stderr and done.stdout == ""
