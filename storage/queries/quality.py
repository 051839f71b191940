"""Output quality: reference outputs per cohort and output agreements per bucket and arm."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from storage.models import CanaryReference, OutputAgreement
from storage.queries._common import _check_window


def references(session: Session, model_version: str, config_hash: str) -> dict[str, list[int]]:
    """Return prompt_key -> reference output ids stored for one cohort."""
    r = CanaryReference
    rows = session.execute(select(r.prompt_key, r.output_ids).where(
        r.model_version == model_version, r.config_hash == config_hash))
    return {key: list(ids or []) for key, ids in rows}


def stored_reference_keys(session: Session, model_version: str, config_hash: str,
                          keys: Collection[str]) -> set[str]:
    """Return which of `keys` already have a reference in the cohort."""
    if not keys:
        return set()
    r = CanaryReference
    return set(session.scalars(select(r.prompt_key).where(
        r.model_version == model_version, r.config_hash == config_hash,
        r.prompt_key.in_(list(keys)))))


@dataclass(frozen=True)
class AgreementGroup:
    """The comparisons of one (bucket, path, decoding, variant), summed (probes.quality).

    `worst`: the least agreeing outputs, each {"key", "agreement", "first_divergence",
    "length_diff"} (the key shortened to 16 characters once stored).
    """

    bucket: str
    path: str
    decoding: str
    variant: str
    count: int
    exact: int
    agreement_sum: float
    length_diff_sum: int
    first_divergence_min: int | None
    worst: tuple[dict[str, Any], ...] = ()
    golden_count: int = 0  # outputs whose canary has a golden answer
    golden_exact: int = 0  # those equal to it

    @property
    def key(self) -> tuple[str, str, str, str]:
        """Return (bucket, path, decoding, variant)."""
        return (self.bucket, self.path, self.decoding, self.variant)

    @property
    def agreement(self) -> float | None:
        """Return the mean token agreement, or None when nothing was compared."""
        return self.agreement_sum / self.count if self.count else None

    @property
    def exact_share(self) -> float | None:
        """Return the share of outputs equal to their reference, or None."""
        return self.exact / self.count if self.count else None

    @property
    def golden_accuracy(self) -> float | None:
        """Return the share of golden answers matched, or None when no canary had one."""
        return self.golden_exact / self.golden_count if self.golden_count else None


@dataclass(frozen=True, kw_only=True)
class AgreementRow(AgreementGroup):
    """One stored group (see storage.models.OutputAgreement): when, where and from what."""

    at: datetime
    source: str
    instance_id: str


def agreements(session: Session, start: datetime, end: datetime, *,
               source: str | None = None, bucket: str | None = None,
               variants: Collection[str] | None = None) -> list[AgreementRow]:
    """Return the agreement rows in [start, end), oldest first."""
    _check_window(start, end)
    a = OutputAgreement
    q = select(a).where(a.at >= start, a.at < end)
    if source is not None:
        q = q.where(a.source == source)
    if bucket is not None:
        q = q.where(a.bucket == bucket)
    if variants is not None:
        q = q.where(a.variant.in_(list(variants)))
    return [AgreementRow(at=r.at, source=r.source, instance_id=r.instance_id, bucket=r.bucket,
                         path=r.path, decoding=r.decoding, variant=r.variant, count=r.count,
                         exact=r.exact, agreement_sum=r.agreement_sum,
                         length_diff_sum=r.length_diff_sum,
                         first_divergence_min=r.first_divergence_min,
                         worst=tuple(r.worst or ()), golden_count=r.golden_count or 0,
                         golden_exact=r.golden_exact or 0)
            for r in session.scalars(q.order_by(a.at, a.id))]


@dataclass(frozen=True)
class AgreementRollup:
    """Agreement of one (source, bucket, variant) over a window."""

    source: str
    bucket: str
    variant: str
    count: int
    exact: int
    agreement: float | None
    first_divergence_min: int | None
    worst: tuple[dict[str, Any], ...]
    golden_count: int = 0  # outputs checked against a golden answer
    golden_exact: int = 0  # those equal to it

    @property
    def golden_accuracy(self) -> float | None:
        """Return the exact-match accuracy against golden answers, or None without any."""
        return self.golden_exact / self.golden_count if self.golden_count else None


def agreement_rollups(session: Session, start: datetime, end: datetime,
                      *, keep_worst: int = 3) -> list[AgreementRollup]:
    """Return agreement per (source, bucket, variant) in [start, end), sorted by those."""
    groups: dict[tuple[str, str, str], list[AgreementRow]] = {}
    for row in agreements(session, start, end):
        groups.setdefault((row.source, row.bucket, row.variant), []).append(row)
    out = []
    for (source, bucket, variant), rows in sorted(groups.items()):
        count = sum(r.count for r in rows)
        firsts = [r.first_divergence_min for r in rows if r.first_divergence_min is not None]
        worst = sorted((w for r in rows for w in r.worst),
                       key=lambda w: (w.get("agreement", 1.0), str(w.get("key", ""))))
        seen: set[str] = set()
        kept = []
        for w in worst:  # one entry per canary: its worst comparison
            if w.get("key") not in seen:
                seen.add(str(w.get("key")))
                kept.append(w)
        out.append(AgreementRollup(
            source=source, bucket=bucket, variant=variant, count=count,
            exact=sum(r.exact for r in rows),
            agreement=sum(r.agreement_sum for r in rows) / count if count else None,
            first_divergence_min=min(firsts) if firsts else None,
            worst=tuple(kept[:keep_worst]),
            golden_count=sum(r.golden_count for r in rows),
            golden_exact=sum(r.golden_exact for r in rows)))
    return out


@dataclass(frozen=True)
class AgreementTotal:
    """All stored comparisons of one (source, bucket, variant)."""

    source: str
    bucket: str
    variant: str
    count: int
    exact: int
    golden_count: int = 0
    golden_exact: int = 0


def agreement_totals(session: Session) -> list[AgreementTotal]:
    """Return compared, exact-match and golden counts per (source, bucket, variant)."""
    a = OutputAgreement
    rows = session.execute(
        select(a.source, a.bucket, a.variant, func.sum(a.count), func.sum(a.exact),
               func.sum(a.golden_count), func.sum(a.golden_exact))
        .group_by(a.source, a.bucket, a.variant).order_by(a.source, a.bucket, a.variant))
    return [AgreementTotal(s, b, v, int(n or 0), int(e or 0), int(gn or 0), int(ge or 0))
            for s, b, v, n, e, gn, ge in rows]
