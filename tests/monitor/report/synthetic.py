"""A synthetic week (2026-W48) written into a real database, with the numbers it implies.

What holds and what breaks, by construction:
- torch.compile HOLDS: 3 recompiles only during warm-up; eager/optimized = 1.5 (bucket 16)
  and 1.4 (bucket 64) against an expected 1.3.
- bucketing VIOLATED: padding waste (1000 + 1400) / 8000 = 0.30 > 0.25, while
  1400 / 1401 real inputs fit the largest bucket (holds).
- static KV cache AT RISK: peak KV share 0.70 <= 0.8, but it rises 0.05 a day
  (trend projects 1.075 a week later); RSS grows exactly 1% a day (holds).
- speculative decoding VIOLATED: acceptance 0.8 in bucket 16, 0.4 in bucket 64;
  direct/optimized = 1.3 (16) and 0.9 (64): bucket 64 costs more than it earns.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy.orm import Session

from monitor.report.week import parse_week
from storage.models import (
    Alert,
    AlertTransition,
    Baseline,
    CompileEvent,
    FlagAudit,
    MemorySample,
    ProbeResult,
    ProbeRun,
    TrafficRollup,
)

WEEK = parse_week("2026-W48")
START = WEEK.start
KV_BUDGET = 100 * 2**20
RSS0 = 1_000_000_000


def fill_week(session: Session) -> None:
    """Write the synthetic week (plus a little noise outside it)."""
    for d in range(7):
        day = START + timedelta(days=d, hours=12)
        # Real traffic: 100 requests of ~6 tokens in bucket 16, 100 of ~50 in bucket 64.
        session.add(TrafficRollup(minute=day, instance_id="i1", bucket="16", path="compiled",
                                  decoding="speculative", requests=100, input_tokens_sum=600,
                                  padded_tokens_sum=1600, draft_tokens=100, accepted_tokens=80,
                                  input_lens={"6": 100}))
        session.add(TrafficRollup(minute=day, instance_id="i1", bucket="64", path="compiled",
                                  decoding="speculative", requests=100, input_tokens_sum=5000,
                                  padded_tokens_sum=6400, draft_tokens=100, accepted_tokens=40,
                                  input_lens={"50": 100}))
        # Canary cycle: optimized p99 per bucket.
        run = ProbeRun(started_at=day, instance_id="i1", kind="cycle")
        run.results = [
            ProbeResult(at=day, bucket="16", path="compiled", decoding="speculative",
                        count=4, p50_s=0.1, p99_s=0.2),
            ProbeResult(at=day, bucket="64", path="compiled", decoding="speculative",
                        count=4, p50_s=0.1, p99_s=0.3),
        ]
        session.add(run)
        # A/B canaries: the optimized arm against each fallback arm.
        ab = ProbeRun(started_at=day + timedelta(minutes=1), instance_id="i1", kind="ab")
        at = day + timedelta(minutes=1)
        arms = {"16": {"optimized": 0.100, "eager": 0.150, "direct": 0.130},
                "64": {"optimized": 0.100, "eager": 0.140, "direct": 0.090}}
        ab.results = [
            ProbeResult(at=at, bucket=b, path="eager" if v == "eager" else "compiled",
                        decoding="direct" if v == "direct" else "speculative", variant=v,
                        count=4, p50_s=p50, p99_s=p50 * 2)
            for b, per in arms.items() for v, p50 in per.items()
        ]
        session.add(ab)
    session.add(TrafficRollup(minute=START + timedelta(hours=1), instance_id="i1",
                              bucket="overflow", path="overflow", decoding="direct",
                              requests=1, input_tokens_sum=300, padded_tokens_sum=300,
                              input_lens={"300": 1}))
    for h in range(168):
        at = START + timedelta(hours=h)
        share = 0.40 + 0.05 * (h // 24)
        session.add(MemorySample(at=at, instance_id="i1", rss_bytes=RSS0 + h * RSS0 // 2400,
                                 kv_cache_bytes=round(share * KV_BUDGET)))
    session.add(CompileEvent(at=START + timedelta(minutes=1), instance_id="i1", graphs=10))
    session.add(CompileEvent(at=START + timedelta(minutes=10), instance_id="i1", recompiles=3))
    for bucket, value in (("16", 0.18), ("64", 0.25)):
        session.add(Baseline(metric="p99_latency", scope={"bucket": bucket},
                             scope_key=f"bucket={bucket}", value=value,
                             created_at=START - timedelta(days=1)))
    fired = START + timedelta(days=1, hours=10)
    alert = Alert(fingerprint="acc64", rule="acceptance_drop", labels={"bucket": "64"},
                  annotations={"summary": "acceptance 0.4 vs baseline 0.7"}, severity="page",
                  state="firing", started_at=fired - timedelta(minutes=2), fired_at=fired,
                  value=0.4, baseline=0.7)
    alert.transitions = [
        AlertTransition(at=fired - timedelta(minutes=2), from_state=None, to_state="pending"),
        AlertTransition(at=fired, from_state="pending", to_state="firing",
                        reason="acceptance_rate 0.4 vs baseline 0.7 (-43%)"),
    ]
    session.add(alert)
    old = Alert(fingerprint="old", rule="p99_latency_regression", labels={"bucket": "16"},
                state="resolved", started_at=START - timedelta(days=3),
                fired_at=START - timedelta(days=3), resolved_at=START - timedelta(days=2))
    session.add(old)
    session.add(FlagAudit(at=fired + timedelta(minutes=1), name="speculative", scope="64",
                          actor="auto-fallback", source="auto", action="set", old_value=True,
                          new_value=False, reason="acceptance_drop fired in bucket 64"))
    session.add(FlagAudit(at=START - timedelta(days=1), name="compiled", actor="alice",
                          source="manual", action="set", old_value=False, new_value=True,
                          reason="last week's change, not this one"))
