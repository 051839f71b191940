"""Turn probe measurements into storage rows (the Writer runs these in its transactions).

Rows written per canary cycle (kind "cycle"):
    ProbeRun        status ok/error/timeout, error message, suite, details:
                    {ab, rejected, missing_buckets, rss_growth_bytes, ab_compile,
                     jobs_during, and on A/B cycles pairs}
                    jobs_during: sorted names of the scheduler jobs that ran beside the cycle
                    pairs: one per canary prompt, its optimized request and arms back to back:
                    {"bucket": "64", "prompt": "<first 12 hex of sha256 of the prompt>",
                     "order": ["direct", "optimized", "eager"],
                     "latency_s": {"optimized": 0.031, "direct": 0.012, "eager": 0.05}}
                    (variant names as vocab.Variant spells them; successful calls only)
    ProbeResult     one per (bucket, path, decoding, variant); variant "optimized" is the
                    engine's current flags, "eager"/"direct"/"exact" (and "speculative" when a
                    bucket's speculation is off) are the A/B fallback arms
    CompileEvent    the compile delta of the optimized calls, when anything changed
    MemorySample    before and after the cycle
A burst probe writes one ProbeRun of kind "burst" (rate, requests, rejections, queue
wait p95; details: latency and queue-wait figures, the arm, and jobs_during as a cycle's)
plus one ProbeResult per (bucket, path, decoding).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from engine.protocol import CompileDelta, MemorySnapshot
from probes.burst import BurstResult
from probes.cycle import CycleResult, PromptPair
from probes.measure import GroupResult
from storage.models import CompileEvent, MemorySample, ProbeResult, ProbeRun


def result_row(g: GroupResult, at: datetime, errors: int = 0) -> ProbeResult:
    """Return the ProbeResult row of one group."""
    return ProbeResult(
        at=at, bucket=g.bucket, path=g.path, decoding=g.decoding, variant=g.variant,
        count=g.requests + errors, errors=errors,
        p50_s=g.latency.p50, p95_s=g.latency.p95, p99_s=g.latency.p99, max_s=g.latency.max,
        ttft_p50_s=g.ttft.p50, ttft_p95_s=g.ttft.p95, per_token_p50_s=g.per_token.p50,
        input_tokens_min=_int(g.input_tokens.min), input_tokens_mean=g.input_tokens.mean,
        input_tokens_max=_int(g.input_tokens.max), padded_length=g.padded_length,
        padding_waste=g.padding_waste, output_tokens=g.output_tokens, drafts=g.drafts,
        draft_tokens=g.draft_tokens, accepted_tokens=g.accepted_tokens,
        accepted_per_position=list(g.accepted_per_position),
        latency_sketch=dict(g.latency_sketch), ttft_sketch=dict(g.ttft_sketch),
        per_token_sketch=dict(g.per_token_sketch), samples=g.requests,
    )


def _int(v: float | None) -> int | None:
    return None if v is None else int(round(v))


def memory_row(m: MemorySnapshot, at: datetime, instance_id: str) -> MemorySample:
    """Return the MemorySample row of one snapshot."""
    return MemorySample(
        at=at, instance_id=instance_id, device=m.device, rss_bytes=m.rss_bytes,
        kv_cache_bytes=m.kv_cache_bytes, kv_static_bytes=m.kv_static_bytes,
        kv_request_peak_bytes=m.kv_request_peak_bytes,
        cuda_allocated_bytes=m.cuda_allocated_bytes,
        cuda_reserved_bytes=m.cuda_reserved_bytes, cuda_peak_bytes=m.cuda_peak_bytes,
        cuda_alloc_retries=m.cuda_alloc_retries, cuda_ooms=m.cuda_ooms,
    )


def compile_changed(d: CompileDelta) -> bool:
    """Return whether a compile delta holds anything worth a row."""
    return bool(d.graphs or d.recompiles or d.graph_breaks or d.recompile_limit_hits
                or d.compile_failures or d.compile_seconds > 0)


def compile_row(d: CompileDelta, at: datetime, instance_id: str) -> CompileEvent:
    """Return the CompileEvent row of one delta."""
    return CompileEvent(
        at=at, instance_id=instance_id, graphs=d.graphs, recompiles=d.recompiles,
        recompile_reasons=dict(d.recompile_reasons), graph_breaks=d.graph_breaks,
        graph_break_reasons=dict(d.graph_break_reasons), compile_seconds=d.compile_seconds,
        limit_hits=d.recompile_limit_hits, failures=d.compile_failures,
    )


def add_compile(session: Session, delta: CompileDelta, at: datetime,
                instance_id: str) -> CompileEvent:
    """Add a compile event outside any run (real traffic's recompiles) to `session`."""
    row = compile_row(delta, at, instance_id)
    session.add(row)
    return row


def _delta_dict(d: CompileDelta | None) -> dict[str, Any] | None:
    if d is None:
        return None
    return {"graphs": d.graphs, "recompiles": d.recompiles,
            "recompile_reasons": dict(d.recompile_reasons), "limit_hits": d.recompile_limit_hits}


def pair_dict(p: PromptPair) -> dict[str, Any]:
    """Return the stored form of one prompt's pair (ProbeRun.details["pairs"] items)."""
    return {"bucket": p.bucket, "prompt": p.prompt, "order": list(p.order),
            "latency_s": dict(p.latency_s)}


def _cycle_details(c: CycleResult) -> dict[str, Any]:
    details: dict[str, Any] = {
        "ab": c.ab, "rejected": c.rejected, "missing_buckets": list(c.missing_buckets),
        "rss_growth_bytes": c.rss_growth_bytes, "ab_compile": _delta_dict(c.ab_compile),
        "jobs_during": list(c.jobs_during)}
    if c.ab:
        details["pairs"] = [pair_dict(p) for p in c.pairs]
        # Why they ran (probes.ab_schedule): drawn, on demand after a slow cycle, requested.
        details["ab_reason"] = c.ab_reason
    return details


def add_cycle(session: Session, c: CycleResult, *, device: str = "") -> ProbeRun:
    """Add a cycle's rows to `session` (no commit) and return its ProbeRun."""
    run = ProbeRun(
        started_at=c.started_at, finished_at=c.finished_at, status=c.status, error=c.error,
        instance_id=c.instance_id, model_version=c.model_version, config_hash=c.config_hash,
        device=device or (c.memory_before.device if c.memory_before else ""),
        suite=c.suite, kind=c.kind, requests=sum(g.requests for g in c.groups),
        rejections=c.rejected,
        details=_cycle_details(c),
    )
    # Results are stamped when the cycle finished, i.e. when they are known: stamped at its
    # start, a cycle slowed past a rule cycle lands in a window already judged, and the
    # canary rules would see an empty window for exactly as long as the slowdown lasts.
    run.results = [result_row(g, c.finished_at) for g in c.groups]
    session.add(run)
    session.flush()  # run.id for the compile event
    if c.compile is not None and compile_changed(c.compile):
        ev = compile_row(c.compile, c.finished_at, c.instance_id)
        ev.run_id = run.id
        session.add(ev)
    if c.memory_before is not None:
        session.add(memory_row(c.memory_before, c.started_at, c.instance_id))
    if c.memory_after is not None:
        session.add(memory_row(c.memory_after, c.finished_at, c.instance_id))
    return run


def add_burst(session: Session, b: BurstResult) -> ProbeRun:
    """Add a burst's rows to `session` (no commit) and return its ProbeRun."""
    run = ProbeRun(
        started_at=b.started_at, finished_at=b.finished_at, status=b.status, error=b.error,
        instance_id=b.instance_id, model_version=b.model_version, config_hash=b.config_hash,
        suite=b.suite, kind=b.kind, rate_per_s=b.rate_per_s, requests=b.offered,
        rejections=b.rejected, queue_wait_p95_s=b.queue_wait.p95,
        details={"duration_s": b.duration_s, "concurrency": b.concurrency,
                 "completed": b.completed, "errors": b.errors, "unfinished": b.unfinished,
                 "latency_p50_s": b.latency.p50, "latency_p95_s": b.latency.p95,
                 "latency_p99_s": b.latency.p99, "latency_max_s": b.latency.max,
                 "latency_samples": b.latency.count, "latency_sketch": b.latency_sketch,
                 "queue_wait_p50_s": b.queue_wait.p50, "queue_wait_max_s": b.queue_wait.max,
                 "queue_wait_samples": b.queue_wait.count, "variant": b.variant,
                 "throughput_per_s": b.throughput_per_s, "pair": b.pair,
                 "jobs_during": list(b.jobs_during)},
    )
    run.results = [result_row(g, b.started_at) for g in b.groups]
    session.add(run)
    return run
