"""Per-cycle series read from stored rows, and the compile -> eager fallback path."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.orm import Session, sessionmaker

from alerts.baselines import BaselineConfig
from alerts.evaluator import EvaluationOptions, evaluate
from alerts.flags import FlagStore
from alerts.policy import load_policy
from alerts.rule_file import load_rules, parse_rule
from alerts.series import RowCache, series
from storage.models import CompileEvent, MemorySample, ProbeRun
from storage.sketches import Sketch
from tests.alerts.builders import add_cycle, add_traffic

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def minute(i: float) -> datetime:
    return T0 + timedelta(minutes=i)


def rule(**raw: object):
    return parse_rule({"name": "r", "change": "+20%", **raw})


def test_canary_traffic_and_burst_series(sessionmaker: sessionmaker[Session]):
    with sessionmaker.begin() as s:
        for i in range(3):
            add_cycle(s, minute(i) + timedelta(seconds=1), {"16": 0.05, "64": 0.1 * (i + 1)},
                      acceptance={"64": 0.5})
            add_traffic(s, minute(i), "64", latency_s=0.09, acceptance=0.6)
        s.add(ProbeRun(started_at=minute(1.5), instance_id="i1", kind="cycle", status="timeout"))
        s.add(ProbeRun(started_at=minute(2), instance_id="i1", kind="burst", status="ok",
                       requests=40, rejections=4,
                       details={"latency_p99_s": 0.4,
                                "latency_sketch": Sketch.of([0.4] * 36).to_json()}))
    with sessionmaker() as s:
        cache = RowCache(s)
        p99 = series(rule(metric="p99_latency"), cache, minute(0), minute(3))
        # Sketch quantiles: within 1% of the true value.
        assert [p.value for p in p99[(("bucket", "64"),)]] == pytest.approx([0.1, 0.2, 0.3],
                                                                            rel=0.01)
        acc = series(rule(metric="acceptance_rate"), cache, minute(0), minute(3))
        assert [p.value for p in acc[(("bucket", "64"),)]] == pytest.approx([0.5] * 3)
        fails = series(rule(metric="probe_failures", per="all"), cache, minute(0), minute(3))
        assert [p.value for p in fails[()]] == pytest.approx([0.0, 1 / 201, 0.0])  # 2 x 100 canaries + 1 run
        tp99 = series(rule(metric="p99_latency", source="traffic"), cache, minute(0), minute(3))
        v = tp99[(("bucket", "64"),)][0]
        assert v.value == pytest.approx(0.09, rel=0.01) and v.samples == 20
        tacc = series(rule(metric="acceptance_rate", source="traffic"), cache, minute(0),
                      minute(3))
        assert tacc[(("bucket", "64"),)][0].value == pytest.approx(0.6)
        burst = series(rule(metric="burst_p99", source="burst", per="all", window="1m"),
                       cache, minute(0), minute(3))
        assert [p.value for p in burst[()]] == [None, None, pytest.approx(0.4, rel=0.01)]
        assert burst[()][-1].samples == 36
        # Only finished cycles: the cycle holding `end` is left out.
        assert len(series(rule(metric="p99_latency"), cache, minute(0),
                          minute(2) + timedelta(seconds=30))[(("bucket", "64"),)]) == 2


def test_a_traffic_minute_is_judged_once_every_flush_is_in(
        sessionmaker: sessionmaker[Session]):
    """Rollups reach the database in flushes, each replica on its own schedule: the minute
    that just ended is not judged on the first (it was, and a shift that began late in it
    read as a mild dip)."""
    acc = rule(metric="acceptance_rate", source="traffic", change="-40%")
    with sessionmaker.begin() as s:
        for i in range(3):
            add_traffic(s, minute(i), "64", acceptance=0.8)
        add_traffic(s, minute(3), "64", acceptance=0.8, requests=10)  # its first flush
    settle = {"traffic": 20.0}
    with sessionmaker() as s:
        early = series(acc, RowCache(s, settle), minute(0), minute(4) + timedelta(seconds=1))
        assert [p.at for p in early[(("bucket", "64"),)]] == [minute(0), minute(1), minute(2)]
        # Without settling (canary rows, written whole per cycle) it is read at once.
        now = series(acc, RowCache(s), minute(0), minute(4) + timedelta(seconds=1))
        assert now[(("bucket", "64"),)][-1].at == minute(3)
    with sessionmaker.begin() as s:  # a second replica's flush, 15 s after the minute ended
        add_traffic(s, minute(3), "64", acceptance=0.05, requests=30, instance="i2")
    with sessionmaker() as s:
        late = series(acc, RowCache(s, settle), minute(0), minute(4) + timedelta(seconds=21))
        last = late[(("bucket", "64"),)][-1]
        assert last.at == minute(3) and last.value == pytest.approx((8 + 1.5) / 40)


def test_evaluation_settles_traffic_minutes_before_judging_them(
        sessionmaker: sessionmaker[Session]):
    """A shift that begins late in minute 30. Judged at once, minute 30 would read normal on
    its first flush and enter the baseline with its late rows, widening its spread and
    delaying the alert; settled, it is the first breaching cycle and the alert fires on the
    next, as the rule's `for: 2` says."""
    acc = parse_rule({"name": "acceptance_drop", "metric": "acceptance_rate",
                      "source": "traffic", "change": "-40%", "resolve_change": "-15%",
                      "for": 2, "resolve_for": 2, "min_samples": 3, "window": "1m",
                      "lookback": 5, "baseline_window": "30m", "min_baseline_cycles": 1,
                      "cusum": {"min_cycles": 2, "min_spread_rel": 0.1}})
    with sessionmaker.begin() as s:
        for i in range(30):
            add_traffic(s, minute(i), "32", acceptance=1.0)
        add_traffic(s, minute(30), "32", acceptance=1.0, requests=28)  # before the shift
    cfg = BaselineConfig(warm_in_s=0)

    def run(at: datetime):
        with sessionmaker.begin() as s:
            return evaluate(
                s, EvaluationOptions([acc], baseline_config=cfg), at, settle={"traffic": 20.0}
            )

    fired = []
    for i in range(31, 36):
        assert run(minute(i) + timedelta(seconds=0.35)).errors == ()
        with sessionmaker.begin() as s:  # a replica's late flush, then the next minute
            if i == 31:
                add_traffic(s, minute(30), "32", acceptance=0.05, requests=36, instance="i2")
            add_traffic(s, minute(i), "32", acceptance=0.05, requests=80)
        rep = run(minute(i) + timedelta(seconds=25))
        fired += [i for t in rep.transitions if t.to_state == "firing"]
    assert fired == [32]  # minute 30 breaches (judged at 31:25), minute 31 confirms


