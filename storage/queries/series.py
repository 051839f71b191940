"""Per-cycle and per-minute series of a metric (input to change detection)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, func, select
from sqlalchemy.orm import Session

from storage.errors import UnknownMetric
from storage.models import (
    VARIANT_OPTIMIZED,
    ProbeResult,
    ProbeRun,
    TrafficRollup,
)
from storage.queries._common import _by_instance, _check_window, _ratio

PROBE_METRICS = ("p50_s", "p95_s", "p99_s", "max_s", "ttft_p50_s", "ttft_p95_s",
                 "per_token_p50_s", "padding_waste", "input_tokens_mean",
                 "acceptance_rate", "mean_acceptance_length", "error_rate")


@dataclass(frozen=True)
class SeriesPoint:
    """One value of a metric at one probe cycle or one minute."""

    at: datetime
    bucket: str
    path: str
    decoding: str
    value: float
    count: int  # requests behind the value


def metric_series(
    session: Session, metric: str, start: datetime, end: datetime, *,
    bucket: str | None = None, path: str | None = None, decoding: str | None = None,
    variant: str = VARIANT_OPTIMIZED, instance_id: str | None = None,
) -> list[SeriesPoint]:
    """Return a canary metric per cycle, oldest first; cycles where it is undefined are left out."""
    if metric not in PROBE_METRICS:
        raise UnknownMetric("metric", f"unknown probe metric (known: {', '.join(PROBE_METRICS)})",
                            value=metric)
    _check_window(start, end)
    r = ProbeResult
    stmt = select(r.at, r.bucket, r.path, r.decoding, r.count, r.errors, r.drafts,
                  r.draft_tokens, r.accepted_tokens,
                  getattr(r, metric) if hasattr(r, metric) else r.id
                  ).where(r.at >= start, r.at < end, r.variant == variant)
    for column, value in ((r.bucket, bucket), (r.path, path), (r.decoding, decoding)):
        if value is not None:
            stmt = stmt.where(column == value)
    stmt = _by_instance(stmt, instance_id).order_by(r.at, r.id)
    out = []
    for at, b, p, d, count, errors, drafts, proposed, accepted, raw in session.execute(stmt):
        if metric == "acceptance_rate":
            value = _ratio(accepted, proposed)
        elif metric == "mean_acceptance_length":
            value = 1 + accepted / drafts if drafts else None
        elif metric == "error_rate":
            value = _ratio(errors, count)
        else:
            value = raw
        if value is not None:
            out.append(SeriesPoint(at, b, p, d, float(value), count))
    return out


TRAFFIC_METRICS = ("requests", "mean_latency_s", "error_rate", "rejection_rate",
                   "overflow_share", "acceptance_rate", "probation_acceptance_rate")


def traffic_series(
    session: Session, metric: str, start: datetime, end: datetime, *,
    bucket: str | None = None, instance_id: str | None = None,
) -> list[SeriesPoint]:
    """Return a real-traffic metric per minute and bucket (paths and decodings summed)."""
    if metric not in TRAFFIC_METRICS:
        raise UnknownMetric("metric", f"unknown traffic metric (known: {', '.join(TRAFFIC_METRICS)})",
                            value=metric)
    _check_window(start, end)
    t = TrafficRollup
    where = [t.minute >= start, t.minute < end]
    if bucket is not None:
        where.append(t.bucket == bucket)
    if instance_id is not None:
        where.append(t.instance_id == instance_id)
    stmt = (select(t.minute, t.bucket, func.sum(t.requests), func.sum(t.latency_sum_s),
                   func.sum(t.errors), func.sum(t.rejections), func.sum(t.overflow),
                   func.sum(t.draft_tokens), func.sum(t.accepted_tokens),
                   func.sum(t.probation_draft_tokens), func.sum(t.probation_accepted))
            .where(and_(*where)).group_by(t.minute, t.bucket).order_by(t.minute, t.bucket))
    out = []
    for minute, b, req, lat, err, rej, ovf, prop, acc, pprop, pacc in session.execute(stmt):
        req = int(req or 0)
        value = {
            "requests": float(req),
            "mean_latency_s": _ratio(lat or 0.0, req),
            "error_rate": _ratio(err or 0, req),
            "rejection_rate": _ratio(rej or 0, req + (rej or 0)),
            "overflow_share": _ratio(ovf or 0, req),
            "acceptance_rate": _ratio(acc or 0, prop or 0),
            "probation_acceptance_rate": _ratio(pacc or 0, pprop or 0),
        }[metric]
        if value is not None:
            out.append(SeriesPoint(minute, b, "*", "*", float(value), req))
    return out


BURST_METRICS = ("rejections", "rejection_rate", "queue_wait_p95_s")


@dataclass(frozen=True)
class BurstPoint:
    """One burst probe's outcome."""

    at: datetime
    run_id: int
    value: float


def burst_series(session: Session, metric: str, start: datetime, end: datetime) -> list[BurstPoint]:
    """Return a metric of each finished burst probe in the window, oldest first."""
    if metric not in BURST_METRICS:
        raise UnknownMetric("metric", f"unknown burst metric (known: {', '.join(BURST_METRICS)})",
                            value=metric)
    _check_window(start, end)
    p = ProbeRun
    stmt = (select(p.started_at, p.id, p.requests, p.rejections, p.queue_wait_p95_s)
            .where(p.kind == "burst", p.started_at >= start, p.started_at < end)
            .order_by(p.started_at, p.id))
    out = []
    for at, run_id, requests, rejections, wait in session.execute(stmt):
        value = {"rejections": rejections, "queue_wait_p95_s": wait,
                 "rejection_rate": _ratio(rejections or 0, requests or 0)
                 if rejections is not None else None}[metric]
        if value is not None:
            out.append(BurstPoint(at, run_id, float(value)))
    return out
