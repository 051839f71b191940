"""The burst probe's defaults reach the engine's admission control, and its rule can fire."""

from __future__ import annotations

import random
import threading
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from sqlalchemy.orm import Session, sessionmaker

from alerts.rule_file import parse_rule
from alerts.rules import evaluate_rule
from alerts.series import RowCache, series
from engine.admission import Admission
from probes.burst import BurstResult, run_burst
from probes.settings import ProbeSettings
from tests.probes.fakes import FakeEngine, FakeTimings, store

# engine.config defaults: one decode stream, 16 callers may wait.
MAX_CONCURRENCY, MAX_QUEUE = 1, 16
T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def _burst(settings: ProbeSettings, prompts: tuple[str, ...]) -> BurstResult:
    # ~10 ms of real work per request: ~100 requests/s through one decode stream.
    engine = FakeEngine(timings=FakeTimings(sleep_scale=0.2),
                        admission=Admission(MAX_CONCURRENCY, MAX_QUEUE))
    return run_burst(engine, prompts, instance_id="i1",
                     rate_per_s=settings.burst_rate_per_s,
                     duration_s=settings.burst_duration_s,
                     concurrency=settings.burst_concurrency, rng=random.Random(3))


def test_default_burst_overfills_the_queue_and_the_burst_rejection_rule_fires(
        suites: dict, sessionmaker: sessionmaker[Session]) -> None:
    defaults = ProbeSettings()
    assert defaults.burst_concurrency > MAX_CONCURRENCY + MAX_QUEUE
    result = _burst(defaults, suites["in_domain"].prompts)
    assert result.rejected > 0 and result.completed > 0
    assert result.completed + result.rejected + result.errors == result.offered
    assert result.queue_wait.max is not None and result.queue_wait.max > 0.05  # queued, measured
    # Stored as two bursts a window apart; a burst-sourced rejection rule fires on them.
    for i in range(2):
        at = T0 + timedelta(minutes=15 * i, seconds=5)
        store(sessionmaker, replace(result, started_at=at, finished_at=at + timedelta(seconds=3)))
    rule = parse_rule({"name": "burst_rejections", "metric": "rejections", "source": "burst",
                       "per": "all", "change": "+100%", "for": 2, "window": "15m",
                       "ceiling": 0.05})
    with sessionmaker() as s:
        pts = series(rule, RowCache(s), T0, T0 + timedelta(minutes=30))[()]
    assert [p.value for p in pts] == [result.rejection_rate] * 2
    verdict = evaluate_rule(rule, {}, None, pts)
    assert verdict.fired, verdict.reason


def test_the_old_defaults_never_reached_admission_control(suites: dict) -> None:
    old = ProbeSettings(burst_rate_per_s=4.0, burst_duration_s=1.0, burst_concurrency=4)
    result = _burst(old, suites["in_domain"].prompts)
    assert result.rejected == 0  # the bug: a burst that cannot see the queue


def test_a_burst_never_turns_a_real_request_away_and_counts_its_own_rejections(
        suites: dict) -> None:
    admission = Admission(MAX_CONCURRENCY, MAX_QUEUE)
    engine = FakeEngine(timings=FakeTimings(sleep_scale=0.2), admission=admission)
    prompts = suites["in_domain"].prompts
    done = threading.Event()
    served: list[int] = []
    refused: list[BaseException] = []

    def real_user() -> None:  # a closed loop of real requests for as long as the burst runs
        n = 0
        while not done.is_set():
            try:
                engine.generate(prompts[n % len(prompts)], timeout_s=30)
                n += 1
            except Exception as exc:  # noqa: BLE001 - the assertion names it
                refused.append(exc)
        served.append(n)

    users = [threading.Thread(target=real_user) for _ in range(4)]
    for u in users:
        u.start()
    defaults = ProbeSettings()
    try:
        result = run_burst(engine, prompts, instance_id="i1",
                           rate_per_s=defaults.burst_rate_per_s,
                           duration_s=defaults.burst_duration_s,
                           concurrency=defaults.burst_concurrency, rng=random.Random(3))
    finally:
        done.set()
        for u in users:
            u.join(30)
    stats = admission.stats()
    assert refused == [] and stats.real_rejected == 0 and stats.real_timeouts == 0
    assert sum(served) > 0 and stats.real_admitted == sum(served)
    # The burst saw admission on its own requests: every synthetic refusal is in its result.
    assert result.rejected == stats.synthetic_rejected > 0
    assert result.completed == stats.synthetic_admitted
    assert result.completed + result.rejected == result.offered
