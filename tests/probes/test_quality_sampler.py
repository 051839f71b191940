"""Real-traffic sampling: reference replays never run on the request thread, the queue is bounded."""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from engine.protocol import REFERENCE, FlagOverride, GenerateResult
from monitor.loopback import wait_for
from probes.sampler import TrafficSampler
from storage.models import OutputAgreement
from storage.writer import Writer
from tests.probes.fakes import FakeEngine


class SlowReference(FakeEngine):
    """A fake engine whose reference path blocks until `gate` is set."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.threads: set[int] = set()
        self.running = 0
        self.max_running = 0
        self._count = threading.Lock()

    def generate(self, text: str, *, override: FlagOverride | None = None,
                 **kw: Any) -> GenerateResult:
        if override != REFERENCE:
            return super().generate(text, override=override, **kw)
        with self._count:
            self.threads.add(threading.get_ident())
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        self.entered.set()
        try:
            assert self.gate.wait(30)
            return super().generate(text, override=override, **kw)
        finally:
            with self._count:
                self.running -= 1


def test_replays_run_off_the_request_thread_and_respect_the_queue_bound(
        sessionmaker: sessionmaker[Session]) -> None:
    engine = SlowReference()
    writer = Writer(sessionmaker)
    sampler = TrafficSampler(writer, share=1.0, queue_max=2, instance_id="a",
                             rng=random.Random(0))
    served = [engine.generate(f"river stone {i}") for i in range(5)]
    try:
        assert sampler.offer(engine, "river stone 0", None, served[0])
        assert engine.entered.wait(10)  # the worker holds the first one on the slow path
        # The request thread goes on while the reference path is stuck: 2 queue, 2 drop.
        queued = [sampler.offer(engine, f"river stone {i}", None, served[i]) for i in (1, 2, 3, 4)]
        assert queued == [True, True, False, False]
        assert sampler.stats.pending == 2 and sampler.stats.dropped == 2
        assert threading.get_ident() not in engine.threads
        # Canary results are never sampled.
        canary = engine.generate("river stone 9", canary=True)
        assert not sampler.offer(engine, "river stone 9", None, canary)
        engine.gate.set()
        wait_for(lambda: sampler.stats.replayed == 3, what="three replays")
        assert sampler.stats.replayed == 3 and sampler.stats.failed == 0
        assert engine.max_running == 1  # concurrency 1
        assert writer.flush(timeout=30) and writer.stats.failed == 0
    finally:
        engine.gate.set()
        sampler.close()
        writer.close()
    with sessionmaker() as s:
        rows = s.scalars(select(OutputAgreement)).all()
    assert len(rows) == 3
    assert all(r.source == "traffic" and r.run_id is None and r.text is None and r.count == 1
               and r.exact == 1 and r.variant == "optimized" for r in rows)
    assert {r.bucket for r in rows} == {served[0].bucket}


def test_sample_share_draws_from_the_rng() -> None:
    engine = FakeEngine()
    sampler = TrafficSampler(None, share=0.25, queue_max=1000, instance_id="a",
                             rng=random.Random(3))
    try:
        result = engine.generate("river")
        taken = sum(sampler.offer(engine, "river", None, result) for _ in range(400))
        assert 60 <= taken <= 140
    finally:
        sampler.close()


def test_a_replay_shed_for_real_traffic_is_dropped_not_failed(
        caplog: pytest.LogCaptureFixture) -> None:
    """Synthetic load is shed first by design: a replay refused by admission while real
    requests wait is counted dropped and logs no traceback; other errors still fail."""
    import logging

    from engine.errors import Overloaded

    class Refusing(FakeEngine):
        def __init__(self) -> None:
            super().__init__()
            self.error: Exception = Overloaded("synthetic request refused: 1 real requests "
                                               "waiting", retry_after_s=0.1)

        def generate(self, text: str, *, override: FlagOverride | None = None,
                     **kw: Any) -> GenerateResult:
            if override == REFERENCE:
                raise self.error
            return super().generate(text, override=override, **kw)

    engine = Refusing()
    sampler = TrafficSampler(None, share=1.0, queue_max=10, instance_id="a",
                             rng=random.Random(0))
    try:
        with caplog.at_level(logging.WARNING, logger="probes.sampler"):
            assert sampler.offer(engine, "river", None, engine.generate("river"))
            wait_for(lambda: sampler.stats.dropped == 1, what="the shed replay")
            assert sampler.stats.failed == 0 and not caplog.records
            engine.error = RuntimeError("reference path broke")
            assert sampler.offer(engine, "river", None, engine.generate("river"))
            wait_for(lambda: sampler.stats.failed == 1, what="the failed replay")
        assert sampler.stats.dropped == 1
        assert [r.getMessage() for r in caplog.records] == ["reference replay failed"]
    finally:
        sampler.close()
