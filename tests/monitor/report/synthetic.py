"""A synthetic week (2026-W48) written by the production writers, with the numbers it implies.

No row is built by hand: canary cycles are the real Prober (ProbeCycle, probes.sink,
storage Writer) driven by the fake engine with fixed latencies per bucket and arm; real
traffic goes through the TrafficRecorder; flag changes through the FlagStore; baselines
through alerts.baselines.pin; alerts through the alert Lifecycle. Every writer runs on an
injected clock, so the rows have exactly the shapes and run kinds the service writes.

What holds and what breaks, by construction:
- torch.compile HOLDS: the cold engine compiles bucket 16 then 64 (one recompile) in the
  week's first cycle, within warm-up; eager/optimized = 1.5 (bucket 16) and 1.4 (bucket
  64), 1.4 over both buckets' pairs, against an expected 1.3.
- bucketing VIOLATED: padding waste (1000 + 1400) / 8000 = 0.30 > 0.25 a day, while
  1400 / 1401 real inputs fit the largest bucket (holds); no exact arm runs (no data).
- static KV cache AT RISK: peak KV share 0.70 <= 0.8, but it rises 0.05 a day
  (trend projects 1.075 a week later); RSS grows exactly 1% a day (holds).
- speculative decoding VIOLATED: acceptance about 0.8 in bucket 16, 0.4 in bucket 64;
  direct/optimized = 1.3 (16) and 0.9 (64): bucket 64 costs more than it earns.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from alerts.baselines import pin
from alerts.flags import FlagStore
from alerts.lifecycle import Lifecycle
from alerts.rules import Rule, RuleResult
from engine.protocol import InMemoryFlagProvider, RuntimeFlags
from monitor.report.week import parse_week
from probes.canaries import CanarySuite
from probes.fake import FakeEngine, FakeTimings
from probes.prober import Prober
from probes.traffic import TrafficRecorder
from storage.models import Alert
from storage.writer import Writer
from tests.probes.fakes import prompt_of

WEEK = parse_week("2026-W48")
START = WEEK.start
KV_BUDGET = 100 * 2**20
RSS0 = 1_000_000_000
CYCLE_EVERY_H = 2
AB_EVERY_H = 4  # every other cycle runs the A/B arms
# Seconds per (bucket, path, decoding): optimized = compiled speculative, eager arm =
# eager speculative, direct arm = compiled direct.
LATENCY = {("16", "compiled", "speculative"): 0.200, ("16", "eager", "speculative"): 0.300,
           ("16", "compiled", "direct"): 0.260,
           ("64", "compiled", "speculative"): 0.300, ("64", "eager", "speculative"): 0.420,
           ("64", "compiled", "direct"): 0.270}
SHIFTED = ("ERR_42", "K8S_POD", "0X1F", "GET", "RC=-1")  # acceptance 0.4 in the fake


class Clock:
    """The injected clock every writer reads."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def fill_week(sessions: sessionmaker[Session],
              latency: Mapping[tuple[str, str, str], float] = LATENCY,
              speculation_off: tuple[str, ...] = ()) -> None:
    """Write the synthetic week (plus a little outside it) through the production writers.

    latency: seconds per (bucket, path, decoding), LATENCY unless a test wants others.
    speculation_off: buckets whose speculative flag is off all week.
    """
    clock = Clock(START)
    off = dict.fromkeys(("overflow", *speculation_off), False)
    # The C decode step serves the compiled path: the compiled step takes 1.2x its time.
    engine = FakeEngine(acceptance={"in_domain": 0.8, "shifted": 0.4}, output_tokens=21,
                        timings=FakeTimings(total_s=dict(latency), compiled_step_factor=1.2),
                        native_step=True,
                        flags=InMemoryFlagProvider(RuntimeFlags(speculative=off)))
    with _writer(sessions) as writer:
        _canaries(engine, writer, clock)
        _traffic(engine, writer, clock)
    _flags_baselines_and_alerts(sessions, clock)


@contextmanager
def _writer(sessions: sessionmaker[Session]) -> Iterator[Writer]:
    writer = Writer(sessions)
    try:
        yield writer
        assert writer.flush(timeout=60) and writer.stats.failed == 0, writer.stats
    finally:
        writer.close()


