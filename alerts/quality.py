"""Output agreement for rules and the fallback policy: series rows and recovery.

`output_agreement` is the mean token agreement (probes.quality) of outputs with their
reference outputs per cycle, read from `output_agreements` rows: canary rows per run and
arm (variant), traffic rows per sampled request. The shipped rule watches the optimized
arm per bucket; the `quantized` fallback is restored once the `quantized` A/B arm (int8
switched back on while the flag is off) agrees again (`canary_agreement`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from storage.queries import quality as queries
from vocab import SCOPE_GLOBAL, Source

METRIC = "output_agreement"
KINDS = {Source.CANARY.value: "agreement_canary", Source.TRAFFIC.value: "agreement_traffic"}

INSTANCE_PREFIX = "instance:"  # alerts.flags.INSTANCE_SCOPE_PREFIX (flags imports the engine)

RowTuple = tuple[datetime, dict[str, str], dict[str, Any]]


def series_kind(metric: str, source: str) -> str:
    """Return the RowCache kind a rule's series reads (its source unless it is agreement)."""
    return KINDS.get(source, source) if metric == METRIC else source


def agreement_rows(session: Session, start: datetime, end: datetime,
                   source: str) -> list[RowTuple]:
    """Return (at, labels, values) of the agreement rows of `source` in [start, end)."""
    return [(r.at, {"bucket": r.bucket, "path": r.path, "decoding": r.decoding,
                    "variant": r.variant, "instance": r.instance_id},
             {"count": r.count, "exact": r.exact, "agreement_sum": r.agreement_sum})
            for r in queries.agreements(session, start, end, source=source)]


def aggregate(metric: str, values: Sequence[dict[str, Any]]) -> tuple[float | None, int]:
    """Return (mean agreement, outputs compared) of one cycle's rows."""
    if metric != METRIC:
        raise ValueError(f"metric: {metric!r} has no agreement series")
    n = int(sum(v.get("count") or 0 for v in values))
    total = sum(v.get("agreement_sum") or 0.0 for v in values)
    return (total / n if n else None), n


def canary_recovery(session: Session, scope: str, start: datetime, end: datetime, *,
                    variant: str, floor: float | None, min_samples: int) -> str | None:
    """Return why the `variant` arm agrees again in `scope` (global, a bucket or
    "instance:<id>"), or None while it does not."""
    instance = scope[len(INSTANCE_PREFIX):] if scope.startswith(INSTANCE_PREFIX) else None
    bucket = None if scope == SCOPE_GLOBAL or instance is not None else scope
    rows = queries.agreements(session, start, end, source=Source.CANARY.value,
                              bucket=bucket, variants=(variant,))
    if instance is not None:
        rows = [r for r in rows if r.instance_id == instance]
    n = sum(r.count for r in rows)
    if n < min_samples or n == 0:
        return None
    agreement = sum(r.agreement_sum for r in rows) / n
    need = 1.0 if floor is None else floor
    if agreement >= need:
        return (f"canary {variant} arm agreement {agreement:.4f} >= floor {need:g} over "
                f"{n} outputs in {(end - start).total_seconds():g}s")
    return None
