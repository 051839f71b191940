"""Speculative acceptance per bucket (and day) from canaries, traffic or probation."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from storage.errors import InvalidQuery
from storage.models import (
    VARIANT_OPTIMIZED,
    ProbeResult,
    ProbeRun,
    TrafficRollup,
)
from storage.queries._common import (
    _bucket_order,
    _by_instance,
    _check_window,
    _day,
    _json_sums,
    _ratio,
)
from vocab import RunKind

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

    "canary" counts the optimized arm of canary cycles only (no A/B arm, no burst).

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
        # Only the optimized arm of canary cycles: A/B arms and burst rows are other
        # configurations or other load, not the canary acceptance.
        where = [r.at >= start, r.at < end, r.variant == VARIANT_OPTIMIZED,
                 r.run_id.in_(select(ProbeRun.id).where(ProbeRun.kind == RunKind.CYCLE.value))]
        model: type[ProbeResult] | type[TrafficRollup] = ProbeResult
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
