"""Cohorts, stored series chunks and rollout verdicts: what incremental baselines read.

A cohort is the (model_version, config_hash) an instance's canary runs report. Rows
that carry no version (traffic, compile events, memory samples) belong to the cohort
their instance ran at that time (`CohortMap.cohort_of`).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from storage.models import RUN_KINDS, ProbeRun, RolloutVerdict, SeriesChunk

Cohort = tuple[str, str]  # (model_version, config_hash)
NO_COHORT: Cohort = ("", "")


@dataclass(frozen=True)
class CohortSpan:
    """One cohort on one instance: its first and last run in the window read."""

    instance_id: str
    cohort: Cohort
    first: datetime
    last: datetime


@dataclass(frozen=True)
class CohortMap:
    """Which cohort each instance ran when (from its canary runs)."""

    spans: tuple[CohortSpan, ...] = ()
    _by_inst: dict[str, list[CohortSpan]] = field(init=False, repr=False, compare=False)
    _firsts: dict[str, list[datetime]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_inst: dict[str, list[CohortSpan]] = {}
        for s in sorted(self.spans, key=lambda s: s.first):
            by_inst.setdefault(s.instance_id, []).append(s)
        object.__setattr__(self, "_by_inst", by_inst)
        object.__setattr__(self, "_firsts", {k: [s.first for s in v] for k, v in by_inst.items()})

    def cohort_of(self, instance_id: str, at: datetime) -> Cohort:
        """Return the cohort `instance_id` ran at `at` (its latest span started by then)."""
        spans = self._by_inst.get(instance_id)
        if not spans:
            return NO_COHORT
        i = bisect_right(self._firsts[instance_id], at)
        return spans[max(i - 1, 0)].cohort


def cohort_map(session: Session, start: datetime, end: datetime) -> CohortMap:
    """Return the instance -> cohort spans of the runs started in [start, end)."""
    r = ProbeRun
    rows = session.execute(
        select(r.instance_id, r.model_version, r.config_hash, func.min(r.started_at),
               func.max(r.started_at))
        # Every kind (a CHECK constraint): lets the (kind, started_at) index serve the range.
        .where(r.kind.in_(RUN_KINDS), r.started_at >= start, r.started_at < end)
        .group_by(r.instance_id, r.model_version, r.config_hash))
    return CohortMap(tuple(CohortSpan(inst, (mv, ch), first, last)
                           for inst, mv, ch, first, last in rows))


def cohort_since(session: Session, end: datetime) -> dict[Cohort, datetime]:
    """Return each cohort's first run started before `end`."""
    r = ProbeRun
    q = (select(r.model_version, r.config_hash, func.min(r.started_at))
         .where(r.started_at < end).group_by(r.model_version, r.config_hash))
    return {(mv, ch): at for mv, ch, at in session.execute(q)}


@dataclass(frozen=True)
class Chunk:
    """One stored hour of a series: [cycle start epoch s, value or None, samples, body]
    per cycle; body (a quantile's own samples' median that cycle, None where it had none)
    is absent in hours stored before 0008."""

    rule: str
    scope_key: str  # "" marks the hour done for the rule (written even when it had no data)
    cohort: Cohort
    start: datetime
    values: Sequence[Sequence[Any]]


def chunk_starts(session: Session, rule: str, start: datetime, end: datetime) -> set[datetime]:
    """Return the hours in [start, end) already chunked for `rule`."""
    c = SeriesChunk
    return set(session.scalars(select(c.start).where(
        c.rule == rule, c.scope_key == "", c.start >= start, c.start < end)))


def chunk_counts(session: Session, rules: Iterable[str], start: datetime,
                 end: datetime) -> dict[str, int]:
    """Return rule -> how many hours in [start, end) are chunked (one cheap grouped count)."""
    c = SeriesChunk
    out = dict.fromkeys(rules, 0)
    if out:
        rows = session.execute(
            select(c.rule, func.count()).where(c.rule.in_(tuple(out)), c.scope_key == "",
                                               c.start >= start, c.start < end)
            .group_by(c.rule))
        out.update({rule: int(n) for rule, n in rows})
    return out


