"""Probe runs: cohorts (current, per instance), the latest runs, listings and A/B pairs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from storage.models import ProbeResult, ProbeRun
from vocab import RunKind


@dataclass(frozen=True)
class CurrentCohort:
    """The model version and config the canaries run now, and since when (None: no runs)."""

    model_version: str = ""
    config_hash: str = ""
    since: datetime | None = None

    @property
    def key(self) -> tuple[str, str] | None:
        """Return (model_version, config_hash), or None before the first run."""
        return None if self.since is None else (self.model_version, self.config_hash)


def current_cohort(session: Session, now: datetime) -> CurrentCohort:
    """Return the latest run's cohort and when its uninterrupted stretch of runs began."""
    r = ProbeRun
    latest = session.execute(
        select(r.model_version, r.config_hash)
        .where(r.started_at <= now).order_by(r.started_at.desc()).limit(1)).first()
    if latest is None:
        return CurrentCohort()
    mv, ch = latest
    other = session.scalar(
        select(r.started_at)
        .where(r.started_at <= now, (r.model_version != mv) | (r.config_hash != ch))
        .order_by(r.started_at.desc()).limit(1))
    first = select(r.started_at).where(r.model_version == mv, r.config_hash == ch)
    if other is not None:
        first = first.where(r.started_at > other)
    since = session.scalar(first.order_by(r.started_at.asc()).limit(1))
    return CurrentCohort(mv, ch, since)


@dataclass(frozen=True)
class LatestCycle:
    """An instance's latest canary cycle in a window: the cohort it ran, when it started."""

    cohort: tuple[str, str]
    started_at: datetime


def latest_cycles(session: Session, since: datetime, until: datetime) -> dict[str, LatestCycle]:
    """Return instance_id -> its latest canary cycle started in [since, until)."""
    r = ProbeRun
    cycles = (r.kind == RunKind.CYCLE.value, r.started_at >= since, r.started_at < until)
    latest = (select(r.instance_id, func.max(r.started_at).label("at")).where(*cycles)
              .group_by(r.instance_id).subquery())
    rows = session.execute(
        select(r.instance_id, r.model_version, r.config_hash, r.started_at)
        .join(latest, (r.instance_id == latest.c.instance_id) & (r.started_at == latest.c.at))
        .where(*cycles).order_by(r.id))
    # Two cycles of an instance started at the same moment: the later stored one speaks.
    return {inst: LatestCycle((mv, ch), at) for inst, mv, ch, at in rows}


def serving_cohorts(session: Session, since: datetime,
                    until: datetime) -> dict[str, tuple[str, str]]:
    """Return instance_id -> (model_version, config_hash) of its latest canary cycle
    started in [since, until): the cohort each instance serves (none: no cycle then)."""
    return serving_since(latest_cycles(session, since, until), since)


def serving_since(latest: Mapping[str, LatestCycle], since: datetime) -> dict[str, tuple[str, str]]:
    """Return `serving_cohorts` from [since, until) out of `latest_cycles` read over an
    earlier start to the same `until`: an instance's latest cycle there is its latest in
    the shorter window where it started in it, and it has none there otherwise."""
    return {inst: c.cohort for inst, c in latest.items() if c.started_at >= since}


def latest_finished_runs(session: Session) -> list[ProbeRun]:
    """Return the latest finished run of each kind."""
    latest = (select(ProbeRun.kind, func.max(ProbeRun.id).label("id"))
              .where(ProbeRun.finished_at.is_not(None)).group_by(ProbeRun.kind).subquery())
    return list(session.scalars(select(ProbeRun).join(latest, ProbeRun.id == latest.c.id)))


@dataclass(frozen=True)
class RunListing:
    """A run's column values (no relationships) and how many result rows it has."""

    columns: dict[str, Any]
    result_rows: int


def list_runs(session: Session, *, kind: str | None = None, limit: int = 50) -> list[RunListing]:
    """Return probe runs, newest first, with their result-row counts."""
    n_results = (select(func.count()).where(ProbeResult.run_id == ProbeRun.id)
                 .correlate(ProbeRun).scalar_subquery())
    q = (select(ProbeRun, n_results).order_by(ProbeRun.started_at.desc(), ProbeRun.id.desc())
         .limit(limit))
    if kind is not None:
        q = q.where(ProbeRun.kind == kind)
    # Column values only: touching the `results` relationship would load every row.
    keys = [c.key for c in ProbeRun.__table__.columns]
    return [RunListing({k: getattr(run, k) for k in keys}, int(n))
            for run, n in session.execute(q)]


@dataclass(frozen=True)
class AbCycle:
    """The prompt pairs one A/B canary cycle stored (details["pairs"], see probes.sink).

    reason: why its arms ran (details["ab_reason"]: "drawn", "slowdown", "requested");
    "" where the row has none (stored before it was recorded). finished_at: when the cycle
    finished (None: not stored).
    """

    run_id: int
    instance_id: str
    started_at: datetime
    pairs: list[dict[str, Any]]
    reason: str = ""
    finished_at: datetime | None = None


def ab_cycle_pairs(session: Session, start: datetime, end: datetime, *,
                   instance_id: str | None = None) -> list[AbCycle]:
    """Return the pairs of every cycle run started in [start, end) that stored any."""
    r = ProbeRun
    stmt = (select(r.id, r.instance_id, r.started_at, r.details, r.finished_at)
            .where(r.kind == RunKind.CYCLE.value, r.started_at >= start, r.started_at < end)
            .order_by(r.started_at, r.id))
    if instance_id is not None:
        stmt = stmt.where(r.instance_id == instance_id)
    # The JSON is filtered here, not in SQL: SQLite and PostgreSQL spell JSON paths apart.
    return [AbCycle(run_id, inst, at, details["pairs"], _reason(details.get("ab_reason")),
                    finished)
            for run_id, inst, at, details, finished in session.execute(stmt)
            if isinstance(details, dict) and isinstance(details.get("pairs"), list)
            and details["pairs"]]


def _reason(raw: object) -> str:
    """Return a stored details["ab_reason"] as text ("" when absent or not a string)."""
    return raw if isinstance(raw, str) else ""