def _canaries(engine: FakeEngine, writer: Writer, clock: Clock) -> None:
    """Run a canary cycle every 2 hours; memory samples come from the engine's snapshots."""
    # Four canaries in bucket 16 and four in bucket 64 (bytes + EOS = tokens).
    prompts = tuple(prompt_of(n, seed=n) for n in (10, 12, 13, 14, 40, 45, 50, 55))
    suite = CanarySuite("in_domain", "in_domain", prompts, 21, "synthetic")
    prober = Prober(engine, writer, {"in_domain": suite}, instance_id="i1",
                    canaries_per_bucket=4, ab_share=0.0, ab_arms=("eager", "direct"),
                    rng=random.Random(0), clock=clock)
    for h in range(0, 168, CYCLE_EVERY_H):
        clock.now = START + timedelta(hours=h)
        engine.state.rss_bytes = RSS0 + h * RSS0 // 2400
        engine.state.kv_cache_bytes = round((0.40 + 0.05 * (h // 24)) * KV_BUDGET)
        prober.run_cycle(ab=h % AB_EVERY_H == 0)


def _traffic(engine: FakeEngine, writer: Writer, clock: Clock) -> None:
    """Serve 100 requests of 6 tokens (bucket 16) and 100 of 50 (bucket 64) a day."""
    recorder = TrafficRecorder("i1", clock=clock)
    in_domain, shifted = "river", prompt_of(49, SHIFTED)  # + EOS: 6 and 50 tokens
    for d in range(7):
        clock.now = START + timedelta(days=d, hours=12)
        for _ in range(100):
            recorder.record(engine.generate(in_domain))
            recorder.record(engine.generate(shifted))
    clock.now = START + timedelta(hours=1)
    recorder.record(engine.generate(prompt_of(299)))  # 300 tokens: overflows
    recorder.flush(writer)


def _flags_baselines_and_alerts(sessions: sessionmaker[Session], clock: Clock) -> None:
    fired = START + timedelta(days=1, hours=10)
    flags = FlagStore(clock=clock)
    with sessions.begin() as session:
        clock.now = START - timedelta(days=1)
        for bucket, value in (("16", 0.18), ("64", 0.25)):
            pin(session, "p99_latency", {"bucket": bucket}, "alice", value=value,
                now=clock.now)
        flags.set(session, "compiled", "global", True, actor="alice", source="manual",
                  reason="last week's change, not this one")
    rule = Rule(name="acceptance_drop", metric="acceptance_rate", direction=-1,
                threshold=0.2, resolve_threshold=0.1, source="traffic", severity="page")
    drop = RuleResult(rule=rule.name, labels={"bucket": "64"}, baseline=0.7, current=0.4,
                      relative_change=-0.43, threshold=-0.2, fired=False, breaching=True,
                      reason="acceptance_rate 0.4 vs baseline 0.7 (-43%)", severity="page")
    old = Rule(name="p99_latency_regression", metric="p99_latency", direction=1,
               threshold=0.2, resolve_threshold=0.1)
    slow = RuleResult(rule=old.name, labels={"bucket": "16"}, baseline=0.18, current=0.3,
                      relative_change=0.67, threshold=0.2, fired=True, breaching=True,
                      reason="p99 0.3 vs 0.18")
    steps = [(START - timedelta(days=3), old, slow),  # fired and resolved last week
             (START - timedelta(days=2), old, RuleResult(
                 **{**slow.__dict__, "fired": False, "breaching": False, "recovered": True})),
             (fired - timedelta(minutes=2), rule, drop),
             (fired, rule, RuleResult(**{**drop.__dict__, "fired": True}))]
    for at, r, result in steps:
        clock.now = at
        with sessions.begin() as session:
            alert = session.scalars(select(Alert).where(Alert.rule == r.name)).one_or_none()
            Lifecycle(session, at).apply(r, result, alert)
    with sessions.begin() as session:
        clock.now = fired + timedelta(minutes=1)
        flags.set(session, "speculative", "64", False, actor="auto-fallback", source="auto",
                  reason="acceptance_drop fired in bucket 64")
