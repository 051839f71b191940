"""Rows that the probes and the traffic recorder would write, built by hand."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta

from sqlalchemy.orm import Session, sessionmaker

from alerts.baselines import BaselineConfig
from alerts.evaluator import EvaluationOptions, EvaluationReport, evaluate
from alerts.rules import Rule
from alerts.webhooks import WebhookTarget
from storage.models import ProbeResult, ProbeRun, TrafficRollup
from storage.sketches import Sketch


def add_cycle(session: Session, at: datetime, p99: Mapping[str, float], *,
              acceptance: Mapping[str, float] | None = None, instance: str = "i1",
              model_version: str = "m1", config_hash: str = "c1", count: int = 100,
              variant: str = "optimized", kind: str = "cycle",
              decoding: str = "speculative") -> ProbeRun:
    """Add one canary cycle: per bucket its p99 (seconds) and optionally its acceptance.

    Each group holds `count` canaries: 2% at the p99 value, the rest at 0.8 x (so the
    cycle's sketch reads p99 = value, p50 = 0.8 x value), TTFT value / 4, 40 tokens each.
    """
    # details as probes.sink writes them for a cycle without A/B arms.
    run = ProbeRun(started_at=at, finished_at=at + timedelta(seconds=5), status="ok",
                   instance_id=instance, model_version=model_version,
                   config_hash=config_hash, suite="in_domain", kind=kind,
                   requests=count * len(p99), rejections=0,
                   details={"ab": False, "rejected": 0, "missing_buckets": [],
                            "rss_growth_bytes": 0, "ab_compile": None, "jobs_during": []})
    for bucket, v in p99.items():
        acc = (acceptance or {}).get(bucket, 0.8)
        edge = int(bucket) if bucket.isdigit() else 512  # overflow: past the largest edge
        lat, ttft, per_token = Sketch(), Sketch(), Sketch()
        top = max(1, count // 50)
        lat.add(v * 0.8, count - top)
        lat.add(v, top)
        ttft.add(v / 4, count)
        per_token.add(v / 40, 39 * count)
        run.results.append(ProbeResult(
            at=at, bucket=bucket, path="compiled", decoding=decoding, variant=variant,
            count=count, errors=0, p50_s=v * 0.8, p95_s=v * 0.95, p99_s=v, max_s=v,
            ttft_p50_s=v / 4, ttft_p95_s=v / 4, per_token_p50_s=v / 40, padding_waste=0.1,
            output_tokens=40, input_tokens_min=edge // 2 + 1,
            input_tokens_mean=edge * 0.9, input_tokens_max=edge, padded_length=edge,
            drafts=25, draft_tokens=100, accepted_tokens=int(round(100 * acc)),
            latency_sketch=lat.to_json(), ttft_sketch=ttft.to_json(),
            per_token_sketch=per_token.to_json(), samples=count))
    session.add(run)
    return run


def add_traffic(session: Session, minute: datetime, bucket: str, *, requests: int = 20,
                acceptance: float | None = 0.8, latency_s: float = 0.1,
                probation: int = 0, probation_acceptance: float | None = None,
                instance: str = "i1") -> None:
    """Add one minute of real traffic in one bucket (speculative and probation rows)."""
    lat, ttft, per_token = Sketch(), Sketch(), Sketch()
    lat.add(latency_s, requests)
    ttft.add(latency_s / 4, requests)
    per_token.add(latency_s * 0.75 / 39, 39 * requests)  # 40 output tokens per request
    drafted = requests * 40 if acceptance is not None else 0
    p_drafted = probation * 40
    p_acc = int(round(p_drafted * (probation_acceptance or 0.0)))
    decoding = "speculative" if acceptance is not None else "direct"
    session.add(TrafficRollup(
        minute=minute, instance_id=instance, bucket=bucket, path="compiled", decoding=decoding,
        requests=requests, latency_sum_s=latency_s * requests, latency_sketch=lat.to_json(),
        ttft_sketch=ttft.to_json(), per_token_sketch=per_token.to_json(),
        ttft_sum_s=latency_s / 4 * requests, input_tokens_sum=50 * requests,
        padded_tokens_sum=64 * requests, output_tokens_sum=40 * requests,
        drafts=drafted // 4, draft_tokens=drafted,
        accepted_tokens=int(round(drafted * (acceptance or 0.0)))))
    if probation:
        session.add(TrafficRollup(
            minute=minute, instance_id=instance, bucket=bucket, path="compiled",
            decoding="speculative", requests=probation, latency_sum_s=latency_s * probation,
            drafts=p_drafted // 4, draft_tokens=p_drafted,
            accepted_tokens=p_acc, probation_requests=probation,
            probation_draft_tokens=p_drafted, probation_accepted=p_acc))


def judge_minute(sm: sessionmaker[Session], t0: datetime, i: int, rule: Rule,
                 target: WebhookTarget) -> EvaluationReport:
    """Evaluate `rule` half a minute into minute i after t0 (cycles up to i - 1 finished),
    as the service does, with no baseline warm-in."""
    with sm.begin() as s:
        return evaluate(s, EvaluationOptions([rule], targets=[target],
                                             baseline_config=BaselineConfig(warm_in_s=0)),
                        t0 + timedelta(minutes=i, seconds=30))
