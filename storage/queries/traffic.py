"""Speculative acceptance and the real-traffic input shape."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from storage import histograms
from storage.errors import InvalidQuery
from storage.models import (
    ProbeResult,
    TrafficRollup,
)
from storage.queries._common import (
    _bucket_order,
    _by_instance,
    _check_window,
    _day,
    _json_sums,
    _ratio,
    _rollups,
)

ACCEPTANCE_SOURCES = ("canary", "traffic", "probation")


@dataclass(frozen=True)
class Acceptance:
    """Speculative acceptance of one bucket (on one UTC day when grouped by day)."""

    source: str
    bucket: str
    day: date | None
    requests: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float | None  # accepted / proposed
    mean_acceptance_length: float | None  # 1 + accepted / drafts
    accepted_per_position: tuple[int, ...]


def acceptance(
    session: Session, start: datetime, end: datetime, *,
    source: str = "canary", by_day: bool = False, instance_id: str | None = None,
) -> list[Acceptance]:
    """Return acceptance per bucket (per day with by_day) from canaries, traffic or probation.

    "probation" counts only real requests that speculated while their bucket's flag
    was off; per-draft and per-position counts are not kept for them.
    """
    _check_window(start, end)
    if source not in ACCEPTANCE_SOURCES:
        raise InvalidQuery("source", f"must be one of {', '.join(ACCEPTANCE_SOURCES)}",
                           value=source)
    if source == "canary":
        r = ProbeResult
        at, aps = r.at, r.accepted_per_position
        cols = [func.sum(r.count), func.sum(r.drafts), func.sum(r.draft_tokens),
                func.sum(r.accepted_tokens)]
        where = [r.at >= start, r.at < end]
        model: type = ProbeResult
    else:
        t = TrafficRollup
        at, aps = t.minute, t.accepted_per_position
        if source == "traffic":
            cols = [func.sum(t.requests), func.sum(t.drafts), func.sum(t.draft_tokens),
                    func.sum(t.accepted_tokens)]
        else:
            cols = [func.sum(t.probation_requests), func.sum(0), func.sum(t.probation_draft_tokens),
                    func.sum(t.probation_accepted)]
        where = [t.minute >= start, t.minute < end]
        if instance_id is not None:
            where.append(t.instance_id == instance_id)
        model = TrafficRollup
    day = _day(session, at).label("day") if by_day else None
    group = [model.bucket] + ([day] if day is not None else [])
    # Guess the number of draft positions from the newest row; a longer list
    # anywhere in the window (k was raised) triggers one exact rerun.
    positions = 0
    if source != "probation":
        newest = _where_instance(select(func.json_array_length(aps)).where(*where), source,
                                 instance_id).order_by(at.desc()).limit(1)
        positions = session.scalar(newest) or 0
    longest = func.max(func.json_array_length(aps)) if source != "probation" else func.max(0)
    while True:
        stmt = select(*group, longest, *cols, *_json_sums(aps, positions)).where(*where)
        rows = session.execute(_where_instance(stmt.group_by(*group), source, instance_id)).all()
        needed = max((int(row[len(group)] or 0) for row in rows), default=0)
        if needed <= positions:
            break
        positions = needed
    out = []
    for row in rows:
        bucket = row[0]
        d = date.fromisoformat(row[1]) if by_day else None
        requests, drafts, proposed, accepted, *per_pos = row[len(group) + 1:]
        requests, drafts, proposed, accepted = (int(v or 0) for v in (requests, drafts,
                                                                      proposed, accepted))
        out.append(Acceptance(
            source=source, bucket=bucket, day=d, requests=requests, drafts=drafts,
            draft_tokens=proposed, accepted_tokens=accepted,
            acceptance_rate=_ratio(accepted, proposed),
            mean_acceptance_length=(1 + accepted / drafts) if drafts else None,
            accepted_per_position=tuple(int(v) for v in per_pos),
        ))
    return sorted(out, key=lambda a: (a.day or date.min, _bucket_order(a.bucket)))


def _where_instance(stmt: Select, source: str, instance_id: str | None) -> Select:
    if source == "canary":
        return _by_instance(stmt, instance_id)
    return stmt




@dataclass(frozen=True)
class TrafficShape:
    """Input-length distribution of real traffic against the bucket edges."""

    requests: int
    input_p50: float | None
    input_p95: float | None
    input_p99: float | None
    output_p50: float | None
    output_p95: float | None
    share_above: Mapping[int, float | None]  # bucket edge -> share of inputs longer
    overflow_share: float | None  # longer than the largest bucket (ran eager)
    padding_waste: float | None  # padded tokens that were padding


def traffic_shape(
    session: Session, start: datetime, end: datetime, *,
    bucket_edges: Sequence[int] = (16, 32, 64, 128, 256), instance_id: str | None = None,
) -> TrafficShape:
    """Return the real-traffic input-length distribution in the window."""
    _check_window(start, end)
    if not bucket_edges:
        raise InvalidQuery("bucket_edges", "must not be empty", value=bucket_edges)
    t = TrafficRollup
    n = len(histograms.TOKEN_EDGES) + 1
    where = [t.minute >= start, t.minute < end]
    if instance_id is not None:
        where.append(t.instance_id == instance_id)
    r = _rollups(session, where, ("requests", "overflow", "input_tokens_sum", "padded_tokens_sum"),
                 ("input_len_hist", "output_len_hist")).c
    stmt = select(func.sum(r.requests), func.sum(r.overflow), func.sum(r.input_tokens_sum),
                  func.sum(r.padded_tokens_sum), *_json_sums(r.input_len_hist, n),
                  *_json_sums(r.output_len_hist, n))
    requests, overflow, input_sum, padded_sum, *hists = session.execute(stmt).one()
    requests = int(requests or 0)
    inp, outp = [int(v) for v in hists[:n]], [int(v) for v in hists[n:]]
    edges = histograms.TOKEN_EDGES
    return TrafficShape(
        requests=requests,
        input_p50=histograms.quantile(inp, edges, 0.5),
        input_p95=histograms.quantile(inp, edges, 0.95),
        input_p99=histograms.quantile(inp, edges, 0.99),
        output_p50=histograms.quantile(outp, edges, 0.5),
        output_p95=histograms.quantile(outp, edges, 0.95),
        share_above={e: histograms.share_above(inp, edges, e) for e in sorted(bucket_edges)},
        overflow_share=_ratio(int(overflow or 0), requests),
        padding_waste=_ratio(int(padded_sum or 0) - int(input_sum or 0), int(padded_sum or 0)),
    )
