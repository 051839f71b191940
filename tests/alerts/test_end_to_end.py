"""End to end on the built-in models: shifted traffic -> alert -> speculation off -> back on.

Real engine (eager, CPU), real traffic recorder, SQLite, the evaluator with the policy,
the SQL flag provider feeding the engine, and a webhook at a loopback receiver. Minutes
are simulated (the recorder and the evaluator take the clock); requests are real.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.orm import Session, sessionmaker

from alerts.baselines import BaselineConfig
from alerts.evaluator import EvaluationOptions, evaluate
from alerts.flags import FlagStore, SqlFlagProvider
from alerts.outbox import Deliverer
from alerts.policy import Policy, parse_policy
from alerts.rule_file import parse_rule
from alerts.webhooks import WebhookTarget
from engine.config import BUILTIN_DIR
from monitor.loopback import WebhookReceiver

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (BUILTIN_DIR / "target").is_dir(), reason="built-in models missing"),
]

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
RULE = parse_rule({"name": "acceptance_drop", "metric": "acceptance_rate", "source": "traffic",
                   "change": "-20%", "resolve_change": "-7%", "for": 3, "resolve_for": 3,
                   "min_samples": 2, "lookback": 10, "baseline_window": "1h",
                   "min_baseline_cycles": 4})
POLICY = {"policies": [{
    "name": "spec_off", "alerts": ["acceptance_drop"], "flag": "speculative",
    "scope_from": "bucket", "value": False, "probation": 0.5, "hold": "2m", "cooldown": "30m",
    "recovery": {"measure": "probation_acceptance", "window": "3m", "min_samples": 40,
                 "within": "-10%"}}]}


@pytest.fixture
def sm(sqlite_url: str) -> Iterator[sessionmaker[Session]]:
    from storage import migrate
    from storage.db import make_engine, make_sessionmaker

    engine = make_engine(sqlite_url)
    migrate.upgrade(engine)
    yield make_sessionmaker(engine)
    engine.dispose()


def test_shifted_traffic_turns_speculation_off_for_one_bucket_and_back(
        sm: sessionmaker[Session]):
    from engine import EngineConfig, load_engine
    from engine.builtin.task import make_input
    from probes.traffic import TrafficRecorder
    from storage.writer import Writer

    now = [T0]
    provider = SqlFlagProvider(sm, ttl_s=0)
    # The engine's own measured-speed fallback is timing-dependent (it may keep the shifted
    # bucket direct after the restore); this test is about the policy's flag.
    engine = load_engine(EngineConfig(device="cpu", compile_mode="off", flag_timeout_s=5.0,
                                      speculative_fallback=False),
                         flags=provider)
    recorder = TrafficRecorder("e2e", clock=lambda: now[0])
    writer = Writer(sm)  # the service's write path
    items, _ = parse_policy(POLICY)
    policy = Policy(items)
    rng = random.Random(7)
    rx = WebhookReceiver()

    def serve_minute(i: int, plan: list[tuple[str, str, int]]) -> list:
        now[0] = T0 + timedelta(minutes=i, seconds=5)
        out = []
        for domain, bucket, n in plan:
            lo, hi = {"32": (16, 31), "64": (32, 63)}[bucket]
            for _ in range(n):
                r = engine.generate(make_input(domain, rng, rng.randint(lo, hi)))
                assert r.bucket == bucket
                recorder.record(r)
                out.append(r)
        recorder.flush(writer)
        assert writer.flush(timeout=30)
        return out

    def tick(i: int):
        with sm.begin() as s:
            return evaluate(
                s,
                EvaluationOptions(
                    [RULE],
                    targets=[target],
                    policy=policy,
                    baseline_config=BaselineConfig(warm_in_s=0),
                ),
                T0 + timedelta(minutes=i, seconds=30),
            )

    try:
        with rx:
            url = rx.url
            target = WebhookTarget(name="ops", url=url, format="generic")
            for i in range(5):  # in-domain baseline in both buckets
                serve_minute(i, [("in_domain", "64", 2), ("in_domain", "32", 2)])
                tick(i + 1)
            fired = None
            for i in range(5, 9):  # shifted-domain traffic reaches bucket 64 only
                serve_minute(i, [("shifted", "64", 2), ("in_domain", "32", 1)])
                rep = tick(i + 1)
                if rep.firing:
                    fired = i + 1
                    break
            assert fired == 8, "fires on the third shifted minute"
            assert [r.labels for r in rep.firing] == [{"bucket": "64"}]
            assert [(a.kind, a.scope) for a in rep.actions if a.kind == "set"] == [
                ("set", "64")]
            flags = provider.flags()
            assert flags.speculative_for("64") is False and flags.speculative_for("32") is True
            at = T0 + timedelta(minutes=fired, seconds=31)
            with Deliverer(sm, [target], clock=lambda: at) as d:
                assert d.run_once().delivered == 1
            (payload,) = rx.payloads()
            assert payload["status"] == "firing" and payload["alert"]["labels"] == {
                "bucket": "64"}
            # The bucket now decodes directly, except its probation share.
            off = serve_minute(8, [("shifted", "64", 4), ("in_domain", "32", 1)])
            assert all(r.decoding == "direct" for r in off if r.bucket == "64" and not r.probation)
            assert any(r.decoding == "direct" for r in off if r.bucket == "64")
            assert [r.decoding for r in off if r.bucket == "32"] == ["speculative"]
            tick(9)
            restored = None
            for i in range(9, 18):  # in-domain traffic returns to bucket 64
                serve_minute(i, [("in_domain", "64", 3), ("in_domain", "32", 1)])
                rep = tick(i + 1)
                if any(a.kind == "restore" for a in rep.actions):
                    restored = i + 1
                    break
            assert restored is not None and restored >= fired + 2  # held, then measured
            flags = provider.flags()
            assert flags.speculative_for("64") is True and flags.speculative_probation == 0.0
            back = serve_minute(restored, [("in_domain", "64", 1)])
            assert back[0].decoding == "speculative" and not back[0].probation
            with sm() as s:
                audit = FlagStore().audit(s, "speculative", "64")
            assert [a.action for a in audit] == ["restore", "set"]
            assert "probation acceptance" in audit[0].reason
    finally:
        writer.close()
        engine.close()
