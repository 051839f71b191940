"""bench.worker_memory's replay: the worker's real jobs over the production prober's rows."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from sqlalchemy import select

from alerts.outbox import enqueue_message
from alerts.webhooks import parse_targets
from bench.worker_memory import START, Clock, Fault, NoisyEngine, Replay
from engine.protocol import FlagOverride
from probes.fake import FakeEngine
from storage.models import ProbeRun


def test_the_ab_share_reaches_the_prober_and_one_tick_stores_a_cycle(tmp_path: Path) -> None:
    replay = Replay(tmp_path, ab_share=1.0, rate=1.0)
    try:
        assert replay.settings.probes.ab_share == 1.0
        replay.tick()
        with replay.sessions() as s:
            (run,) = s.scalars(select(ProbeRun)).all()
        assert run.details and run.details["pairs"]  # every cycle ran its A/B arms
    finally:
        replay.close()
    (tmp_path / "default").mkdir()
    shipped = Replay(tmp_path / "default", rate=1.0)
    try:
        assert shipped.settings.probes.ab_share == 0.25  # probes.ab_share's default
    finally:
        shipped.close()


def test_the_noisy_engine_jitters_canaries_and_slows_optimized_ones_in_the_fault() -> None:
    clock = Clock(START)
    fault = Fault(START + timedelta(minutes=10), 5, 2.0)
    engine = NoisyEngine(clock, sigma=0.2, fault=fault)
    plain = FakeEngine()
    text = "the river runs past the house"
    base = plain.generate(text, canary=True).total_s
    jittered = {engine.generate(text, canary=True).total_s for _ in range(20)}
    assert len(jittered) == 20 and min(jittered) < base < max(jittered)  # spread around it
    assert engine.generate(text).total_s == plain.generate(text).total_s  # real traffic as is
    assert NoisyEngine(clock, sigma=0.2).generate(text, canary=True).total_s == \
        NoisyEngine(clock, sigma=0.2).generate(text, canary=True).total_s  # seeded

    steady = NoisyEngine(clock, fault=fault)  # no jitter: the fault's factor alone
    clock.at = START + timedelta(minutes=12)
    assert steady.generate(text, canary=True).total_s == 2.0 * base
    arm = steady.generate(text, canary=True, override=FlagOverride(speculative=False))
    assert arm.total_s == plain.generate(text, canary=True,
                                         override=FlagOverride(speculative=False)).total_s
    clock.at = START + timedelta(minutes=15)  # the window has ended
    assert steady.generate(text, canary=True).total_s == base
    assert steady.faulted == 1


def test_the_replay_delivers_to_a_loopback_receiver_over_http(tmp_path: Path) -> None:
    replay = Replay(tmp_path, rate=1.0)
    try:
        with replay.sessions.begin() as s:
            enqueue_message(s, "hello", "over the loopback", parse_targets(
                replay.settings.alerts.webhooks), now=replay.clock())
        replay.jobs["delivery"]()
        (delivery,) = replay.receiver.deliveries()  # a real POST to the receiver
        assert delivery.ok and "over the loopback" in delivery.raw.decode()
        assert "notifications received 1" in replay.outcome()
    finally:
        replay.close()