def test_sliding_memory_growth(sessionmaker: sessionmaker[Session]):
    with sessionmaker.begin() as s:
        for i in range(0, 60, 5):  # +50 MB every 5 minutes: 600 MB per hour
            s.add(MemorySample(at=minute(i), instance_id="i1", rss_bytes=10**9 + i * 10**7))
    with sessionmaker() as s:
        pts = series(rule(metric="memory_growth", per=["instance"]), RowCache(s), minute(0),
                     minute(60))[(("instance", "i1"),)]
    assert pts[0].value is None  # one sample: no slope yet
    assert pts[-1].value == pytest.approx(6e8)


def test_recompile_limit_hit_turns_compile_off_then_expires(sessionmaker: sessionmaker[Session]):
    rules = [r for r in load_rules() if r.name in ("compile_failures", "recompiles_per_hour")]
    policy = load_policy()
    cfg = BaselineConfig(warm_in_s=0)
    with sessionmaker.begin() as s:
        for i in range(30):
            add_cycle(s, minute(i) + timedelta(seconds=1), {"16": 0.05})
        s.add(CompileEvent(at=minute(20) + timedelta(seconds=3), instance_id="i1", limit_hits=1))
    fired = None
    for i in range(21, 30):
        with sessionmaker.begin() as s:
            rep = evaluate(
                s, EvaluationOptions(rules, policy=policy, baseline_config=cfg), minute(i)
            )
        if rep.firing:
            fired = i
            break
    assert fired == 22  # the hit stays in the trailing hour; two cycles over the ceiling
    (r,) = rep.firing
    assert r.rule == "compile_failures" and r.labels == {"instance": "i1"}
    assert [(a.kind, a.flag, a.scope, a.value) for a in rep.actions] == [
        ("set", "compiled", "instance:i1", False)]  # the storm's instance only
    with sessionmaker() as s:
        assert FlagStore(lambda: minute(23)).runtime_flags(s, "i1").compiled is False
        assert FlagStore(lambda: minute(23)).runtime_flags(s, "i2").compiled is True
    # No canary A/B arm measures the compiled path here, so it stays off until expiry (6 h),
    # and is not re-applied for the same alert afterwards.
    later = minute(22) + timedelta(hours=6, seconds=1)
    with sessionmaker.begin() as s:
        rep = evaluate(s, EvaluationOptions(rules, policy=policy, baseline_config=cfg), later)
        assert [a.kind for a in rep.actions] == ["expire", "skip"]
        assert FlagStore(lambda: later).runtime_flags(s, "i1").compiled is True


def test_compile_counts_are_zero_not_missing_while_probes_run(sessionmaker: sessionmaker[Session]):
    with sessionmaker.begin() as s:
        for i in range(5):
            add_cycle(s, minute(i) + timedelta(seconds=1), {"16": 0.05})
        s.add(CompileEvent(at=minute(1), instance_id="i1", recompiles=3))
    r = rule(metric="recompiles_per_hour", per=["instance"])
    with sessionmaker() as s:
        pts = series(r, RowCache(s), minute(0), minute(5))[(("instance", "i1"),)]
    assert [p.value for p in pts] == [0.0, 3.0, 3.0, 3.0, 3.0]
