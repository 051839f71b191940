"""Batching per bucket and batch-size class, and the batching loop, over a window.

Reads storage.models.BatchRollup: request rows (real traffic) by bucket x batch-size
class x decoding, and engine rows (bucket "all") sampling the loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.batch_rollups import ENGINE_SCOPE
from storage.models import BatchRollup
from storage.queries._common import _bucket_order, _check_window, _ratio
from storage.sketches import merged


@dataclass(frozen=True)
class BatchUsage:
    """Real traffic of one bucket x batch-size class x decoding over a window.

    queue_wait_share: (queue wait + wait for the loop) / latency, summed over requests.
    step_tokens_per_s: tokens per second of the steps the requests took part in, all rows.
    """

    bucket: str
    batch: str
    decoding: str
    requests: int
    batch_size_mean: float | None
    batch_size_max: int
    queue_wait_share: float | None
    step_tokens_per_s: float | None
    tokens_per_s: float | None  # output tokens over the window's seconds
    latency_p50_s: float | None
    latency_p99_s: float | None


@dataclass(frozen=True)
class BatchLoop:
    """The batching loop of one instance over a window (sampled at each traffic flush).

    step_mean_s: phase -> mean seconds of one step ("encode", "decode", "verify").
    """

    instance_id: str
    samples: int
    rows_waiting_mean: float | None
    rows_waiting_max: int
    batch_size_mean: float | None
    window_mean_s: float | None
    steps: int
    step_mean_s: dict[str, float | None]


def batch_rollups(session: Session, start: datetime, end: datetime, *,
                  instance_id: str | None = None) -> list[BatchRollup]:
    """Return the batch rollup rows of minutes in [start, end)."""
    _check_window(start, end)
    q = select(BatchRollup).where(BatchRollup.minute >= start, BatchRollup.minute < end)
    if instance_id is not None:
        q = q.where(BatchRollup.instance_id == instance_id)
    return list(session.scalars(q.order_by(BatchRollup.minute, BatchRollup.id)))


def batch_usage(session: Session, start: datetime, end: datetime, *,
                instance_id: str | None = None) -> list[BatchUsage]:
    """Return real traffic per bucket x batch-size class x decoding in [start, end)."""
    rows = [r for r in batch_rollups(session, start, end, instance_id=instance_id)
            if r.bucket != ENGINE_SCOPE]
    groups: dict[tuple[str, str, str], list[BatchRollup]] = {}
    for r in rows:
        groups.setdefault((r.bucket, r.batch, r.decoding), []).append(r)
    seconds = (end - start).total_seconds()
    out = [usage(key, rs, seconds) for key, rs in groups.items()]
    return sorted(out, key=lambda u: (_bucket_order(u.bucket), int(u.batch), u.decoding))


def usage(key: tuple[str, str, str], rows: Iterable[BatchRollup], seconds: float) -> BatchUsage:
    """Return the BatchUsage of the rows of one key over a window of `seconds`."""
    rs = list(rows)
    n = sum(r.requests for r in rs)
    sketch = merged(r.latency_sketch for r in rs)
    return BatchUsage(
        bucket=key[0], batch=key[1], decoding=key[2], requests=n,
        batch_size_mean=_ratio(sum(r.batch_size_sum for r in rs), n),
        batch_size_max=max((r.batch_size_max for r in rs), default=0),
        queue_wait_share=_ratio(sum(r.queue_wait_sum_s + r.batch_wait_sum_s for r in rs),
                                sum(r.latency_sum_s for r in rs)),
        step_tokens_per_s=_ratio(sum(r.row_tokens_sum for r in rs),
                                 sum(r.decode_sum_s for r in rs)),
        tokens_per_s=_ratio(sum(r.output_tokens_sum for r in rs), seconds),
        latency_p50_s=sketch.quantile(0.5), latency_p99_s=sketch.quantile(0.99))


def batch_loop(session: Session, start: datetime, end: datetime, *,
               instance_id: str | None = None) -> list[BatchLoop]:
    """Return the batching loop per instance in [start, end) (engine rows)."""
    groups: dict[str, list[BatchRollup]] = {}
    for r in batch_rollups(session, start, end, instance_id=instance_id):
        if r.bucket == ENGINE_SCOPE:
            groups.setdefault(r.instance_id, []).append(r)
    out = []
    for inst, rs in sorted(groups.items()):
        samples = sum(r.samples for r in rs)
        out.append(BatchLoop(
            instance_id=inst, samples=samples,
            rows_waiting_mean=_ratio(sum(r.rows_waiting_sum for r in rs), samples),
            rows_waiting_max=max(r.rows_waiting_max for r in rs),
            batch_size_mean=_ratio(sum(r.batch_now_sum for r in rs), samples),
            window_mean_s=_ratio(sum(r.window_sum_s for r in rs), samples),
            steps=sum(r.steps for r in rs),
            step_mean_s={
                "encode": _ratio(sum(r.encode_s for r in rs), sum(r.encode_steps for r in rs)),
                "decode": _ratio(sum(r.decode_s for r in rs), sum(r.decode_steps for r in rs)),
                "verify": _ratio(sum(r.verify_s for r in rs), sum(r.verify_steps for r in rs)),
            }))
    return out