def chunks(session: Session, rule: str, scope_keys: Iterable[str], cohorts: Iterable[Cohort],
           start: datetime, end: datetime) -> list[Chunk]:
    """Return the chunks of `rule` in those scopes and cohorts for hours in [start, end)."""
    c = SeriesChunk
    keys, wanted = tuple(k for k in scope_keys if k), set(cohorts)
    if not keys or not wanted:
        return []
    q = select(c.scope_key, c.model_version, c.config_hash, c.start, c.values).where(
        c.rule == rule, c.scope_key.in_(keys), c.start >= start, c.start < end,
        c.model_version.in_(tuple({mv for mv, _ in wanted})))
    return [Chunk(rule, key, (mv, ch), at, values or [])
            for key, mv, ch, at, values in session.execute(q) if (mv, ch) in wanted]


def add_chunks(session: Session, items: Iterable[Chunk]) -> int:
    """Store chunks (none of them stored yet); return how many."""
    rows = [SeriesChunk(rule=ch.rule, scope_key=ch.scope_key, model_version=ch.cohort[0],
                        config_hash=ch.cohort[1], start=ch.start,
                        values=[list(v) for v in ch.values]) for ch in items]
    session.add_all(rows)
    session.flush()
    return len(rows)


def delete_chunks_before(session: Session, rule: str, before: datetime) -> int:
    """Delete the chunks of `rule` for hours before `before` (out of its window)."""
    result = session.execute(delete(SeriesChunk).where(SeriesChunk.rule == rule,
                                                       SeriesChunk.start < before))
    return int(result.rowcount or 0)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Verdict:
    """One rollout comparison as stored (see storage.models.RolloutVerdict)."""

    new: Cohort
    old: Cohort
    source: str
    metric: str
    bucket: str
    verdict: str
    p_value: float | None
    relative_change: float | None
    threshold: float
    new_median: float | None
    old_median: float | None
    new_cycles: int
    old_cycles: int
    window_start: datetime
    first_at: datetime
    updated_at: datetime


def _verdict(r: RolloutVerdict) -> Verdict:
    return Verdict(
        (r.new_model_version, r.new_config_hash), (r.old_model_version, r.old_config_hash),
        r.source, r.metric, r.bucket, r.verdict, r.p_value, r.relative_change, r.threshold,
        r.new_median, r.old_median, r.new_cycles, r.old_cycles, r.window_start, r.first_at,
        r.updated_at)


def save_verdict(session: Session, v: Verdict) -> None:
    """Insert or update the stored verdict of one comparison (first_at is kept)."""
    t = RolloutVerdict
    row = session.scalars(select(t).where(
        t.new_model_version == v.new[0], t.new_config_hash == v.new[1],
        t.old_model_version == v.old[0], t.old_config_hash == v.old[1], t.source == v.source,
        t.metric == v.metric, t.bucket == v.bucket)).first()
    if row is None:
        row = RolloutVerdict(new_model_version=v.new[0], new_config_hash=v.new[1],
                             old_model_version=v.old[0], old_config_hash=v.old[1],
                             source=v.source, metric=v.metric, bucket=v.bucket,
                             first_at=v.first_at)
        session.add(row)
    row.verdict, row.p_value, row.relative_change = v.verdict, v.p_value, v.relative_change
    row.threshold, row.new_median, row.old_median = v.threshold, v.new_median, v.old_median
    row.new_cycles, row.old_cycles = v.new_cycles, v.old_cycles
    row.window_start, row.updated_at = v.window_start, v.updated_at
    session.flush()


def list_verdicts(session: Session, *, since: datetime | None = None,
                  until: datetime | None = None, limit: int = 200) -> list[Verdict]:
    """Return rollout verdicts judged within [since, until), most recently updated first."""
    t = RolloutVerdict
    q = select(t).order_by(t.updated_at.desc(), t.id.desc()).limit(limit)
    if since is not None:
        q = q.where(t.updated_at >= since)
    if until is not None:
        q = q.where(t.first_at < until)
    return [_verdict(r) for r in session.scalars(q)]
